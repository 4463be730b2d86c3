// The tile loop of the Q16 kernels for the types of ops/q16_units.h, written once over how a block
// is widened and multiplied: W::widen<T>(unit, c) gives block c's 32 integers wq in W::Block,
// W::accumulate(rows, x block, scales, acc) adds four rows' products to an accumulator laid out as
// ops/q16_avx2.h's accumulate_block does, with the same exact integer halves. gemm_q16_units_avx2.cpp
// and gemm_q16_units_avx512.cpp include it after their own target pragmas (so that it compiles for
// their ISA) with their own W; everything here has internal linkage: each file gets its own copy.
//   - one activation row (decode): the accumulators of a 4-row tile stay in registers; the weights
//     are read once, which is what a decode GEMV is bound by.
//   - several activation rows (a server's decode batch): each block of a 4-row tile is widened once
//     and swept by every activation row, their accumulators kept in an L1-resident array.
// The scales are q16_unit_scales' (the scalar reference's) arithmetic with F16C's conversions (the
// same values), so every W gives gemm_q16_scalar's bits.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "ops/avx2_common.h"
#include "ops/q16_avx2.h"
#include "ops/q16_units.h"
#include "ops/quant_kernels.h"

namespace kallpa::ops::kernels {
namespace {  // NOLINT: one copy per including file, compiled for its ISA (see above)

inline __m256i load32(const std::byte* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// How far ahead of a decode tile its weights are prefetched (bench/results/quant-matmul.md).
constexpr std::size_t kUnitsPrefetchBytes = 16384;

// Activation rows swept per pass over a tile's blocks (their accumulators: 64 x 48 bytes in L1).
constexpr std::int64_t kSweepRows = 64;

// The 4 f16 at p + r * stride (r < NW; 0 for the rows past NW) as floats: F16C gives the bits of
// the reference's f16_to_f32.
template <int NW>
inline __m128 halves4(const std::byte* const* units, std::size_t at) {
  // Gathered in a general register: four 2-byte stores read back as one vector would stall on
  // store forwarding, once per block.
  std::uint64_t bits = 0;
  for (int r = 0; r < NW; ++r) {
    std::uint16_t h;
    std::memcpy(&h, units[r] + at, 2);
    bits |= static_cast<std::uint64_t>(h) << (16 * r);
  }
  return _mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<long long>(bits)));
}

// Four rows of 8 values (one per block c) as 8 vectors of the 4 rows' values for block c.
inline void transpose4x8(const __m256 (&v)[4], __m128* out) {
  const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]);  // r0c0 r1c0 r0c1 r1c1 | the same for c4, c5
  const __m256 t1 = _mm256_unpackhi_ps(v[0], v[1]);  // c2, c3 | c6, c7
  const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]);
  const __m256 t3 = _mm256_unpackhi_ps(v[2], v[3]);
  const __m256 u[4] = {_mm256_shuffle_ps(t0, t2, 0x44), _mm256_shuffle_ps(t0, t2, 0xee),
                       _mm256_shuffle_ps(t1, t3, 0x44), _mm256_shuffle_ps(t1, t3, 0xee)};
  for (int c = 0; c < 4; ++c) {
    out[c] = _mm256_castps256_ps128(u[c]);
    out[c + 4] = _mm256_extractf128_ps(u[c], 1);
  }
}

