// cuda-flash kernels. Both compute, for one query row and the keys it sees,
//   o = sum_j p_j v_j / sum_j p_j,  p_j = 2^(s_j log2(e) - m)
// with the running maximum m kept per row (online softmax, f32), so a row's scores are never
// materialised. Masked keys are never read: every load is limited to the visible key range, and
// the tensor-core kernel zero-fills tile rows outside its block's visible range (a masked value's
// weight is 0, but 0 * NaN is NaN).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "backends/cuda/flash_kernels.h"
#include "backends/cuda/flash_plan.h"

namespace kallpa::cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ float load_any(const void* base, std::int32_t dtype, std::int64_t i) {
  switch (dtype) {
    case kF16: return __half2float(static_cast<const __half*>(base)[i]);
    case kBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
    default: return static_cast<const float*>(base)[i];
  }
}

__device__ __forceinline__ void store_any(void* base, std::int32_t dtype, std::int64_t i, float x) {
  switch (dtype) {
    case kF16: static_cast<__half*>(base)[i] = __float2half_rn(x); break;
    case kBF16: static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(x); break;
    default: static_cast<float*>(base)[i] = x; break;
  }
}

struct KeyRange {
  std::int64_t first;
  std::int64_t last;  // empty when first > last
};

// attention.h: query i of a sequence sits at key position i + Skv - Sq (bottom-right alignment).
__device__ __forceinline__ KeyRange visible_keys(const FlashParams& p, std::int64_t i, std::int32_t sq,
                                                 std::int32_t skv) {
  const std::int64_t pos = i + skv - sq;
  std::int64_t first = 0, last = std::int64_t{skv} - 1;
  if (p.causal) last = min(last, pos);
  if (p.window_left >= 0) first = max(first, pos - p.window_left);
  if (p.window_right >= 0) last = min(last, pos + p.window_right);
  return {first, last};
}

// Element offset of K (is_v false) or V row j of sequence b at KV head 0, dim 0.
__device__ __forceinline__ std::int64_t kv_row(const FlashParams& p, const SeqMeta& m, int b, std::int64_t j,
                                               bool is_v) {
  if (p.paged) {
    const std::int64_t block = p.block_table[b * p.table_stride + j / p.page_size];
    const std::int64_t in_page = j % p.page_size;
    return is_v ? block * p.v_bs + in_page * p.v_rs : block * p.k_bs + in_page * p.k_rs;
  }
  return is_v ? m.v + j * p.v_rs : m.k + j * p.k_rs;
}

// scale, then softcap, then ALiBi (attention.h's order); the result in log2 units.
__device__ __forceinline__ float score_log2(const FlashParams& p, float dot, float slope, std::int64_t pos,
                                            std::int64_t j) {
  float s = dot * p.scale;
  if (p.softcap > 0.0f) s = p.softcap * tanhf(s / p.softcap);
  if (slope != 0.0f) s -= slope * static_cast<float>(pos > j ? pos - j : j - pos);
  return s * kLog2e;
}

__device__ __forceinline__ float warp_max(float x) {
  for (int off = 16; off > 0; off /= 2) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, off));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
  for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(kFullMask, x, off);
  return x;
}

// <q, k> for one key row, summed in order c = 0, 1, ..., D - 1 whichever way it is loaded: 16-byte
// loads when the row allows them (unit stride, aligned), element loads otherwise.
template <typename KV>
__device__ __forceinline__ float dot_row(const float* qs, const KV* krow, int d, std::int64_t ds) {
  constexpr int kPerLoad = 16 / static_cast<int>(sizeof(KV));
  float dot = 0.0f;
  if (ds == 1 && d % kPerLoad == 0 && (reinterpret_cast<std::uintptr_t>(krow) & 15) == 0) {
    for (int c = 0; c < d; c += kPerLoad) {
      const uint4 raw = *reinterpret_cast<const uint4*>(krow + c);
      const KV* e = reinterpret_cast<const KV*>(&raw);
#pragma unroll
      for (int t = 0; t < kPerLoad; ++t) dot = fmaf(qs[c + t], to_float(e[t]), dot);
    }
    return dot;
  }
  for (int c = 0; c < d; ++c) dot = fmaf(qs[c], to_float(krow[c * ds]), dot);
  return dot;
}

// ---- generic kernel ---------------------------------------------------------------------------
// One warp per (query row, query head), four per block; each lane scores one key of a 32-key chunk
// (its own dot product over D), then the warp accumulates the chunk's values with lanes over Dv.
// With num_splits > 1, blockIdx.y takes keys [y * keys_per_split, (y + 1) * keys_per_split) and
// the unnormalised result goes to the partial buffers for flash_combine.
template <typename KV>
__global__ void __launch_bounds__(kGenericThreads) flash_generic(FlashParams p) {
  extern __shared__ float generic_smem[];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int b = static_cast<int>(blockIdx.z);
  const SeqMeta m = p.meta[b];
  const std::int64_t task = static_cast<std::int64_t>(blockIdx.x) * kGenericWarps + warp;
  const std::int64_t i = task / p.hq;
  const int h = static_cast<int>(task % p.hq);
  if (i >= m.sq) return;  // whole warp; no block-wide barrier follows
  const int split = static_cast<int>(blockIdx.y);
  const int hk = h / p.group;

  float* qs = generic_smem + static_cast<std::int64_t>(warp) * (p.d + p.dv);
  float* os = qs + p.d;
  const std::int64_t q_off = m.q + i * p.q_rs + h * p.q_hs;
  for (int c = lane; c < p.d; c += 32) qs[c] = load_any(p.q, p.q_dtype, q_off + c * p.q_ds);
  for (int c = lane; c < p.dv; c += 32) os[c] = 0.0f;
  __syncwarp();

  KeyRange r = visible_keys(p, i, m.sq, m.skv);
  if (p.num_splits > 1) {
    r.first = max(r.first, static_cast<std::int64_t>(split) * p.keys_per_split);
    r.last = min(r.last, static_cast<std::int64_t>(split + 1) * p.keys_per_split - 1);
  }
  const float slope = p.alibi != nullptr ? p.alibi[h] : 0.0f;
  const std::int64_t pos = i + m.skv - m.sq;
  const KV* kb = static_cast<const KV*>(p.k);
  const KV* vb = static_cast<const KV*>(p.v);
  float row_max = -INFINITY, row_sum = 0.0f;  // log2 units

  for (std::int64_t c0 = r.first; c0 <= r.last; c0 += 32) {
    const int n = static_cast<int>(min(std::int64_t{32}, r.last - c0 + 1));
    float s = -INFINITY;
    if (lane < n) {
      const std::int64_t j = c0 + lane;
      const KV* krow = kb + kv_row(p, m, b, j, false) + hk * p.k_hs;
      s = score_log2(p, dot_row(qs, krow, p.d, p.k_ds), slope, pos, j);
    }
    const float new_max = fmaxf(row_max, warp_max(s));
    // A row that has seen only -inf so far keeps weights 0 instead of exp(-inf - -inf) = NaN.
    const float base = new_max == -INFINITY ? 0.0f : new_max;
    const float alpha = exp2f(row_max - base);
    const float pj = lane < n ? exp2f(s - base) : 0.0f;
    row_sum = row_sum * alpha + warp_sum(pj);
    row_max = new_max;
    for (int c = lane; c < p.dv; c += 32) os[c] *= alpha;
    for (int t = 0; t < n; ++t) {
      const float pt = __shfl_sync(kFullMask, pj, t);
      const KV* vrow = vb + kv_row(p, m, b, c0 + t, true) + hk * p.v_hs;
      for (int c = lane; c < p.dv; c += 32) os[c] = fmaf(pt, to_float(vrow[c * p.v_ds]), os[c]);
    }
  }

  if (p.num_splits > 1) {
    const std::int64_t slot = (static_cast<std::int64_t>(split) * p.total_q + m.row0 + i) * p.hq + h;
    for (int c = lane; c < p.dv; c += 32) p.part_o[slot * p.dv + c] = os[c];
    if (lane == 0) {
      p.part_m[slot] = row_max;
      p.part_l[slot] = row_sum;
    }
    return;
  }
  const std::int64_t o_off = m.o + i * p.o_rs + h * p.o_hs;
  for (int c = lane; c < p.dv; c += 32) {
    store_any(p.o, p.o_dtype, o_off + c * p.o_ds, row_sum == 0.0f ? 0.0f : os[c] / row_sum);
  }
  if (p.lse != nullptr && lane == 0) {
    p.lse[m.lse + h * p.lse_hs + i * p.lse_is] = row_sum == 0.0f ? -INFINITY : (row_max + log2f(row_sum)) * kLn2;
  }
}

