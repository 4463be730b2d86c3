// AVX2 dequantisers of the K-quant types of Q4_K_M / Q5_K_M files (Q4_K, Q5_K, Q6_K), the same
// bits as the scalar reference (dequant_blocks.cpp): eight elements per instruction, and each
// value rounds as there, since dl * q is exact in f32 and fmsub(q, dl, ml) then rounds once like
// the reference's dl * q - ml.
#include <cstring>

#include "ops/quant_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KALLPA_X86 1
#endif

namespace kallpa::ops::kernels {

#if KALLPA_X86

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

namespace {

inline float half_at(const std::byte* p) {
  std::uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// 8 bytes at p, zero-extended to 8 int32 lanes.
inline __m256i load8_u8(const std::byte* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// Q4_K and Q5_K (HighBits): sub-blocks 2p and 2p + 1 share qs bytes 32p .. 32p + 31 (low and high
// nibbles); Q5_K adds bit c of qh[i] as the fifth bit of sub-block c's element i.
template <bool HighBits>
void dequant_q45_k(const std::byte* src, float* dst, std::int64_t nb) {
  constexpr std::size_t kBytes = HighBits ? kQ5KBytes : kQ4KBytes;
  constexpr std::size_t kQs = HighBits ? 48 : 16;
  const __m256i low = _mm256_set1_epi32(0x0f);
  const __m256i one = _mm256_set1_epi32(1);
  for (std::int64_t b = 0; b < nb; ++b, src += kBytes, dst += kQK_K) {
    const float d = half_at(src);
    const float dmin = half_at(src + 2);
    const auto* scales = reinterpret_cast<const std::uint8_t*>(src + 4);
    for (int p = 0; p < 4; ++p) {
      const KScaleMin s0 = kquant_scale_min(scales, 2 * p);
      const KScaleMin s1 = kquant_scale_min(scales, 2 * p + 1);
      const __m256 dl0 = _mm256_set1_ps(d * static_cast<float>(s0.scale));
      const __m256 ml0 = _mm256_set1_ps(dmin * static_cast<float>(s0.min));
      const __m256 dl1 = _mm256_set1_ps(d * static_cast<float>(s1.scale));
      const __m256 ml1 = _mm256_set1_ps(dmin * static_cast<float>(s1.min));
      for (int g = 0; g < 4; ++g) {
        const __m256i v = load8_u8(src + kQs + 32 * p + 8 * g);
        __m256i q0 = _mm256_and_si256(v, low);
        __m256i q1 = _mm256_srli_epi32(v, 4);
        if constexpr (HighBits) {
          const __m256i h = load8_u8(src + 16 + 8 * g);
          const __m256i h0 = _mm256_and_si256(_mm256_srl_epi32(h, _mm_cvtsi32_si128(2 * p)), one);
          const __m256i h1 = _mm256_and_si256(_mm256_srl_epi32(h, _mm_cvtsi32_si128(2 * p + 1)), one);
          q0 = _mm256_or_si256(q0, _mm256_slli_epi32(h0, 4));
          q1 = _mm256_or_si256(q1, _mm256_slli_epi32(h1, 4));
        }
        _mm256_storeu_ps(dst + 64 * p + 8 * g, _mm256_fmsub_ps(_mm256_cvtepi32_ps(q0), dl0, ml0));
        _mm256_storeu_ps(dst + 64 * p + 32 + 8 * g, _mm256_fmsub_ps(_mm256_cvtepi32_ps(q1), dl1, ml1));
      }
    }
  }
}

void dequant_q4_k_avx2(const std::byte* src, float* dst, std::int64_t nb) { dequant_q45_k<false>(src, dst, nb); }
void dequant_q5_k_avx2(const std::byte* src, float* dst, std::int64_t nb) { dequant_q45_k<true>(src, dst, nb); }

// Q6_K: element 128 h + 32 t + i takes ql[64 h + 32 (t % 2) + i]'s nibble t / 2 and qh[32 h + i]'s
// bits 2t, 2t + 1; a product d * scale * q per element (rounded once, as the reference).
void dequant_q6_k_avx2(const std::byte* src, float* dst, std::int64_t nb) {
  const __m256i low = _mm256_set1_epi32(0x0f);
  const __m256i low2 = _mm256_set1_epi32(3);
  const __m256i bias = _mm256_set1_epi32(32);
  for (std::int64_t b = 0; b < nb; ++b, src += kQ6KBytes, dst += kQK_K) {
    const auto* scales = reinterpret_cast<const std::int8_t*>(src + 192);
    const float d = half_at(src + 208);
    for (int h = 0; h < 2; ++h) {
      for (int t = 0; t < 4; ++t) {
        const __m128i lo_shift = _mm_cvtsi32_si128(4 * (t / 2));
        const __m128i hi_shift = _mm_cvtsi32_si128(2 * t);
        for (int g = 0; g < 4; ++g) {
          const __m256i lo =
              _mm256_and_si256(_mm256_srl_epi32(load8_u8(src + 64 * h + 32 * (t % 2) + 8 * g), lo_shift), low);
          const __m256i hi = _mm256_and_si256(_mm256_srl_epi32(load8_u8(src + 128 + 32 * h + 8 * g), hi_shift), low2);
          const __m256i q = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), bias);
          const float dl = d * static_cast<float>(scales[8 * h + 2 * t + g / 2]);
          _mm256_storeu_ps(dst + 128 * h + 32 * t + 8 * g, _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(dl)));
        }
      }
    }
  }
}

}  // namespace

DequantBlocksFn dequant_blocks_avx2(GgmlType type) noexcept {
  switch (type) {
    case GgmlType::q4_k: return dequant_q4_k_avx2;
    case GgmlType::q5_k: return dequant_q5_k_avx2;
    case GgmlType::q6_k: return dequant_q6_k_avx2;
    default: return dequant_blocks_scalar(type);
  }
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else  // not x86

DequantBlocksFn dequant_blocks_avx2(GgmlType type) noexcept { return dequant_blocks_scalar(type); }

#endif

}  // namespace kallpa::ops::kernels
