// AVX2 + FMA + F16C kernels (run-time selected; see quant_kernels.h), written once over the block
// type (Q8_0/Q4_0/Q4_1, block_geom) and the layout (ggml's rows, or kallpa's repacked rows4, where
// a 4-row tile reads its blocks from one stream and converts its 4 scales with one instruction).
// Quantised weights are dotted with Q8 activation blocks in integer arithmetic (maddubs/madd), one
// float FMA per block and pair of rows; tiles of up to 4 weight rows x 4 activation rows share
// every load. The exact-activation kernels (gemm_qf) expand weight blocks to f32 in registers
// (small batches) or into a per-thread f32 tile run through a 3 x 4 f32 micro-kernel (larger
// batches), same FMA order.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ops/avx2_common.h"
#include "ops/q16_avx2.h"
#include "ops/quant_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define KALLPA_X86 1
#endif

namespace kallpa::ops::kernels {

#if KALLPA_X86

bool avx2_available() noexcept {
  // F16C through CPUID (leaf 1, ECX bit 29): clang's __builtin_cpu_supports does not know it.
  static const bool ok = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
    return f16c && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return ok;
}

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

namespace {

inline __m256i unpack_q4(const std::byte* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

// Scales of rows r .. r+NW-1 at block b as floats: d[i], and m[i] for Q4_1 (Q4_0: m = -8d, exact;
// Q8_0: none). In the rows4 layout a 4-row tile finds its 4 (or 8) f16 side by side: one convert.
template <GgmlType T, WeightLayout L, int NW>
inline void load_scales(const std::byte* w, std::size_t row_bytes, std::int64_t r, std::int64_t b, float* d, float* m) {
  constexpr BlockGeom g = block_geom(T);
  if constexpr (L == WeightLayout::rows4 && NW % 4 == 0) {  // r % 4 == 0
    for (int i = 0; i < NW; i += 4) {
      const std::byte* p = w + static_cast<std::size_t>(r + i) * row_bytes + static_cast<std::size_t>(b) * 4 * g.bytes;
      if constexpr (g.has_m) {
        const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        _mm_storeu_ps(d + i, _mm256_castps256_ps128(dm));
        _mm_storeu_ps(m + i, _mm256_extractf128_ps(dm, 1));
      } else {
        const __m128 d4 = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
        _mm_storeu_ps(d + i, d4);
        if constexpr (T == GgmlType::q4_0) _mm_storeu_ps(m + i, _mm_mul_ps(d4, _mm_set1_ps(-8.0f)));
      }
    }
  } else {
    for (int i = 0; i < NW; ++i) {
      const BlockPtr p = block_ptr(g, L, w, row_bytes, r + i, b);
      d[i] = load_half(p.d);
      if constexpr (g.has_m) {
        m[i] = load_half(p.m);
      } else if constexpr (T == GgmlType::q4_0) {
        m[i] = -8.0f * d[i];
      }
    }
  }
}

// The quants of row r0 + r at block b. A 4-row tile in the rows4 layout (r0 % 4 == 0) addresses its
// group with constant offsets, without block_ptr's general row arithmetic.
template <GgmlType T, WeightLayout L, int NW>
inline const std::byte* quants(const std::byte* w, std::size_t row_bytes, std::int64_t r0, int r, std::int64_t b) {
  constexpr BlockGeom g = block_geom(T);
  if constexpr (L == WeightLayout::rows4 && NW % 4 == 0) {
    return w + static_cast<std::size_t>(r0 + (r & ~3)) * row_bytes + static_cast<std::size_t>(b) * 4 * g.bytes +
           (g.has_m ? 16 : 8) + static_cast<std::size_t>(r & 3) * g.qs_bytes;
  } else {
    return block_ptr(g, L, w, row_bytes, r0 + r, b).qs;
  }
}

// --- Q8 activations (gemm_q): integer dot products ---

// One tile: NW weight rows (from row r0) x NX activation rows. Per block and pair: integer dot
// (maddubs, madd), then acc += (float(isum) * dx) * dw, and the constant term (Q4_0's -8d, Q4_1's
// m) as macc = fma(m, x block sum, macc): the same operations whatever the tile shape or layout.
template <GgmlType T, WeightLayout L, int NW, int NX>
void tile_q(const std::byte* w, std::size_t row_bytes, std::int64_t r0, const BlockQ8x* xq, std::int64_t nb, float* y,
            std::int64_t ldy) {
  __m256 acc[NW][NX];
  float macc[NW][NX];
  for (int r = 0; r < NW; ++r) {
    for (int x = 0; x < NX; ++x) {
      acc[r][x] = _mm256_setzero_ps();
      macc[r][x] = 0.0f;
    }
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (std::int64_t b = 0; b < nb; ++b) {
    alignas(16) float d[NW < 4 ? 4 : NW], m[NW < 4 ? 4 : NW];
    load_scales<T, L, NW>(w, row_bytes, r0, b, d, m);
    __m256i wv[NW];
    for (int r = 0; r < NW; ++r) {
      const std::byte* qs = quants<T, L, NW>(w, row_bytes, r0, r, b);
      if constexpr (T == GgmlType::q8_0) {
        wv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
      } else {
        wv[r] = unpack_q4(qs);
      }
    }
    for (int x = 0; x < NX; ++x) {
      const BlockQ8x& xb = xq[static_cast<std::int64_t>(x) * nb + b];
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.qs));
      const __m256 dx = _mm256_broadcast_ss(&xb.d);
      for (int r = 0; r < NW; ++r) {
        __m256i p;
        if constexpr (T == GgmlType::q8_0) {
          p = _mm256_maddubs_epi16(_mm256_sign_epi8(wv[r], wv[r]), _mm256_sign_epi8(xv, wv[r]));
        } else {
          p = _mm256_maddubs_epi16(wv[r], xv);
        }
        const __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
        acc[r][x] = _mm256_fmadd_ps(_mm256_mul_ps(s, dx), _mm256_set1_ps(d[r]), acc[r][x]);
        if constexpr (T != GgmlType::q8_0) macc[r][x] = std::fma(m[r], xb.s, macc[r][x]);
      }
    }
  }
  for (int x = 0; x < NX; ++x) {
    for (int r = 0; r < NW; ++r) y[static_cast<std::int64_t>(x) * ldy + r] = canonical_hsum(acc[r][x]) + macc[r][x];
  }
}

// Sweeps a weight-rows x activation-rows product with tile(NW, NX, r, x): 4 x 1 tiles for a single
// activation row (decode), else up to 2 x 4, then the leftovers. NW and NX arrive as
// std::integral_constant so that each tile shape is its own instantiation.
template <typename Tile>
void sweep_tiles(std::int64_t nw, std::int64_t nx, Tile tile) {
  using std::integral_constant;
  for (std::int64_t x = 0; x < nx;) {
    const std::int64_t xn = nx - x >= 4 ? 4 : nx - x;
    auto rows_of = [&](auto nw_c, std::int64_t r) {
      switch (xn) {
        case 4: tile(nw_c, integral_constant<int, 4>{}, r, x); break;
        case 3: tile(nw_c, integral_constant<int, 3>{}, r, x); break;
        case 2: tile(nw_c, integral_constant<int, 2>{}, r, x); break;
        default: tile(nw_c, integral_constant<int, 1>{}, r, x); break;
      }
    };
    std::int64_t r = 0;
    if (xn == 1) {
      for (; r + 4 <= nw; r += 4) tile(integral_constant<int, 4>{}, integral_constant<int, 1>{}, r, x);
    }
    for (; r + 2 <= nw; r += 2) rows_of(integral_constant<int, 2>{}, r);
    for (; r < nw; ++r) rows_of(integral_constant<int, 1>{}, r);
    x += xn;
  }
}

template <GgmlType T, WeightLayout L>
void gemm_q_typed(const std::byte* w, std::size_t row_bytes, std::int64_t nw, const BlockQ8x* xq, std::int64_t nx,
                  std::int64_t k, float* y, std::int64_t ldy) {
  const std::int64_t nb = k / kQK;
  sweep_tiles(nw, nx, [&](auto nw_c, auto nx_c, std::int64_t r, std::int64_t x) {
    tile_q<T, L, decltype(nw_c)::value, decltype(nx_c)::value>(w, row_bytes, r, xq + x * nb, nb, y + x * ldy + r, ldy);
  });
}

// --- Q16 activations (gemm_q16): 16-bit integer dot products, for decode rows ---
//
// The exact integer halves and their fold are ops/q16_avx2.h's (shared with the other block types'
// Q16 kernels); one accumulator per activation row means no spills at 4 activation rows.

// A weight block as 2 x 16 int16 (elements 0..15, 16..31).
template <GgmlType T>
inline void widen_block(const std::byte* qs, __m256i& w0, __m256i& w1) {
  if constexpr (T == GgmlType::q8_0) {
    w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16)));
  } else {
    // Byte j holds element j (low nibble) and j + 16 (high): zero-extended to 16 bits, the low
    // nibble is a mask away and the high one a shift, with no widening per half.
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    w0 = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0f));
    w1 = _mm256_srli_epi16(bytes, 4);
  }
}

