// Hopper's warpgroup MMA (wgmma.mma_async, sm_90a) for the Hopper prefill kernel
// (forward_wgmma.cu): the shared-memory descriptor of the 128-byte-swizzle layout it stores tiles
// in, and the three instruction shapes it issues. A warpgroup (4 warps, 128 threads) multiplies a
// 64-row A by a 16-deep slice of B per instruction; the accumulator fragment is mma.m16n8's,
// repeated: warp w of the group holds rows 16 w .. 16 w + 15, and register 4 n + e of a lane is
// row lane / 4 (+ 8 for e >= 2), column 8 n + 2 (lane % 4) + (e & 1). An A fragment from
// registers is mma.m16n8k16's A fragment per warp, so the score accumulator, rounded to 16 bits,
// is the probability operand of the second product without any exchange between lanes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "backends/cuda/flash_plan.h"

namespace kallpa::cuda {

// Tiles live in shared memory in the layout swizzled_chunk() (flash_plan.h) describes.

// The 64-bit matrix descriptor: start address, leading and stride byte offsets (all >> 4, 14 bits
// each), 128-byte swizzle (mode 1 in bits 62-63); the base-offset field stays 0 because every atom
// starts on a 1024-byte boundary. K-major operands (rows along M or N, the 16-deep slice within a
// row): stride = 1024, the next 8 rows; leading unused (1). MN-major (V: keys along K, the head dim
// contiguous): stride = 1024, the next 8 keys; leading = the next 64-dim panel.
__device__ __forceinline__ std::uint64_t sw128_desc(std::uint32_t smem_address, std::uint32_t leading,
                                                    std::uint32_t stride) {
  return static_cast<std::uint64_t>((smem_address & 0x3FFFF) >> 4) |
         (static_cast<std::uint64_t>((leading >> 4) & 0x3FFF) << 16) |
         (static_cast<std::uint64_t>((stride >> 4) & 0x3FFF) << 32) | (std::uint64_t{1} << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int Pending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory");
}
// wgmma reads shared memory through the async proxy; what cp.async wrote (generic proxy) must be
// fenced into it by the writing thread before the barrier that publishes it.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Ties an accumulator to this point of the program, so that the compiler neither reads it before
// the wgmma that writes it has been waited for nor moves writes to it past the next fence.
template <int N>
__device__ __forceinline__ void pin_registers(float (&r)[N]) {
  #pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

#define KALLPA_F4(a, i) "+f"(a[i]), "+f"(a[(i) + 1]), "+f"(a[(i) + 2]), "+f"(a[(i) + 3])
#define KALLPA_F16(a, i) KALLPA_F4(a, i), KALLPA_F4(a, (i) + 4), KALLPA_F4(a, (i) + 8), KALLPA_F4(a, (i) + 12)
#define KALLPA_F32(a) KALLPA_F16(a, 0), KALLPA_F16(a, 16)
#define KALLPA_F64(a) KALLPA_F16(a, 0), KALLPA_F16(a, 16), KALLPA_F16(a, 32), KALLPA_F16(a, 48)
#define KALLPA_D32                                                                                               \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define KALLPA_D64                                                                                               \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "  \
  "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

template <typename T>
constexpr bool kIsHalf = std::is_same_v<T, __half>;

// d (64 x 128, f32) = (Accumulate ? d : 0) + A (64 x 16, K-major in shared memory) B (16 x 128,
// K-major: 128 rows of 16) -- the scores of 64 query rows against 128 keys, 16 dims at a time.
// Accumulate is an immediate: a predicate computed between two wgmma would make ptxas serialize them.
template <typename T, bool Accumulate>
__device__ __forceinline__ void wgmma_ss_n128(float (&d)[64], std::uint64_t a, std::uint64_t b) {
  if constexpr (kIsHalf<T>) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " KALLPA_D64 ", %64, %65, %66, 1, 1, 0, 0;\n"
                 : KALLPA_F64(d)
                 : "l"(a), "l"(b), "n"(Accumulate ? 1 : 0));
  } else {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " KALLPA_D64 ", %64, %65, %66, 1, 1, 0, 0;\n"
                 : KALLPA_F64(d)
                 : "l"(a), "l"(b), "n"(Accumulate ? 1 : 0));
  }
}

// d (64 x N, f32) += A (64 x 16 from registers: the probabilities) B (16 x N, MN-major in shared
// memory: 16 keys of V, N head dims contiguous, hence the transpose flag), N = 128 or 64.
template <typename T, int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const std::uint32_t (&a)[4], std::uint64_t b) {
  static_assert(N == 128 || N == 64);
  if constexpr (N == 128) {
    if constexpr (kIsHalf<T>) {
      asm volatile(
          "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " KALLPA_D64 ", {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
          : KALLPA_F64(d)
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
    } else {
      asm volatile(
          "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " KALLPA_D64
          ", {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
          : KALLPA_F64(d)
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
    }
  } else {
    if constexpr (kIsHalf<T>) {
      asm volatile(
          "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " KALLPA_D32 ", {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"
          : KALLPA_F32(d)
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
    } else {
      asm volatile(
          "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " KALLPA_D32 ", {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"
          : KALLPA_F32(d)
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
    }
  }
}

#undef KALLPA_F4
#undef KALLPA_F16
#undef KALLPA_F32
#undef KALLPA_F64
#undef KALLPA_D32
#undef KALLPA_D64

}  // namespace kallpa::cuda
