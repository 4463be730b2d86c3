// Small AVX2 pieces the ops' kernels share: the f16 scale load of every block type, and the one
// horizontal sum every f32 kernel ends an output with. Static: the AVX-512 files include them too,
// and each file keeps its own copy, compiled for its own target, rather than sharing one symbol.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace kallpa::ops::kernels {

// An f16 stored at p (any alignment), as f32.
__attribute__((target("avx2,fma,f16c"))) static inline float load_half(const std::byte* p) {
  std::uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// quant.h's canonical order, ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)), which the scalar reference
// kernels follow too, so that AVX2 and scalar agree bit for bit.
__attribute__((target("avx2,fma,f16c"))) static inline float canonical_hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace kallpa::ops::kernels
#endif