constexpr std::size_t kPrefetchBytes = 16384;

// NW <= 4 weight rows (from row r0) against one activation row: each block's rows widened, then
// accumulate_block.
template <GgmlType T, WeightLayout L, int NW>
void tile_q16_row(const std::byte* w, std::size_t row_bytes, std::int64_t r0, const BlockQ16x* xq, std::int64_t nb,
                  float* y) {
  static_assert(NW >= 1 && NW <= 4);
  __m256 acc = _mm256_setzero_ps();
  __m128 macc = _mm_setzero_ps();  // lane r: row r's constant term
  for (std::int64_t b = 0; b < nb; ++b) {
    if constexpr (L == WeightLayout::rows4 && NW == 4) {
      // Decode streams every weight once per token from DRAM, in tasks of a few KiB that the
      // hardware prefetcher barely ramps up on, so each cache line of the group stream is asked
      // for 16 KiB ahead (into the next task, whichever core takes it: it lands in the shared L3
      // at least). A block of 4 rows spans two or three lines: asking for one of them leaves the
      // others to demand misses (bench/results/quant-matmul.md).
      prefetch_lines<kPrefetchToL1>(w + static_cast<std::size_t>(r0) * row_bytes +
                                        static_cast<std::size_t>(b) * 4 * block_geom(T).bytes + kPrefetchBytes,
                                    4 * block_geom(T).bytes);
    }
    alignas(16) float d[4] = {}, m[4] = {};
    load_scales<T, L, NW>(w, row_bytes, r0, b, d, m);
    const BlockQ16x& xb = xq[b];
    __m256i wv[8];
    for (int r = 0; r < 4; ++r) {
      if (r < NW) {
        widen_block<T>(quants<T, L, NW>(w, row_bytes, r0, r, b), wv[2 * r], wv[2 * r + 1]);
      } else {
        wv[2 * r] = wv[2 * r + 1] = _mm256_setzero_si256();
      }
    }
    acc = accumulate_block(wv, xb, pair_lanes(_mm_load_ps(d)), acc);
    if constexpr (T != GgmlType::q8_0) macc = _mm_fmadd_ps(_mm_load_ps(m), _mm_broadcast_ss(&xb.s), macc);
  }
  store_row_sums(acc, macc, NW, y);
}

// A widened 4-row group (see gemm_q16_rows): per block, each row's elements 0..15 and 16..31 as
// int16 (8 vectors, row after row), then the lane scales d_w[r] (8 floats, pair_lanes) and
// constant terms m[r] (4 floats).
constexpr std::int64_t kWideBlockVectors = 8;
constexpr std::int64_t kWideBlockFloats = 12;

// NX activation rows against a widened 4-row group: per block, accumulate_block on the stored
// vectors (tile_q16_row without its widening). Each activation row keeps one accumulator in a
// register (the folded layout serves four weight rows with one; a vector per row and activation
// row would spill from 3 activation rows), and each pair of rows one constant-term vector
// ([m * s_x0 | m * s_x1], the same fma per lane as tile_q16_row's). The x loop is unrolled by
// hand: accumulators kept in an array go through the stack, and that round trip bounds the loop.
// Kept out of line: inlined into gemm_q16_rows beside the widening, the same loop is slower
// (bench/results/quant-matmul.md).
template <GgmlType T, int NX>
__attribute__((noinline)) void tile_q16_wide(const __m256i* wide, const float* scales, const BlockQ16x* xq,
                                             std::int64_t nb, __m256 (&acc_out)[4], __m128 (&macc_out)[4]) {
  static_assert(NX >= 1 && NX <= 4);
  constexpr bool has_m = T != GgmlType::q8_0;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, m01 = a0, m23 = a0;
  for (std::int64_t b = 0; b < nb; ++b) {
    const __m256i* wb = wide + b * kWideBlockVectors;
    const float* sb = scales + b * kWideBlockFloats;
    const __m256 d8 = _mm256_loadu_ps(sb);
    auto row = [&](std::int64_t x, __m256& acc) { acc = accumulate_block(wb, xq[x * nb + b], d8, acc); };
    auto constant_terms = [&](std::int64_t x, __m256& macc) {  // rows x and x + 1 (if any)
      const __m128 s0 = _mm_broadcast_ss(&xq[x * nb + b].s);
      const __m128 s1 = x + 1 < NX ? _mm_broadcast_ss(&xq[(x + 1) * nb + b].s) : _mm_setzero_ps();
      macc =
          _mm256_fmadd_ps(_mm256_broadcast_ps(reinterpret_cast<const __m128*>(sb + 8)), _mm256_set_m128(s1, s0), macc);
    };
    row(0, a0);
    if constexpr (NX > 1) row(1, a1);
    if constexpr (NX > 2) row(2, a2);
    if constexpr (NX > 3) row(3, a3);
    if constexpr (has_m) {
      constant_terms(0, m01);
      if constexpr (NX > 2) constant_terms(2, m23);
    }
  }
  acc_out[0] = a0;
  acc_out[1] = a1;
  acc_out[2] = a2;
  acc_out[3] = a3;
  macc_out[0] = _mm256_castps256_ps128(m01);
  macc_out[1] = _mm256_extractf128_ps(m01, 1);
  macc_out[2] = _mm256_castps256_ps128(m23);
  macc_out[3] = _mm256_extractf128_ps(m23, 1);
}

