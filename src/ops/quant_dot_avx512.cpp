// AVX-512 VNNI kernel for batched Q16 products (gemm_q16 with several activation rows: a server's
// batch of decode streams), run-time selected above the AVX2 kernels (see quant_kernels.h).
//
// AVX2's folding tile (gemm_q16_rows) keeps a weight row's 32 products in the lanes of one register
// and folds them to the block's two halves E and O with shuffles, per block and activation row;
// that fold and the separate multiply and add bound it. Here the lanes are weight rows instead (as
// in AVX2's gemm_q16_lanes, 8 rows per vector there, madd + add for vpdpwssd): 16 rows per vector,
// and vpdpwssd adds a pair of int16 products per lane straight into an int32 accumulator. Pairs
// are (element j, element j + 16), both in the same half (j mod 4 == (j + 16) mod 4), which is the
// low and the high nibble of one Q4 quant byte, and the activation side broadcasts the matching
// pair from memory. So E and O come out per row without any fold, exactly (integer sums do not
// depend on order), and the float steps per lane are those of tile_q16_row: acc_e = fma(float(E),
// d_w * d_x, acc_e), acc_o likewise, macc = fma(m_w, s_x, macc) in block order, y = (acc_e +
// acc_o) + macc. The result is bit for bit the AVX2 and scalar kernels', whatever kernel or tile a
// row lands in.
//
// Making rows the lanes takes a transpose: a 16-row group's blocks are widened once per call into
// a per-thread buffer (byte permutes for the repacked rows4 layout, a 16 x 16 dword transpose for
// ggml's) and swept by every activation row, so its cost is shared by the batch; one activation
// row alone goes to the AVX2 kernel. bench/quant_matmul_bench compares the two (avx2:0 vs avx2:1).
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ops/quant_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KALLPA_X86 1
#endif

namespace kallpa::ops::kernels {

#if KALLPA_X86

bool avx512_vnni_available() noexcept {
  static const bool ok = avx2_available() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
                         __builtin_cpu_supports("avx512vbmi");
  return ok;
}

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")
// GCC 12's AVX-512 headers initialise their "undefined" vectors from themselves, which
// -Wmaybe-uninitialized reports at every inlined intrinsic (GCC bug 105593, fixed in 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

}  // namespace kallpa::ops::kernels
// After the target pragma, at file scope: its templates compile for this file's ISA.
#include "ops/q16_lanes_avx512.h"
namespace kallpa::ops::kernels {

namespace {

// Row r's block as 16 dwords, lane j = (int16 element j) | (int16 element j + 16) << 16.
template <GgmlType T>
inline __m512i row_pairs(const std::byte* qs) {
  if constexpr (T == GgmlType::q8_0) {
    const __m512i lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    const __m512i hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16)));
    // (lo & 0xffff) | (hi << 16)
    return _mm512_ternarylogic_epi32(_mm512_slli_epi32(hi, 16), lo, _mm512_set1_epi32(0xffff), 0xF8);
  } else {
    // Byte j: element j in its low nibble, j + 16 in its high one. (v | v << 12) & 0x000f000f puts
    // them in the low and high halves of the dword.
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    return _mm512_and_si512(_mm512_or_si512(v, _mm512_slli_epi32(v, 12)), _mm512_set1_epi32(0x000f000f));
  }
}

// The 16 scales d_w of rows r0 .. r0+15 at block b, and their constant terms m_w (Q4_1's mins,
// Q4_0's -8 d, Q8_0's none), as floats, for any layout.
template <GgmlType T, WeightLayout L>
inline void group_scales(const std::byte* w, std::size_t row_bytes, std::int64_t r0, std::int64_t b, __m512& d,
                         __m512& m) {
  constexpr BlockGeom g = block_geom(T);
  if constexpr (L == WeightLayout::rows4) {
    // Each 4-row group has its 4 d (and then 4 m) side by side: four 8-byte loads, one convert.
    auto halves = [&](std::size_t offset) {
      const std::byte* p[4];
      for (int i = 0; i < 4; ++i) {
        p[i] =
            w + static_cast<std::size_t>(r0 + 4 * i) * row_bytes + static_cast<std::size_t>(b) * 4 * g.bytes + offset;
      }
      auto two = [](const std::byte* a, const std::byte* c) {
        return _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)),
                                  _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)));
      };
      return _mm512_cvtph_ps(_mm256_set_m128i(two(p[2], p[3]), two(p[0], p[1])));
    };
    d = halves(0);
    if constexpr (g.has_m) m = halves(8);
  } else {
    alignas(64) float dv[16], mv[16];
    for (int r = 0; r < kGroupRows; ++r) {
      const BlockPtr p = block_ptr(g, L, w, row_bytes, r0 + r, b);
      std::uint16_t h;
      std::memcpy(&h, p.d, 2);
      dv[r] = _cvtsh_ss(h);
      if constexpr (g.has_m) {
        std::memcpy(&h, p.m, 2);
        mv[r] = _cvtsh_ss(h);
      }
    }
    d = _mm512_load_ps(dv);
    if constexpr (g.has_m) m = _mm512_load_ps(mv);
  }
  if constexpr (T == GgmlType::q4_0) m = _mm512_mul_ps(_mm512_set1_ps(-8.0f), d);
  if constexpr (T == GgmlType::q8_0) m = _mm512_setzero_ps();
}

