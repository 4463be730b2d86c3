// The AVX2 pieces every Q16 kernel (gemm_q16 of quant_kernels.h: quant_dot_avx2.cpp for Q8_0/Q4_0/
// Q4_1, gemm_q16_units_avx2.cpp for the types of ops/q16_units.h) shares: a row's 32 products per
// block are summed exactly in two int32 halves, E (elements j with j mod 4 in {0, 1}) and O (j mod 4
// in {2, 3}); four rows' halves share one vector as [E0 O0 E1 O1 | E2 O2 E3 O3], so one convert and
// one FMA (with [s0 s0 s1 s1 | s2 s2 s3 s3], s_r = d_w * d_x) serve four rows, and a batched tile
// needs one accumulator per activation row instead of four. Every kernel that goes through
// accumulate_block and store_row_sums computes the same bits for a row, alone or batched. Static,
// as avx2_common.h's: the AVX-512 files include them too, each keeping its own copy.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "ops/quant_types.h"

#define KALLPA_Q16_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace kallpa::ops::kernels {

// Four rows' madd results (lane l of v[r]: elements 2l, 2l+1, 16+2l, 17+2l, so each 64-bit half
// holds an (E, O) pair) folded to [E0 O0 E1 O1 | E2 O2 E3 O3]. Integer sums are exact, so the
// order of the adds does not matter.
KALLPA_Q16_AVX2 static inline __m256i fold_row_sums(const __m256i (&v)[4]) {
  const __m256i a = _mm256_add_epi32(_mm256_unpacklo_epi64(v[0], v[1]), _mm256_unpackhi_epi64(v[0], v[1]));
  const __m256i c = _mm256_add_epi32(_mm256_unpacklo_epi64(v[2], v[3]), _mm256_unpackhi_epi64(v[2], v[3]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, c, 0x20), _mm256_permute2x128_si256(a, c, 0x31));
}

// [d0 d1 d2 d3] -> [d0 d0 d1 d1 | d2 d2 d3 d3], the scale of each lane of a folded vector.
KALLPA_Q16_AVX2 static inline __m256 pair_lanes(__m128 d4) {
  return _mm256_set_m128(_mm_unpackhi_ps(d4, d4), _mm_unpacklo_ps(d4, d4));
}

// acc + [E0 O0 .. E3 O3] * (d8 * d_x) from four rows' per-lane sums v[r] (lane l: the products of
// elements 2l, 2l+1, 16+2l and 17+2l of the block), d8 the rows' scales as pair_lanes gives them.
KALLPA_Q16_AVX2 static inline __m256 accumulate_sums(const __m256i (&v)[4], const BlockQ16x& xb, __m256 d8,
                                                     __m256 acc) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(fold_row_sums(v)), _mm256_mul_ps(d8, _mm256_broadcast_ss(&xb.d)), acc);
}

// One block of four weight rows against one activation block: w[2r] and w[2r + 1] are row r's
// elements 0..15 and 16..31 as int16 (zero for a row that is not there), d8 the rows' scales as
// pair_lanes gives them. Returns acc + [E0 O0 .. E3 O3] * (d8 * d_x). Both Q16 tiles go through
// it, which is what makes a row's result the same alone or batched.
KALLPA_Q16_AVX2 static inline __m256 accumulate_block(const __m256i* w, const BlockQ16x& xb, __m256 d8, __m256 acc) {
  const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.qs));
  const __m256i xc = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.qs + 16));
  __m256i v[4];
  for (int r = 0; r < 4; ++r) {
    v[r] = _mm256_add_epi32(_mm256_madd_epi16(w[2 * r], xa), _mm256_madd_epi16(w[2 * r + 1], xc));
  }
  return accumulate_sums(v, xb, d8, acc);
}

// y[r] = ((acc lane 2r) + (acc lane 2r + 1)) + macc[r] for the first n rows.
KALLPA_Q16_AVX2 static inline void store_row_sums(__m256 acc, __m128 macc, int n, float* y) {
  const __m128 sums = _mm_add_ps(_mm_hadd_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1)), macc);
  if (n == 4) {
    _mm_storeu_ps(y, sums);
  } else {
    alignas(16) float s[4];
    _mm_store_ps(s, sums);
    for (int r = 0; r < n; ++r) y[r] = s[r];
  }
}

}  // namespace kallpa::ops::kernels

#undef KALLPA_Q16_AVX2
#endif