// d_c and m_c of the NW rows' units (lane r: row r; zero past NW), per block c of the unit.
template <GgmlType T, int NW>
inline void unit_scales4(const std::byte* const* units, __m128* d, __m128* m) {
  if constexpr (T == GgmlType::q5_0 || T == GgmlType::iq4_nl) {
    d[0] = halves4<NW>(units, 0);
  } else if constexpr (T == GgmlType::q5_1) {
    d[0] = halves4<NW>(units, 0);
    m[0] = halves4<NW>(units, 2);
  } else if constexpr (T == GgmlType::q6_k) {
    const __m128 dd = halves4<NW>(units, 208);
    for (int c = 0; c < kMaxUnitBlocks; ++c) d[c] = dd;
  } else {  // q4_k, q5_k: q16_unit_scales' products, 8 blocks of a row per vector
    __m256 ds[4], ms[4];
    for (int r = 0; r < 4; ++r) {
      if (r >= NW) {
        ds[r] = ms[r] = _mm256_setzero_ps();
        continue;
      }
      // The 12 packed bytes as 8 six-bit scales (bytes 0..7) and 8 mins (8..15), as
      // kquant_scale_min reads them, four bytes at a time.
      std::uint32_t s[3];
      std::memcpy(s, units[r] + 4, 12);
      constexpr std::uint32_t k6 = 0x3f3f3f3f, k4 = 0x0f0f0f0f, k2 = 0x03030303;
      const std::uint32_t sc_lo = s[0] & k6;
      const std::uint32_t sc_hi = (s[2] & k4) | (((s[0] >> 6) & k2) << 4);
      const std::uint32_t mn_lo = s[1] & k6;
      const std::uint32_t mn_hi = ((s[2] >> 4) & k4) | (((s[1] >> 6) & k2) << 4);
      const __m256 sc = _mm256_cvtepi32_ps(
          _mm256_cvtepu8_epi32(_mm_setr_epi32(static_cast<int>(sc_lo), static_cast<int>(sc_hi), 0, 0)));
      const __m256 mn = _mm256_cvtepi32_ps(
          _mm256_cvtepu8_epi32(_mm_setr_epi32(static_cast<int>(mn_lo), static_cast<int>(mn_hi), 0, 0)));
      ds[r] = _mm256_mul_ps(_mm256_set1_ps(load_half(units[r])), sc);
      // -(dmin * min): the sign flipped, as the scalar negation does (-0 for a zero min).
      ms[r] = _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(load_half(units[r] + 2)), mn), _mm256_set1_ps(-0.0f));
    }
    transpose4x8(ds, d);
    transpose4x8(ms, m);
  }
}

// NW <= 4 weight rows (w: the first) against nx activation rows; W widens and multiplies.
template <class W, GgmlType T, int NW, bool One>
void tile_units(const std::byte* w, std::size_t row_bytes, const BlockQ16x* xq, std::int64_t nx, std::int64_t nb,
                float* y, std::int64_t ldy) {
  static_assert(NW >= 1 && NW <= 4);
  constexpr Q16Unit g = q16_unit(T);
  const std::int64_t nu = nb / g.blocks;
  constexpr bool one = One;  // a decode row: its own instantiation, no per-block branch
  __m256 acc1 = _mm256_setzero_ps();
  __m128 macc1 = _mm_setzero_ps();
  // The swept rows' accumulators, only in the batched instantiation.
  struct Swept {
    __m256 acc[kSweepRows];
    __m128 macc[kSweepRows];
  };
  struct NoSwept {};
  [[maybe_unused]] std::conditional_t<one, NoSwept, Swept> swept;
  if constexpr (!one) {
    for (std::int64_t i = 0; i < nx; ++i) {
      swept.acc[i] = _mm256_setzero_ps();
      swept.macc[i] = _mm_setzero_ps();
    }
  }
  for (std::int64_t u = 0; u < nu; ++u) {
    if constexpr (one) {
      // A decode row reads each weight once, from DRAM, in tasks of a few KiB: four rows of a few
      // hundred bytes each are streams too short for the hardware prefetcher, so the tile asks
      // for the bytes kUnitsPrefetchBytes past its own (the rows are contiguous: the next tile,
      // then the next task), as far along as it has read its own.
      const std::byte* ahead = w + kUnitsPrefetchBytes + static_cast<std::size_t>(u) * 4 * g.bytes;
      prefetch_lines<kPrefetchToL1>(ahead, 4 * g.bytes);
    }
    const std::byte* units[NW];
    for (int r = 0; r < NW; ++r) {
      units[r] = w + static_cast<std::size_t>(r) * row_bytes + static_cast<std::size_t>(u) * g.bytes;
    }
    __m128 d4[g.blocks], m4[g.blocks];
    unit_scales4<T, NW>(units, d4, m4);
    // Unrolled, each block's shifts and offsets are constants.
#pragma GCC unroll 8
    for (int c = 0; c < g.blocks; ++c) {
      typename W::Block wv[4];
      for (int r = 0; r < 4; ++r) wv[r] = r < NW ? W::template widen<T>(units[r], c) : W::zero();
      const __m256 d8 = pair_lanes(d4[c]);
      const std::int64_t b = u * g.blocks + c;
      if constexpr (one) {
        acc1 = W::accumulate(wv, xq[b], d8, acc1);
        if constexpr (g.has_m) macc1 = _mm_fmadd_ps(m4[c], _mm_broadcast_ss(&xq[b].s), macc1);
      } else {
        for (std::int64_t i = 0; i < nx; ++i) {
          const BlockQ16x& xb = xq[i * nb + b];
          swept.acc[i] = W::accumulate(wv, xb, d8, swept.acc[i]);
          if constexpr (g.has_m) swept.macc[i] = _mm_fmadd_ps(m4[c], _mm_broadcast_ss(&xb.s), swept.macc[i]);
        }
      }
    }
  }
  if constexpr (one) {
    store_row_sums(acc1, macc1, NW, y);
  } else {
    for (std::int64_t i = 0; i < nx; ++i) store_row_sums(swept.acc[i], swept.macc[i], NW, y + i * ldy);
  }
}