// Merges the splits of one (query row, head) per warp, with the generic kernel's task layout.
__global__ void __launch_bounds__(kGenericThreads) flash_combine(FlashParams p) {
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int b = static_cast<int>(blockIdx.z);
  const SeqMeta m = p.meta[b];
  const std::int64_t task = static_cast<std::int64_t>(blockIdx.x) * kGenericWarps + warp;
  const std::int64_t i = task / p.hq;
  const int h = static_cast<int>(task % p.hq);
  if (i >= m.sq) return;
  const std::int64_t split_stride = p.total_q * p.hq;
  const std::int64_t slot0 = (m.row0 + i) * p.hq + h;
  float big = -INFINITY;
  for (int s = 0; s < p.num_splits; ++s) big = fmaxf(big, p.part_m[slot0 + s * split_stride]);
  const float base = big == -INFINITY ? 0.0f : big;
  float total = 0.0f;
  for (int s = 0; s < p.num_splits; ++s) {
    const std::int64_t slot = slot0 + s * split_stride;
    total += p.part_l[slot] * exp2f(p.part_m[slot] - base);
  }
  const std::int64_t o_off = m.o + i * p.o_rs + h * p.o_hs;
  for (int c = lane; c < p.dv; c += 32) {
    float acc = 0.0f;
    for (int s = 0; s < p.num_splits; ++s) {
      const std::int64_t slot = slot0 + s * split_stride;
      acc = fmaf(p.part_o[slot * p.dv + c], exp2f(p.part_m[slot] - base), acc);
    }
    store_any(p.o, p.o_dtype, o_off + c * p.o_ds, total == 0.0f ? 0.0f : acc / total);
  }
  if (p.lse != nullptr && lane == 0) {
    p.lse[m.lse + h * p.lse_hs + i * p.lse_is] = total == 0.0f ? -INFINITY : (big + log2f(total)) * kLn2;
  }
}

// ---- tensor-core kernel -----------------------------------------------------------------------
// FlashAttention-2's forward: a block of 4 warps owns 64 query rows of one (sequence, head); each
// warp owns 16 of them and keeps their scores, running max/sum and output in registers in the
// mma.m16n8k16 accumulator layout (PTX ISA, "Matrix Fragments for mma.m16n8k16"): lane = 4g + t
// holds rows g and g + 8, columns 2t and 2t + 1 of each 8-column tile. The score accumulators of
// two adjacent 8-key tiles are exactly the A operand of P.V for 16 keys, so P never leaves
// registers. K tiles are staged row-major and V tiles transposed in shared memory, so every
// operand register is one aligned 32-bit shared load.

template <typename T>
__device__ __forceinline__ std::uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ std::uint32_t pack2<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);  // .x (lo) in the low 16 bits
  return *reinterpret_cast<const std::uint32_t*>(&v);
}
template <>
__device__ __forceinline__ std::uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const std::uint32_t*>(&v);
}

template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                          std::uint32_t b1);
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                                  std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&c)[4], const std::uint32_t (&a)[4],
                                                         std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ std::uint32_t lds32(const void* p) { return *static_cast<const std::uint32_t*>(p); }

