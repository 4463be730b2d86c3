// Kernels behind matmul / dequantize_row, each in a plain scalar reference and an
// AVX2 (+FMA, F16C) version selected at run time, and for batched Q16 products an AVX-512 VNNI one
// above that. Tests compare them.
//
// Tile kernels compute y[x * ldy + r] = sum_k W[r][k] * X[x][k] for r < nw weight rows and x < nx
// activation rows. Quantised weights (Q8_0/Q4_0/Q4_1) come in either layout of WeightLayout (w
// points at a row that starts a 4-row group in the rows4 layout); float weights (F32/F16/BF16) are
// always row after row, row_bytes apart. For gemm_q_*, X is given as BlockQ8x blocks (k / 32 per
// row, row x starting at xq + x * (k / 32)); for gemm_f_* and gemm_qf_* as floats (ldx apart).
// Every output element is computed with the same sequence of operations whatever nw/nx/tile or
// layout it is part of, so results do not depend on batch size, thread count or repacking.
//
// gemm_qf_* (exact activations) take quantised weights and float X (ldx apart). Each output is the
// canonical f32 sum: weights dequantised exactly as dequantize_row_scalar (q*d, (q-8)*d, q*d + m:
// one rounding at most, so fma(q, d, m) gives the same bits), acc[l] = fma(w[8i+l], x[8i+l], acc[l])
// for i = 0 .. k/8-1 in order (8 lanes), y = ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)). The scalar and
// AVX2 versions (fused in-register for small nx, dequantised tile + f32 micro-kernel for larger nx)
// all follow it, so they agree bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kallpa/ops/ggml_type.h"
#include "kallpa/ops/quant.h"
#include "ops/quant_types.h"