// Every 4-row tile of nw rows, then the 1-3 rows past the last one.
template <class W, GgmlType T, bool One>
void tiles_units(const std::byte* w, std::size_t row_bytes, std::int64_t nw, const BlockQ16x* xt, std::int64_t n,
                 std::int64_t nb, float* yt, std::int64_t ldy) {
  std::int64_t r = 0;
  for (; r + 4 <= nw; r += 4) {
    tile_units<W, T, 4, One>(w + static_cast<std::size_t>(r) * row_bytes, row_bytes, xt, n, nb, yt + r, ldy);
  }
  const std::byte* wr = w + static_cast<std::size_t>(r) * row_bytes;
  switch (nw - r) {
    case 3: tile_units<W, T, 3, One>(wr, row_bytes, xt, n, nb, yt + r, ldy); break;
    case 2: tile_units<W, T, 2, One>(wr, row_bytes, xt, n, nb, yt + r, ldy); break;
    case 1: tile_units<W, T, 1, One>(wr, row_bytes, xt, n, nb, yt + r, ldy); break;
    default: break;
  }
}

template <class W, GgmlType T>
void gemm_units(const std::byte* w, std::size_t row_bytes, std::int64_t nw, const BlockQ16x* xq, std::int64_t nx,
                std::int64_t k, float* y, std::int64_t ldy) {
  const std::int64_t nb = k / kQK;
  for (std::int64_t x0 = 0; x0 < nx; x0 += kSweepRows) {
    const std::int64_t n = std::min(kSweepRows, nx - x0);
    const BlockQ16x* xt = xq + x0 * nb;
    float* yt = y + x0 * ldy;
    if (n == 1) {
      tiles_units<W, T, true>(w, row_bytes, nw, xt, n, nb, yt, ldy);
    } else {
      tiles_units<W, T, false>(w, row_bytes, nw, xt, n, nb, yt, ldy);
    }
  }
}

// gemm_q16_units_* on W's widening.
template <class W>
void gemm_q16_units_with(GgmlType type, const std::byte* w, std::size_t row_bytes, std::int64_t nw, const BlockQ16x* xq,
                         std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy) {
  switch (type) {
    case GgmlType::q5_0: return gemm_units<W, GgmlType::q5_0>(w, row_bytes, nw, xq, nx, k, y, ldy);
    case GgmlType::q5_1: return gemm_units<W, GgmlType::q5_1>(w, row_bytes, nw, xq, nx, k, y, ldy);
    case GgmlType::iq4_nl: return gemm_units<W, GgmlType::iq4_nl>(w, row_bytes, nw, xq, nx, k, y, ldy);
    case GgmlType::q4_k: return gemm_units<W, GgmlType::q4_k>(w, row_bytes, nw, xq, nx, k, y, ldy);
    case GgmlType::q5_k: return gemm_units<W, GgmlType::q5_k>(w, row_bytes, nw, xq, nx, k, y, ldy);
    case GgmlType::q6_k: return gemm_units<W, GgmlType::q6_k>(w, row_bytes, nw, xq, nx, k, y, ldy);
    default: return;
  }
}

}  // namespace
}  // namespace kallpa::ops::kernels
#endif
