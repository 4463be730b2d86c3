// Q16 integer products for the block types of ops/q16_units.h (Q5_0, Q5_1, IQ4_NL, Q4_K, Q5_K,
// Q6_K), AVX2: each block of 32 weights is widened in registers to the unit's integers wq (two
// vectors of 16 int16), with byte-wide bit operations on the 32 quants before one widening, and
// goes through ops/q16_avx2.h's accumulate_block, four weight rows per vector, exactly as Q4_1 does
// in quant_dot_avx2.cpp. The tiles are ops/q16_units_tile.h's.
#include <algorithm>
#include <cstring>

#include "ops/avx2_common.h"
#include "ops/q16_avx2.h"
#include "ops/q16_units.h"
#include "ops/quant_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

// After the target pragma, at file scope: its templates compile for this file's ISA.
#include "ops/q16_units_tile.h"

namespace kallpa::ops::kernels {

namespace {

// 32 signed bytes as elements 0..15 and 16..31 in int16.
inline void widen_i8(__m256i v, __m256i& w0, __m256i& w1) {
  w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v));
  w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1));
}

// Block c of the unit at u as its integers wq (ops/q16_units.h), elements 0..15 in w0, 16..31 in
// w1.
template <GgmlType T>
inline void widen_unit_block(const std::byte* u, int c, __m256i& w0, __m256i& w1) {
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  if constexpr (T == GgmlType::q5_0 || T == GgmlType::q5_1) {
    constexpr std::size_t at = T == GgmlType::q5_0 ? 2 : 4;
    std::uint32_t qh;
    std::memcpy(&qh, u + at, 4);
    __m256i q = _mm256_or_si256(nibbles32(u + at + 4), bits32_as_0x10(qh));
    if constexpr (T == GgmlType::q5_0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
    widen_i8(q, w0, w1);
  } else if constexpr (T == GgmlType::iq4_nl) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4NlValues)));
    widen_i8(_mm256_shuffle_epi8(table, nibbles32(u + 2)), w0, w1);
  } else if constexpr (T == GgmlType::q4_k || T == GgmlType::q5_k) {
    constexpr std::size_t qs_at = T == GgmlType::q5_k ? 48 : 16;
    const __m128i nib_shift = _mm_cvtsi32_si128(4 * (c & 1));
    __m256i q = _mm256_and_si256(_mm256_srl_epi16(load32(u + qs_at + 32 * (c >> 1)), nib_shift), low4);
    if constexpr (T == GgmlType::q5_k) {
      const __m256i h = _mm256_and_si256(_mm256_srl_epi16(load32(u + 16), _mm_cvtsi32_si128(c)), _mm256_set1_epi8(1));
      q = _mm256_or_si256(q, _mm256_slli_epi16(h, 4));  // bytes <= 1: no carry into the next byte
    }
    widen_i8(q, w0, w1);  // values 0..31: the signed widening is the unsigned one
  } else {                // q6_k
    const int h = c >> 2;
    const __m256i lo = _mm256_and_si256(
        _mm256_srl_epi16(load32(u + 64 * h + 32 * (c & 1)), _mm_cvtsi32_si128(4 * ((c >> 1) & 1))), low4);
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(load32(u + 128 + 32 * h), _mm_cvtsi32_si128(2 * (c & 3))),
                                        _mm256_set1_epi8(3));
    const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
    widen_i8(q, w0, w1);
    const auto* sc = reinterpret_cast<const std::int8_t*>(u + 192);
    w0 = _mm256_mullo_epi16(w0, _mm256_set1_epi16(sc[2 * c]));
    w1 = _mm256_mullo_epi16(w1, _mm256_set1_epi16(sc[2 * c + 1]));
  }
}

struct Avx2Widen {
  struct Block {
    __m256i lo, hi;  // elements 0..15, 16..31
  };
  static Block zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
  template <GgmlType T>
  static Block widen(const std::byte* u, int c) {
    Block b;
    widen_unit_block<T>(u, c, b.lo, b.hi);
    return b;
  }
  static __m256 accumulate(const Block (&w)[4], const BlockQ16x& xb, __m256 d8, __m256 acc) {
    const __m256i wv[8] = {w[0].lo, w[0].hi, w[1].lo, w[1].hi, w[2].lo, w[2].hi, w[3].lo, w[3].hi};
    return accumulate_block(wv, xb, d8, acc);
  }
};

}  // namespace

void gemm_q16_units_avx2(GgmlType type, const std::byte* w, std::size_t row_bytes, std::int64_t nw, const BlockQ16x* xq,
                         std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy) {
  gemm_q16_units_with<Avx2Widen>(type, w, row_bytes, nw, xq, nx, k, y, ldy);
}

}  // namespace kallpa::ops::kernels

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else  // not x86: the scalar kernel

namespace kallpa::ops::kernels {

void gemm_q16_units_avx2(GgmlType type, const std::byte* w, std::size_t row_bytes, std::int64_t nw, const BlockQ16x* xq,
                         std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy) {
  gemm_q16_scalar(type, WeightLayout::rows, w, row_bytes, nw, xq, nx, k, y, ldy);
}

}  // namespace kallpa::ops::kernels

#endif
