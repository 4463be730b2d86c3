// The f32 micro-kernel of the exact-activation prompt products (gemm_f32_tile_avx2's contract) on
// AVX-512: each 512-bit accumulator holds two weight rows' 8-lane accumulators side by side (row 2p
// in the low half, row 2p + 1 in the high one) against the same 8 activations broadcast to both
// halves. Each half takes exactly the AVX2 kernel's FMAs in the same order, so an output's bits do
// not depend on which kernel, tile or half computed it; one instruction does two rows' work, which
// doubles the FMA throughput where the core has 512-bit FMA units. Tiles of 3 row pairs x 8
// activation rows keep 24 accumulators in registers; a last odd row goes to the AVX2 kernel.
#include "ops/avx2_common.h"
#include "ops/quant_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KALLPA_X86 1
#endif

namespace kallpa::ops::kernels {

#if KALLPA_X86

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512dq,avx512vl,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512vl,avx2,fma,f16c")
// GCC 12's AVX-512 headers initialise their "undefined" vectors from themselves, which
// -W(maybe-)uninitialized reports at every inlined intrinsic (GCC bug 105593, fixed in 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace {

// NP row pairs (rows 0 .. 2 NP - 1 of w, k apart) x NX activation rows.
template <int NP, int NX>
void tile_pairs(const float* w, std::int64_t k, const float* x, std::int64_t ldx, float* y, std::int64_t ldy) {
  __m512 acc[NP][NX];
  for (int p = 0; p < NP; ++p) {
    for (int c = 0; c < NX; ++c) acc[p][c] = _mm512_setzero_ps();
  }
  for (std::int64_t i = 0; i < k; i += 8) {
    __m512 wv[NP];
    for (int p = 0; p < NP; ++p) {
      const float* lo = w + static_cast<std::int64_t>(2 * p) * k + i;
      wv[p] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(lo)), _mm256_loadu_ps(lo + k), 1);
    }
    for (int c = 0; c < NX; ++c) {
      const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + static_cast<std::int64_t>(c) * ldx + i));
      for (int p = 0; p < NP; ++p) acc[p][c] = _mm512_fmadd_ps(wv[p], xv, acc[p][c]);
    }
  }
  for (int c = 0; c < NX; ++c) {
    float* yc = y + static_cast<std::int64_t>(c) * ldy;
    for (int p = 0; p < NP; ++p) {
      yc[2 * p] = canonical_hsum(_mm512_castps512_ps256(acc[p][c]));
      yc[2 * p + 1] = canonical_hsum(_mm512_extractf32x8_ps(acc[p][c], 1));
    }
  }
}

template <int NP>
void tile_pairs_cols(const float* w, std::int64_t k, const float* x, std::int64_t ldx, std::int64_t nx, float* y,
                     std::int64_t ldy) {
  constexpr int kCols = 8;
  std::int64_t c = 0;
  for (; c + kCols <= nx; c += kCols) tile_pairs<NP, kCols>(w, k, x + c * ldx, ldx, y + c * ldy, ldy);
  for (; c + 2 <= nx; c += 2) tile_pairs<NP, 2>(w, k, x + c * ldx, ldx, y + c * ldy, ldy);
  if (c < nx) tile_pairs<NP, 1>(w, k, x + c * ldx, ldx, y + c * ldy, ldy);
}

}  // namespace

void gemm_f32_tile_avx512(const float* w, std::int64_t nr, std::int64_t k, const float* x, std::int64_t ldx,
                          std::int64_t nx, float* y, std::int64_t ldy) {
  std::int64_t r = 0;
  for (; r + 6 <= nr; r += 6) tile_pairs_cols<3>(w + r * k, k, x, ldx, nx, y + r, ldy);
  for (; r + 2 <= nr; r += 2) tile_pairs_cols<1>(w + r * k, k, x, ldx, nx, y + r, ldy);
  if (r < nr) gemm_f32_tile_avx2(w + r * k, nr - r, k, x, ldx, nx, y + r, ldy);
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

#else  // not x86

void gemm_f32_tile_avx512(const float* w, std::int64_t nr, std::int64_t k, const float* x, std::int64_t ldx,
                          std::int64_t nx, float* y, std::int64_t ldy) {
  gemm_f32_tile_avx2(w, nr, k, x, ldx, nx, y, ldy);
}

#endif

}  // namespace kallpa::ops::kernels
