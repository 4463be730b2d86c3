// AVX2 dequantisers of the block types computed by dequantisation (Q5_0, Q5_1, IQ4_NL, Q2_K ..
// Q6_K; Q8_K uses the scalar one), the same bits as the scalar reference (dequant_blocks.cpp):
// quants are built 32 at a time as bytes, then widened to f32 eight at a time; each value rounds
// as there, since dl * q is exact in f32 and fmsub(q, dl, ml) rounds once like dl * q - ml.
#include <cstring>

#include "ops/avx2_common.h"
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

// 32 int8 quants to f32 at dst: q * dl - ml for elements 0..15, q * dl2 - ml2 for 16..31. Each
// value rounds once as in the reference: q * dl is exact in f32, and fmsub rounds q * dl - ml once
// (ml = 0 gives the product itself; a min added as + m is passed as ml = -m).
inline void store_q32(__m256i q, __m256 dl, __m256 dl2, __m256 ml, __m256 ml2, float* dst) {
  const __m128i lo = _mm256_castsi256_si128(q);
  const __m128i hi = _mm256_extracti128_si256(q, 1);
  const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
  const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(lo, lo)));
  const __m256 q2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
  const __m256 q3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(hi, hi)));
  _mm256_storeu_ps(dst, _mm256_fmsub_ps(q0, dl, ml));
  _mm256_storeu_ps(dst + 8, _mm256_fmsub_ps(q1, dl, ml));
  _mm256_storeu_ps(dst + 16, _mm256_fmsub_ps(q2, dl2, ml2));
  _mm256_storeu_ps(dst + 24, _mm256_fmsub_ps(q3, dl2, ml2));
}

// Q5_0 (MinAdded false): (q - 16) * d; Q5_1 (true): q * d + m.
template <bool MinAdded>
void dequant_q5(const std::byte* src, float* dst, std::int64_t nb) {
  constexpr std::size_t kBytes = MinAdded ? kQ5_1Bytes : kQ5_0Bytes;
  constexpr std::size_t kQh = MinAdded ? 4 : 2;
  for (std::int64_t b = 0; b < nb; ++b, src += kBytes, dst += kQK) {
    const __m256 d = _mm256_set1_ps(load_half(src));
    std::uint32_t qh;
    std::memcpy(&qh, src + kQh, 4);
    __m256i q = _mm256_or_si256(nibbles32(src + kQh + 4), bits32_as_0x10(qh));
    __m256 ml = _mm256_setzero_ps();
    if constexpr (MinAdded) {
      ml = _mm256_set1_ps(-load_half(src + 2));
    } else {
      q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
    }
    store_q32(q, d, d, ml, ml, dst);
  }
}

void dequant_q5_0_avx2(const std::byte* src, float* dst, std::int64_t nb) { dequant_q5<false>(src, dst, nb); }
void dequant_q5_1_avx2(const std::byte* src, float* dst, std::int64_t nb) { dequant_q5<true>(src, dst, nb); }

void dequant_iq4_nl_avx2(const std::byte* src, float* dst, std::int64_t nb) {
  const __m128i levels = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4NlValues));
  const __m256i table = _mm256_set_m128i(levels, levels);
  const __m256 zero = _mm256_setzero_ps();
  for (std::int64_t b = 0; b < nb; ++b, src += kIq4NlBytes, dst += kQK) {
    const __m256 d = _mm256_set1_ps(load_half(src));
    store_q32(_mm256_shuffle_epi8(table, nibbles32(src + 2)), d, d, zero, zero, dst);
  }
}

// Q2_K and Q3_K: element 128 h + 32 t + i has the 2 bits at 2t of qs[32 h + i]; Q3_K subtracts 4
// unless bit 4h + t of hmask[i] is set. Scales per 16 elements, decoded once per super-block.
template <bool Q3>
void dequant_q23_k(const std::byte* src, float* dst, std::int64_t nb) {
  constexpr std::size_t kBytes = Q3 ? kQ3KBytes : kQ2KBytes;
  constexpr std::size_t kQs = Q3 ? 32 : 16;
  const __m256i two_bits = _mm256_set1_epi8(3);
  const __m256i four = _mm256_set1_epi8(4);
  for (std::int64_t b = 0; b < nb; ++b, src += kBytes, dst += kQK_K) {
    float dl[16], ml[16] = {};
    const auto* s = reinterpret_cast<const std::uint8_t*>(src + (Q3 ? 96 : 0));
    if constexpr (Q3) {
      const float d = load_half(src + 108);
      for (int j = 0; j < 16; ++j) {
        const int lo = j < 8 ? s[j] & 0x0f : s[j - 8] >> 4;
        const int hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        dl[j] = d * static_cast<float>((lo | hi << 4) - 32);
      }
    } else {
      const float d = load_half(src + 80);
      const float dmin = load_half(src + 82);
      for (int j = 0; j < 16; ++j) {
        dl[j] = d * static_cast<float>(s[j] & 0x0f);
        ml[j] = dmin * static_cast<float>(s[j] >> 4);
      }
    }
    const __m256i hmask = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    for (int h = 0; h < 2; ++h) {
      const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + kQs + 32 * h));
      for (int t = 0; t < 4; ++t) {
        __m256i q = _mm256_and_si256(_mm256_srl_epi16(qs, _mm_cvtsi32_si128(2 * t)), two_bits);
        if constexpr (Q3) {
          const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << (4 * h + t)));
          const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(hmask, bit), bit);
          q = _mm256_sub_epi8(q, _mm256_andnot_si256(set, four));
        }
        const int j = 8 * h + 2 * t;
        store_q32(q, _mm256_set1_ps(dl[j]), _mm256_set1_ps(dl[j + 1]), _mm256_set1_ps(ml[j]), _mm256_set1_ps(ml[j + 1]),
                  dst + 128 * h + 32 * t);
      }
    }
  }
}