template <typename T, int D>
__global__ void __launch_bounds__(kTcThreads) flash_tensor_core(FlashParams p) {
  constexpr int BQ = kTcBlockQ, BK = kTcBlockK;
  constexpr int QS = D + kTcPad;   // row pitch of the Q and K tiles (elements)
  constexpr int VS = BK + kTcPad;  // row pitch of the transposed V tile
  constexpr int CH = D / 8;        // 16-byte chunks per row
  extern __shared__ __align__(16) unsigned char tc_smem[];
  T* qs = reinterpret_cast<T*>(tc_smem);
  T* ks = qs + BQ * QS;
  T* vt = ks + BK * QS;

  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t4 = lane % 4;
  const int b = static_cast<int>(blockIdx.z), h = static_cast<int>(blockIdx.y);
  const SeqMeta m = p.meta[b];
  // Causal rows at the bottom see the most keys: schedule them first.
  const std::int64_t q0 = static_cast<std::int64_t>(gridDim.x - 1 - blockIdx.x) * BQ;
  if (q0 >= m.sq) return;  // uniform over the block
  const int hk = h / p.group;
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);

  for (int idx = tid; idx < BQ * CH; idx += kTcThreads) {
    const int r = idx / CH, c = idx % CH;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (q0 + r < m.sq) val = *reinterpret_cast<const uint4*>(q + m.q + (q0 + r) * p.q_rs + h * p.q_hs + c * 8);
    *reinterpret_cast<uint4*>(qs + r * QS + c * 8) = val;
  }
  __syncthreads();
  const int row_a = warp * 16 + g;  // this lane's rows in the tile: row_a and row_a + 8
  std::uint32_t qf[D / 16][4];
  for (int kk = 0; kk < D / 16; ++kk) {
    const T* base = qs + row_a * QS + kk * 16 + t4 * 2;
    qf[kk][0] = lds32(base);
    qf[kk][1] = lds32(base + 8 * QS);
    qf[kk][2] = lds32(base + 8);
    qf[kk][3] = lds32(base + 8 * QS + 8);
  }

  const std::int64_t q_last = min(q0 + BQ, std::int64_t{m.sq}) - 1;
  const std::int64_t k_first = visible_keys(p, q0, m.sq, m.skv).first;  // both bounds grow with i
  const std::int64_t k_last = visible_keys(p, q_last, m.sq, m.skv).last;
  std::int64_t row_i[2];
  KeyRange row_keys[2];
  std::int64_t row_pos[2];
  for (int rr = 0; rr < 2; ++rr) {
    row_i[rr] = q0 + row_a + rr * 8;
    row_keys[rr] = visible_keys(p, row_i[rr], m.sq, m.skv);
    row_pos[rr] = row_i[rr] + m.skv - m.sq;
  }
  const float slope = p.alibi != nullptr ? p.alibi[h] : 0.0f;

  float acc[D / 8][4];
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};  // row_sum: this lane's part

  for (std::int64_t k0 = k_first / BK * BK; k0 <= k_last; k0 += BK) {
    __syncthreads();  // the previous tile's readers are done
    for (int idx = tid; idx < BK * CH; idx += kTcThreads) {
      const int r = idx / CH, c = idx % CH;
      const std::int64_t j = k0 + r;
      uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
      if (j >= k_first && j <= k_last) {
        kv = *reinterpret_cast<const uint4*>(k + kv_row(p, m, b, j, false) + hk * p.k_hs + c * 8);
        vv = *reinterpret_cast<const uint4*>(v + kv_row(p, m, b, j, true) + hk * p.v_hs + c * 8);
      }
      *reinterpret_cast<uint4*>(ks + r * QS + c * 8) = kv;
      const T* ve = reinterpret_cast<const T*>(&vv);
      for (int e = 0; e < 8; ++e) vt[(c * 8 + e) * VS + r] = ve[e];
    }
    __syncthreads();

    float s[BK / 8][4];
    for (int n = 0; n < BK / 8; ++n) {
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
      const T* kb = ks + (n * 8 + g) * QS + t4 * 2;
      for (int kk = 0; kk < D / 16; ++kk) mma_16816<T>(s[n], qf[kk], lds32(kb + kk * 16), lds32(kb + kk * 16 + 8));
    }

    float tile_max[2] = {-INFINITY, -INFINITY};
    for (int n = 0; n < BK / 8; ++n) {
      for (int e = 0; e < 4; ++e) {
        const int rr = e / 2;
        const std::int64_t j = k0 + n * 8 + t4 * 2 + (e & 1);
        const bool seen = j >= row_keys[rr].first && j <= row_keys[rr].last;
        s[n][e] = seen ? score_log2(p, s[n][e], slope, row_pos[rr], j) : -INFINITY;
        tile_max[rr] = fmaxf(tile_max[rr], s[n][e]);
      }
    }
    float base[2];
    for (int rr = 0; rr < 2; ++rr) {
      // The four lanes of a quad hold one row between them.
      tile_max[rr] = fmaxf(tile_max[rr], __shfl_xor_sync(kFullMask, tile_max[rr], 1));
      tile_max[rr] = fmaxf(tile_max[rr], __shfl_xor_sync(kFullMask, tile_max[rr], 2));
      const float new_max = fmaxf(row_max[rr], tile_max[rr]);
      base[rr] = new_max == -INFINITY ? 0.0f : new_max;
      const float alpha = exp2f(row_max[rr] - base[rr]);
      row_max[rr] = new_max;
      row_sum[rr] *= alpha;
      for (int n = 0; n < D / 8; ++n) {
        acc[n][2 * rr] *= alpha;
        acc[n][2 * rr + 1] *= alpha;
      }
    }
    for (int n = 0; n < BK / 8; ++n) {
      for (int e = 0; e < 4; ++e) {
        s[n][e] = exp2f(s[n][e] - base[e / 2]);
        row_sum[e / 2] += s[n][e];
      }
    }

    for (int kk = 0; kk < BK / 16; ++kk) {
      const std::uint32_t a[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                                  pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                  pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
      for (int n = 0; n < D / 8; ++n) {
        const T* vb = vt + (n * 8 + g) * VS + kk * 16 + t4 * 2;
        mma_16816<T>(acc[n], a, lds32(vb), lds32(vb + 8));
      }
    }
  }

  T* o = static_cast<T*>(p.o);
  for (int rr = 0; rr < 2; ++rr) {
    float total = row_sum[rr];
    total += __shfl_xor_sync(kFullMask, total, 1);
    total += __shfl_xor_sync(kFullMask, total, 2);
    if (row_i[rr] >= m.sq) continue;
    const std::int64_t o_off = m.o + row_i[rr] * p.o_rs + h * p.o_hs;
    for (int n = 0; n < D / 8; ++n) {
      for (int e = 0; e < 2; ++e) {
        const float val = total == 0.0f ? 0.0f : acc[n][2 * rr + e] / total;
        o[o_off + n * 8 + t4 * 2 + e] = static_cast<T>(val);
      }
    }
    if (p.lse != nullptr && t4 == 0) {
      p.lse[m.lse + h * p.lse_hs + row_i[rr] * p.lse_is] =
          total == 0.0f ? -INFINITY : (row_max[rr] + log2f(total)) * kLn2;
    }
  }
}

// ---- tensor-core kernel, version 2 ------------------------------------------------------------
// v1's inner loop waits on every tile's global loads (nothing else to do meanwhile but other
// blocks) and transposes V with 2-byte shared stores that, with its 72-element pitch, all land in
// one bank: a 16-way conflict on each. v2 keeps V row-major and takes its B fragments with
// ldmatrix.trans (the hardware transposes the 8x8 pieces), reads K with ldmatrix too (four
// fragments per instruction instead of one), and fetches tiles with cp.async into two stages so
// that tile t + 1 is in flight while tile t is multiplied. Rows outside the block's visible range
// are zero-filled by cp.async itself (source size 0). Tiles that every row of the lane sees whole
// skip the per-element mask. Same layouts and online softmax as v1 otherwise.

// 2^x by the special-function unit alone (exp2f adds range handling for denormal results, which
// a softmax weight below 2^-126 does not need: it flushes to 0).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ std::uint32_t smem_addr(const void* ptr) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(ptr));
}
// 16 bytes global -> shared, asynchronous; with valid false nothing is read and zeros are written.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int Pending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending) : "memory");
}
// Four 8x8 16-bit matrices; lane l addresses row l % 8 of matrix l / 8 and receives, of matrix j,
// row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 in register j (with trans: column l / 4, rows
// 2 (l % 4) and 2 (l % 4) + 1) -- the mma.m16n8k16 B fragment layout.
__device__ __forceinline__ void ldsm_x4(std::uint32_t (&r)[4], const void* ptr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(ptr))
               : "memory");
}
__device__ __forceinline__ void ldsm_x4_trans(std::uint32_t (&r)[4], const void* ptr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(ptr))
               : "memory");
}