// Several activation rows (batched decode): a 4-row group's blocks are widened once into a
// per-thread buffer (L1-sized: 4 rows x k int16), then swept by tiles of 4 activation
// rows. Each output takes exactly tile_q16_row's operations (the same exact integer halves, the
// same converts, FMAs and final adds), so a row's result is the same alone or batched, whatever
// tile it lands in.
template <GgmlType T, WeightLayout L>
void gemm_q16_rows(const std::byte* w, std::size_t row_bytes, std::int64_t r0, const BlockQ16x* xq, std::int64_t nx,
                   std::int64_t nb, float* y, std::int64_t ldy) {
  thread_local std::vector<std::int16_t> wide;  // 16 int16 per vector
  thread_local std::vector<float> scales;
  wide.resize(static_cast<std::size_t>(nb * kWideBlockVectors * 16));
  scales.resize(static_cast<std::size_t>(nb * kWideBlockFloats));
  // Plain pointers: thread_local objects in a shared library cost a __tls_get_addr per access.
  __m256i* const wide_p = reinterpret_cast<__m256i*>(wide.data());
  float* const scales_p = scales.data();
  for (std::int64_t b = 0; b < nb; ++b) {
    alignas(16) float d[4], m[4] = {};
    load_scales<T, L, 4>(w, row_bytes, r0, b, d, m);
    float* sb = scales_p + b * kWideBlockFloats;
    _mm256_storeu_ps(sb, pair_lanes(_mm_load_ps(d)));
    _mm_storeu_ps(sb + 8, _mm_load_ps(m));
    for (int r = 0; r < 4; ++r) {
      __m256i lo, hi;
      widen_block<T>(quants<T, L, 4>(w, row_bytes, r0, r, b), lo, hi);
      _mm256_storeu_si256(wide_p + b * kWideBlockVectors + 2 * r, lo);
      _mm256_storeu_si256(wide_p + b * kWideBlockVectors + 2 * r + 1, hi);
    }
  }
  for (std::int64_t x = 0; x < nx; x += 4) {
    const BlockQ16x* xt = xq + x * nb;
    const std::int64_t n = std::min<std::int64_t>(4, nx - x);
    __m256 acc[4];
    __m128 macc[4];
    switch (n) {
      case 4: tile_q16_wide<T, 4>(wide_p, scales_p, xt, nb, acc, macc); break;
      case 3: tile_q16_wide<T, 3>(wide_p, scales_p, xt, nb, acc, macc); break;
      case 2: tile_q16_wide<T, 2>(wide_p, scales_p, xt, nb, acc, macc); break;
      default: tile_q16_wide<T, 1>(wide_p, scales_p, xt, nb, acc, macc); break;
    }
    for (std::int64_t i = 0; i < n; ++i) store_row_sums(acc[i], macc[i], 4, y + (x + i) * ldy);
  }
}

// --- Batched Q16, rows as lanes ---
//
// gemm_q16_rows keeps a weight row's 32 products in one register and folds four rows' halves
// with shuffles, per block and activation row: the fold, convert and multiply cost as much as the
// products. Here, as in the AVX-512 kernel, the lanes are 8 weight rows: lane r of pair vector p
// holds row r's elements (2p, 2p + 1) as two int16, and madd against the activation's matching
// pair (one int32 broadcast from the block, which already stores its quants in that order) adds
// both products into the row's lane. Pairs with p even are elements j mod 4 in {0, 1} (E), odd p
// the others (O), so E and O come out per row with no fold, exactly, and the float steps per lane
// are tile_q16_row's: acc_e = fma(float(E), d_w * d_x, acc_e), acc_o likewise, macc = fma(m_w,
// s_x, macc) in block order, y = (acc_e + acc_o) + macc.
constexpr std::int64_t kLanesBlockVectors = 32;  // pair vectors per block of a 16-row group

// 8 rows x 8 words (16-bit) in place: in[r] word j -> in[j] word r.
inline void transpose_words8x8(__m128i (&m)[8]) {
  __m128i a[8], b[8];
  for (int i = 0; i < 4; ++i) {
    a[2 * i] = _mm_unpacklo_epi16(m[2 * i], m[2 * i + 1]);
    a[2 * i + 1] = _mm_unpackhi_epi16(m[2 * i], m[2 * i + 1]);
  }
  // a[2i]: words 0..3 of rows 2i, 2i+1 interleaved; a[2i+1]: words 4..7.
  for (int h = 0; h < 2; ++h) {                                     // h = 0: rows 0..3, h = 1: rows 4..7
    b[4 * h + 0] = _mm_unpacklo_epi32(a[4 * h + 0], a[4 * h + 2]);  // words 0, 1
    b[4 * h + 1] = _mm_unpackhi_epi32(a[4 * h + 0], a[4 * h + 2]);  // words 2, 3
    b[4 * h + 2] = _mm_unpacklo_epi32(a[4 * h + 1], a[4 * h + 3]);  // words 4, 5
    b[4 * h + 3] = _mm_unpackhi_epi32(a[4 * h + 1], a[4 * h + 3]);  // words 6, 7
  }
  for (int q = 0; q < 4; ++q) {
    m[2 * q] = _mm_unpacklo_epi64(b[q], b[4 + q]);
    m[2 * q + 1] = _mm_unpackhi_epi64(b[q], b[4 + q]);
  }
}

