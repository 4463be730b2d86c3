// A vectorised exp for the engine's element-wise ops and the sampler's softmax.
#pragma once

#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kallpa::ops {

#if defined(__x86_64__)
// exp(x) for x in [-87, 88] (clamped outside), Cephes' expf: 2^n * p(r), r = x - n ln2 in
// [-ln2/2, ln2/2], degree-5 polynomial; within 2 ulp of expf.
__attribute__((target("avx2,fma"))) inline __m256 exp_avx2(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

// x[i] = exp(x[i]) for i < n: AVX2 where the CPU has it (within 2 ulp of expf; inputs below -87
// give exp(-87) ~ 1.6e-38 rather than a denormal or 0), else std::exp.
void exp_inplace(float* x, std::int64_t n) noexcept;

// The largest of x[0..n) that is not NaN; -inf when there is none.
float max_ignoring_nan(const float* x, std::int64_t n) noexcept;

// out[i] = exp((x[i] - shift) * scale), and exactly 0 where x[i] is NaN or the scaled value is
// below -87 (where f32 runs out of normal range): a softmax's weights, with masked entries 0.
void shifted_exp(const float* x, float* out, std::int64_t n, float shift, float scale) noexcept;

}  // namespace kallpa::ops
