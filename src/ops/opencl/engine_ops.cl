// The engine's op set (ops/ops.h) on an OpenCL device; opencl_ops.cpp plans the launches.
// OpenCL C 1.2, f32 arithmetic. f16 is read with vload_half, so cl_khr_fp16 is not needed; double
// is used only where the device has cl_khr_fp64 (RMSNorm's sum of squares, RoPE's angles).
//
// Every buffer argument comes with an offset (in its elements, or bytes for uchar pointers),
// because a kallpa device address is (buffer, offset) and OpenCL 1.2 kernels cannot take a pointer
// into the middle of a buffer.

// Contraction off: the matmul kernels exist in several tile shapes that must give each output the
// very same roundings (a row's result may not depend on its batch), and the element-wise kernels
// then round as the CPU ops do.
#pragma OPENCL FP_CONTRACT OFF

#ifdef cl_khr_fp64
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
#endif

// GgmlType values (ops/ggml_type.h).
#define T_F32 0
#define T_F16 1
#define T_Q4_0 2
#define T_Q4_1 3
#define T_Q8_0 8
#define T_BF16 30

#define QK 32
#define MAX_LANES 32  // matmul work-group size bound (opencl_ops.cpp: kMaxLanes)

inline float bf16_value(ushort bits) { return as_float((uint)bits << 16); }

// Element j of a weight row in the rows layout, dequantised as model::dequantize_row does it.
inline float weight_at(int type, global const uchar* row, long j) {
  switch (type) {
    case T_F32: return ((global const float*)row)[j];
    case T_F16: return vload_half(j, (global const half*)row);
    case T_BF16: return bf16_value(((global const ushort*)row)[j]);
    case T_Q8_0: {
      global const uchar* blk = row + (j / QK) * 34;
      return (float)((global const char*)(blk + 2))[j % QK] * vload_half(0, (global const half*)blk);
    }
    case T_Q4_0: {
      global const uchar* blk = row + (j / QK) * 18;
      const int i = (int)(j % QK);
      const uchar b = blk[2 + (i & 15)];
      const int q = i < 16 ? (b & 15) : (b >> 4);
      return (float)(q - 8) * vload_half(0, (global const half*)blk);
    }
    case T_Q4_1: {
      global const uchar* blk = row + (j / QK) * 20;
      const int i = (int)(j % QK);
      const uchar b = blk[4 + (i & 15)];
      const int q = i < 16 ? (b & 15) : (b >> 4);
      return (float)q * vload_half(0, (global const half*)blk) + vload_half(1, (global const half*)blk);
    }
  }
  return 0.0f;
}

// out[t] = table row ids[t]; global (cols, tokens).
kernel void embedding(global const uchar* table, ulong table_off, ulong row_bytes, int type, global const int* ids,
                      ulong ids_off, long cols, global float* out, ulong out_off) {
  const long j = get_global_id(0), t = get_global_id(1);
  if (j >= cols) return;
  global const uchar* row = table + table_off + (ulong)ids[ids_off + t] * row_bytes;
  out[out_off + t * cols + j] = weight_at(type, row, j);
}

// ---- RMSNorm: one work-group (a power of two <= 256 work-items) per row ----------------------
#ifdef cl_khr_fp64
typedef double acc_t;
#else
typedef float acc_t;
#endif

