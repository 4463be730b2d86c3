// opencl-flash: tiled online-softmax attention (FlashAttention-2's algorithm) in OpenCL C 1.2.
//
// One work-group owns BQ "rows" of one (sequence, KV head): row r is query i = r / G of head
// kvh * G + r % G, so the G query heads that share a KV head (GQA/MQA) share every K/V tile
// loaded into local memory; decode (Sq = 1) then still fills a work-group with G rows. For each
// tile of BK keys inside the union of the rows' visible ranges:
//   1. load K and V into local memory as f32;
//   2. scores S = scale * Q K^T, softcap, ALiBi, for visible (row, key) pairs only;
//   3. per row: running max m, rescale factor alpha, probabilities P = exp(S - m), sum l;
//   4. O = alpha * O + P V, over each row's visible keys only.
// Visible keys form one interval per row ([first, last], attention.h), so a masked key is never
// used in arithmetic: NaN stored there (or in a key only another row sees) cannot leak into a row.
// All arithmetic is f32; inputs are converted on load (vload_half needs no cl_khr_fp16; bf16 is
// the top half of an f32), outputs rounded to nearest even on store.
//
// Sizes (BQ, BK, D, DV) are run-time arguments and local buffers are sized by the host, so one
// program serves every head dim and every device; the host picks BQ and BK to fit local memory.

#define DT_F32 0
#define DT_F16 1
#define DT_BF16 2

inline float load_el(global const uchar* base, long index, int dtype) {
  if (dtype == DT_F32) return ((global const float*)base)[index];
  if (dtype == DT_F16) return vload_half((size_t)index, (global const half*)base);
  return as_float(((uint)((global const ushort*)base)[index]) << 16);
}

inline void store_el(global uchar* base, long index, int dtype, float x) {
  if (dtype == DT_F32) {
    ((global float*)base)[index] = x;
  } else if (dtype == DT_F16) {
    vstore_half_rte(x, (size_t)index, (global half*)base);
  } else {
    const uint u = as_uint(x);
    // Round to nearest even; a NaN keeps its sign and stays a (quiet) NaN.
    const uint r = isnan(x) ? ((u >> 16) | 0x40u) : ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    ((global ushort*)base)[index] = (ushort)r;
  }
}

// n elements from base (stride apart) into local f32; contiguous rows four at a time.
inline void load_row(local float* dst, global const uchar* src, long base, long stride, int n, int dtype) {
  int c = 0;
  if (stride == 1) {
    if (dtype == DT_F32) {
      global const float* p = (global const float*)src + base;
      for (; c + 4 <= n; c += 4) vstore4(vload4(0, p + c), 0, dst + c);
    } else if (dtype == DT_F16) {
      global const half* p = (global const half*)src + base;
      for (; c + 4 <= n; c += 4) vstore4(vload_half4(0, p + c), 0, dst + c);
    } else {
      global const ushort* p = (global const ushort*)src + base;
      for (; c + 4 <= n; c += 4) vstore4(as_float4(convert_uint4(vload4(0, p + c)) << 16), 0, dst + c);
    }
  }
  for (; c < n; ++c) dst[c] = load_el(src, base + c * stride, dtype);
}

// Per sequence, in elements from each buffer's start: the element offsets of q/o row 0 (head 0,
// dim 0), of lse (b, h = 0, i = 0), of k/v row 0 (0 for paged), then Sq and Skv.
#define META_Q 0
#define META_O 1
#define META_LSE 2
#define META_K 3
#define META_V 4
#define META_SQ 5
#define META_SKV 6
#define META_STRIDE 8

inline long kv_row(global const int* table, long table_stride, int page, long b, long base, long row_stride,
                   long block_stride, long j) {
  if (page == 0) return base + j * row_stride;
  const long block = table[b * table_stride + j / page];
  return base + block * block_stride + (j % page) * row_stride;
}

// <a, b> over n floats of local memory, eight at a time.
inline float dot_product(local const float* a, local const float* b, int n) {
  float8 acc = (float8)(0.0f);
  int c = 0;
  for (; c + 8 <= n; c += 8) acc = fma(vload8(0, a + c), vload8(0, b + c), acc);
  float tail = 0.0f;
  for (; c < n; ++c) tail = fma(a[c], b[c], tail);
  const float4 h = acc.lo + acc.hi;
  return (h.s0 + h.s1) + (h.s2 + h.s3) + tail;
}

