// The engine's op set on CUDA (cuda_ops.cpp): the kernels and their launchers. Each launcher
// queues on `stream` and returns the launch's error; completion is the caller's business.
// Weights are in GGUF's block layouts, row-major, `row_bytes` apart.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kallpa::cuda {

// The weight encodings these kernels read (GGUF's, block size 32 for the quantised ones).
enum class WeightCode : int { f32, f16, bf16, q8_0, q4_0, q4_1 };

// out[t, :] = dequantised row ids[t] of the table (ids on the device, already range-checked).
cudaError_t launch_embedding(const void* table, std::int64_t row_bytes, WeightCode code, std::int64_t cols,
                             const std::int32_t* ids, std::int64_t n, float* out, cudaStream_t stream);
// The whole matrix as f32 (rows x cols), for the GEMM path.
cudaError_t launch_dequantize(const void* w, std::int64_t row_bytes, WeightCode code, std::int64_t rows,
                              std::int64_t cols, float* out, cudaStream_t stream);
// y[r, n] = sum_k x[r, k] W[n, k] for r < rows: a warp per output column n, each lane a fixed
// stride of k, so a row's result does not depend on how many rows come with it.
cudaError_t launch_gemv(const void* w, std::int64_t row_bytes, WeightCode code, std::int64_t n_out, std::int64_t k,
                        const float* x, std::int64_t rows, float* y, cudaStream_t stream);
cudaError_t launch_rmsnorm(const float* x, const float* weight, float eps, float* y, std::int64_t rows,
                           std::int64_t dim, cudaStream_t stream);
cudaError_t launch_rope(float* x, const std::int32_t* positions, std::int64_t rows, std::int64_t heads,
                        std::int64_t head_dim, std::int64_t n_rot, float theta, cudaStream_t stream);
cudaError_t launch_swiglu(const float* gate, const float* up, float* out, std::int64_t n, cudaStream_t stream);
cudaError_t launch_add(float* x, const float* y, std::int64_t n, cudaStream_t stream);
cudaError_t launch_gather_rows(const float* x, const std::int64_t* rows, std::int64_t n, std::int64_t dim, float* out,
                               cudaStream_t stream);
// dst_type: 0 f32, 1 f16, 2 bf16 (kallpa::DType), rounded to nearest even.
cudaError_t launch_scatter_rows(const float* src, std::int64_t dim, void* dst, int dst_type, const std::int64_t* rows,
                                std::int64_t n, cudaStream_t stream);

}  // namespace kallpa::cuda
