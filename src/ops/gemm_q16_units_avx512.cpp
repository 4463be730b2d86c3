// Q16 integer products for the block types of ops/q16_units.h on AVX-512 (BW, VL): the tiles of
// ops/q16_units_tile.h with a block's 32 integers in one 512-bit register. The 32 quants are built
// as bytes (mask registers take Q5_0/Q5_1's 32 high bits and Q5_K's as they are), widened in one
// instruction, and multiplied with the activation block in one vpmaddwd; adding the register's two
// halves gives each lane the products of elements 2l, 2l+1, 16+2l and 17+2l, the per-lane sums the
// AVX2 kernel forms, so the same fold and float steps (accumulate_sums) give the same bits.
#include <algorithm>
#include <cstring>

#include "ops/avx2_common.h"
#include "ops/q16_avx2.h"
#include "ops/q16_units.h"
#include "ops/quant_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")
// GCC 12's AVX-512 headers initialise their "undefined" vectors from themselves, which
// -W(maybe-)uninitialized reports at every inlined intrinsic (GCC bug 105593, fixed in 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

// After the target pragma, at file scope: their templates compile for this file's ISA.
#include "ops/q16_lanes_avx512.h"
#include "ops/q16_units_tile.h"

namespace kallpa::ops::kernels {

namespace {

// Block c of the unit at u as its 32 integers wq (ops/q16_units.h) in int16.
template <GgmlType T>
inline __m512i widen_unit_block512(const std::byte* u, int c) {
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const __m256i sixteen = _mm256_set1_epi8(16);
  __m256i q;
  if constexpr (T == GgmlType::q5_0 || T == GgmlType::q5_1) {
    constexpr std::size_t at = T == GgmlType::q5_0 ? 2 : 4;
    std::uint32_t qh;
    std::memcpy(&qh, u + at, 4);
    const __m256i nib = nibbles32(u + at + 4);
    // Q5_0: nibble - 16 where the high bit is clear; Q5_1: nibble + 16 where it is set.
    q = T == GgmlType::q5_0 ? _mm256_mask_sub_epi8(nib, static_cast<__mmask32>(~qh), nib, sixteen)
                            : _mm256_mask_add_epi8(nib, static_cast<__mmask32>(qh), nib, sixteen);
  } else if constexpr (T == GgmlType::iq4_nl) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4NlValues)));
    q = _mm256_shuffle_epi8(table, nibbles32(u + 2));
  } else if constexpr (T == GgmlType::q4_k || T == GgmlType::q5_k) {
    constexpr std::size_t qs_at = T == GgmlType::q5_k ? 48 : 16;
    q = _mm256_and_si256(_mm256_srl_epi16(load32(u + qs_at + 32 * (c >> 1)), _mm_cvtsi32_si128(4 * (c & 1))), low4);
    if constexpr (T == GgmlType::q5_k) {
      const __mmask32 high = _mm256_test_epi8_mask(load32(u + 16), _mm256_set1_epi8(static_cast<char>(1 << c)));
      q = _mm256_mask_add_epi8(q, high, q, sixteen);
    }
  } else {  // q6_k
    const int h = c >> 2;
    const __m256i lo = _mm256_and_si256(
        _mm256_srl_epi16(load32(u + 64 * h + 32 * (c & 1)), _mm_cvtsi32_si128(4 * ((c >> 1) & 1))), low4);
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(load32(u + 128 + 32 * h), _mm_cvtsi32_si128(2 * (c & 3))),
                                        _mm256_set1_epi8(3));
    q = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
    const auto* sc = reinterpret_cast<const std::int8_t*>(u + 192);
    const __m512i scales =
        _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(sc[2 * c])), _mm256_set1_epi16(sc[2 * c + 1]), 1);
    return _mm512_mullo_epi16(_mm512_cvtepi8_epi16(q), scales);
  }
  return _mm512_cvtepi8_epi16(q);
}

struct Avx512Widen {
  using Block = __m512i;
  static Block zero() { return _mm512_setzero_si512(); }
  template <GgmlType T>
  static Block widen(const std::byte* u, int c) {
    return widen_unit_block512<T>(u, c);
  }
  static __m256 accumulate(const Block (&w)[4], const BlockQ16x& xb, __m256 d8, __m256 acc) {
    const __m512i x = _mm512_loadu_si512(xb.qs);
    __m256i v[4];
    for (int r = 0; r < 4; ++r) {
      const __m512i p = _mm512_madd_epi16(w[r], x);
      v[r] = _mm256_add_epi32(_mm512_castsi512_si256(p), _mm512_extracti64x4_epi64(p, 1));
    }
    return accumulate_sums(v, xb, d8, acc);
  }
};