// Weights in the rows4 layout, where a 4-row group's quants are contiguous: byte transposes
// instead of row_pairs + transpose16x16 (~50-70 instructions per block instead of ~130-150).
//   Q4: 64 bytes per group (row i's byte j at 16 i + j: element j in the low nibble, j + 16 in the
//       high one); the nibbles split on whole vectors, and one zeroing permute per output vector
//       interleaves them into (j, j + 16) pairs.
//   Q8_0: 128 bytes per group (row i's 32 bytes at 32 i); its elements 0..15 and 16..31 are
//       gathered into two Q4-shaped matrices, transposed alike, interleaved, then sign-extended.
// Each 16-row group also asks for the next one's bytes: decode reads every weight once per step,
// mostly from DRAM, and the widening otherwise waits on each load.
template <GgmlType T>
void widen_rows4(const std::byte* w, std::size_t row_bytes, std::int64_t r0, std::int64_t b0, std::int64_t b1,
                 std::byte* wide) {
  constexpr BlockGeom g = block_geom(T);
  constexpr std::size_t qs_offset = g.has_m ? 16 : 8;
  static const ByteShuffles sh = make_byte_shuffles();
  const std::byte* group = w + static_cast<std::size_t>(r0) * row_bytes;
  const std::byte* next = group + kGroupRows * row_bytes;
  for (std::int64_t b = b0; b < b1; ++b) {
    const std::byte* blk[4];
    for (int i = 0; i < 4; ++i) blk[i] = group + 4 * i * row_bytes + static_cast<std::size_t>(b) * 4 * g.bytes;
    prefetch_lines<kPrefetchToL1>(next + static_cast<std::size_t>(b) * kGroupRows * g.bytes, kGroupRows * g.bytes);
    std::byte* out = wide + (b - b0) * kWideBlockBytes;
    if constexpr (T == GgmlType::q8_0) {
      __m512i lo_in[4], hi_in[4], lo[4], hi[4];
      for (int i = 0; i < 4; ++i) {
        const __m512i r01 = _mm512_loadu_si512(blk[i] + qs_offset);
        const __m512i r23 = _mm512_loadu_si512(blk[i] + qs_offset + 64);
        lo_in[i] = _mm512_permutex2var_epi8(r01, sh.q8_lo, r23);
        hi_in[i] = _mm512_permutex2var_epi8(r01, sh.q8_hi, r23);
      }
      transpose_bytes16x16(sh, lo_in, lo);
      transpose_bytes16x16(sh, hi_in, hi);
      for (int q = 0; q < 4; ++q) {
        for (int c = 0; c < 4; ++c) {
          const __m512i bytes = _mm512_maskz_permutex2var_epi8(0x5555555555555555ULL, lo[q], sh.w[c], hi[q]);
          _mm512_store_si512(out + 64 * (4 * q + c), _mm512_srai_epi16(_mm512_slli_epi16(bytes, 8), 8));
        }
      }
    } else {
      __m512i in[4], t[4], pairs[16];
      for (int i = 0; i < 4; ++i) in[i] = _mm512_loadu_si512(blk[i] + qs_offset);
      transpose_bytes16x16(sh, in, t);
      nibble_pairs(sh, t, pairs);
      for (int j = 0; j < 16; ++j) _mm512_store_si512(out + 64 * j, pairs[j]);
    }
    __m512 d, m;
    group_scales<T, WeightLayout::rows4>(w, row_bytes, r0, b, d, m);
    _mm512_store_ps(out + 64 * kWideVectors, d);
    _mm512_store_ps(out + 64 * kWideVectors + 64, m);
  }
}