template <typename T, int D>
__global__ void __launch_bounds__(kTcThreads) flash_tensor_core_v2(FlashParams p) {
  constexpr int BQ = kTcBlockQ, BK = kTcBlockK;
  constexpr int QS = D + kTcPad;  // row pitch of every tile (elements): ldmatrix rows hit distinct banks
  constexpr int CH = D / 8;       // 16-byte chunks per row
  constexpr int TILE = BK * QS;   // elements of one K or V stage
  extern __shared__ __align__(16) unsigned char tc_smem[];
  T* qs = reinterpret_cast<T*>(tc_smem);
  T* ks = qs + BQ * QS;  // stages 0 and 1
  T* vs = ks + 2 * TILE;

  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t4 = lane % 4;
  const int b = static_cast<int>(blockIdx.z), h = static_cast<int>(blockIdx.y);
  const SeqMeta m = p.meta[b];
  const std::int64_t q0 = static_cast<std::int64_t>(gridDim.x - 1 - blockIdx.x) * BQ;  // longest rows first
  if (q0 >= m.sq) return;  // uniform over the block
  const int hk = h / p.group;
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);

  const std::int64_t q_last = min(q0 + BQ, std::int64_t{m.sq}) - 1;
  const std::int64_t k_first = visible_keys(p, q0, m.sq, m.skv).first;  // both bounds grow with i
  const std::int64_t k_last = visible_keys(p, q_last, m.sq, m.skv).last;
  auto load_tile = [&](int stage, std::int64_t k0) {
    T* kd = ks + stage * TILE;
    T* vd = vs + stage * TILE;
    for (int idx = tid; idx < BK * CH; idx += kTcThreads) {
      const int r = idx / CH, c = idx % CH;
      const std::int64_t j = k0 + r;
      const bool valid = j >= k_first && j <= k_last;
      cp_async16(kd + r * QS + c * 8, valid ? k + kv_row(p, m, b, j, false) + hk * p.k_hs + c * 8 : k, valid);
      cp_async16(vd + r * QS + c * 8, valid ? v + kv_row(p, m, b, j, true) + hk * p.v_hs + c * 8 : v, valid);
    }
    cp_async_commit();
  };
  const std::int64_t k_begin = k_first / BK * BK;
  if (k_begin <= k_last) load_tile(0, k_begin);  // in flight while Q is staged

  for (int idx = tid; idx < BQ * CH; idx += kTcThreads) {
    const int r = idx / CH, c = idx % CH;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (q0 + r < m.sq) val = *reinterpret_cast<const uint4*>(q + m.q + (q0 + r) * p.q_rs + h * p.q_hs + c * 8);
    *reinterpret_cast<uint4*>(qs + r * QS + c * 8) = val;
  }
  __syncthreads();
  const int row_a = warp * 16 + g;  // this lane's rows in the tile: row_a and row_a + 8
  std::uint32_t qf[D / 16][4];
  for (int kk = 0; kk < D / 16; ++kk) {
    const T* base = qs + row_a * QS + kk * 16 + t4 * 2;
    qf[kk][0] = lds32(base);
    qf[kk][1] = lds32(base + 8 * QS);
    qf[kk][2] = lds32(base + 8);
    qf[kk][3] = lds32(base + 8 * QS + 8);
  }

  std::int64_t row_i[2];
  KeyRange row_keys[2];
  std::int64_t row_pos[2];
  for (int rr = 0; rr < 2; ++rr) {
    row_i[rr] = q0 + row_a + rr * 8;
    row_keys[rr] = visible_keys(p, row_i[rr], m.sq, m.skv);
    row_pos[rr] = row_i[rr] + m.skv - m.sq;
  }
  const std::int64_t whole_first = max(row_keys[0].first, row_keys[1].first);
  const std::int64_t whole_last = min(row_keys[0].last, row_keys[1].last);
  const float slope = p.alibi != nullptr ? p.alibi[h] : 0.0f;

  float acc[D / 8][4];
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};  // row_sum: this lane's part

  int stage = 0;
  for (std::int64_t k0 = k_begin; k0 <= k_last; k0 += BK, stage ^= 1) {
    if (k0 + BK <= k_last) {
      load_tile(stage ^ 1, k0 + BK);  // that stage's readers finished at the previous barrier
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // this stage's tile, written by every thread's copies, is complete
    const T* kt = ks + stage * TILE;
    const T* vt = vs + stage * TILE;

    float s[BK / 8][4];
    for (int n = 0; n < BK / 8; ++n) {
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
      for (int kk = 0; kk < D / 16; kk += 2) {
        std::uint32_t kf[4];  // B fragments of key rows n*8.., dims kk*16.. (0, 1) and (kk+1)*16.. (2, 3)
        ldsm_x4(kf, kt + (n * 8 + (lane & 7)) * QS + kk * 16 + (lane >> 3) * 8);
        mma_16816<T>(s[n], qf[kk], kf[0], kf[1]);
        mma_16816<T>(s[n], qf[kk + 1], kf[2], kf[3]);
      }
    }

    const bool whole = k0 >= whole_first && k0 + BK - 1 <= whole_last;
    float tile_max[2] = {-INFINITY, -INFINITY};
    for (int n = 0; n < BK / 8; ++n) {
      for (int e = 0; e < 4; ++e) {
        const int rr = e / 2;
        const std::int64_t j = k0 + n * 8 + t4 * 2 + (e & 1);
        const bool seen = whole || (j >= row_keys[rr].first && j <= row_keys[rr].last);
        s[n][e] = seen ? score_log2(p, s[n][e], slope, row_pos[rr], j) : -INFINITY;
        tile_max[rr] = fmaxf(tile_max[rr], s[n][e]);
      }
    }
    float base[2];
    for (int rr = 0; rr < 2; ++rr) {
      tile_max[rr] = fmaxf(tile_max[rr], __shfl_xor_sync(kFullMask, tile_max[rr], 1));
      tile_max[rr] = fmaxf(tile_max[rr], __shfl_xor_sync(kFullMask, tile_max[rr], 2));
      const float new_max = fmaxf(row_max[rr], tile_max[rr]);
      base[rr] = new_max == -INFINITY ? 0.0f : new_max;
      const float alpha = exp2f(row_max[rr] - base[rr]);
      row_max[rr] = new_max;
      row_sum[rr] *= alpha;
      for (int n = 0; n < D / 8; ++n) {
        acc[n][2 * rr] *= alpha;
        acc[n][2 * rr + 1] *= alpha;
      }
    }
    for (int n = 0; n < BK / 8; ++n) {
      for (int e = 0; e < 4; ++e) {
        s[n][e] = exp2f(s[n][e] - base[e / 2]);
        row_sum[e / 2] += s[n][e];
      }
    }

    for (int kk = 0; kk < BK / 16; ++kk) {
      const std::uint32_t a[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                                  pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                  pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
      for (int n = 0; n < D / 8; n += 2) {
        std::uint32_t vf[4];  // keys kk*16 + 0..7 / 8..15 of dims n*8.. (0, 1) and (n+1)*8.. (2, 3)
        ldsm_x4_trans(vf, vt + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * QS + (n + (lane >> 4)) * 8);
        mma_16816<T>(acc[n], a, vf[0], vf[1]);
        mma_16816<T>(acc[n + 1], a, vf[2], vf[3]);
      }
    }
    __syncthreads();  // every warp is done with this stage before the next iteration refills it
  }

  T* o = static_cast<T*>(p.o);
  for (int rr = 0; rr < 2; ++rr) {
    float total = row_sum[rr];
    total += __shfl_xor_sync(kFullMask, total, 1);
    total += __shfl_xor_sync(kFullMask, total, 2);
    if (row_i[rr] >= m.sq) continue;
    const std::int64_t o_off = m.o + row_i[rr] * p.o_rs + h * p.o_hs;
    for (int n = 0; n < D / 8; ++n) {
      for (int e = 0; e < 2; ++e) {
        const float val = total == 0.0f ? 0.0f : acc[n][2 * rr + e] / total;
        o[o_off + n * 8 + t4 * 2 + e] = static_cast<T>(val);
      }
    }
    if (p.lse != nullptr && t4 == 0) {
      p.lse[m.lse + h * p.lse_hs + row_i[rr] * p.lse_is] =
          total == 0.0f ? -INFINITY : (row_max[rr] + log2f(total)) * kLn2;
    }
  }
}

// ---- tensor-core kernel, version 3 ------------------------------------------------------------
// v2 ran at 76-88 TFLOP/s where FlashAttention-2 runs at 266-349 (H200, bf16, D 128, 4k-16k
// tokens): each of its warps owns 16 rows, so every K or V fragment it reads from shared memory
// feeds a single mma. v3 gives each warp 32 rows, two 16-row slices (FlashAttention-2's
// arrangement of 128 rows over 4 warps): each fragment feeds two mma, and one K/V tile serves
// twice the rows (half the tile loads per FLOP). Q's fragments no longer fit in registers beside
// twice the accumulators, so they are re-read from shared memory (ldmatrix) for each tile. Key
// positions are int32 (a sequence has at most 2^31 - 1 keys), and problems without softcap and
// ALiBi (Plain) score with one multiply.

template <typename T, int D, bool Plain, bool Lean, int SUB>
__global__ void __launch_bounds__(kTcThreads) flash_tensor_core_v3(FlashParams p) {
  constexpr int BQ = kTcBlockQV3, BK = kTcBlockK;
  constexpr int QS = D + kTcPad;
  constexpr int CH = D / 8;
  constexpr int TILE = BK * QS;
  // SUB: keys scored at a time, a whole tile or half of one (for D 128 the two 64-key score slices
  // beside the 128 output accumulators spill without the lean softmax: v3).
  static_assert(BK % SUB == 0 && SUB % 16 == 0);
  extern __shared__ __align__(16) unsigned char tc_smem[];
  T* qs = reinterpret_cast<T*>(tc_smem);
  T* ks = qs + BQ * QS;  // stages 0 and 1
  T* vs = ks + 2 * TILE;

  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t4 = lane % 4;
  const int b = static_cast<int>(blockIdx.z), h = static_cast<int>(blockIdx.y);
  const SeqMeta m = p.meta[b];
  const std::int64_t q0 = static_cast<std::int64_t>(gridDim.x - 1 - blockIdx.x) * BQ;  // longest rows first
  if (q0 >= m.sq) return;  // uniform over the block
  const int hk = h / p.group;
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);

  const std::int64_t q_last = min(q0 + BQ, std::int64_t{m.sq}) - 1;
  const auto k_first = static_cast<std::int32_t>(visible_keys(p, q0, m.sq, m.skv).first);
  const auto k_last = static_cast<std::int32_t>(visible_keys(p, q_last, m.sq, m.skv).last);
  for (int idx = tid; idx < BQ * CH; idx += kTcThreads) {
    const int r = idx / CH, c = idx % CH;
    const bool valid = q0 + r < m.sq;
    cp_async16(qs + r * QS + c * 8, valid ? q + m.q + (q0 + r) * p.q_rs + h * p.q_hs + c * 8 : q, valid);
  }
  cp_async_commit();
  auto load_tile = [&](int stage, std::int32_t k0) {
    T* kd = ks + stage * TILE;
    T* vd = vs + stage * TILE;
    #pragma unroll 1  // unrolled, its hoisted addresses stay live through the tile and spill
    for (int idx = tid; idx < BK * CH; idx += kTcThreads) {
      const int r = idx / CH, c = idx % CH;
      const std::int32_t j = k0 + r;
      const bool valid = j >= k_first && j <= k_last;
      cp_async16(kd + r * QS + c * 8, valid ? k + kv_row(p, m, b, j, false) + hk * p.k_hs + c * 8 : k, valid);
      cp_async16(vd + r * QS + c * 8, valid ? v + kv_row(p, m, b, j, true) + hk * p.v_hs + c * 8 : v, valid);
    }
    cp_async_commit();
  };
  const std::int32_t k_begin = k_first / BK * BK;
  if (k_begin <= k_last) load_tile(0, k_begin);

  const int row_w = warp * 32;  // the warp's first row in the block; slice sl holds rows row_w + 16 sl ..
  std::int32_t first[2][2], last[2][2], pos[2][2];  // [slice][rr]: rows g and g + 8 of the slice
  std::int32_t whole_first = 0, whole_last = m.skv - 1;
  #pragma unroll
  for (int sl = 0; sl < 2; ++sl) {
    #pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const std::int64_t i = q0 + row_w + sl * 16 + rr * 8 + g;
      const KeyRange keys = visible_keys(p, i, m.sq, m.skv);
      first[sl][rr] = static_cast<std::int32_t>(keys.first);
      last[sl][rr] = static_cast<std::int32_t>(max(keys.last, std::int64_t{-1}));
      pos[sl][rr] = static_cast<std::int32_t>(i + m.skv - m.sq);
      whole_first = max(whole_first, first[sl][rr]);
      whole_last = min(whole_last, last[sl][rr]);
    }
  }
  const float slope = p.alibi != nullptr ? p.alibi[h] : 0.0f;
  const float scale_log2 = p.scale * kLog2e;

  float acc[2][D / 8][4];
  #pragma unroll
  for (int sl = 0; sl < 2; ++sl) {
    #pragma unroll
    for (int n = 0; n < D / 8; ++n) acc[sl][n][0] = acc[sl][n][1] = acc[sl][n][2] = acc[sl][n][3] = 0.0f;
  }
  float row_max[2][2] = {{-INFINITY, -INFINITY}, {-INFINITY, -INFINITY}};
  float row_sum[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};  // this lane's part

  int stage = 0;
  for (std::int32_t k0 = k_begin; k0 <= k_last; k0 += BK, stage ^= 1) {
    if (k0 + BK <= k_last) {
      load_tile(stage ^ 1, k0 + BK);  // that stage's readers finished at the previous barrier
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // this stage's tile (and, the first time, Q) is complete
    const T* kt = ks + stage * TILE;
    const T* vt = vs + stage * TILE;
    #pragma unroll 1
    for (int sub = 0; sub < BK; sub += SUB) {

    float s[2][SUB / 8][4];
    #pragma unroll
    for (int sl = 0; sl < 2; ++sl) {
      #pragma unroll
      for (int n = 0; n < SUB / 8; ++n) s[sl][n][0] = s[sl][n][1] = s[sl][n][2] = s[sl][n][3] = 0.0f;
    }
    #pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      std::uint32_t qa[2][4];  // A fragments of both slices: rows +0..7 / +8..15, dims kk*16 +0 / +8
      #pragma unroll
      for (int sl = 0; sl < 2; ++sl) {
        ldsm_x4(qa[sl], qs + (row_w + sl * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * QS + kk * 16 + (lane >> 4) * 8);
      }
      #pragma unroll
      for (int n = 0; n < SUB / 8; n += 2) {
        std::uint32_t kf[4];  // B fragments of key rows n*8.. (0, 1) and (n+1)*8.. (2, 3), dims kk*16 +0 / +8
        ldsm_x4(kf, kt + (sub + (n + (lane >> 4)) * 8 + (lane & 7)) * QS + kk * 16 + ((lane >> 3) & 1) * 8);
        #pragma unroll
        for (int sl = 0; sl < 2; ++sl) {
          mma_16816<T>(s[sl][n], qa[sl], kf[0], kf[1]);
          mma_16816<T>(s[sl][n + 1], qa[sl], kf[2], kf[3]);
        }
      }
    }

    const bool whole = k0 + sub >= whole_first && k0 + sub + SUB - 1 <= whole_last;
    if constexpr (Lean) {
      // Raw scores: the maximum is taken before scaling (scale > 0 keeps the order) and the scale
      // folds into the exponent's FFMA; max and sum run as four independent chains per row.
      if (!__all_sync(kFullMask, whole)) {
        #pragma unroll
        for (int sl = 0; sl < 2; ++sl) {
          #pragma unroll
          for (int n = 0; n < SUB / 8; ++n) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
              const std::int32_t j = k0 + sub + n * 8 + t4 * 2 + (e & 1);
              if (j < first[sl][e / 2] || j > last[sl][e / 2]) s[sl][n][e] = -INFINITY;
            }
          }
        }
      }
      float chain[2][2][4];
      #pragma unroll
      for (int sl = 0; sl < 2; ++sl) {
        #pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          #pragma unroll
          for (int c = 0; c < 4; ++c) chain[sl][rr][c] = -INFINITY;
        }
        #pragma unroll
        for (int n = 0; n < SUB / 8; ++n) {
          #pragma unroll
          for (int e = 0; e < 4; ++e) {
            float& m = chain[sl][e / 2][(n & 1) * 2 + (e & 1)];
            m = fmaxf(m, s[sl][n][e]);
          }
        }
      }
      float base[2][2], alpha[2][2];
      bool rescale = false;
      #pragma unroll
      for (int sl = 0; sl < 2; ++sl) {
        #pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          float tmax = fmaxf(fmaxf(chain[sl][rr][0], chain[sl][rr][1]), fmaxf(chain[sl][rr][2], chain[sl][rr][3]));
          tmax = fmaxf(tmax, __shfl_xor_sync(kFullMask, tmax, 1));
          tmax = fmaxf(tmax, __shfl_xor_sync(kFullMask, tmax, 2));
          const float new_max = fmaxf(row_max[sl][rr], tmax);  // raw units
          base[sl][rr] = new_max == -INFINITY ? 0.0f : new_max * scale_log2;
          alpha[sl][rr] = fast_exp2(fmaf(row_max[sl][rr], scale_log2, -base[sl][rr]));
          rescale = rescale || alpha[sl][rr] != 1.0f;
          row_max[sl][rr] = new_max;
          row_sum[sl][rr] *= alpha[sl][rr];
        }
      }
      if (__any_sync(kFullMask, rescale)) {
        #pragma unroll
        for (int sl = 0; sl < 2; ++sl) {
          #pragma unroll
          for (int n = 0; n < D / 8; ++n) {
            acc[sl][n][0] *= alpha[sl][0];
            acc[sl][n][1] *= alpha[sl][0];
            acc[sl][n][2] *= alpha[sl][1];
            acc[sl][n][3] *= alpha[sl][1];
          }
        }
      }
      #pragma unroll
      for (int sl = 0; sl < 2; ++sl) {
        float sum[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
        #pragma unroll
        for (int n = 0; n < SUB / 8; ++n) {
          #pragma unroll
          for (int e = 0; e < 4; ++e) {
            s[sl][n][e] = fast_exp2(fmaf(s[sl][n][e], scale_log2, -base[sl][e / 2]));
            sum[e / 2][e & 1] += s[sl][n][e];
          }
        }
        row_sum[sl][0] += sum[0][0] + sum[0][1];
        row_sum[sl][1] += sum[1][0] + sum[1][1];
      }
    } else {
      const bool whole = k0 + sub >= whole_first && k0 + sub + SUB - 1 <= whole_last;
      float tile_max[2][2] = {{-INFINITY, -INFINITY}, {-INFINITY, -INFINITY}};
      #pragma unroll
      for (int sl = 0; sl < 2; ++sl) {
        #pragma unroll
        for (int n = 0; n < SUB / 8; ++n) {
          #pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int rr = e / 2;
            const std::int32_t j = k0 + sub + n * 8 + t4 * 2 + (e & 1);
            const bool seen = whole || (j >= first[sl][rr] && j <= last[sl][rr]);
            float x;
            if constexpr (Plain) {
              x = s[sl][n][e] * scale_log2;
            } else {
              x = score_log2(p, s[sl][n][e], slope, pos[sl][rr], j);
            }
            s[sl][n][e] = seen ? x : -INFINITY;
            tile_max[sl][rr] = fmaxf(tile_max[sl][rr], s[sl][n][e]);
          }
        }
      }
      float base[2][2], alpha[2][2];
      bool rescale = false;
      #pragma unroll
      for (int sl = 0; sl < 2; ++sl) {
        #pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          float tmax = tile_max[sl][rr];
          tmax = fmaxf(tmax, __shfl_xor_sync(kFullMask, tmax, 1));
          tmax = fmaxf(tmax, __shfl_xor_sync(kFullMask, tmax, 2));
          const float new_max = fmaxf(row_max[sl][rr], tmax);
          base[sl][rr] = new_max == -INFINITY ? 0.0f : new_max;
          alpha[sl][rr] = exp2f(row_max[sl][rr] - base[sl][rr]);
          rescale = rescale || alpha[sl][rr] != 1.0f;
          row_max[sl][rr] = new_max;
          row_sum[sl][rr] *= alpha[sl][rr];
        }
      }
      // Past the first tiles a row's maximum rarely moves: skip the 128 multiplies by exactly 1.
      if (__any_sync(kFullMask, rescale)) {
        #pragma unroll
        for (int sl = 0; sl < 2; ++sl) {
          #pragma unroll
          for (int n = 0; n < D / 8; ++n) {
            acc[sl][n][0] *= alpha[sl][0];
            acc[sl][n][1] *= alpha[sl][0];
            acc[sl][n][2] *= alpha[sl][1];
            acc[sl][n][3] *= alpha[sl][1];
          }
        }
      }
      #pragma unroll
      for (int sl = 0; sl < 2; ++sl) {
        #pragma unroll
        for (int n = 0; n < SUB / 8; ++n) {
          #pragma unroll
          for (int e = 0; e < 4; ++e) {
            s[sl][n][e] = exp2f(s[sl][n][e] - base[sl][e / 2]);
            row_sum[sl][e / 2] += s[sl][n][e];
          }
        }
      }
    }

    #pragma unroll
    for (int kk = 0; kk < SUB / 16; ++kk) {
      std::uint32_t a[2][4];
      #pragma unroll
      for (int sl = 0; sl < 2; ++sl) {
        a[sl][0] = pack2<T>(s[sl][2 * kk][0], s[sl][2 * kk][1]);
        a[sl][1] = pack2<T>(s[sl][2 * kk][2], s[sl][2 * kk][3]);
        a[sl][2] = pack2<T>(s[sl][2 * kk + 1][0], s[sl][2 * kk + 1][1]);
        a[sl][3] = pack2<T>(s[sl][2 * kk + 1][2], s[sl][2 * kk + 1][3]);
      }
      #pragma unroll
      for (int n = 0; n < D / 8; n += 2) {
        std::uint32_t vf[4];  // keys kk*16 + 0..7 / 8..15 of dims n*8.. (0, 1) and (n+1)*8.. (2, 3)
        ldsm_x4_trans(vf, vt + (sub + kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * QS + (n + (lane >> 4)) * 8);
        #pragma unroll
        for (int sl = 0; sl < 2; ++sl) {
          mma_16816<T>(acc[sl][n], a[sl], vf[0], vf[1]);
          mma_16816<T>(acc[sl][n + 1], a[sl], vf[2], vf[3]);
        }
      }
    }
    }
    __syncthreads();  // every warp is done with this stage before the next iteration refills it
  }
  cp_async_wait<0>();  // a block whose rows see no key still has Q's copy in flight

  T* o = static_cast<T*>(p.o);
  #pragma unroll
  for (int sl = 0; sl < 2; ++sl) {
    #pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      float total = row_sum[sl][rr];
      total += __shfl_xor_sync(kFullMask, total, 1);
      total += __shfl_xor_sync(kFullMask, total, 2);
      const std::int64_t i = q0 + row_w + sl * 16 + rr * 8 + g;
      if (i >= m.sq) continue;
      const std::int64_t o_off = m.o + i * p.o_rs + h * p.o_hs;
      #pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        #pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float val = total == 0.0f ? 0.0f : acc[sl][n][2 * rr + e] / total;
          o[o_off + n * 8 + t4 * 2 + e] = static_cast<T>(val);
        }
      }
      if (p.lse != nullptr && t4 == 0) {
        const float max_log2 = Lean ? row_max[sl][rr] * scale_log2 : row_max[sl][rr];
        p.lse[m.lse + h * p.lse_hs + i * p.lse_is] = total == 0.0f ? -INFINITY : (max_log2 + log2f(total)) * kLn2;
      }
    }
  }
}