// Rows r0 .. r0+7 at block b as 16 pair vectors (vector p, lane r: row r's elements 2p, 2p + 1),
// vector p at out[p * stride].
template <GgmlType T, WeightLayout L>
inline void widen_rows8(const std::byte* w, std::size_t row_bytes, std::int64_t r0, std::int64_t b, __m256i* out,
                        int stride) {
  if constexpr (T == GgmlType::q8_0) {
    for (int half = 0; half < 2; ++half) {  // quant bytes 0..15 (pairs 0..7), 16..31 (pairs 8..15)
      __m128i m[8];
      for (int r = 0; r < 8; ++r) {
        m[r] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(quants<T, L, 8>(w, row_bytes, r0, r, b) + 16 * half));
      }
      transpose_words8x8(m);
      for (int j = 0; j < 8; ++j) _mm256_storeu_si256(out + (8 * half + j) * stride, _mm256_cvtepi8_epi16(m[j]));
    }
  } else {
    // Byte j holds element j (low nibble) and j + 16 (high): word j of a row is pair j in its low
    // nibbles and pair j + 8 in its high ones.
    __m128i m[8];
    for (int r = 0; r < 8; ++r) {
      m[r] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(quants<T, L, 8>(w, row_bytes, r0, r, b)));
    }
    transpose_words8x8(m);
    for (int j = 0; j < 8; ++j) {
      const __m256i bytes = _mm256_cvtepu8_epi16(m[j]);
      _mm256_storeu_si256(out + j * stride, _mm256_and_si256(bytes, _mm256_set1_epi16(0x0f)));
      _mm256_storeu_si256(out + (8 + j) * stride, _mm256_srli_epi16(bytes, 4));
    }
  }
}

// One parity pass of one block of a 16-row widened group (per pair p: rows 0..7, then 8..15)
// against 4 activation rows: a[g][x] = sum over pairs p = parity, parity + 2, .., 14 + parity of
// madd(weights[p][g], broadcast pair p of x). In assembly because GCC 12, given this loop in
// intrinsics, hoists every product ahead of its add and spills them all (or, kept from that,
// shuffles the sums between registers). One pass at a time holds 8 sums, 2 weight vectors, a
// broadcast and a product (12 registers), and loads 6 vectors per 8 products.
inline void parity_pass_16x4(const __m256i* wb, const float* x0, const float* x1, const float* x2, const float* x3,
                             __m256i (&a)[2][4]) {
  __m256i w0, w1, bc, t;
  long count = 8;
  asm("vpxor %[a00], %[a00], %[a00]\n\t"
      "vpxor %[a01], %[a01], %[a01]\n\t"
      "vpxor %[a02], %[a02], %[a02]\n\t"
      "vpxor %[a03], %[a03], %[a03]\n\t"
      "vpxor %[a10], %[a10], %[a10]\n\t"
      "vpxor %[a11], %[a11], %[a11]\n\t"
      "vpxor %[a12], %[a12], %[a12]\n\t"
      "vpxor %[a13], %[a13], %[a13]\n\t"
      "1:\n\t"
      "vmovdqu (%[w]), %[w0]\n\t"
      "vmovdqu 32(%[w]), %[w1]\n\t"
      "vbroadcastss (%[x0]), %[bc]\n\t"
      "vpmaddwd %[bc], %[w0], %[t]\n\t"
      "vpaddd %[t], %[a00], %[a00]\n\t"
      "vpmaddwd %[bc], %[w1], %[t]\n\t"
      "vpaddd %[t], %[a10], %[a10]\n\t"
      "vbroadcastss (%[x1]), %[bc]\n\t"
      "vpmaddwd %[bc], %[w0], %[t]\n\t"
      "vpaddd %[t], %[a01], %[a01]\n\t"
      "vpmaddwd %[bc], %[w1], %[t]\n\t"
      "vpaddd %[t], %[a11], %[a11]\n\t"
      "vbroadcastss (%[x2]), %[bc]\n\t"
      "vpmaddwd %[bc], %[w0], %[t]\n\t"
      "vpaddd %[t], %[a02], %[a02]\n\t"
      "vpmaddwd %[bc], %[w1], %[t]\n\t"
      "vpaddd %[t], %[a12], %[a12]\n\t"
      "vbroadcastss (%[x3]), %[bc]\n\t"
      "vpmaddwd %[bc], %[w0], %[t]\n\t"
      "vpaddd %[t], %[a03], %[a03]\n\t"
      "vpmaddwd %[bc], %[w1], %[t]\n\t"
      "vpaddd %[t], %[a13], %[a13]\n\t"
      "add $128, %[w]\n\t"
      "add $8, %[x0]\n\t"
      "add $8, %[x1]\n\t"
      "add $8, %[x2]\n\t"
      "add $8, %[x3]\n\t"
      "dec %[n]\n\t"
      "jnz 1b"
      : [a00] "=&x"(a[0][0]), [a01] "=&x"(a[0][1]), [a02] "=&x"(a[0][2]), [a03] "=&x"(a[0][3]), [a10] "=&x"(a[1][0]),
        [a11] "=&x"(a[1][1]), [a12] "=&x"(a[1][2]), [a13] "=&x"(a[1][3]), [w0] "=&x"(w0), [w1] "=&x"(w1),
        [bc] "=&x"(bc), [t] "=&x"(t), [w] "+r"(wb), [x0] "+r"(x0), [x1] "+r"(x1), [x2] "+r"(x2), [x3] "+r"(x3),
        [n] "+r"(count)
      :
      : "cc", "memory");
}

