// The lanes tile of the AVX-512 Q16 kernels for batches of activation rows: 16 weight rows in the
// lanes of a vector, an element pair per dword, vpdpwssd into each activation row's exact integer
// halves E and O, then tile_q16_row's float steps per lane. quant_dot_avx512.cpp (Q8_0, Q4_0, Q4_1)
// and gemm_q16_units_avx512.cpp (the types of ops/q16_units.h) include it after their own target
// pragmas (AVX-512 F, BW, VL, VNNI, VBMI) and give sweep_groups their own widening: how a 16-row group's
// blocks become kWideBlockBytes each (16 pair vectors, lane r = row r's
// (element j) | (element j + 16) << 16, then the rows' 16 d_w and 16 m_w as floats). Everything here
// has internal linkage: each including file gets its own copy, compiled for its ISA.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "ops/avx2_common.h"
#include "ops/quant_types.h"

namespace kallpa::ops::kernels {
namespace {  // NOLINT: one copy per including file, compiled for its ISA (see above)

constexpr int kGroupRows = 16;
// Per block of a widened group: 16 vectors of (row lanes x one element pair), then 16 d_w and 16
// m_w as floats.
constexpr std::int64_t kWideVectors = 16;
constexpr std::int64_t kWideBlockBytes = kWideVectors * 64 + 2 * 64;

// In place: m[r] lane j -> m[j] lane r.
inline void transpose16x16(__m512i (&m)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(m[i], m[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(m[i], m[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    m[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    m[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    m[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    m[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // Now m[4a + c] holds, in its 128-bit lane q, element 4q + c of rows 4a..4a+3; we want m[4q + c]
  // to hold that in lane a: a 4 x 4 transpose of 128-bit lanes, two rounds of lane shuffles.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(m[i], m[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_i32x4(m[i], m[4 + i], 0xdd);
    t[8 + i] = _mm512_shuffle_i32x4(m[8 + i], m[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_i32x4(m[8 + i], m[12 + i], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    m[i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88);
    m[8 + i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0xdd);
    m[4 + i] = _mm512_shuffle_i32x4(t[4 + i], t[12 + i], 0x88);
    m[12 + i] = _mm512_shuffle_i32x4(t[4 + i], t[12 + i], 0xdd);
  }
}

// Index vectors of the byte shuffles that widen 16 rows of Q4-style quant bytes (quant_dot_avx512.cpp's
// widen_rows4, gemm_q16_units_avx512.cpp's Q5_0 groups), built once.
struct ByteShuffles {
  __m512i a_lo, a_hi, b01, b23, w[4], q8_lo, q8_hi;
};
inline ByteShuffles make_byte_shuffles() {
  alignas(64) std::uint8_t a_lo[64], a_hi[64], b01[64], b23[64], wv[4][64], q8_lo[64], q8_hi[64];
  for (int j = 0; j < 8; ++j) {
    for (int r = 0; r < 8; ++r) {  // rows 0..7 (or 8..15) of the two sources: (r / 4) picks one
      a_lo[8 * j + r] = static_cast<std::uint8_t>((r < 4 ? 0 : 64) + 16 * (r % 4) + j);
      a_hi[8 * j + r] = static_cast<std::uint8_t>((r < 4 ? 0 : 64) + 16 * (r % 4) + j + 8);
    }
  }
  for (int c = 0; c < 4; ++c) {
    for (int r = 0; r < 16; ++r) {
      b01[16 * c + r] = static_cast<std::uint8_t>((r < 8 ? 0 : 64) + 8 * c + r % 8);
      b23[16 * c + r] = static_cast<std::uint8_t>((r < 8 ? 0 : 64) + 8 * (4 + c) + r % 8);
      wv[c][4 * r] = static_cast<std::uint8_t>(16 * c + r);
      wv[c][4 * r + 1] = 0;
      wv[c][4 * r + 2] = static_cast<std::uint8_t>(64 + 16 * c + r);
      wv[c][4 * r + 3] = 0;
    }
  }
  for (int i = 0; i < 4; ++i) {  // Q8_0: row i's bytes 0..15 (lo) or 16..31 (hi) of 4 x 32
    for (int j = 0; j < 16; ++j) {
      q8_lo[16 * i + j] = static_cast<std::uint8_t>(32 * i + j);
      q8_hi[16 * i + j] = static_cast<std::uint8_t>(32 * i + j + 16);
    }
  }
  ByteShuffles s;
  s.a_lo = _mm512_load_si512(a_lo);
  s.a_hi = _mm512_load_si512(a_hi);
  s.b01 = _mm512_load_si512(b01);
  s.b23 = _mm512_load_si512(b23);
  for (int c = 0; c < 4; ++c) s.w[c] = _mm512_load_si512(wv[c]);
  s.q8_lo = _mm512_load_si512(q8_lo);
  s.q8_hi = _mm512_load_si512(q8_hi);
  return s;
}

// 16 rows x 16 bytes, in[g] holding rows 4g..4g+3 (row i's byte j at 16 i + j), transposed into
// t[q] (byte 16 c + r: row r's byte 4 q + c) by two rounds of two-source byte permutes, 8 in all.
inline void transpose_bytes16x16(const ByteShuffles& sh, const __m512i (&in)[4], __m512i (&t)[4]) {
  // Byte 8 j + r: row r (of 0..7, or 8..15 for the b pair) at byte j (lo: j < 8; hi: j - 8).
  const __m512i a_lo = _mm512_permutex2var_epi8(in[0], sh.a_lo, in[1]);
  const __m512i a_hi = _mm512_permutex2var_epi8(in[0], sh.a_hi, in[1]);
  const __m512i b_lo = _mm512_permutex2var_epi8(in[2], sh.a_lo, in[3]);
  const __m512i b_hi = _mm512_permutex2var_epi8(in[2], sh.a_hi, in[3]);
  t[0] = _mm512_permutex2var_epi8(a_lo, sh.b01, b_lo);
  t[1] = _mm512_permutex2var_epi8(a_lo, sh.b23, b_lo);
  t[2] = _mm512_permutex2var_epi8(a_hi, sh.b01, b_hi);
  t[3] = _mm512_permutex2var_epi8(a_hi, sh.b23, b_hi);
}

// 32 int16 elements as 16 dwords, lane j = (element j) | (element j + 16) << 16: the pairing of
// the lanes tile, for an activation block (pair_q16_activations_avx512) and a widened weight row's.
inline __m512i pair_halves(__m512i elements) {
  alignas(64) static constexpr std::int16_t kPairs[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                          8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  return _mm512_permutexvar_epi16(_mm512_load_si512(kPairs), elements);
}

// The 16 pair vectors of 16 rows' Q4-style quant bytes (byte j: element j in its low nibble,
// j + 16 in its high one) as transpose_bytes16x16 leaves them: pairs[4 q + c], lane r = row r's
// element (4 q + c) | element (4 q + c + 16) << 16, each a nibble.
inline void nibble_pairs(const ByteShuffles& sh, const __m512i (&t)[4], __m512i (&pairs)[16]) {
  const __m512i low_nibbles = _mm512_set1_epi8(0x0f);
  for (int q = 0; q < 4; ++q) {
    const __m512i lo = _mm512_and_si512(t[q], low_nibbles);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(t[q], 4), low_nibbles);
    for (int c = 0; c < 4; ++c) {
      pairs[4 * q + c] = _mm512_maskz_permutex2var_epi8(0x5555555555555555ULL, lo, sh.w[c], hi);
    }
  }
}

// The float accumulators of one activation row against a 16-row group, carried from one chunk of
// blocks to the next.
struct alignas(64) RowAcc {
  __m512 e, o, m;
};

// NX activation rows against blocks [b0, b1) of a widened group (wide holds block b0 first): the
// float steps of tile_q16_row per lane (= row). Each pair's weight vector is loaded once and
// multiplied into every activation row's half. The accumulators start at zero for b0 = 0 (else
// from acc) and end in y for b1 = nb (else in acc), so chunking changes no operation's order.
template <int NX>
void tile_group(const std::byte* wide, const std::int32_t* xp, const BlockQ16x* xq, std::int64_t nb, std::int64_t b0,
                std::int64_t b1, RowAcc* acc, float* y, std::int64_t ldy) {
  __m512 acc_e[NX], acc_o[NX], macc[NX];
  for (int x = 0; x < NX; ++x) {
    if (b0 == 0) {
      acc_e[x] = acc_o[x] = macc[x] = _mm512_setzero_ps();
    } else {
      acc_e[x] = acc[x].e;
      acc_o[x] = acc[x].o;
      macc[x] = acc[x].m;
    }
  }
  for (std::int64_t b = b0; b < b1; ++b) {
    const std::byte* wb = wide + (b - b0) * kWideBlockBytes;
    __m512i e[NX], o[NX];
    for (int x = 0; x < NX; ++x) e[x] = o[x] = _mm512_setzero_si512();
#pragma GCC unroll 16
    for (int j = 0; j < 16; j += 4) {  // j, j + 1 in E; j + 2, j + 3 in O
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        const __m512i wv = _mm512_load_si512(wb + 64 * (j + p));
        for (int x = 0; x < NX; ++x) {
          const __m512i xv = _mm512_set1_epi32(xp[(x * nb + b) * 16 + j + p]);
          if (p < 2) {
            e[x] = _mm512_dpwssd_epi32(e[x], wv, xv);
          } else {
            o[x] = _mm512_dpwssd_epi32(o[x], wv, xv);
          }
        }
      }
    }
    const __m512 dw = _mm512_load_ps(wb + 64 * kWideVectors);
    const __m512 mw = _mm512_load_ps(wb + 64 * kWideVectors + 64);
    for (int x = 0; x < NX; ++x) {
      const BlockQ16x& blk = xq[x * nb + b];
      const __m512 s = _mm512_mul_ps(dw, _mm512_set1_ps(blk.d));
      acc_e[x] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(e[x]), s, acc_e[x]);
      acc_o[x] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(o[x]), s, acc_o[x]);
      macc[x] = _mm512_fmadd_ps(mw, _mm512_set1_ps(blk.s), macc[x]);
    }
  }
  for (int x = 0; x < NX; ++x) {
    if (b1 == nb) {
      _mm512_storeu_ps(y + x * ldy, _mm512_add_ps(_mm512_add_ps(acc_e[x], acc_o[x]), macc[x]));
    } else {
      acc[x] = RowAcc{acc_e[x], acc_o[x], macc[x]};
    }
  }
}

// Rows longer than kChunkMaxBlocks blocks are widened and swept kChunkBlocks at a time, so that a
// chunk's widened weights (16 x 1152 bytes) and every activation row's pairs for it (16 x 64 bytes
// each) stay in L1 while the batch's tiles sweep them; whole rows of SmolLM2's down projection
// (k = 1536: 55 KB widened + 49 KB of pairs for 16 rows) would spill to L2 and slow its tiles
// (bench/results/quant-matmul.md).
constexpr std::int64_t kChunkBlocks = 16;
constexpr std::int64_t kChunkMaxBlocks = 24;

// Groups 0 .. n_groups-1 of 16 rows (w: the first row) against nx activation rows (xq, and xp: their
// pairs as pair_q16_activations_avx512 gives them). widen(w_group, b0, b1, wide) writes the group's
// blocks [b0, b1) into wide, block b0 first.
template <class Widen>
void sweep_groups(const Widen& widen, const std::byte* w, std::size_t row_bytes, std::int64_t n_groups,
                  const BlockQ16x* xq, const std::int32_t* xp, std::int64_t nx, std::int64_t nb, float* y,
                  std::int64_t ldy) {
  const std::int64_t chunk = nb > kChunkMaxBlocks ? kChunkBlocks : nb;
  // Per-thread, reused across calls; plain pointers below (thread_local in a shared library costs
  // a __tls_get_addr per access).
  struct alignas(64) Line {
    std::byte bytes[64];
  };
  thread_local std::vector<Line> wide_buf;
  thread_local std::vector<RowAcc> acc_buf;
  wide_buf.resize(static_cast<std::size_t>(chunk * kWideBlockBytes / 64));
  acc_buf.resize(static_cast<std::size_t>(nx));
  std::byte* const wide = reinterpret_cast<std::byte*>(wide_buf.data());
  RowAcc* const acc = acc_buf.data();
  // The rows4 widening asks for each next group while it widens one, but a task's first group has
  // no predecessor, and without a prefetch its blocks miss one after another. The whole group at
  // once, into L2, lets the misses overlap (bench/results/quant-matmul.md).
  if (n_groups > 0) prefetch_lines<kPrefetchToL2>(w, kGroupRows * row_bytes);
  for (std::int64_t g = 0; g < n_groups; ++g) {
    float* yg = y + g * kGroupRows;
    const std::byte* wg = w + static_cast<std::size_t>(g * kGroupRows) * row_bytes;
    for (std::int64_t b0 = 0; b0 < nb; b0 += chunk) {
      const std::int64_t b1 = std::min(nb, b0 + chunk);
      widen(wg, b0, b1, wide);
      std::int64_t x = 0;
      auto tile = [&](auto rows) {
        constexpr int NX = decltype(rows)::value;
        tile_group<NX>(wide, xp + x * nb * 16, xq + x * nb, nb, b0, b1, acc + x, yg + x * ldy, ldy);
      };
      for (; x + 4 <= nx; x += 4) tile(std::integral_constant<int, 4>());
      switch (nx - x) {
        case 3: tile(std::integral_constant<int, 3>()); break;
        case 2: tile(std::integral_constant<int, 2>()); break;
        case 1: tile(std::integral_constant<int, 1>()); break;
        default: break;
      }
    }
  }
}

}  // namespace
}  // namespace kallpa::ops::kernels
#endif