// ---- split-KV decode kernel on tensor cores -----------------------------------------------------
// Few query rows against many keys. The generic kernel reached 367 GB/s of an H200's ~4.3 TB/s on
// 8 x 32k keys (32/8 heads, D 128, bf16): each lane reads a whole key row (uncoalesced) and each
// query head re-reads its KV head's keys. Here one warp owns every query row of one KV head --
// (query row, head of the group) pairs, at most 16: the m16 of an mma tile -- over one range of
// keys (a split), and streams 16-key K/V steps through two shared-memory stages of its own with
// cp.async: every K/V byte is read once, coalesced, for the whole group, and the scores and P.V
// run on tensor cores as in the prefill kernels. Each warp writes a partial result (unnormalised
// output, max, sum) that flash_combine merges; warps synchronise only among their own lanes.

template <typename T, typename QT, int D>
__global__ void __launch_bounds__(kDecodeThreads, 3) flash_decode_tc(FlashParams p) {
  constexpr int BK = kDecodeStepKeys;
  constexpr int QS = D + kTcPad;
  constexpr int CH = D / 8;
  constexpr int STEP = BK * QS;  // elements of one K or V step
  extern __shared__ __align__(16) unsigned char dec_smem[];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, t4 = lane % 4;
  const int split = static_cast<int>(blockIdx.x) * kDecodeWarps + warp;
  const int hk = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const SeqMeta m = p.meta[b];
  if (split >= p.num_splits || m.sq == 0) return;  // whole warp; only warp barriers follow
  T* ks = reinterpret_cast<T*>(dec_smem) + warp * 4 * STEP;  // this warp's K stages, then its V stages
  T* vs = ks + 2 * STEP;
  const QT* q = static_cast<const QT*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const int rows = m.sq * p.group;  // tile row r: query row r / group of head hk * group + r % group

  // Keys of this split that some row sees (visible ranges grow with the row).
  const std::int64_t split_first = static_cast<std::int64_t>(split) * p.keys_per_split;
  const auto lo = static_cast<std::int32_t>(max(visible_keys(p, 0, m.sq, m.skv).first, split_first));
  const auto hi = static_cast<std::int32_t>(
      min(visible_keys(p, m.sq - 1, m.sq, m.skv).last, split_first + p.keys_per_split - 1));

  std::int32_t first[2], last[2], pos[2], head[2];
  std::int64_t qrow[2];
  bool live[2];
  for (int rr = 0; rr < 2; ++rr) {
    const int r = g + rr * 8;
    live[rr] = r < rows;
    qrow[rr] = live[rr] ? r / p.group : 0;
    head[rr] = hk * p.group + (live[rr] ? r % p.group : 0);
    const KeyRange keys = visible_keys(p, qrow[rr], m.sq, m.skv);
    first[rr] = static_cast<std::int32_t>(max(keys.first, std::int64_t{lo}));
    last[rr] = live[rr] ? static_cast<std::int32_t>(min(keys.last, std::int64_t{hi})) : -1;
    pos[rr] = static_cast<std::int32_t>(qrow[rr] + m.skv - m.sq);
  }
  // A fragments of Q (rows g and g + 8), loaded once; rows past `rows` are zero; f32 q is rounded.
  std::uint32_t qf[D / 16][4];
  #pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int rr = e & 1, col = kk * 16 + t4 * 2 + (e >> 1) * 8;
      const QT* src = q + m.q + qrow[rr] * p.q_rs + head[rr] * p.q_hs + col;
      if constexpr (std::is_same_v<QT, float>) {
        qf[kk][e] = live[rr] ? pack2<T>(src[0], src[1]) : 0u;
      } else {
        qf[kk][e] = live[rr] ? lds32(src) : 0u;
      }
    }
  }
  const float slope0 = p.alibi != nullptr && live[0] ? p.alibi[head[0]] : 0.0f;
  const float slope1 = p.alibi != nullptr && live[1] ? p.alibi[head[1]] : 0.0f;

  float acc[D / 8][4];
  #pragma unroll
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};

  auto load_step = [&](int stage, std::int32_t k0) {
    T* kd = ks + stage * STEP;
    T* vd = vs + stage * STEP;
    #pragma unroll 1  // unrolled, the hoisted addresses of 8 rows stay live through the step
    for (int idx = lane; idx < BK * CH; idx += 32) {
      const int r = idx / CH, c = idx % CH;
      const std::int32_t j = k0 + r;
      const bool valid = j <= hi;
      cp_async16(kd + r * QS + c * 8, valid ? k + kv_row(p, m, b, j, false) + hk * p.k_hs + c * 8 : k, valid);
      cp_async16(vd + r * QS + c * 8, valid ? v + kv_row(p, m, b, j, true) + hk * p.v_hs + c * 8 : v, valid);
    }
    cp_async_commit();
  };
  if (lo <= hi) load_step(0, lo);
  int stage = 0;
  for (std::int32_t k0 = lo; k0 <= hi; k0 += BK, stage ^= 1) {
    if (k0 + BK <= hi) {
      load_step(stage ^ 1, k0 + BK);  // this warp finished reading that stage at the previous syncwarp
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncwarp();  // every lane's copies of this step are visible to the whole warp
    const T* kt = ks + stage * STEP;
    const T* vt = vs + stage * STEP;

    float s[2][4];
    #pragma unroll
    for (int n = 0; n < 2; ++n) {
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
      #pragma unroll
      for (int kk = 0; kk < D / 16; kk += 2) {
        std::uint32_t kf[4];
        ldsm_x4(kf, kt + (n * 8 + (lane & 7)) * QS + kk * 16 + (lane >> 3) * 8);
        mma_16816<T>(s[n], qf[kk], kf[0], kf[1]);
        mma_16816<T>(s[n], qf[kk + 1], kf[2], kf[3]);
      }
    }
    float tile_max[2] = {-INFINITY, -INFINITY};
    #pragma unroll
    for (int n = 0; n < 2; ++n) {
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int rr = e / 2;
        const std::int32_t j = k0 + n * 8 + t4 * 2 + (e & 1);
        const bool seen = j >= first[rr] && j <= last[rr];
        s[n][e] = seen ? score_log2(p, s[n][e], rr == 0 ? slope0 : slope1, pos[rr], j) : -INFINITY;
        tile_max[rr] = fmaxf(tile_max[rr], s[n][e]);
      }
    }
    float base[2], alpha[2];
    bool rescale = false;
    #pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      tile_max[rr] = fmaxf(tile_max[rr], __shfl_xor_sync(kFullMask, tile_max[rr], 1));
      tile_max[rr] = fmaxf(tile_max[rr], __shfl_xor_sync(kFullMask, tile_max[rr], 2));
      const float new_max = fmaxf(row_max[rr], tile_max[rr]);
      base[rr] = new_max == -INFINITY ? 0.0f : new_max;
      alpha[rr] = exp2f(row_max[rr] - base[rr]);
      rescale = rescale || alpha[rr] != 1.0f;
      row_max[rr] = new_max;
      row_sum[rr] *= alpha[rr];
    }
    if (__any_sync(kFullMask, rescale)) {
      #pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        acc[n][0] *= alpha[0];
        acc[n][1] *= alpha[0];
        acc[n][2] *= alpha[1];
        acc[n][3] *= alpha[1];
      }
    }
    #pragma unroll
    for (int n = 0; n < 2; ++n) {
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[n][e] = exp2f(s[n][e] - base[e / 2]);
        row_sum[e / 2] += s[n][e];
      }
    }
    const std::uint32_t a[4] = {pack2<T>(s[0][0], s[0][1]), pack2<T>(s[0][2], s[0][3]), pack2<T>(s[1][0], s[1][1]),
                                pack2<T>(s[1][2], s[1][3])};
    #pragma unroll
    for (int n = 0; n < D / 8; n += 2) {
      std::uint32_t vf[4];  // keys 0..7 / 8..15 of dims n*8.. (0, 1) and (n+1)*8.. (2, 3)
      ldsm_x4_trans(vf, vt + ((lane & 7) + ((lane >> 3) & 1) * 8) * QS + (n + (lane >> 4)) * 8);
      mma_16816<T>(acc[n], a, vf[0], vf[1]);
      mma_16816<T>(acc[n + 1], a, vf[2], vf[3]);
    }
    __syncwarp();  // the whole warp is done with this stage before the next step refills it
  }

  #pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    float total = row_sum[rr];
    total += __shfl_xor_sync(kFullMask, total, 1);
    total += __shfl_xor_sync(kFullMask, total, 2);
    if (!live[rr]) continue;
    const std::int64_t slot = (static_cast<std::int64_t>(split) * p.total_q + m.row0 + qrow[rr]) * p.hq + head[rr];
    #pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      p.part_o[slot * p.dv + n * 8 + t4 * 2] = acc[n][2 * rr];
      p.part_o[slot * p.dv + n * 8 + t4 * 2 + 1] = acc[n][2 * rr + 1];
    }
    if (t4 == 0) {
      p.part_m[slot] = row_max[rr];
      p.part_l[slot] = total;
    }
  }
}