// A 16-row group's blocks [b0, b1) as q16_lanes_avx512.h's sweep wants them: each row's block c of
// unit u widened (widen_unit_block512), its int16 elements paired (j, j + 16) into dwords, the 16
// rows transposed into the lanes; d_c and m_c (zero for the types without a minimum) from
// q16_unit_scales, the scalar reference's arithmetic, decoded once per unit.
template <GgmlType T>
void widen_units_group(const std::byte* group, std::size_t row_bytes, std::int64_t b0, std::int64_t b1,
                       std::byte* wide) {
  constexpr Q16Unit g = q16_unit(T);
  alignas(64) float d[kMaxUnitBlocks][kGroupRows] = {};
  alignas(64) float m[kMaxUnitBlocks][kGroupRows] = {};
  std::int64_t scales_unit = -1;
  for (std::int64_t b = b0; b < b1; ++b) {
    const std::int64_t u = b / g.blocks;
    const int c = static_cast<int>(b % g.blocks);
    const std::byte* units[kGroupRows];
    for (int r = 0; r < kGroupRows; ++r) {
      units[r] = group + static_cast<std::size_t>(r) * row_bytes + static_cast<std::size_t>(u) * g.bytes;
    }
    if (u != scales_unit) {
      for (int r = 0; r < kGroupRows; ++r) {
        float dr[kMaxUnitBlocks], mr[kMaxUnitBlocks] = {};  // mr stays zero for the types without m
        q16_unit_scales(T, units[r], dr, mr);
        for (int cc = 0; cc < g.blocks; ++cc) {
          d[cc][r] = dr[cc];
          m[cc][r] = mr[cc];
        }
      }
      scales_unit = u;
    }
    __m512i v[kGroupRows];
    for (int r = 0; r < kGroupRows; ++r) {
      v[r] = pair_halves(widen_unit_block512<T>(units[r], c));
    }
    transpose16x16(v);
    std::byte* out = wide + (b - b0) * kWideBlockBytes;
    for (int j = 0; j < kWideVectors; ++j) _mm512_store_si512(out + 64 * j, v[j]);
    _mm512_store_ps(out + 64 * kWideVectors, _mm512_load_ps(d[c]));
    _mm512_store_ps(out + 64 * kWideVectors + 64, _mm512_load_ps(m[c]));
  }
}

// Q5_0's groups with byte transposes instead of a row at a time: the 16 rows' quant bytes (element
// j in the low nibble of byte j, j + 16 in the high one, as Q4_0's) go through
// transpose_bytes16x16 and widen_rows4's zeroing permutes into (j, j + 16) pairs per lane, the high
// bits come from the rows' qh words (one gather: lane r holds row r's) shifted into bits 4 and 20,
// and 16 is taken from both halves: wq = q - 16, as ops/q16_units.h defines it. d comes from a
// second gather, exact in f32 as the scalar reference's. Each group also asks for the next one's
// bytes (the rows are contiguous, so the next group is the next 16 x row_bytes): a server's batch of
// decode rows reads every weight once per step, from DRAM.
void widen_q5_0_group(const std::byte* group, std::size_t row_bytes, std::int64_t b0, std::int64_t b1,
                      std::byte* wide) {
  static const ByteShuffles sh = make_byte_shuffles();
  const __m512i sixteen = _mm512_set1_epi16(16);
  const __m512i high_bits = _mm512_set1_epi32(0x00100010);
  const __m512i row_offsets =
      _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                         _mm512_set1_epi32(static_cast<int>(row_bytes)));
  const std::byte* next = group + kGroupRows * row_bytes;
  for (std::int64_t b = b0; b < b1; ++b) {
    const std::byte* blk = group + static_cast<std::size_t>(b) * kQ5_0Bytes;
    prefetch_lines<kPrefetchToL1>(next + static_cast<std::size_t>(b) * kGroupRows * kQ5_0Bytes,
                                  kGroupRows * kQ5_0Bytes);
    __m512i in[4], t[4], pairs[16];
    for (int i = 0; i < 4; ++i) {
      const std::byte* qs = blk + static_cast<std::size_t>(4 * i) * row_bytes + 6;
      auto load16 = [&](int r) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + r * row_bytes)); };
      __m512i v = _mm512_castsi128_si512(load16(0));
      v = _mm512_inserti32x4(v, load16(1), 1);
      v = _mm512_inserti32x4(v, load16(2), 2);
      in[i] = _mm512_inserti32x4(v, load16(3), 3);
    }
    transpose_bytes16x16(sh, in, t);
    nibble_pairs(sh, t, pairs);
    const __m512i qh = _mm512_i32gather_epi32(row_offsets, blk + 2, 1);
    const __m512i d_bits = _mm512_i32gather_epi32(row_offsets, blk, 1);
    std::byte* out = wide + (b - b0) * kWideBlockBytes;
    for (int j = 0; j < 16; ++j) {
      // qh bit j to bit 4 (element j), bit j + 16 to bit 20 (element j + 16).
      const __m512i h = j >= 4 ? _mm512_srli_epi32(qh, static_cast<unsigned>(j - 4))
                               : _mm512_slli_epi32(qh, static_cast<unsigned>(4 - j));
      const __m512i q5 = _mm512_ternarylogic_epi32(pairs[j], h, high_bits, 0xF8);  // pairs | (h & bits)
      _mm512_store_si512(out + 64 * j, _mm512_sub_epi16(q5, sixteen));
    }
    _mm512_store_ps(out + 64 * kWideVectors, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(d_bits)));
    _mm512_store_ps(out + 64 * kWideVectors + 64, _mm512_setzero_ps());
  }
}

