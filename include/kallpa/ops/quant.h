// Tensor-type kernels: dequantisation to f32 and (quantised) matrix products for the tensor types
// the engine computes with: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL and the K-quants
// Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K (ggml block layouts; dequantize_row gives gguf-py's
// gguf.quants values bit for bit, tests/gguf checks it).
//
// matmul computes y[b][i] = sum_j W[i][j] * x[b][j] for a GGUF matrix W (ne = {k, n}: n rows of k).
// For Q8_0/Q4_0/Q4_1 weights MatmulOptions::activations picks how x enters the product (for Q5_0,
// Q5_1, IQ4_NL, Q4_K, Q5_K and Q6_K it picks between f32 and q16; see below):
//   - Activations::f32 (the default): x is used as given. Weights are dequantised in registers (or
//     into a per-thread f32 tile for large batches) to exactly the values dequantize_row gives, and
//     the products are f32 FMAs. The only error is f32 rounding: |y - exact| <~ k/8 * 2^-24 *
//     sum_j |W[i][j] x[j]| (in practice far less; the tests bound it by 1e-5 * sum_j |W x|).
//   - Activations::q8: each x row is first quantised to Q8 blocks of 32 (one scale per block,
//     round-to-nearest-even) and the products run in integer arithmetic (llama.cpp does the same);
//     the result differs from the exact product by at most sum_j |W[i][j]| * max|x_block| / 254
//     (plus float rounding). Faster for decode GEMVs on AVX2 (bench/results/quant-matmul.md), but
//     the noise (~0.5% per dot) is enough to change a small model's greedy answers: SmolLM2-135M's
//     first answer token to "What is the capital of France?" is "The" by a margin of 0.08 logits
//     over "L", and Q8 noise flips it. Opt-in only (KALLPA_MATMUL_ACTIVATIONS=q8 for the CPU ops).
//   - Activations::q16: the same with 16-bit blocks (BlockQ16x: one f32 scale per 32, |q| <= 32767,
//     round-to-nearest-even), so the activation error is max|x_block| / 65534 per element, 256x
//     below q8's, and the products are exact int32 sums (two halves per block). About as fast as
//     q8 for decode GEMVs, where the f32 path is bound by expanding weights to floats, and faster
//     than the f32 path for prompts on AVX-512 VNNI (vpdpwssd: twice the multiply-adds of an f32
//     FMA; bench/results/quant-matmul.md); the CPU ops use it for every row (see ops/ops.h).
// Q5_0, Q5_1, IQ4_NL, Q4_K, Q5_K and Q6_K take f32 or q16 activations (q8 means f32 for them):
// with q16 each block of 32 weights is read as integers times one scale (plus a constant for the
// types with a minimum; Q6_K's 16-element scales are folded into the integers), and the products
// are q16's exact int32 sums with q16's bound. F32/F16/BF16 weights always use f32 x directly (the
// option is ignored for them), and so do Q2_K, Q3_K and Q8_K; f32 activations with any block type:
// weights are dequantised block by block (into registers or a per-thread f32 tile) to exactly the
// values dequantize_row gives, then take the f32 path above with its bound and summation order.
//
// Every output element is computed by the same sequence of operations whatever batch size, batch
// position, tile or thread count it is part of (work is split over kallpa::parallel::ThreadPool::
// global() by output rows and batch rows), so results do not depend on the number of threads or on
// the batch size. In the f32 path each output is accumulated in 8 f32 lanes (lane l takes
// j = l mod 8, FMAs in increasing j), then summed ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)); the scalar
// reference kernels follow the same order, so they agree with the AVX2 ones bit for bit.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "kallpa/ops/ggml_type.h"
#include "kallpa/status.h"