template <typename T, int D>
cudaError_t launch_decode(const FlashParams& p, cudaStream_t stream) {
  const LaunchShape s = decode_launch(p);
  auto* kernel = p.q_dtype == kF32 ? flash_decode_tc<T, float, D> : flash_decode_tc<T, T, D>;
  if (const cudaError_t e =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(s.smem_bytes));
      e != cudaSuccess) {
    return e;
  }
  kernel<<<dim3(s.grid[0], s.grid[1], s.grid[2]), dim3(s.block), s.smem_bytes, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t launch_tc(const FlashParams& p, cudaStream_t stream) {
  const LaunchShape s = tensor_core_launch(p);
  const bool plain = p.softcap <= 0.0f && p.alibi == nullptr;
  // v4: v3 with the lean softmax; v5: v4 scoring whole 64-key tiles at D 128 too (v3 and v4 take
  // two 32-key halves there). Softcap, ALiBi or a negative scale take v3's general softmax.
  constexpr int kHalf = D > 64 ? kTcBlockK / 2 : kTcBlockK;
  const bool lean = p.tc_version >= 4 && plain && p.scale > 0.0f;
  auto* kernel = p.tc_version == 1          ? flash_tensor_core<T, D>
                 : p.tc_version == 2        ? flash_tensor_core_v2<T, D>
                 : lean && p.tc_version >= 5 ? flash_tensor_core_v3<T, D, true, true, kTcBlockK>
                 : lean                     ? flash_tensor_core_v3<T, D, true, true, kHalf>
                 : plain                    ? flash_tensor_core_v3<T, D, true, false, kHalf>
                                            : flash_tensor_core_v3<T, D, false, false, kHalf>;
  // Above 48 KiB a kernel must opt in; cheap enough to repeat per launch.
  if (const cudaError_t e =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(s.smem_bytes));
      e != cudaSuccess) {
    return e;
  }
  kernel<<<dim3(s.grid[0], s.grid[1], s.grid[2]), dim3(s.block), s.smem_bytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_flash_tensor_core(const FlashParams& p, cudaStream_t stream) {
  const bool bf16 = p.q_dtype == kBF16;
  if (p.d == 64) return bf16 ? launch_tc<__nv_bfloat16, 64>(p, stream) : launch_tc<__half, 64>(p, stream);
  return bf16 ? launch_tc<__nv_bfloat16, 128>(p, stream) : launch_tc<__half, 128>(p, stream);
}

