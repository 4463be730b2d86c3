// cuda-flash's generic kernel (any dtypes, head dims and strides; f32 FMAs) and the combine step
// that merges split-KV partial results (its own and the decode kernel's).
#include "backends/cuda/flash_device.cuh"
#include "backends/cuda/flash_kernels.h"

namespace kallpa::cuda {
namespace {

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

}  // namespace

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