// 4 activation rows (xrow[x]: a row's nb blocks; a tail tile repeats its last row) against a
// widened 16-row group: y[x * ldy + r] for x < n_out, r < 16. Per block, the even pairs' pass,
// its sums into acc_e; the odd pairs' pass into acc_o; the constant terms into macc: the float
// steps of tile_q16_row, lane by lane.
template <GgmlType T>
__attribute__((noinline)) void tile_q16_lanes16x4(const __m256i* wide, const float* dw, const float* mw,
                                                  const BlockQ16x* const (&xrow)[4], std::int64_t nb, float* y,
                                                  std::int64_t ldy, int n_out) {
  constexpr bool has_m = T != GgmlType::q8_0;
  // Touched once per block, the float accumulators stay in memory (the asm at the end of the
  // block loop), so the passes have the registers.
  __m256 acc_e[2][4], acc_o[2][4], macc[2][4];
  for (int g = 0; g < 2; ++g) {
    for (int x = 0; x < 4; ++x) acc_e[g][x] = acc_o[g][x] = macc[g][x] = _mm256_setzero_ps();
  }
  for (std::int64_t b = 0; b < nb; ++b) {
    const __m256i* wb = wide + b * kLanesBlockVectors;
    const float* xp[4];
    for (int x = 0; x < 4; ++x) xp[x] = reinterpret_cast<const float*>(xrow[x][b].qs);
    __m256 s[2][4];
    for (int g = 0; g < 2; ++g) {
      const __m256 d8 = _mm256_loadu_ps(dw + (b * 2 + g) * 8);
      for (int x = 0; x < 4; ++x) s[g][x] = _mm256_mul_ps(d8, _mm256_broadcast_ss(&xrow[x][b].d));
    }
    for (int parity = 0; parity < 2; ++parity) {
      __m256i a[2][4];
      parity_pass_16x4(wb + 2 * parity, xp[0] + parity, xp[1] + parity, xp[2] + parity, xp[3] + parity, a);
      __m256(&acc)[2][4] = parity == 0 ? acc_e : acc_o;
      for (int g = 0; g < 2; ++g) {
        for (int x = 0; x < 4; ++x) acc[g][x] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[g][x]), s[g][x], acc[g][x]);
      }
    }
    if constexpr (has_m) {
      for (int g = 0; g < 2; ++g) {
        const __m256 m8 = _mm256_loadu_ps(mw + (b * 2 + g) * 8);
        for (int x = 0; x < 4; ++x) macc[g][x] = _mm256_fmadd_ps(m8, _mm256_broadcast_ss(&xrow[x][b].s), macc[g][x]);
      }
    }
    asm volatile("" : : "m"(acc_e), "m"(acc_o), "m"(macc) : "memory");
  }
  for (int x = 0; x < n_out; ++x) {
    for (int g = 0; g < 2; ++g) {
      _mm256_storeu_ps(y + x * ldy + 8 * g, _mm256_add_ps(_mm256_add_ps(acc_e[g][x], acc_o[g][x]), macc[g][x]));
    }
  }
}

// Rows r0 .. r0 + 15 against nx >= 2 activation rows: the group widened once into a per-thread
// buffer (per block: for each pair p, rows 0..7 then 8..15), then swept by tiles of 4 activation
// rows. A tail of 2 or 3 runs as a padded tile (its last row again, not stored); a tail of 1 goes
// to tile_q16_row, where padding would waste 3/4 of a tile.
template <GgmlType T, WeightLayout L>
void gemm_q16_lanes(const std::byte* w, std::size_t row_bytes, std::int64_t r0, const BlockQ16x* xq, std::int64_t nx,
                    std::int64_t nb, float* y, std::int64_t ldy) {
  thread_local std::vector<std::int16_t> wide;  // 16 int16 per vector
  thread_local std::vector<float> scales;       // d_w (16 per block), then m_w (16 per block)
  wide.resize(static_cast<std::size_t>(nb * kLanesBlockVectors * 16));
  scales.resize(static_cast<std::size_t>(nb * 32));
  // Plain pointers: thread_local objects in a shared library cost a __tls_get_addr per access.
  __m256i* const wide_p = reinterpret_cast<__m256i*>(wide.data());
  float* const dw = scales.data();
  float* const mw = dw + nb * 16;
  // While one group is widened, the next group's bytes are asked for, a block's worth at a time
  // (in rows4 the 16 rows are one contiguous run): decode reads each weight once per step, from
  // DRAM, and the widening otherwise waits on each load (bench/results/quant-matmul.md).
  const std::byte* next = w + static_cast<std::size_t>(r0 + 16) * row_bytes;
  constexpr std::size_t kGroupBlockBytes = 16 * block_geom(T).bytes;
  for (std::int64_t b = 0; b < nb; ++b) {
    if constexpr (L == WeightLayout::rows4) {
      prefetch_lines<kPrefetchToL1>(next + static_cast<std::size_t>(b) * kGroupBlockBytes, kGroupBlockBytes);
    }
    for (int g = 0; g < 2; ++g) {
      load_scales<T, L, 8>(w, row_bytes, r0 + 8 * g, b, dw + (b * 2 + g) * 8, mw + (b * 2 + g) * 8);
      widen_rows8<T, L>(w, row_bytes, r0 + 8 * g, b, wide_p + b * kLanesBlockVectors + g, 2);
    }
  }
  for (std::int64_t x = 0; x < nx; x += 4) {
    const int n = static_cast<int>(std::min<std::int64_t>(4, nx - x));
    if (n == 1) {
      for (int r = 0; r < 16; r += 4) tile_q16_row<T, L, 4>(w, row_bytes, r0 + r, xq + x * nb, nb, y + x * ldy + r);
      break;
    }
    const BlockQ16x* xrow[4];
    for (int i = 0; i < 4; ++i) xrow[i] = xq + (x + std::min(i, n - 1)) * nb;
    tile_q16_lanes16x4<T>(wide_p, dw, mw, xrow, nb, y + x * ldy, ldy, n);
  }
}

// Which batched tile runs is a rule on the shape alone, and every path gives the same bits:
// - one activation row (decode): tile_q16_row, 4 weight rows at a time;
// - 2 or 3 activation rows: gemm_q16_rows (each 4-row group widened once, 4 rows folded per
//   register), since the rows-as-lanes widening is paid back only by a full tile of 4 activation
//   rows;
// - 4 or more: gemm_q16_lanes on each whole group of 16 weight rows, then gemm_q16_rows on the
//   4-row groups left;
// - and tile_q16_row for the last nw % 4 rows.
// Tasks start at whole 16-row groups for batches (matmul.cpp), so lanes cover nearly every row.
template <GgmlType T, WeightLayout L>
void gemm_q16_typed(const std::byte* w, std::size_t row_bytes, std::int64_t nw, const BlockQ16x* xq, std::int64_t nx,
                    std::int64_t k, float* y, std::int64_t ldy) {
  const std::int64_t nb = k / kQK;
  std::int64_t r = 0;
  if (nx >= 2) {
    if (nx >= kQ16LanesMinBatch) {
      // A task's first group has no predecessor to ask for it (gemm_q16_lanes asks for each next
      // group while widening this one); the whole group at once, into L2, lets its misses overlap.
      if (L == WeightLayout::rows4 && nw >= 16) prefetch_lines<kPrefetchToL2>(w, 16 * row_bytes);
      for (; r + 16 <= nw; r += 16) gemm_q16_lanes<T, L>(w, row_bytes, r, xq, nx, nb, y + r, ldy);
    }
    for (; r + 4 <= nw; r += 4) gemm_q16_rows<T, L>(w, row_bytes, r, xq, nx, nb, y + r, ldy);
  }
  for (std::int64_t x = 0; x < nx; ++x) {
    const BlockQ16x* xr = xq + x * nb;
    float* yx = y + x * ldy;
    std::int64_t rr = r;
    for (; rr + 4 <= nw; rr += 4) tile_q16_row<T, L, 4>(w, row_bytes, rr, xr, nb, yx + rr);
    switch (nw - rr) {
      case 3: tile_q16_row<T, L, 3>(w, row_bytes, rr, xr, nb, yx + rr); break;
      case 2: tile_q16_row<T, L, 2>(w, row_bytes, rr, xr, nb, yx + rr); break;
      case 1: tile_q16_row<T, L, 1>(w, row_bytes, rr, xr, nb, yx + rr); break;
      default: break;
    }
  }
}