cudaError_t launch_flash_decode(const FlashParams& p, cudaStream_t stream) {
  const bool bf16 = p.kv_dtype == kBF16;
  if (p.d == 64) return bf16 ? launch_decode<__nv_bfloat16, 64>(p, stream) : launch_decode<__half, 64>(p, stream);
  return bf16 ? launch_decode<__nv_bfloat16, 128>(p, stream) : launch_decode<__half, 128>(p, stream);
}

cudaError_t launch_flash_generic(const FlashParams& p, cudaStream_t stream) {
  const LaunchShape s = generic_launch(p);
  const dim3 grid(s.grid[0], s.grid[1], s.grid[2]);
  if (s.smem_bytes > 48 * 1024) {  // large head dims: opt in to the device's larger limit
    cudaError_t e = cudaSuccess;
    switch (p.kv_dtype) {
      case kF16: e = cudaFuncSetAttribute(flash_generic<__half>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(s.smem_bytes)); break;
      case kBF16: e = cudaFuncSetAttribute(flash_generic<__nv_bfloat16>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(s.smem_bytes)); break;
      default: e = cudaFuncSetAttribute(flash_generic<float>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(s.smem_bytes)); break;
    }
    if (e != cudaSuccess) return e;
  }
  switch (p.kv_dtype) {
    case kF16:
      flash_generic<__half><<<grid, dim3(s.block), s.smem_bytes, stream>>>(p);
      break;
    case kBF16:
      flash_generic<__nv_bfloat16><<<grid, dim3(s.block), s.smem_bytes, stream>>>(p);
      break;
    default:
      flash_generic<float><<<grid, dim3(s.block), s.smem_bytes, stream>>>(p);
      break;
  }
  return cudaGetLastError();
}

cudaError_t launch_flash_combine(const FlashParams& p, cudaStream_t stream) {
  LaunchShape s = generic_launch(p);
  s.grid[1] = 1;
  flash_combine<<<dim3(s.grid[0], s.grid[1], s.grid[2]), dim3(s.block), 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace kallpa::cuda
