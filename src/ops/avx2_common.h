// Small AVX2 pieces the ops' kernels share: the f16 scale load of every block type, the unpacking
// of Q4-ordered nibbles and Q5 high bits, and the one horizontal sum every f32 kernel ends an
// output with. Static: the AVX-512 files include them too,
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

// A 32-element block's 16 quant bytes as 32 bytes: byte j < 16 the low nibble of byte j, byte
// j >= 16 the high nibble of byte j - 16 (ggml's order for Q4_0/Q5_*/IQ4_NL).
__attribute__((target("avx2,fma,f16c"))) static inline __m256i nibbles32(const std::byte* qs) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

// Bit j of a 32-bit word as byte j: 0x10 where set, 0 where clear (Q5's fifth bits).
__attribute__((target("avx2,fma,f16c"))) static inline __m256i bits32_as_0x10(std::uint32_t bits) {
  // Byte j takes the word's byte j / 8, then keeps bit j % 8 of it.
  const __m256i spread =
      _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                          _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0));
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
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
