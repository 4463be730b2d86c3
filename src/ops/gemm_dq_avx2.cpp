// Products with the block types that have no integer kernel (is_block_dequant: Q5_0, Q5_1, IQ4_NL,
// the K-quants), exact activations: weight blocks are dequantised (dequant_blocks_avx2, the
// reference's bits) into a per-thread f32 buffer and dotted with f32 FMAs in the canonical order
// of quant.h (8 lanes, lane l takes j = l mod 8 in increasing j, then ((a0+a4)+(a2+a6)) +
// ((a1+a5)+(a3+a7))), so the results are gemm_dq_scalar's bit for bit.
//   - one or two activation rows (decode): 4 weight rows at a time, a super-block (256 elements,
//     or 8 blocks of 32) of each dequantised into an L1-resident buffer, then swept with the
//     activations; weights are read once, which is what a decode GEMV is bound by.
//   - larger batches: a tile of rows (~96 KiB of f32, a multiple of 6 rows) is dequantised once
//     and swept by the batch with an f32 micro-kernel: gemm_qf's 3 x 4 one (gemm_f32_tile_avx2),
//     or two rows per 512-bit register (gemm_f32_tile_avx512, gemm_dq_avx512), the same bits.
#include <algorithm>
#include <vector>

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

struct BlockShape {
  DequantBlocksFn dequant;
  std::int64_t elements;  // per block
  std::size_t bytes;      // per block
};

template <int NW, int NX>
void tile_dq(const BlockShape& s, const std::byte* w, std::size_t row_bytes, std::int64_t k, const float* x,
             std::int64_t ldx, float* y, std::int64_t ldy) {
  alignas(32) float buf[NW][kQK_K];
  __m256 acc[NW][NX];
  for (int r = 0; r < NW; ++r) {
    for (int c = 0; c < NX; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  for (std::int64_t e0 = 0; e0 < k; e0 += kQK_K) {
    const std::int64_t n = std::min<std::int64_t>(kQK_K, k - e0);
    const std::size_t at = static_cast<std::size_t>(e0 / s.elements) * s.bytes;
    for (int r = 0; r < NW; ++r) s.dequant(w + static_cast<std::size_t>(r) * row_bytes + at, buf[r], n / s.elements);
    for (std::int64_t i = 0; i < n; i += 8) {
      __m256 wv[NW];
      for (int r = 0; r < NW; ++r) wv[r] = _mm256_load_ps(buf[r] + i);
      for (int c = 0; c < NX; ++c) {
        const __m256 xv = _mm256_loadu_ps(x + static_cast<std::int64_t>(c) * ldx + e0 + i);
        for (int r = 0; r < NW; ++r) acc[r][c] = _mm256_fmadd_ps(wv[r], xv, acc[r][c]);
      }
    }
  }
  for (int c = 0; c < NX; ++c) {
    for (int r = 0; r < NW; ++r) y[static_cast<std::int64_t>(c) * ldy + r] = canonical_hsum(acc[r][c]);
  }
}

template <int NX>
void rows_dq(const BlockShape& s, const std::byte* w, std::size_t row_bytes, std::int64_t nw, const float* x,
             std::int64_t ldx, std::int64_t k, float* y, std::int64_t ldy) {
  std::int64_t r = 0;
  for (; r + 4 <= nw; r += 4)
    tile_dq<4, NX>(s, w + static_cast<std::size_t>(r) * row_bytes, row_bytes, k, x, ldx, y + r, ldy);
  for (; r < nw; ++r) tile_dq<1, NX>(s, w + static_cast<std::size_t>(r) * row_bytes, row_bytes, k, x, ldx, y + r, ldy);
}

using TileFn = void (*)(const float* w, std::int64_t nr, std::int64_t k, const float* x, std::int64_t ldx,
                        std::int64_t nx, float* y, std::int64_t ldy);

void gemm_dq(TileFn tile, GgmlType type, const std::byte* w, std::size_t row_bytes, std::int64_t nw, const float* x,
             std::int64_t ldx, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy) {
  const std::int64_t elements =
      type == GgmlType::q5_0 || type == GgmlType::q5_1 || type == GgmlType::iq4_nl ? kQK : kQK_K;
  const BlockShape s{dequant_blocks_avx2(type), elements, row_bytes / static_cast<std::size_t>(k / elements)};
  if (s.dequant == nullptr || nw <= 0 || nx <= 0) return;
  if (nx == 1) return rows_dq<1>(s, w, row_bytes, nw, x, ldx, k, y, ldy);
  if (nx == 2) return rows_dq<2>(s, w, row_bytes, nw, x, ldx, k, y, ldy);
  std::int64_t tile_rows = (96 * 1024) / (k * static_cast<std::int64_t>(sizeof(float)));
  tile_rows = tile_rows < 6 ? 6 : (tile_rows > 48 ? 48 : tile_rows / 6 * 6);
  thread_local std::vector<float> wbuf;
  wbuf.resize(static_cast<std::size_t>(tile_rows * k));
  for (std::int64_t r0 = 0; r0 < nw; r0 += tile_rows) {
    const std::int64_t nr = std::min(tile_rows, nw - r0);
    for (std::int64_t r = 0; r < nr; ++r) {
      s.dequant(w + static_cast<std::size_t>(r0 + r) * row_bytes, wbuf.data() + r * k, k / elements);
    }
    tile(wbuf.data(), nr, k, x, ldx, nx, y + r0, ldy);
  }
}

}  // namespace

void gemm_dq_avx2(GgmlType type, const std::byte* w, std::size_t row_bytes, std::int64_t nw, const float* x,
                  std::int64_t ldx, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy) {
  gemm_dq(gemm_f32_tile_avx2, type, w, row_bytes, nw, x, ldx, nx, k, y, ldy);
}

void gemm_dq_avx512(GgmlType type, const std::byte* w, std::size_t row_bytes, std::int64_t nw, const float* x,
                    std::int64_t ldx, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy) {
  gemm_dq(gemm_f32_tile_avx512, type, w, row_bytes, nw, x, ldx, nx, k, y, ldy);
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else  // not x86: the scalar kernel

void gemm_dq_avx2(GgmlType type, const std::byte* w, std::size_t row_bytes, std::int64_t nw, const float* x,
                  std::int64_t ldx, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy) {
  gemm_dq_scalar(type, w, row_bytes, nw, x, ldx, nx, k, y, ldy);
}
void gemm_dq_avx512(GgmlType type, const std::byte* w, std::size_t row_bytes, std::int64_t nw, const float* x,
                    std::int64_t ldx, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy) {
  gemm_dq_scalar(type, w, row_bytes, nw, x, ldx, nx, k, y, ldy);
}

#endif

}  // namespace kallpa::ops::kernels