// Rows r0 .. r0+15, blocks [b0, b1), into `wide` (kWideBlockBytes per block, block b0 first).
template <GgmlType T, WeightLayout L>
void widen_group(const std::byte* w, std::size_t row_bytes, std::int64_t r0, std::int64_t b0, std::int64_t b1,
                 std::byte* wide) {
  if constexpr (L == WeightLayout::rows4) {
    widen_rows4<T>(w, row_bytes, r0, b0, b1, wide);
  } else {
    constexpr BlockGeom g = block_geom(T);
    for (std::int64_t b = b0; b < b1; ++b) {
      __m512i m[16];
      for (int r = 0; r < kGroupRows; ++r) m[r] = row_pairs<T>(block_ptr(g, L, w, row_bytes, r0 + r, b).qs);
      transpose16x16(m);
      std::byte* out = wide + (b - b0) * kWideBlockBytes;
      for (int j = 0; j < kWideVectors; ++j) _mm512_store_si512(out + 64 * j, m[j]);
      __m512 d, mins;
      group_scales<T, L>(w, row_bytes, r0, b, d, mins);
      _mm512_store_ps(out + 64 * kWideVectors, d);
      _mm512_store_ps(out + 64 * kWideVectors + 64, mins);
    }
  }
}

template <GgmlType T, WeightLayout L>
void gemm_q16_groups(const std::byte* w, std::size_t row_bytes, std::int64_t n_groups, const BlockQ16x* xq,
                     const std::int32_t* xp, std::int64_t nx, std::int64_t nb, float* y, std::int64_t ldy) {
  auto widen = [row_bytes](const std::byte* group, std::int64_t b0, std::int64_t b1, std::byte* wide) {
    widen_group<T, L>(group, row_bytes, 0, b0, b1, wide);
  };
  sweep_groups(widen, w, row_bytes, n_groups, xq, xp, nx, nb, y, ldy);
}

template <GgmlType T>
void by_layout(WeightLayout layout, const std::byte* w, std::size_t row_bytes, std::int64_t n_groups,
               const BlockQ16x* xq, const std::int32_t* xp, std::int64_t nx, std::int64_t nb, float* y,
               std::int64_t ldy) {
  if (layout == WeightLayout::rows4) {
    gemm_q16_groups<T, WeightLayout::rows4>(w, row_bytes, n_groups, xq, xp, nx, nb, y, ldy);
  } else {
    gemm_q16_groups<T, WeightLayout::rows>(w, row_bytes, n_groups, xq, xp, nx, nb, y, ldy);
  }
}

}  // namespace

void pair_q16_activations_avx512(const BlockQ16x* xq, std::int64_t nb, std::int32_t* out) {
  for (std::int64_t b = 0; b < nb; ++b) _mm512_storeu_si512(out + 16 * b, pair_halves(_mm512_loadu_si512(xq[b].qs)));
}

void gemm_q16_avx512(GgmlType type, WeightLayout layout, const std::byte* w, std::size_t row_bytes, std::int64_t nw,
                     const BlockQ16x* xq, const std::int32_t* x_pairs, std::int64_t nx, std::int64_t k, float* y,
                     std::int64_t ldy) {
  // One activation row cannot share a group's widening: the AVX2 kernel reads the weights once.
  const std::int64_t n_groups = nx >= kQ16Avx512MinBatch && x_pairs != nullptr ? nw / kGroupRows : 0;
  const std::int64_t nb = k / kQK;
  switch (type) {
    case GgmlType::q8_0: by_layout<GgmlType::q8_0>(layout, w, row_bytes, n_groups, xq, x_pairs, nx, nb, y, ldy); break;
    case GgmlType::q4_0: by_layout<GgmlType::q4_0>(layout, w, row_bytes, n_groups, xq, x_pairs, nx, nb, y, ldy); break;
    case GgmlType::q4_1: by_layout<GgmlType::q4_1>(layout, w, row_bytes, n_groups, xq, x_pairs, nx, nb, y, ldy); break;
    default: return;
  }
  const std::int64_t done = n_groups * kGroupRows;
  if (done < nw) {
    gemm_q16_avx2(type, layout, w + static_cast<std::size_t>(done) * row_bytes, row_bytes, nw - done, xq, nx, k,
                  y + done, ldy);
  }
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

#else  // not x86

bool avx512_vnni_available() noexcept { return false; }
void pair_q16_activations_avx512(const BlockQ16x* xq, std::int64_t nb, std::int32_t* out) {
  for (std::int64_t b = 0; b < nb; ++b) {
    for (int j = 0; j < 16; ++j) {
      out[16 * b + j] =
          static_cast<std::int32_t>(static_cast<std::uint16_t>(xq[b].qs[j]) |
                                    static_cast<std::uint32_t>(static_cast<std::uint16_t>(xq[b].qs[j + 16])) << 16);
    }
  }
}
void gemm_q16_avx512(GgmlType type, WeightLayout layout, const std::byte* w, std::size_t row_bytes, std::int64_t nw,
                     const BlockQ16x* xq, const std::int32_t* x_pairs, std::int64_t nx, std::int64_t k, float* y,
                     std::int64_t ldy) {
  gemm_q16_scalar(type, layout, w, row_bytes, nw, xq, nx, k, y, ldy);
}

#endif

}  // namespace kallpa::ops::kernels