void dequant_q2_k_avx2(const std::byte* src, float* dst, std::int64_t nb) { dequant_q23_k<false>(src, dst, nb); }
void dequant_q3_k_avx2(const std::byte* src, float* dst, std::int64_t nb) { dequant_q23_k<true>(src, dst, nb); }

// Q4_K and Q5_K (HighBits): sub-blocks 2p and 2p + 1 are the low and high nibbles of qs bytes
// 32p .. 32p + 31; Q5_K adds bit c of qh[i] as the fifth bit of sub-block c's element i. The
// quants are built 32 at a time as bytes.
template <bool HighBits>
void dequant_q45_k(const std::byte* src, float* dst, std::int64_t nb) {
  constexpr std::size_t kBytes = HighBits ? kQ5KBytes : kQ4KBytes;
  constexpr std::size_t kQs = HighBits ? 48 : 16;
  const __m256i low = _mm256_set1_epi8(0x0f);
  const __m256i fifth = _mm256_set1_epi8(0x10);
  for (std::int64_t b = 0; b < nb; ++b, src += kBytes, dst += kQK_K) {
    const float d = load_half(src);
    const float dmin = load_half(src + 2);
    const auto* scales = reinterpret_cast<const std::uint8_t*>(src + 4);
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 16));
    for (int p = 0; p < 4; ++p) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + kQs + 32 * p));
      __m256i q[2] = {_mm256_and_si256(v, low), _mm256_and_si256(_mm256_srli_epi16(v, 4), low)};
      for (int h = 0; h < 2; ++h) {
        const int c = 2 * p + h;
        if constexpr (HighBits) {
          const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << c));
          const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
          q[h] = _mm256_or_si256(q[h], _mm256_and_si256(set, fifth));
        }
        const KScaleMin sm = kquant_scale_min(scales, c);
        const __m256 dl = _mm256_set1_ps(d * static_cast<float>(sm.scale));
        const __m256 ml = _mm256_set1_ps(dmin * static_cast<float>(sm.min));
        store_q32(q[h], dl, dl, ml, ml, dst + 32 * c);
      }
    }
  }
}

void dequant_q4_k_avx2(const std::byte* src, float* dst, std::int64_t nb) { dequant_q45_k<false>(src, dst, nb); }
void dequant_q5_k_avx2(const std::byte* src, float* dst, std::int64_t nb) { dequant_q45_k<true>(src, dst, nb); }

// Q6_K: element 128 h + 32 t + i takes ql[64 h + 32 (t % 2) + i]'s nibble t / 2 and qh[32 h + i]'s
// bits 2t, 2t + 1, built 32 at a time as bytes; a product d * scale * q per element, rounded once
// as in the reference.
void dequant_q6_k_avx2(const std::byte* src, float* dst, std::int64_t nb) {
  const __m256i low = _mm256_set1_epi8(0x0f);
  const __m256i high2 = _mm256_set1_epi8(0x30);
  const __m256i bias = _mm256_set1_epi8(32);
  const __m256 zero = _mm256_setzero_ps();
  for (std::int64_t b = 0; b < nb; ++b, src += kQ6KBytes, dst += kQK_K) {
    const auto* scales = reinterpret_cast<const std::int8_t*>(src + 192);
    const float d = load_half(src + 208);
    for (int h = 0; h < 2; ++h) {
      const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 64 * h));
      const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 64 * h + 32));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 128 + 32 * h));
      const __m256i lo[4] = {_mm256_and_si256(ql0, low), _mm256_and_si256(ql1, low),
                             _mm256_and_si256(_mm256_srli_epi16(ql0, 4), low),
                             _mm256_and_si256(_mm256_srli_epi16(ql1, 4), low)};
      const __m256i hi[4] = {_mm256_and_si256(_mm256_slli_epi16(qh, 4), high2),
                             _mm256_and_si256(_mm256_slli_epi16(qh, 2), high2), _mm256_and_si256(qh, high2),
                             _mm256_and_si256(_mm256_srli_epi16(qh, 2), high2)};
      for (int t = 0; t < 4; ++t) {
        const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo[t], hi[t]), bias);
        const __m256 dl = _mm256_set1_ps(d * static_cast<float>(scales[8 * h + 2 * t]));
        const __m256 dl2 = _mm256_set1_ps(d * static_cast<float>(scales[8 * h + 2 * t + 1]));
        store_q32(q, dl, dl2, zero, zero, dst + 128 * h + 32 * t);
      }
    }
  }
}

}  // namespace

DequantBlocksFn dequant_blocks_avx2(GgmlType type) noexcept {
  switch (type) {
    case GgmlType::q5_0: return dequant_q5_0_avx2;
    case GgmlType::q5_1: return dequant_q5_1_avx2;
    case GgmlType::iq4_nl: return dequant_iq4_nl_avx2;
    case GgmlType::q2_k: return dequant_q2_k_avx2;
    case GgmlType::q3_k: return dequant_q3_k_avx2;
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
