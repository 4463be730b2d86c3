// Kernels behind kallpa::model::matmul / dequantize_row, each in a plain scalar reference and an
// AVX2 (+FMA, F16C) version selected at run time. Tests compare the two.
//
// Tile kernels compute y[x * ldy + r] = sum_k W[r][k] * X[x][k] for r < nw weight rows (row_bytes
// apart) and x < nx activation rows. For quantised weights (Q8_0/Q4_0/Q4_1) X is given as BlockQ8x
// blocks (k / 32 per row, row x starting at xq + x * (k / 32)); for float weights (F32/F16/BF16) as
// floats (ldx apart). Every output element is computed with the same sequence of operations whatever
// nw/nx/tile it is part of, so results do not depend on batch size or thread count.
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

#include "kallpa/model/ggml_type.h"
#include "model/quant_types.h"

namespace kallpa::model::kernels {

// --- scalar reference (quant_ref.cpp) ---
void dequantize_row_scalar(GgmlType type, const void* src, float* dst, std::int64_t n);
void quantize_row_scalar(GgmlType type, const float* src, void* dst, std::int64_t n);  // weights
void quantize_row_q8x_scalar(const float* x, BlockQ8x* out, std::int64_t k);
void gemm_q_scalar(GgmlType type, const std::byte* w, std::size_t row_bytes, std::int64_t nw,
                   const BlockQ8x* xq, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy);
void gemm_f_scalar(GgmlType type, const std::byte* w, std::size_t row_bytes, std::int64_t nw,
                   const float* x, std::int64_t ldx, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy);
void gemm_qf_scalar(GgmlType type, const std::byte* w, std::size_t row_bytes, std::int64_t nw,
                    const float* x, std::int64_t ldx, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy);

// --- AVX2 + FMA + F16C (quant_dot_avx2.cpp); only call when avx2_available() ---
bool avx2_available() noexcept;
void quantize_row_q8x_avx2(const float* x, BlockQ8x* out, std::int64_t k);
void gemm_q_avx2(GgmlType type, const std::byte* w, std::size_t row_bytes, std::int64_t nw,
                 const BlockQ8x* xq, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy);
void gemm_f_avx2(GgmlType type, const std::byte* w, std::size_t row_bytes, std::int64_t nw,
                 const float* x, std::int64_t ldx, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy);
void gemm_qf_avx2(GgmlType type, const std::byte* w, std::size_t row_bytes, std::int64_t nw,
                  const float* x, std::int64_t ldx, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy);

inline bool is_quantized(GgmlType t) noexcept {
  return t == GgmlType::q8_0 || t == GgmlType::q4_0 || t == GgmlType::q4_1;
}

}  // namespace kallpa::model::kernels