namespace kallpa::ops {

// How a quantised matrix's blocks are laid out in memory.
enum class WeightLayout : std::uint8_t {
  rows,   // ggml's: row after row, each row its blocks in order (as in a GGUF file)
  rows4,  // kallpa's repacked one (ops/repack.h): groups of 4 rows, block-interleaved, scales
          // gathered per block, for SIMD kernels; same bytes per 4 rows, rows % 4 == 0
};

// A weight matrix: rows x cols elements of `type`, row_bytes per row (row r of the rows layout
// starts at r * row_bytes; in rows4, group g of rows 4g..4g+3 starts at 4g * row_bytes).
struct WeightMatrix {
  GgmlType type = GgmlType::f32;
  const void* data = nullptr;
  std::int64_t rows = 0;        // n (outputs)
  std::int64_t cols = 0;        // k (inputs), a multiple of the type's block size
  std::uint64_t row_bytes = 0;  // bytes per row
  WeightLayout layout = WeightLayout::rows;
};

// Bytes of one row of `cols` elements of `type` (0 if the type is unknown or cols not a multiple
// of its block size).
std::uint64_t row_size(GgmlType type, std::int64_t cols) noexcept;

// Dequantises n elements (a multiple of the type's block size) starting at src into dst.
Status dequantize_row(GgmlType type, const void* src, float* dst, std::int64_t n);
// Checks that every block of `bytes` bytes of `type` data (a whole number of blocks) has finite
// scales (the f16 d, and dmin/m where the type has one; Q8_K's f32 d): a non-finite scale turns
// every product with its block into inf/NaN. invalid_argument naming the first bad block and
// field otherwise; plain types (F32/F16/BF16) always pass.
Status check_block_scales(GgmlType type, const void* data, std::uint64_t bytes);
// Quantises n floats (a multiple of the block size) to `type` with ggml's reference rounding
// (bit-identical to ggml-quants.c and gguf-py's gguf.quants for Q8_0, Q4_0, Q4_1; F16/BF16 round to
// nearest even). dst receives row_size(type, n) bytes. unsupported for the other types (their
// data comes from files quantised elsewhere).
Status quantize_row(GgmlType type, const float* src, void* dst, std::int64_t n);
// Dequantises rows [first, first + count) of a matrix into dst (count x cols floats), e.g. an
// embedding lookup. invalid_argument when the rows are out of range.
Status dequantize_rows(const WeightMatrix& w, std::int64_t first, std::int64_t count, float* dst);

struct MatmulOptions {
  // How activations enter products with quantised weights (q16 for the types with Q16 kernels, q8
  // for Q8_0/Q4_0/Q4_1 only; the others always use f32); see the top of this file.
  enum class Activations {
    f32,  // exact activations: f32 FMAs with in-register dequantised weights (f32 rounding only)
    q8,   // activations quantised to Q8 blocks, integer dot products (llama.cpp style)
    q16,  // activations quantised to 16-bit blocks, integer dot products (decode rows; see above)
  };
  // The widest instruction set the kernels may use (tests and benchmarks compare them; the env
  // KALLPA_QUANT_ISA=scalar|avx2 caps it for a whole process). With f32 and q16 activations every
  // ISA gives the same bits; q8's scalar reference rounds in another order (agrees within 1e-5).
  enum class Isa { best, avx2, scalar };
  int max_threads = 0;  // 0: all of the pool's threads
  Isa max_isa = Isa::best;
  Activations activations = Activations::f32;  // ignored for F32/F16/BF16 weights
};

// y[b * ldy + i] = sum_j W[i][j] * x[b * ldx + j] for b < batch, i < w.rows. ldx >= w.cols,
// ldy >= w.rows. x and y must not overlap.
Status matmul(const WeightMatrix& w, const float* x, std::int64_t batch, std::int64_t ldx, float* y, std::int64_t ldy,
              const MatmulOptions& options = {});

// Several products that share x (a layer's q/k/v, or gate/up) in one pass over the thread pool:
// x is quantised once, and the tasks of all matrices are spread over the threads together. Each
// y is exactly what matmul() gives for its matrix. All matrices must have the same cols.
struct MatmulJob {
  const WeightMatrix* w = nullptr;
  float* y = nullptr;
  std::int64_t ldy = 0;  // >= w->rows
};
Status matmul_group(std::span<const MatmulJob> jobs, const float* x, std::int64_t batch, std::int64_t ldx,
                    const MatmulOptions& options = {});

// The widest SIMD path the kernels use on this machine: "avx512-vnni" (batched Q16 products, the
// Q16 products of the block types, and their f32 prompt tiles; the rest AVX2), "avx2" or "scalar".
std::string_view quant_kernel_isa() noexcept;

}  // namespace kallpa::ops
