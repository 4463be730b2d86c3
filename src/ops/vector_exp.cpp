#include "ops/vector_exp.h"

#include <cmath>
#include <limits>

namespace kallpa::ops {

namespace {
#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) std::int64_t exp_inplace_avx2(float* x, std::int64_t n) {
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp_avx2(_mm256_loadu_ps(x + i)));
  return i;
}

__attribute__((target("avx2,fma"))) std::int64_t max_ignoring_nan_avx2(const float* x, std::int64_t n, float& max) {
  // max_ps returns its second operand when either is NaN, so NaN entries never displace it.
  __m256 acc = _mm256_set1_ps(max);
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_max_ps(_mm256_loadu_ps(x + i), acc);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float l : lanes) max = l > max ? l : max;
  return i;
}

__attribute__((target("avx2,fma"))) std::int64_t shifted_exp_avx2(const float* x, float* out, std::int64_t n,
                                                                  float shift, float scale) {
  const __m256 s = _mm256_set1_ps(shift), k = _mm256_set1_ps(scale), floor = _mm256_set1_ps(-87.0f);
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 t = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), s), k);
    const __m256 weighed = _mm256_cmp_ps(t, floor, _CMP_GE_OQ);  // false for NaN
    _mm256_storeu_ps(out + i, _mm256_and_ps(exp_avx2(t), weighed));
  }
  return i;
}
#endif

#if defined(__x86_64__)
const bool kHasAvx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
}  // namespace

void exp_inplace(float* x, std::int64_t n) noexcept {
  std::int64_t i = 0;
#if defined(__x86_64__)
  if (kHasAvx2) i = exp_inplace_avx2(x, n);
#endif
  for (; i < n; ++i) x[i] = std::exp(x[i]);
}

float max_ignoring_nan(const float* x, std::int64_t n) noexcept {
  float max = -std::numeric_limits<float>::infinity();
  std::int64_t i = 0;
#if defined(__x86_64__)
  if (kHasAvx2) i = max_ignoring_nan_avx2(x, n, max);
#endif
  for (; i < n; ++i) max = x[i] > max ? x[i] : max;
  return max;
}

void shifted_exp(const float* x, float* out, std::int64_t n, float shift, float scale) noexcept {
  std::int64_t i = 0;
#if defined(__x86_64__)
  if (kHasAvx2) i = shifted_exp_avx2(x, out, n, shift, scale);
#endif
  for (; i < n; ++i) {
    const float t = (x[i] - shift) * scale;
    out[i] = t >= -87.0f ? std::exp(t) : 0.0f;
  }
}

}  // namespace kallpa::ops