// Whole 16-row groups through the lanes tile (from kQ16UnitsLanesMinBatch activation rows with
// their pairs), the rest a block per register.
template <GgmlType T>
void gemm_units_avx512(const std::byte* w, std::size_t row_bytes, std::int64_t nw, const BlockQ16x* xq,
                       const std::int32_t* xp, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy) {
  const std::int64_t n_groups = nx >= kQ16UnitsLanesMinBatch && xp != nullptr ? nw / kGroupRows : 0;
  if (n_groups > 0) {
    auto widen = [row_bytes](const std::byte* group, std::int64_t b0, std::int64_t b1, std::byte* wide) {
      if constexpr (T == GgmlType::q5_0) {
        widen_q5_0_group(group, row_bytes, b0, b1, wide);
      } else {
        widen_units_group<T>(group, row_bytes, b0, b1, wide);
      }
    };
    sweep_groups(widen, w, row_bytes, n_groups, xq, xp, nx, k / kQK, y, ldy);
  }
  const std::int64_t done = n_groups * kGroupRows;
  if (done < nw) {
    gemm_units<Avx512Widen, T>(w + static_cast<std::size_t>(done) * row_bytes, row_bytes, nw - done, xq, nx, k,
                               y + done, ldy);
  }
}

}  // namespace

void gemm_q16_units_avx512(GgmlType type, const std::byte* w, std::size_t row_bytes, std::int64_t nw,
                           const BlockQ16x* xq, const std::int32_t* x_pairs, std::int64_t nx, std::int64_t k, float* y,
                           std::int64_t ldy) {
  switch (type) {
    case GgmlType::q5_0: return gemm_units_avx512<GgmlType::q5_0>(w, row_bytes, nw, xq, x_pairs, nx, k, y, ldy);
    case GgmlType::q5_1: return gemm_units_avx512<GgmlType::q5_1>(w, row_bytes, nw, xq, x_pairs, nx, k, y, ldy);
    case GgmlType::iq4_nl: return gemm_units_avx512<GgmlType::iq4_nl>(w, row_bytes, nw, xq, x_pairs, nx, k, y, ldy);
    case GgmlType::q4_k: return gemm_units_avx512<GgmlType::q4_k>(w, row_bytes, nw, xq, x_pairs, nx, k, y, ldy);
    case GgmlType::q5_k: return gemm_units_avx512<GgmlType::q5_k>(w, row_bytes, nw, xq, x_pairs, nx, k, y, ldy);
    case GgmlType::q6_k: return gemm_units_avx512<GgmlType::q6_k>(w, row_bytes, nw, xq, x_pairs, nx, k, y, ldy);
    default: return;
  }
}

}  // namespace kallpa::ops::kernels

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

#else  // not x86: the scalar kernel

namespace kallpa::ops::kernels {

void gemm_q16_units_avx512(GgmlType type, const std::byte* w, std::size_t row_bytes, std::int64_t nw,
                           const BlockQ16x* xq, const std::int32_t*, std::int64_t nx, std::int64_t k, float* y,
                           std::int64_t ldy) {
  gemm_q16_scalar(type, WeightLayout::rows, w, row_bytes, nw, xq, nx, k, y, ldy);
}

}  // namespace kallpa::ops::kernels

#endif