// --- float weights (gemm_f) ---

template <GgmlType T>
inline __m256 load8(const std::byte* p) {
  if constexpr (T == GgmlType::f32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  } else if constexpr (T == GgmlType::f16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
  }
}

template <GgmlType T>
inline float load1(const std::byte* p) {
  if constexpr (T == GgmlType::f32) {
    float v;
    std::memcpy(&v, p, 4);
    return v;
  } else if constexpr (T == GgmlType::f16) {
    return load_half(p);
  } else {
    std::uint16_t h;
    std::memcpy(&h, p, 2);
    const std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
    float v;
    std::memcpy(&v, &u, 4);
    return v;
  }
}

template <GgmlType T, int NW, int NX>
void tile_f(const std::byte* w, std::size_t row_bytes, const float* x, std::int64_t ldx, std::int64_t k, float* y,
            std::int64_t ldy) {
  constexpr std::size_t esz = T == GgmlType::f32 ? 4 : 2;
  __m256 acc[NW][NX];
  for (int r = 0; r < NW; ++r) {
    for (int c = 0; c < NX; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  std::int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    __m256 wv[NW];
    for (int r = 0; r < NW; ++r)
      wv[r] = load8<T>(w + static_cast<std::size_t>(r) * row_bytes + static_cast<std::size_t>(i) * esz);
    for (int c = 0; c < NX; ++c) {
      const __m256 xv = _mm256_loadu_ps(x + static_cast<std::int64_t>(c) * ldx + i);
      for (int r = 0; r < NW; ++r) acc[r][c] = _mm256_fmadd_ps(wv[r], xv, acc[r][c]);
    }
  }
  for (int c = 0; c < NX; ++c) {
    for (int r = 0; r < NW; ++r) {
      float s = canonical_hsum(acc[r][c]);
      for (std::int64_t j = i; j < k; ++j) {
        s += load1<T>(w + static_cast<std::size_t>(r) * row_bytes + static_cast<std::size_t>(j) * esz) *
             x[static_cast<std::int64_t>(c) * ldx + j];
      }
      y[static_cast<std::int64_t>(c) * ldy + r] = s;
    }
  }
}

template <GgmlType T>
void gemm_f_typed(const std::byte* w, std::size_t row_bytes, std::int64_t nw, const float* x, std::int64_t ldx,
                  std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy) {
  for (std::int64_t c = 0; c < nx;) {
    const std::int64_t xn = nx - c >= 4 ? 4 : nx - c;
    const float* xt = x + c * ldx;
    float* yt = y + c * ldy;
    std::int64_t r = 0;
    for (; r + 2 <= nw; r += 2) {
      const std::byte* wt = w + static_cast<std::size_t>(r) * row_bytes;
      switch (xn) {
        case 4: tile_f<T, 2, 4>(wt, row_bytes, xt, ldx, k, yt + r, ldy); break;
        case 3: tile_f<T, 2, 3>(wt, row_bytes, xt, ldx, k, yt + r, ldy); break;
        case 2: tile_f<T, 2, 2>(wt, row_bytes, xt, ldx, k, yt + r, ldy); break;
        default: tile_f<T, 2, 1>(wt, row_bytes, xt, ldx, k, yt + r, ldy); break;
      }
    }
    for (; r < nw; ++r) {
      const std::byte* wt = w + static_cast<std::size_t>(r) * row_bytes;
      switch (xn) {
        case 4: tile_f<T, 1, 4>(wt, row_bytes, xt, ldx, k, yt + r, ldy); break;
        case 3: tile_f<T, 1, 3>(wt, row_bytes, xt, ldx, k, yt + r, ldy); break;
        case 2: tile_f<T, 1, 2>(wt, row_bytes, xt, ldx, k, yt + r, ldy); break;
        default: tile_f<T, 1, 1>(wt, row_bytes, xt, ldx, k, yt + r, ldy); break;
      }
    }
    c += xn;
  }
}

// --- exact activations (gemm_qf): weights dequantised to f32, f32 FMAs in the canonical order ---

// The 32 weights of one block (quants at qs, scale d, min m) as 4 x 8 floats, bit-identical to
// dequantize_row_scalar: q*d is exact in f32 (|q| < 2^8, d an f16), so fma(q, d, m) rounds
// q*d + m once, like the scalar q*d + m (Q4_0: m = -8d, and (q-8)*d is exact).
template <GgmlType T>
inline void expand_block(const std::byte* qs, float dv, float mv, __m256 (&w)[4]) {
  const __m256 d = _mm256_set1_ps(dv);
  if constexpr (T == GgmlType::q8_0) {
    for (int i = 0; i < 4; ++i) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * i));
      w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
    }
  } else {
    const __m256 m = _mm256_set1_ps(mv);
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs)));      // bytes 0..7
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8)));  // bytes 8..15
    const __m256i lo = _mm256_set1_epi32(0x0f);
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(a, lo)), d, m);  // elements 0..7
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, lo)), d, m);  // 8..15
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), d, m);  // 16..23
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), d, m);  // 24..31
  }
}

