// Device helpers shared by cuda-flash's kernels (forward_*.cu, decode.cu; the lab's too): dtype
// conversion, the visible-key range and K/V row addressing of the contract, scoring, warp
// reductions, and the PTX wrappers the tensor-core kernels use (mma.sync, ldmatrix, cp.async, ex2).
// Every kernel computes, for one query row and the keys it sees,
//   o = sum_j p_j v_j / sum_j p_j,  p_j = 2^(s_j log2(e) - m)
// with the running maximum m kept per row (online softmax, f32), so a row's scores are never
// materialised. Masked keys are never read: every load is limited to the visible key range, and
// the tensor-core kernels zero-fill tile rows outside their block's visible range (a masked value's
// weight is 0, but 0 * NaN is NaN).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "backends/cuda/flash_params.h"
#include "backends/cuda/flash_plan.h"

namespace kallpa::cuda {

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;
inline constexpr unsigned kFullMask = 0xffffffffu;

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

// The first query row of this tensor-core block (block_q rows per block, x over a sequence's
// row tiles): blocks are numbered from the last tile, so the rows that see the most keys (causal)
// start first and the short ones fill the tail.
__device__ __forceinline__ std::int64_t block_first_row(int block_q) {
  return static_cast<std::int64_t>(gridDim.x - 1 - blockIdx.x) * block_q;
}
// The keys that any of rows q0 .. q0 + block_q - 1 of sequence m sees: both bounds of
// visible_keys() grow with the row, so the first row gives the first key and the last the last.
__device__ __forceinline__ KeyRange block_keys(const FlashParams& p, const SeqMeta& m, std::int64_t q0, int block_q) {
  const std::int64_t q_last = min(q0 + block_q, std::int64_t{m.sq}) - 1;
  return {visible_keys(p, q0, m.sq, m.skv).first, visible_keys(p, q_last, m.sq, m.skv).last};
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

// acc[n] holds an m16n8 accumulator tile's rows g (registers 0, 1) and g + 8 (2, 3) for this lane:
// multiplies them by their rows' factors (the online softmax's correction for a new maximum).
template <int N>
__device__ __forceinline__ void scale_rows(float (&acc)[N][4], float row_g, float row_g8) {
  #pragma unroll
  for (int n = 0; n < N; ++n) {
    acc[n][0] *= row_g;
    acc[n][1] *= row_g;
    acc[n][2] *= row_g8;
    acc[n][3] *= row_g8;
  }
}

// Opts the kernel in to its shared memory (above 48 KiB a kernel must; cheap enough to repeat per
// launch) and queues it with shape s.
inline cudaError_t launch_with_smem(void (*kernel)(FlashParams), const LaunchShape& s, const FlashParams& p,
                                    cudaStream_t stream) {
  if (const cudaError_t e =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(s.smem_bytes));
      e != cudaSuccess) {
    return e;
  }
  kernel<<<dim3(s.grid[0], s.grid[1], s.grid[2]), dim3(s.block), s.smem_bytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace kallpa::cuda