namespace kallpa::ops::kernels {

inline bool is_quantized(GgmlType t) noexcept {
  return t == GgmlType::q8_0 || t == GgmlType::q4_0 || t == GgmlType::q4_1;
}

// Block types without integer kernels or the rows4 layout (Q5_0, Q5_1, IQ4_NL, the K-quants):
// their products (gemm_dq_*) dequantise weight blocks to f32 with the reference dequantisers'
// exact values and run the f32 path's canonical FMA order, whatever the activations option says.
inline bool is_block_dequant(GgmlType t) noexcept {
  switch (t) {
    case GgmlType::q5_0:
    case GgmlType::q5_1:
    case GgmlType::iq4_nl:
    case GgmlType::q2_k:
    case GgmlType::q3_k:
    case GgmlType::q4_k:
    case GgmlType::q5_k:
    case GgmlType::q6_k:
    case GgmlType::q8_k: return true;
    default: return false;
  }
}

// Dequantises nblocks whole blocks at src (ggml's layout, quant_types.h) into dst. The scalar
// ones (dequant_blocks.cpp) are the reference, bit for bit gguf-py's gguf.quants; the AVX2 ones
// (dequant_blocks_avx2.cpp: every type but Q8_K, which keeps the scalar one) give the same bits.
// Both are nullptr for types is_block_dequant rejects.
using DequantBlocksFn = void (*)(const std::byte* src, float* dst, std::int64_t nblocks);
DequantBlocksFn dequant_blocks_scalar(GgmlType type) noexcept;
DequantBlocksFn dequant_blocks_avx2(GgmlType type) noexcept;

// Sizes of one block of a quantised type: all of it, its quants, and whether it has a min (Q4_1).
struct BlockGeom {
  std::size_t bytes;
  std::size_t qs_bytes;
  bool has_m;
};
constexpr BlockGeom block_geom(GgmlType t) noexcept {
  return t == GgmlType::q8_0   ? BlockGeom{sizeof(BlockQ8_0), kQK, false}
         : t == GgmlType::q4_0 ? BlockGeom{sizeof(BlockQ4_0), kQK / 2, false}
                               : BlockGeom{sizeof(BlockQ4_1), kQK / 2, true};
}

// Where block b of row r lives: its scale d (f16), min m (f16, Q4_1 only) and quants.
// rows:  row r at w + r * row_bytes, its blocks one after another (ggml's block structs).
// rows4: rows 4g..4g+3 at w + 4g * row_bytes; for each block b, in 4 * bytes: d[4], then m[4]
//        (Q4_1), then the 4 rows' quants (qs_bytes each, ggml's nibble order).
struct BlockAt {  // byte offsets from w
  std::size_t d, m, qs;
};
constexpr BlockAt block_at(BlockGeom g, WeightLayout layout, std::size_t row_bytes, std::int64_t r,
                           std::int64_t b) noexcept {
  if (layout == WeightLayout::rows) {
    const std::size_t p = static_cast<std::size_t>(r) * row_bytes + static_cast<std::size_t>(b) * g.bytes;
    return {p, p + 2, p + (g.has_m ? 4 : 2)};
  }
  const auto i = static_cast<std::size_t>(r & 3);
  const std::size_t p = static_cast<std::size_t>(r - static_cast<std::int64_t>(i)) * row_bytes +
                        static_cast<std::size_t>(b) * 4 * g.bytes;
  return {p + 2 * i, p + 8 + 2 * i, p + (g.has_m ? 16 : 8) + i * g.qs_bytes};
}
struct BlockPtr {
  const std::byte* d;
  const std::byte* m;
  const std::byte* qs;
};
constexpr BlockPtr block_ptr(BlockGeom g, WeightLayout layout, const std::byte* w, std::size_t row_bytes,
                             std::int64_t r, std::int64_t b) noexcept {
  const BlockAt at = block_at(g, layout, row_bytes, r, b);
  return {w + at.d, w + at.m, w + at.qs};
}

// Asks for every cache line of [p, p + bytes), at the level Locality names (__builtin_prefetch's:
// 3 = into L1, 2 = into L2).
inline constexpr int kPrefetchToL1 = 3;
inline constexpr int kPrefetchToL2 = 2;
template <int Locality>
inline void prefetch_lines(const std::byte* p, std::size_t bytes) {
  for (std::size_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, Locality);
}

// Row r of a quantised matrix as ggml's row bytes (k / 32 blocks) in out.
void load_row_ggml(GgmlType type, WeightLayout layout, const std::byte* w, std::size_t row_bytes, std::int64_t r,
                   std::int64_t k, std::byte* out);

// --- scalar reference (quant_ref.cpp) ---
void dequantize_row_scalar(GgmlType type, const void* src, float* dst, std::int64_t n);
void quantize_row_scalar(GgmlType type, const float* src, void* dst, std::int64_t n);  // weights
void quantize_row_q8x_scalar(const float* x, BlockQ8x* out, std::int64_t k);
void gemm_q_scalar(GgmlType type, WeightLayout layout, const std::byte* w, std::size_t row_bytes, std::int64_t nw,
                   const BlockQ8x* xq, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy);
// Q16 activations (gemm_q16_*): per block b, two exact integer halves E = sum of w_q[j] * x_q[j]
// over j mod 4 in {0, 1} and O over j mod 4 in {2, 3}; with s = d_w * d_x, acc_e = fma(float(E),
// s, acc_e) and acc_o = fma(float(O), s, acc_o) in block order, macc = fma(m_w, s_x, macc) for
// Q4_0 (m = -8 d) / Q4_1, and y = (acc_e + acc_o) + macc. Scalar and AVX2 agree bit for bit.
// gemm_q16_scalar also takes the types of ops/q16_units.h (rows layout), with their w_q, d_w and
// m_w as that header defines them.
void quantize_row_q16x_scalar(const float* x, BlockQ16x* out, std::int64_t k);
void gemm_q16_scalar(GgmlType type, WeightLayout layout, const std::byte* w, std::size_t row_bytes, std::int64_t nw,
                     const BlockQ16x* xq, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy);
void gemm_f_scalar(GgmlType type, const std::byte* w, std::size_t row_bytes, std::int64_t nw, const float* x,
                   std::int64_t ldx, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy);
void gemm_qf_scalar(GgmlType type, WeightLayout layout, const std::byte* w, std::size_t row_bytes, std::int64_t nw,
                    const float* x, std::int64_t ldx, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy);
// is_block_dequant types (rows layout), float X: the canonical f32 sum of gemm_qf over the
// dequantised row.
void gemm_dq_scalar(GgmlType type, const std::byte* w, std::size_t row_bytes, std::int64_t nw, const float* x,
                    std::int64_t ldx, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy);

// --- AVX2 + FMA + F16C (quant_dot_avx2.cpp); only call when avx2_available() ---
bool avx2_available() noexcept;
// n floats to F16 or BF16 (type), bit for bit quantize_row_scalar (convert_half_avx2.cpp).
void convert_row_half_avx2(GgmlType type, const float* src, std::uint16_t* dst, std::int64_t n);
void quantize_row_q8x_avx2(const float* x, BlockQ8x* out, std::int64_t k);
void gemm_q_avx2(GgmlType type, WeightLayout layout, const std::byte* w, std::size_t row_bytes, std::int64_t nw,
                 const BlockQ8x* xq, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy);
void quantize_row_q16x_avx2(const float* x, BlockQ16x* out, std::int64_t k);
// The tile is chosen by shape, all giving the same bits: one activation row runs 4 weight rows
// per register; from kQ16LanesMinBatch activation rows, each whole group of 16 weight rows puts 8
// rows in the lanes of a vector (a full tile of 4 activation rows pays for that widening); other
// batches, and the 4-row groups past the last group of 16, fold 4 weight rows' products per
// register.
constexpr std::int64_t kQ16LanesMinBatch = 4;
void gemm_q16_avx2(GgmlType type, WeightLayout layout, const std::byte* w, std::size_t row_bytes, std::int64_t nw,
                   const BlockQ16x* xq, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy);
void gemm_f_avx2(GgmlType type, const std::byte* w, std::size_t row_bytes, std::int64_t nw, const float* x,
                 std::int64_t ldx, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy);
void gemm_qf_avx2(GgmlType type, WeightLayout layout, const std::byte* w, std::size_t row_bytes, std::int64_t nw,
                  const float* x, std::int64_t ldx, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy);
// y[c * ldy + r] = the canonical f32 sum of row r of a dequantised tile (nr rows of k floats, k a
// multiple of 8) with X row c, for r < nr, c < nx: the 3 x 4 micro-kernel of gemm_qf's batches.
void gemm_f32_tile_avx2(const float* w, std::int64_t nr, std::int64_t k, const float* x, std::int64_t ldx,
                        std::int64_t nx, float* y, std::int64_t ldy);
// gemm_dq_scalar's bits (gemm_dq_avx2.cpp): blocks dequantised into a per-thread f32 buffer (a
// 4-row tile for one or two X rows, a ~96 KiB tile of rows for larger batches), then f32 FMAs.
void gemm_dq_avx2(GgmlType type, const std::byte* w, std::size_t row_bytes, std::int64_t nw, const float* x,
                  std::int64_t ldx, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy);
// The same with gemm_f32_tile_avx512 for the larger batches (only call when
// avx512_vnni_available()).
void gemm_dq_avx512(GgmlType type, const std::byte* w, std::size_t row_bytes, std::int64_t nw, const float* x,
                    std::int64_t ldx, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy);
// gemm_f32_tile_avx2's contract and bits with two weight rows per 512-bit register
// (gemm_f32_tile_avx512.cpp; only call when avx512_vnni_available()).
void gemm_f32_tile_avx512(const float* w, std::int64_t nr, std::int64_t k, const float* x, std::int64_t ldx,
                          std::int64_t nx, float* y, std::int64_t ldy);

// gemm_q16 for the types of ops/q16_units.h (rows layout; gemm_q16_scalar is their reference too),
// bit for bit gemm_q16_scalar (gemm_q16_units_avx2.cpp; the AVX-512 one, a block per register, in
// gemm_q16_units_avx512.cpp: only call it when avx512_vnni_available()).
void gemm_q16_units_avx2(GgmlType type, const std::byte* w, std::size_t row_bytes, std::int64_t nw, const BlockQ16x* xq,
                         std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy);
// From kQ16UnitsLanesMinBatch activation rows with x_pairs (pair_q16_activations_avx512's), each
// whole group of 16 weight rows is widened once into the lanes of vectors and swept by the batch
// with vpdpwssd (q16_lanes_avx512.h, as gemm_q16_avx512 does for Q8_0/Q4_0/Q4_1); other batches,
// and the rows past the last group, take a block per register.
constexpr std::int64_t kQ16UnitsLanesMinBatch = 8;
void gemm_q16_units_avx512(GgmlType type, const std::byte* w, std::size_t row_bytes, std::int64_t nw,
                           const BlockQ16x* xq, const std::int32_t* x_pairs, std::int64_t nx, std::int64_t k, float* y,
                           std::int64_t ldy);

// --- AVX-512 (F, BW, VL, VNNI, VBMI) (quant_dot_avx512.cpp); only call when avx512_vnni_available() ---
// gemm_q16 for batches of activation rows: 16 weight rows per vector (vpdpwssd), bit for bit the
// AVX2 and scalar results. x_pairs holds each activation row's blocks as pair_q16_activations_avx512
// gives them (16 int32 per block), next to xq. Batches below kQ16Avx512MinBatch rows (or without
// x_pairs), and rows past the last whole group of 16, go to gemm_q16_avx2.
bool avx512_vnni_available() noexcept;
constexpr std::int64_t kQ16Avx512MinBatch = 2;
// out[16 b + j] = qs[j] | qs[j + 16] << 16 of block b (the element pairs that share a Q4 byte).
void pair_q16_activations_avx512(const BlockQ16x* xq, std::int64_t nb, std::int32_t* out);
void gemm_q16_avx512(GgmlType type, WeightLayout layout, const std::byte* w, std::size_t row_bytes, std::int64_t nw,
                     const BlockQ16x* xq, const std::int32_t* x_pairs, std::int64_t nx, std::int64_t k, float* y,
                     std::int64_t ldy);

}  // namespace kallpa::ops::kernels