kernel void rmsnorm(global const float* x, ulong x_off, global const float* w, ulong w_off, float eps,
                    global float* y, ulong y_off, long dim) {
  local acc_t partial[256];
  const int lane = get_local_id(0), lanes = get_local_size(0);
  const long r = get_group_id(1);
  global const float* xr = x + x_off + r * dim;
  global float* yr = y + y_off + r * dim;
  acc_t s = 0;
  for (long i = lane; i < dim; i += lanes) {
    const acc_t v = xr[i];
    s += v * v;
  }
  partial[lane] = s;
  barrier(CLK_LOCAL_MEM_FENCE);
  for (int half_n = lanes / 2; half_n > 0; half_n /= 2) {
    if (lane < half_n) partial[lane] += partial[lane + half_n];
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  const float inv = 1.0f / sqrt((float)(partial[0] / (acc_t)dim) + eps);
  for (long i = lane; i < dim; i += lanes) yr[i] = xr[i] * inv * w[w_off + i];
}

// ---- Matrix products ---------------------------------------------------------------------------
// y[r][n] = sum_j W[n][j] x[r][j]. A work-group of `lanes` work-items computes TN outputs for TR
// rows of x: lane l takes the blocks of 32 (b = l, l + lanes, ...) of every (n, r) pair, then the
// lanes' partial sums are added in lane order. The weights of a block are read once for TR rows.
//
// The order of every rounding is fixed by (cols, lanes) alone: a block's product is four float8
// products summed in order, reduced ((0+4)+(2+6))+((1+5)+(3+7)), times the block scale (plus the
// Q4_1 offset times the block's sum of x), added into the lane's sum in increasing b. So every
// tile shape gives an output the same bits, and a row's result never depends on its batch.

inline float hsum8(float8 p) { return ((p.s0 + p.s4) + (p.s2 + p.s6)) + ((p.s1 + p.s5) + (p.s3 + p.s7)); }

// Block b of a row as four float8 (q values for the quantised types) and its scale d and offset m.
#define LOAD_F32(row, b)                                        \
  global const float* p_ = (global const float*)(row) + (b)*QK; \
  w0 = vload8(0, p_);                                           \
  w1 = vload8(1, p_);                                           \
  w2 = vload8(2, p_);                                           \
  w3 = vload8(3, p_);                                           \
  d = 1.0f;                                                     \
  m = 0.0f;

#define LOAD_F16(row, b)                                      \
  global const half* p_ = (global const half*)(row) + (b)*QK; \
  w0 = vload_half8(0, p_);                                    \
  w1 = vload_half8(1, p_);                                    \
  w2 = vload_half8(2, p_);                                    \
  w3 = vload_half8(3, p_);                                    \
  d = 1.0f;                                                   \
  m = 0.0f;

#define LOAD_BF16(row, b)                                          \
  global const ushort* p_ = (global const ushort*)(row) + (b)*QK;  \
  w0 = as_float8(convert_uint8(vload8(0, p_)) << 16);              \
  w1 = as_float8(convert_uint8(vload8(1, p_)) << 16);              \
  w2 = as_float8(convert_uint8(vload8(2, p_)) << 16);              \
  w3 = as_float8(convert_uint8(vload8(3, p_)) << 16);              \
  d = 1.0f;                                                        \
  m = 0.0f;

#define LOAD_Q8_0(row, b)                                   \
  global const uchar* blk_ = (row) + (b)*34;                \
  d = vload_half(0, (global const half*)blk_);              \
  global const char* q_ = (global const char*)(blk_ + 2);   \
  w0 = convert_float8(vload8(0, q_));                       \
  w1 = convert_float8(vload8(1, q_));                       \
  w2 = convert_float8(vload8(2, q_));                       \
  w3 = convert_float8(vload8(3, q_));                       \
  m = 0.0f;

#define LOAD_Q4_0(row, b)                                        \
  global const uchar* blk_ = (row) + (b)*18;                     \
  d = vload_half(0, (global const half*)blk_);                   \
  const uchar16 q_ = vload16(0, blk_ + 2);                       \
  w0 = convert_float8(q_.lo & (uchar)15) - 8.0f;                 \
  w1 = convert_float8(q_.hi & (uchar)15) - 8.0f;                 \
  w2 = convert_float8(q_.lo >> (uchar)4) - 8.0f;                 \
  w3 = convert_float8(q_.hi >> (uchar)4) - 8.0f;                 \
  m = 0.0f;

#define LOAD_Q4_1(row, b)                                 \
  global const uchar* blk_ = (row) + (b)*20;              \
  d = vload_half(0, (global const half*)blk_);            \
  m = vload_half(1, (global const half*)blk_);            \
  const uchar16 q_ = vload16(0, blk_ + 4);                \
  w0 = convert_float8(q_.lo & (uchar)15);                 \
  w1 = convert_float8(q_.hi & (uchar)15);                 \
  w2 = convert_float8(q_.lo >> (uchar)4);                 \
  w3 = convert_float8(q_.hi >> (uchar)4);

// global (lanes, ceil(n_out / TN), ceil(n_x / TR)), local (lanes, 1, 1); lanes <= MAX_LANES.
#define DEFINE_MATMUL(NAME, TYPE, LOAD, HAS_M, TN, TR)                                                        \
  kernel void NAME(global const uchar* w, ulong w_off, ulong row_bytes, long n_out, long cols,                \
                   global const float* x, ulong x_off, long n_x, global float* y, ulong y_off, long ldy) {    \
    local float red[MAX_LANES * TN * TR];                                                                     \
    const int lane = get_local_id(0), lanes = get_local_size(0);                                              \
    const long n0 = get_group_id(1) * TN, r0 = get_group_id(2) * TR;                                          \
    const long full = cols / QK, nb = (cols + QK - 1) / QK;                                                   \
    float acc[TN][TR];                                                                                        \
    global const float* xr[TR];                                                                               \
    for (int r = 0; r < TR; ++r) xr[r] = x + x_off + min(r0 + r, n_x - 1) * cols;                             \
    for (int n = 0; n < TN; ++n)                                                                              \
      for (int r = 0; r < TR; ++r) acc[n][r] = 0.0f;                                                          \
    for (long b = lane; b < nb; b += lanes) {                                                                 \
      for (int n = 0; n < TN; ++n) {                                                                          \
        global const uchar* row = w + w_off + min(n0 + n, n_out - 1) * row_bytes;                            \
        if (b < full) {                                                                                       \
          float8 w0, w1, w2, w3;                                                                              \
          float d, m;                                                                                         \
          LOAD(row, b)                                                                                        \
          for (int r = 0; r < TR; ++r) {                                                                      \
            global const float* xb = xr[r] + b * QK;                                                          \
            const float8 x0 = vload8(0, xb), x1 = vload8(1, xb), x2 = vload8(2, xb), x3 = vload8(3, xb);      \
            float8 p = w0 * x0;                                                                               \
            p = p + w1 * x1;                                                                                  \
            p = p + w2 * x2;                                                                                  \
            p = p + w3 * x3;                                                                                  \
            float c = hsum8(p) * d;                                                                           \
            if (HAS_M) c = c + m * hsum8(((x0 + x1) + x2) + x3);                                              \
            acc[n][r] += c;                                                                                   \
          }                                                                                                   \
        } else { /* the partial last block of a plain-float row (cols % 32 != 0) */                          \
          for (int r = 0; r < TR; ++r) {                                                                      \
            float c = 0.0f;                                                                                   \
            for (long j = b * QK; j < cols; ++j) c += weight_at(TYPE, row, j) * xr[r][j];                     \
            acc[n][r] += c;                                                                                   \
          }                                                                                                   \
        }                                                                                                     \
      }                                                                                                       \
    }                                                                                                         \
    for (int n = 0; n < TN; ++n)                                                                              \
      for (int r = 0; r < TR; ++r) red[(n * TR + r) * lanes + lane] = acc[n][r];                              \
    barrier(CLK_LOCAL_MEM_FENCE);                                                                             \
    for (int o = lane; o < TN * TR; o += lanes) {                                                             \
      float s = red[o * lanes];                                                                               \
      for (int l = 1; l < lanes; ++l) s += red[o * lanes + l];                                                \
      const long n = n0 + o / TR, r = r0 + o % TR;                                                            \
      if (n < n_out && r < n_x) y[y_off + r * ldy + n] = s;                                                   \
    }                                                                                                         \
  }

// Decode-sized batches (a few rows) and prompt tiles of 8 rows; TN must match kMatmulTileN.
#define DEFINE_MATMULS(SUFFIX, TYPE, LOAD, HAS_M)                 \
  DEFINE_MATMUL(matmul_##SUFFIX##_r1, TYPE, LOAD, HAS_M, 4, 1)    \
  DEFINE_MATMUL(matmul_##SUFFIX##_r8, TYPE, LOAD, HAS_M, 4, 8)

DEFINE_MATMULS(f32, T_F32, LOAD_F32, 0)
DEFINE_MATMULS(f16, T_F16, LOAD_F16, 0)
DEFINE_MATMULS(bf16, T_BF16, LOAD_BF16, 0)
DEFINE_MATMULS(q8_0, T_Q8_0, LOAD_Q8_0, 0)
DEFINE_MATMULS(q4_0, T_Q4_0, LOAD_Q4_0, 0)
DEFINE_MATMULS(q4_1, T_Q4_1, LOAD_Q4_1, 1)

// ---- RoPE (GGUF llama convention: adjacent pairs) --------------------------------------------
// global (n_rot / 2, rows). inv_freq[i] = theta^(-2i / n_rot), computed on the host as the CPU
// ops do; the angle pos * inv_freq reaches tens of thousands of radians, so it is formed and
// reduced in double where the device has it, else in f32 with an exact product and a three-part
// 2*pi (Cody-Waite), which leaves an absolute angle error of a few 1e-7.
inline void rotate(global float* x, long heads, long head_dim, long i, float c, float s) {
  for (long h = 0; h < heads; ++h) {
    global float* p = x + h * head_dim + 2 * i;
    const float x0 = p[0], x1 = p[1];
    p[0] = x0 * c - x1 * s;
    p[1] = x0 * s + x1 * c;
  }
}

#ifdef cl_khr_fp64
kernel void rope_f64(global float* x, ulong x_off, global const int* pos, ulong pos_off, global const float* inv_freq,
                     ulong freq_off, long heads, long head_dim, long half_rot) {
  const long i = get_global_id(0), r = get_global_id(1);
  if (i >= half_rot) return;
  const double angle = (double)pos[pos_off + r] * (double)inv_freq[freq_off + i];
  rotate(x + x_off + r * heads * head_dim, heads, head_dim, i, (float)cos(angle), (float)sin(angle));
}
#endif

kernel void rope_f32(global float* x, ulong x_off, global const int* pos, ulong pos_off, global const float* inv_freq,
                     ulong freq_off, long heads, long head_dim, long half_rot) {
  const long i = get_global_id(0), r = get_global_id(1);
  if (i >= half_rot) return;
  const float p = (float)pos[pos_off + r], f = inv_freq[freq_off + i];
  const float hi = p * f;
  const float lo = fma(p, f, -hi);  // p * f == hi + lo exactly
  const float k = rint(hi * 0.15915494309189535f);
  float a = fma(-k, 0x1.921fb6p+2f, hi);
  a = fma(-k, -0x1.777a5cp-23f, a);
  a = fma(-k, -0x1.0p-47f, a);
  a = a + lo;
  rotate(x + x_off + r * heads * head_dim, heads, head_dim, i, cos(a), sin(a));
}

// ---- Element-wise ------------------------------------------------------------------------------
kernel void swiglu(global const float* gate, ulong gate_off, global const float* up, ulong up_off, global float* out,
                   ulong out_off, long n) {
  const long i = get_global_id(0);
  if (i >= n) return;
  const float g = gate[gate_off + i];
  out[out_off + i] = g / (1.0f + exp(-g)) * up[up_off + i];
}

kernel void add(global float* x, ulong x_off, global const float* y, ulong y_off, long n) {
  const long i = get_global_id(0);
  if (i >= n) return;
  x[x_off + i] = x[x_off + i] + y[y_off + i];
}

// global (dim, rows): out row i = x row rows[i].
kernel void gather_rows(global const float* x, ulong x_off, global const long* rows, ulong rows_off, long dim,
                        global float* out, ulong out_off) {
  const long j = get_global_id(0), i = get_global_id(1);
  if (j >= dim) return;
  out[out_off + i * dim + j] = x[x_off + rows[rows_off + i] * dim + j];
}

// f32 -> f16 / bf16 bits, round to nearest even, NaN/Inf/subnormals kept: kallpa/half.h's
// f32_to_f16 and f32_to_bf16 step for step, so the device and the CPU store the same bits.
inline ushort f16_bits(float value) {
  const uint u = as_uint(value);
  const uint sign = (u >> 16) & 0x8000u;
  const uint a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (ushort)(sign | 0x7e00u);
  if (a >= 0x477ff000u) return (ushort)(sign | 0x7c00u);
  if (a < 0x38800000u) {
    if (a < 0x33000000u) return (ushort)sign;
    const uint e = a >> 23;
    const uint mant = (a & 0x7fffffu) | 0x800000u;
    const uint shift = 126u - e;
    uint r = mant >> shift;
    const uint rem = mant & ((1u << shift) - 1u);
    const uint halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (r & 1u))) ++r;
    return (ushort)(sign | r);
  }
  uint bits = a - ((127u - 15u) << 23);
  const uint rem = bits & 0x1fffu;
  bits >>= 13;
  if (rem > 0x1000u || (rem == 0x1000u && (bits & 1u))) ++bits;
  return (ushort)(sign | bits);
}

inline ushort bf16_bits(float value) {
  uint u = as_uint(value);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (ushort)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (ushort)(u >> 16);
}

// global (dim, rows): dst row rows[i] = src row i, as f32 (0), f16 (1) or bf16 (2); dst_off in
// elements of that type.
kernel void scatter_rows(global const float* src, ulong src_off, long dim, global uchar* dst, ulong dst_off,
                         int dst_type, global const long* rows, ulong rows_off) {
  const long j = get_global_id(0), i = get_global_id(1);
  if (j >= dim) return;
  const float v = src[src_off + i * dim + j];
  const ulong at = dst_off + (ulong)(rows[rows_off + i] * dim + j);
  if (dst_type == 0) {
    ((global float*)dst)[at] = v;
  } else if (dst_type == 1) {
    ((global ushort*)dst)[at] = f16_bits(v);
  } else {
    ((global ushort*)dst)[at] = bf16_bits(v);
  }
}
