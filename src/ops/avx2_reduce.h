// The one horizontal sum every AVX2 f32 kernel of the ops ends an output with: the canonical
// order of quant.h, ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)), which the scalar reference kernels
// follow too, so that AVX2 and scalar agree bit for bit.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

namespace kallpa::ops::kernels {

__attribute__((target("avx2,fma,f16c"))) inline float canonical_hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace kallpa::ops::kernels
#endif
