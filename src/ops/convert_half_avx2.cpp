// f32 rows to F16 / BF16 eight at a time (quantize_row's F16/BF16 path when avx2_available()),
// bit for bit f32_to_f16 / f32_to_bf16. The KV cache converts one row per sequence and layer on
// every decode step, enough that a software conversion one element at a time shows in a busy
// server's profile (bench/results/kv-cache.md).
#include <cstdint>

#include "kallpa/half.h"
#include "ops/quant_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KALLPA_X86 1
#endif

namespace kallpa::ops::kernels {

namespace {

void convert_row_scalar(GgmlType type, const float* src, std::uint16_t* dst, std::int64_t from, std::int64_t n) {
  for (std::int64_t e = from; e < n; ++e) dst[e] = type == GgmlType::f16 ? f32_to_f16(src[e]) : f32_to_bf16(src[e]);
}

#if KALLPA_X86
// The hardware rounds to nearest even like f32_to_f16, overflow included; a NaN keeps part of its
// payload there, so NaN lanes are set to f32_to_f16's quiet NaN (sign | 0x7e00).
__attribute__((target("avx2,f16c"))) std::int64_t to_f16_avx2(const float* src, std::uint16_t* dst, std::int64_t n) {
  const __m128i quiet = _mm_set1_epi16(0x7e00);
  const __m128i sign_bit = _mm_set1_epi16(static_cast<short>(0x8000));
  std::int64_t e = 0;
  for (; e + 8 <= n; e += 8) {
    const __m256 x = _mm256_loadu_ps(src + e);
    __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i nan32 = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m128i nan16 = _mm_packs_epi32(_mm256_castsi256_si128(nan32), _mm256_extracti128_si256(nan32, 1));
    h = _mm_blendv_epi8(h, _mm_or_si128(_mm_and_si128(h, sign_bit), quiet), nan16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + e), h);
  }
  return e;
}

// f32_to_bf16's rounding (add 0x7fff plus the kept lowest bit, keep the top half) in integers:
// AVX512-BF16's conversion would flush denormal inputs, which bf16 can hold.
__attribute__((target("avx2"))) std::int64_t to_bf16_avx2(const float* src, std::uint16_t* dst, std::int64_t n) {
  const __m256i round = _mm256_set1_epi32(0x7fff);
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i inf = _mm256_set1_epi32(0x7f800000);
  const __m256i quiet = _mm256_set1_epi32(0x40);
  std::int64_t e = 0;
  for (; e + 8 <= n; e += 8) {
    const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + e));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(round, _mm256_and_si256(_mm256_srli_epi32(u, 16), one))), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs_mask), inf);
    const __m256i r = _mm256_blendv_epi8(rounded, _mm256_or_si256(_mm256_srli_epi32(u, 16), quiet), nan);
    // Each 32-bit lane holds its result in the low 16 bits: pack (unsigned saturation is exact here).
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + e), _mm256_castsi256_si128(packed));
  }
  return e;
}
#endif

}  // namespace

void convert_row_half_avx2(GgmlType type, const float* src, std::uint16_t* dst, std::int64_t n) {
  std::int64_t done = 0;
#if KALLPA_X86
  done = type == GgmlType::f16 ? to_f16_avx2(src, dst, n) : to_bf16_avx2(src, dst, n);
#endif
  convert_row_scalar(type, src, dst, done, n);
}

}  // namespace kallpa::ops::kernels