// Small batches: NW weight rows (from row r0) x NX activation rows, weights expanded in registers
// block by block.
template <GgmlType T, WeightLayout L, int NW, int NX>
void tile_qf(const std::byte* w, std::size_t row_bytes, std::int64_t r0, const float* x, std::int64_t ldx,
             std::int64_t nb, float* y, std::int64_t ldy) {
  __m256 acc[NW][NX];
  for (int r = 0; r < NW; ++r) {
    for (int c = 0; c < NX; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  for (std::int64_t b = 0; b < nb; ++b) {
    alignas(16) float d[NW < 4 ? 4 : NW], m[NW < 4 ? 4 : NW];
    load_scales<T, L, NW>(w, row_bytes, r0, b, d, m);
    for (int r = 0; r < NW; ++r) {
      __m256 wv[4];
      expand_block<T>(quants<T, L, NW>(w, row_bytes, r0, r, b), d[r], m[r], wv);
      for (int c = 0; c < NX; ++c) {
        const float* xb = x + static_cast<std::int64_t>(c) * ldx + b * kQK;
        for (int i = 0; i < 4; ++i) acc[r][c] = _mm256_fmadd_ps(wv[i], _mm256_loadu_ps(xb + 8 * i), acc[r][c]);
      }
    }
  }
  for (int c = 0; c < NX; ++c) {
    for (int r = 0; r < NW; ++r) y[static_cast<std::int64_t>(c) * ldy + r] = canonical_hsum(acc[r][c]);
  }
}

template <int NW, int NX>
void tile_ff(const float* w, std::int64_t k, const float* x, std::int64_t ldx, float* y, std::int64_t ldy) {
  __m256 acc[NW][NX];
  for (int r = 0; r < NW; ++r) {
    for (int c = 0; c < NX; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  for (std::int64_t i = 0; i < k; i += 8) {
    __m256 wv[NW];
    for (int r = 0; r < NW; ++r) wv[r] = _mm256_loadu_ps(w + static_cast<std::int64_t>(r) * k + i);
    for (int c = 0; c < NX; ++c) {
      const __m256 xv = _mm256_loadu_ps(x + static_cast<std::int64_t>(c) * ldx + i);
      for (int r = 0; r < NW; ++r) acc[r][c] = _mm256_fmadd_ps(wv[r], xv, acc[r][c]);
    }
  }
  for (int c = 0; c < NX; ++c) {
    for (int r = 0; r < NW; ++r) y[static_cast<std::int64_t>(c) * ldy + r] = canonical_hsum(acc[r][c]);
  }
}

template <int NW>
void tile_ff_cols(const float* w, std::int64_t k, const float* x, std::int64_t ldx, std::int64_t nx, float* y,
                  std::int64_t ldy) {
  constexpr int kCols = 4;
  std::int64_t c = 0;
  for (; c + kCols <= nx; c += kCols) tile_ff<NW, kCols>(w, k, x + c * ldx, ldx, y + c * ldy, ldy);
  switch (nx - c) {
    case 3: tile_ff<NW, 3>(w, k, x + c * ldx, ldx, y + c * ldy, ldy); break;
    case 2: tile_ff<NW, 2>(w, k, x + c * ldx, ldx, y + c * ldy, ldy); break;
    case 1: tile_ff<NW, 1>(w, k, x + c * ldx, ldx, y + c * ldy, ldy); break;
    default: break;
  }
}

}  // namespace

void gemm_f32_tile_avx2(const float* w, std::int64_t nr, std::int64_t k, const float* x, std::int64_t ldx,
                        std::int64_t nx, float* y, std::int64_t ldy) {
  std::int64_t r = 0;
  for (; r + 3 <= nr; r += 3) tile_ff_cols<3>(w + r * k, k, x, ldx, nx, y + r, ldy);
  if (nr - r == 2) tile_ff_cols<2>(w + r * k, k, x, ldx, nx, y + r, ldy);
  if (nr - r == 1) tile_ff_cols<1>(w + r * k, k, x, ldx, nx, y + r, ldy);
}

namespace {

template <GgmlType T, WeightLayout L>
void gemm_qf_typed(const std::byte* w, std::size_t row_bytes, std::int64_t nw, const float* x, std::int64_t ldx,
                   std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy) {
  constexpr BlockGeom g = block_geom(T);
  const std::int64_t nb = k / kQK;
  if (nx <= 2) {  // decode: fused, memory bound
    // 4 rows per tile: with 8, the accumulators and expanded blocks spill
    // (bench/results/quant-matmul.md).
    std::int64_t r = 0;
    for (; r + 4 <= nw; r += 4) {
      if (nx == 1) {
        tile_qf<T, L, 4, 1>(w, row_bytes, r, x, ldx, nb, y + r, ldy);
      } else {
        tile_qf<T, L, 4, 2>(w, row_bytes, r, x, ldx, nb, y + r, ldy);
      }
    }
    for (; r < nw; ++r) {
      if (nx == 1) {
        tile_qf<T, L, 1, 1>(w, row_bytes, r, x, ldx, nb, y + r, ldy);
      } else {
        tile_qf<T, L, 1, 2>(w, row_bytes, r, x, ldx, nb, y + r, ldy);
      }
    }
    return;
  }
  // Prefill: dequantise a tile of weight rows (~96 KiB of f32, a multiple of 3 rows) once, then
  // sweep the batch with the 3 x 4 micro-kernel. The tile size only changes which rows are
  // computed together, never the operations per output.
  std::int64_t tile_rows = (96 * 1024) / (k * static_cast<std::int64_t>(sizeof(float)));
  tile_rows = tile_rows < 3 ? 3 : (tile_rows > 48 ? 48 : tile_rows / 3 * 3);
  const std::int64_t kRowTile = tile_rows;
  thread_local std::vector<float> wbuf;
  wbuf.resize(static_cast<std::size_t>(kRowTile * k));
  for (std::int64_t r0 = 0; r0 < nw; r0 += kRowTile) {
    const std::int64_t nr = nw - r0 < kRowTile ? nw - r0 : kRowTile;
    for (std::int64_t r = 0; r < nr; ++r) {
      float* dst = wbuf.data() + r * k;
      for (std::int64_t b = 0; b < nb; ++b) {
        float d, m;
        load_scales<T, L, 1>(w, row_bytes, r0 + r, b, &d, &m);
        __m256 wv[4];
        expand_block<T>(block_ptr(g, L, w, row_bytes, r0 + r, b).qs, d, m, wv);
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(dst + b * kQK + 8 * i, wv[i]);
      }
    }
    gemm_f32_tile_avx2(wbuf.data(), nr, k, x, ldx, nx, y + r0, ldy);
  }
}

}  // namespace

namespace {

// One block of 32 floats as integers in [-qmax, qmax]: d = max|x| / qmax, q = round-to-nearest-even
// (x * (qmax / max|x|)), the four 8-lane groups as int32 (elements 0..7, 8..15, ...) and sum(q),
// exactly as the scalar quantize_row_q*x_scalar.
struct QuantBlock {
  float d;
  int sum;
  __m256i q[4];
};
inline QuantBlock quantize_block(const float* xb, float qmax) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 v[4] = {_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8), _mm256_loadu_ps(xb + 16),
                       _mm256_loadu_ps(xb + 24)};
  const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  QuantBlock out;
  out.d = amax / qmax;
  const __m256 vid = _mm256_set1_ps(out.d != 0.0f ? qmax / amax : 0.0f);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int i = 0; i < 4; ++i) out.q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], vid), kRound));
  const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(out.q[0], out.q[1]), _mm256_add_epi32(out.q[2], out.q[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
  out.sum = _mm_cvtsi128_si32(s4);
  return out;
}

}  // namespace