kernel void flash_attention(
    global const uchar* q, global const uchar* k, global const uchar* v, global uchar* o,
    global float* lse, global const long* meta, global const int* block_table,
    global const float* alibi,
    int q_dtype, int kv_dtype, int o_dtype, int D, int DV, int G, int BQ, int BK,
    long q_rs, long q_hs, long q_ds, long k_rs, long k_hs, long k_ds, long k_bs,
    long v_rs, long v_hs, long v_ds, long v_bs, long o_rs, long o_hs, long o_ds,
    long lse_hs, long lse_is, int page, long table_stride,
    int causal, long window_left, long window_right, float scale, float softcap, int has_lse,
    int has_alibi,
    local float* Ql, local float* Kl, local float* Vl, local float* Sl, local float* Ol,
    local float* row_m, local float* row_l, local float* row_alpha, local long* row_first,
    local long* row_last) {
  const int lid = (int)get_local_id(0);
  const int wg = (int)get_local_size(0);
  const long b = get_group_id(2);
  const int kvh = (int)get_group_id(1);
  global const long* m = meta + b * META_STRIDE;
  const long sq = m[META_SQ], skv = m[META_SKV];
  const long rows = sq * G;
  const long row0 = (long)get_group_id(0) * BQ;
  if (row0 >= rows) return;  // uniform over the work-group: before any barrier
  const int nr = (int)min((long)BQ, rows - row0);

  for (int r = lid; r < nr; r += wg) {
    const long i = (row0 + r) / G;
    const long pos = i + skv - sq;  // bottom-right alignment
    long first = 0, last = skv - 1;
    if (causal) last = min(last, pos);
    if (window_left >= 0) first = max(first, pos - window_left);
    if (window_right >= 0) last = min(last, pos + window_right);
    row_first[r] = first;
    row_last[r] = last;
    row_m[r] = -INFINITY;
    row_l[r] = 0.0f;
  }
  for (int r = lid; r < nr; r += wg) {
    const long i = (row0 + r) / G;
    const long h = (long)kvh * G + (row0 + r) % G;
    const long base = m[META_Q] + i * q_rs + h * q_hs;
    load_row(Ql + r * D, q, base, q_ds, D, q_dtype);
  }
  for (int x = lid; x < nr * DV; x += wg) Ol[x] = 0.0f;
  barrier(CLK_LOCAL_MEM_FENCE);

  // Keys any row of this block can see; tiles outside are never loaded (causal/window skipping).
  long kfirst = LONG_MAX, klast = -1;
  for (int r = 0; r < nr; ++r) {
    if (row_first[r] <= row_last[r]) {
      kfirst = min(kfirst, row_first[r]);
      klast = max(klast, row_last[r]);
    }
  }

  for (long kt = kfirst; kt <= klast; kt += BK) {
    const int n = (int)min((long)BK, klast + 1 - kt);
    // One key row per work-item: the row's address (a block-table lookup when paged) is worked
    // out once, then read along the head dim.
    for (int j = lid; j < n; j += wg) {
      const long krow = kv_row(block_table, table_stride, page, b, m[META_K], k_rs, k_bs, kt + j) + kvh * k_hs;
      load_row(Kl + j * D, k, krow, k_ds, D, kv_dtype);
      const long vrow = kv_row(block_table, table_stride, page, b, m[META_V], v_rs, v_bs, kt + j) + kvh * v_hs;
      load_row(Vl + j * DV, v, vrow, v_ds, DV, kv_dtype);
    }
    barrier(CLK_LOCAL_MEM_FENCE);

    for (int x = lid; x < nr * n; x += wg) {
      const int r = x / n, j = x % n;
      const long key = kt + j;
      float s = -INFINITY;
      if (key >= row_first[r] && key <= row_last[r]) {
        s = scale * dot_product(Ql + r * D, Kl + j * D, D);
        if (softcap > 0.0f) s = softcap * tanh(s / softcap);
        if (has_alibi) {
          const long i = (row0 + r) / G;
          const long h = (long)kvh * G + (row0 + r) % G;
          const long dist = (i + skv - sq) - key;
          s -= alibi[h] * (float)(dist < 0 ? -dist : dist);
        }
      }
      Sl[r * BK + j] = s;
    }
    barrier(CLK_LOCAL_MEM_FENCE);

    // Running max and rescale factor, one row per work-item (compares only).
    for (int r = lid; r < nr; r += wg) {
      const int lo = (int)max(row_first[r] - kt, 0L);
      const int hi = (int)min(row_last[r] - kt, (long)n - 1);
      const float m_old = row_m[r];
      float mx = m_old;  // NaN scores are skipped by the comparison; they reach l through P below
      for (int j = lo; j <= hi; ++j) {
        const float s = Sl[r * BK + j];
        if (s > mx) mx = s;
      }
      row_alpha[r] = mx == -INFINITY ? 1.0f : exp(m_old - mx);
      row_m[r] = mx;
    }
    barrier(CLK_LOCAL_MEM_FENCE);

    // Probabilities, one (row, key) per work-item: the exponentials are most of the non-FMA work.
    for (int x = lid; x < nr * n; x += wg) {
      const int r = x / n, j = x % n;
      const long key = kt + j;
      if (key < row_first[r] || key > row_last[r]) continue;
      const float mx = row_m[r], s = Sl[r * BK + j];
      // With every score so far -inf (or NaN) there is no finite max: -inf weighs 0, NaN stays.
      Sl[r * BK + j] = mx == -INFINITY ? (isnan(s) ? s : 0.0f) : exp(s - mx);
    }
    barrier(CLK_LOCAL_MEM_FENCE);

    for (int r = lid; r < nr; r += wg) {
      const int lo = (int)max(row_first[r] - kt, 0L);
      const int hi = (int)min(row_last[r] - kt, (long)n - 1);
      float sum = 0.0f;
      for (int j = lo; j <= hi; ++j) sum += Sl[r * BK + j];
      if (lo <= hi) row_l[r] = row_l[r] * row_alpha[r] + sum;
    }

    // Four output columns per work-item (float4: SIMD on CPUs, wide loads on GPUs).
    const int dv4 = (DV + 3) / 4;
    for (int x = lid; x < nr * dv4; x += wg) {
      const int r = x / dv4, c = (x % dv4) * 4;
      const int lo = (int)max(row_first[r] - kt, 0L);
      const int hi = (int)min(row_last[r] - kt, (long)n - 1);
      if (lo > hi) continue;
      local float* out = Ol + r * DV + c;
      local const float* p = Sl + r * BK;
      if (c + 4 <= DV) {
        float4 acc = vload4(0, out) * row_alpha[r];
        for (int j = lo; j <= hi; ++j) acc = fma((float4)(p[j]), vload4(0, Vl + j * DV + c), acc);
        vstore4(acc, 0, out);
      } else {
        for (int cc = 0; cc < DV - c; ++cc) {
          float acc = out[cc] * row_alpha[r];
          for (int j = lo; j <= hi; ++j) acc = fma(p[j], Vl[j * DV + c + cc], acc);
          out[cc] = acc;
        }
      }
    }
    barrier(CLK_LOCAL_MEM_FENCE);  // the next tile overwrites Kl, Vl and Sl
  }

  for (int x = lid; x < nr * DV; x += wg) {
    const int r = x / DV, c = x % DV;
    const long i = (row0 + r) / G;
    const long h = (long)kvh * G + (row0 + r) % G;
    const float l = row_l[r];
    // l == 0: no visible key, or every visible score -inf (the contract's zero row).
    const float out = l == 0.0f ? 0.0f : Ol[x] / l;
    store_el(o, m[META_O] + i * o_rs + h * o_hs + c * o_ds, o_dtype, out);
  }
  if (has_lse) {
    for (int r = lid; r < nr; r += wg) {
      const long i = (row0 + r) / G;
      const long h = (long)kvh * G + (row0 + r) % G;
      const float l = row_l[r];
      lse[m[META_LSE] + h * lse_hs + i * lse_is] = l == 0.0f ? -INFINITY : row_m[r] + log(l);
    }
  }
}
