#include "runtime/vector_exp.h"

#include <cmath>

namespace kallpa::runtime {

namespace {
#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) std::int64_t exp_inplace_avx2(float* x, std::int64_t n) {
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp_avx2(_mm256_loadu_ps(x + i)));
  return i;
}
#endif
}  // namespace

void exp_inplace(float* x, std::int64_t n) noexcept {
  std::int64_t i = 0;
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2) i = exp_inplace_avx2(x, n);
#endif
  for (; i < n; ++i) x[i] = std::exp(x[i]);
}

}  // namespace kallpa::runtime