void quantize_row_q8x_avx2(const float* x, BlockQ8x* out, std::int64_t k) {
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (std::int64_t b = 0; b < k / kQK; ++b) {
    const QuantBlock qb = quantize_block(x + b * kQK, 127.0f);
    const __m256i p01 = _mm256_packs_epi32(qb.q[0], qb.q[1]);
    const __m256i p23 = _mm256_packs_epi32(qb.q[2], qb.q[3]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[b].qs),
                        _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), perm));
    out[b].d = qb.d;
    out[b].s = qb.d * static_cast<float>(qb.sum);
  }
}

void quantize_row_q16x_avx2(const float* x, BlockQ16x* out, std::int64_t k) {
  for (std::int64_t b = 0; b < k / kQK; ++b) {
    const QuantBlock qb = quantize_block(x + b * kQK, 32767.0f);
    // packs works per 128-bit lane: [0..3, 8..11, 4..7, 12..15]; the permute restores the order.
    const __m256i p01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(qb.q[0], qb.q[1]), _MM_SHUFFLE(3, 1, 2, 0));
    const __m256i p23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(qb.q[2], qb.q[3]), _MM_SHUFFLE(3, 1, 2, 0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[b].qs), p01);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[b].qs + 16), p23);
    out[b].d = qb.d;
    out[b].s = qb.d * static_cast<float>(qb.sum);
  }
}

namespace {

template <template <GgmlType, WeightLayout> class K, typename... Args>
void by_type_and_layout(GgmlType type, WeightLayout layout, Args... args) {
  const bool r4 = layout == WeightLayout::rows4;
  switch (type) {
    case GgmlType::q8_0:
      return r4 ? K<GgmlType::q8_0, WeightLayout::rows4>::run(args...)
                : K<GgmlType::q8_0, WeightLayout::rows>::run(args...);
    case GgmlType::q4_0:
      return r4 ? K<GgmlType::q4_0, WeightLayout::rows4>::run(args...)
                : K<GgmlType::q4_0, WeightLayout::rows>::run(args...);
    case GgmlType::q4_1:
      return r4 ? K<GgmlType::q4_1, WeightLayout::rows4>::run(args...)
                : K<GgmlType::q4_1, WeightLayout::rows>::run(args...);
    default: return;
  }
}

template <GgmlType T, WeightLayout L>
struct GemmQ {
  template <typename... Args>
  static void run(Args... args) {
    gemm_q_typed<T, L>(args...);
  }
};
template <GgmlType T, WeightLayout L>
struct GemmQ16 {
  template <typename... Args>
  static void run(Args... args) {
    gemm_q16_typed<T, L>(args...);
  }
};
template <GgmlType T, WeightLayout L>
struct GemmQf {
  template <typename... Args>
  static void run(Args... args) {
    gemm_qf_typed<T, L>(args...);
  }
};

}  // namespace

void gemm_q_avx2(GgmlType type, WeightLayout layout, const std::byte* w, std::size_t row_bytes, std::int64_t nw,
                 const BlockQ8x* xq, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy) {
  by_type_and_layout<GemmQ>(type, layout, w, row_bytes, nw, xq, nx, k, y, ldy);
}

void gemm_q16_avx2(GgmlType type, WeightLayout layout, const std::byte* w, std::size_t row_bytes, std::int64_t nw,
                   const BlockQ16x* xq, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy) {
  by_type_and_layout<GemmQ16>(type, layout, w, row_bytes, nw, xq, nx, k, y, ldy);
}

void gemm_f_avx2(GgmlType type, const std::byte* w, std::size_t row_bytes, std::int64_t nw, const float* x,
                 std::int64_t ldx, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy) {
  switch (type) {
    case GgmlType::f32: gemm_f_typed<GgmlType::f32>(w, row_bytes, nw, x, ldx, nx, k, y, ldy); return;
    case GgmlType::f16: gemm_f_typed<GgmlType::f16>(w, row_bytes, nw, x, ldx, nx, k, y, ldy); return;
    case GgmlType::bf16: gemm_f_typed<GgmlType::bf16>(w, row_bytes, nw, x, ldx, nx, k, y, ldy); return;
    default: return;
  }
}

void gemm_qf_avx2(GgmlType type, WeightLayout layout, const std::byte* w, std::size_t row_bytes, std::int64_t nw,
                  const float* x, std::int64_t ldx, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy) {
  by_type_and_layout<GemmQf>(type, layout, w, row_bytes, nw, x, ldx, nx, k, y, ldy);
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else  // not x86: the scalar kernels are used

bool avx2_available() noexcept { return false; }
void quantize_row_q8x_avx2(const float* x, BlockQ8x* out, std::int64_t k) { quantize_row_q8x_scalar(x, out, k); }
void gemm_q_avx2(GgmlType type, WeightLayout layout, const std::byte* w, std::size_t row_bytes, std::int64_t nw,
                 const BlockQ8x* xq, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy) {
  gemm_q_scalar(type, layout, w, row_bytes, nw, xq, nx, k, y, ldy);
}
void quantize_row_q16x_avx2(const float* x, BlockQ16x* out, std::int64_t k) { quantize_row_q16x_scalar(x, out, k); }
void gemm_q16_avx2(GgmlType type, WeightLayout layout, const std::byte* w, std::size_t row_bytes, std::int64_t nw,
                   const BlockQ16x* xq, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy) {
  gemm_q16_scalar(type, layout, w, row_bytes, nw, xq, nx, k, y, ldy);
}
void gemm_f_avx2(GgmlType type, const std::byte* w, std::size_t row_bytes, std::int64_t nw, const float* x,
                 std::int64_t ldx, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy) {
  gemm_f_scalar(type, w, row_bytes, nw, x, ldx, nx, k, y, ldy);
}
void gemm_qf_avx2(GgmlType type, WeightLayout layout, const std::byte* w, std::size_t row_bytes, std::int64_t nw,
                  const float* x, std::int64_t ldx, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy) {
  gemm_qf_scalar(type, layout, w, row_bytes, nw, x, ldx, nx, k, y, ldy);
}

#endif

}  // namespace kallpa::ops::kernels
