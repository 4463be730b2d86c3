// Kernels of the engine's op set on CUDA (engine_kernels.h). Plain and exact first: f32 arithmetic
// (double where the CPU ops use double: RMSNorm's sum, RoPE's angle), so the GPU's logits match
// the CPU's and the NumPy reference within the same tolerance.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "ops/cuda/engine_kernels.h"

namespace kallpa::cuda {
namespace {

constexpr int kWarp = 32;

__device__ __forceinline__ float half_at(const unsigned char* p) {
  __half h;
  memcpy(&h, p, 2);
  return __half2float(h);
}

// Element e of a row in GGUF's encoding.
__device__ __forceinline__ float weight_at(const unsigned char* row, WeightCode code, std::int64_t e) {
  switch (code) {
    case WeightCode::f32: return reinterpret_cast<const float*>(row)[e];
    case WeightCode::f16: return half_at(row + 2 * e);
    case WeightCode::bf16: {
      const unsigned int bits = static_cast<unsigned int>(reinterpret_cast<const unsigned short*>(row)[e]) << 16;
      return __uint_as_float(bits);
    }
    case WeightCode::q8_0: {
      const unsigned char* b = row + (e / 32) * 34;
      return half_at(b) * static_cast<float>(static_cast<signed char>(b[2 + e % 32]));
    }
    case WeightCode::q4_0: {
      const unsigned char* b = row + (e / 32) * 18;
      const int j = static_cast<int>(e % 32);
      const int q = j < 16 ? (b[2 + j] & 0xF) : (b[2 + j - 16] >> 4);
      return half_at(b) * static_cast<float>(q - 8);
    }
    case WeightCode::q4_1: {
      const unsigned char* b = row + (e / 32) * 20;
      const int j = static_cast<int>(e % 32);
      const int q = j < 16 ? (b[4 + j] & 0xF) : (b[4 + j - 16] >> 4);
      return half_at(b) * static_cast<float>(q) + half_at(b + 2);
    }
  }
  return 0.0f;
}

__global__ void embedding_kernel(const unsigned char* table, std::int64_t row_bytes, WeightCode code, std::int64_t cols,
                                 const std::int32_t* ids, float* out) {
  const std::int64_t t = blockIdx.x;
  const unsigned char* row = table + static_cast<std::int64_t>(ids[t]) * row_bytes;
  for (std::int64_t e = threadIdx.x; e < cols; e += blockDim.x) out[t * cols + e] = weight_at(row, code, e);
}

__global__ void dequantize_kernel(const unsigned char* w, std::int64_t row_bytes, WeightCode code, std::int64_t cols,
                                  float* out) {
  const std::int64_t r = blockIdx.x;
  for (std::int64_t e = threadIdx.x; e < cols; e += blockDim.x) out[r * cols + e] = weight_at(w + r * row_bytes, code, e);
}

constexpr int kGemvRows = 8;  // input rows per pass over a weight row (accumulators per lane)

__global__ void gemv_kernel(const unsigned char* w, std::int64_t row_bytes, WeightCode code, std::int64_t n_out,
                            std::int64_t k, const float* x, std::int64_t rows, float* y) {
  const int lane = threadIdx.x % kWarp;
  const std::int64_t n = static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  if (n >= n_out) return;
  const unsigned char* wr = w + n * row_bytes;
  for (std::int64_t r0 = 0; r0 < rows; r0 += kGemvRows) {
    const int count = static_cast<int>(rows - r0 < kGemvRows ? rows - r0 : kGemvRows);
    float acc[kGemvRows] = {};
    for (std::int64_t e = lane; e < k; e += kWarp) {
      const float we = weight_at(wr, code, e);
#pragma unroll
      for (int j = 0; j < kGemvRows; ++j) {
        if (j < count) acc[j] = fmaf(we, x[(r0 + j) * k + e], acc[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < kGemvRows; ++j) {
      float v = acc[j];
      for (int off = kWarp / 2; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
      if (lane == 0 && j < count) y[(r0 + j) * n_out + n] = v;
    }
  }
}

__global__ void rmsnorm_kernel(const float* x, const float* weight, float eps, float* y, std::int64_t dim) {
  __shared__ double partial[256];
  const std::int64_t r = blockIdx.x;
  const float* xr = x + r * dim;
  double sum = 0.0;
  for (std::int64_t i = threadIdx.x; i < dim; i += blockDim.x) sum += static_cast<double>(xr[i]) * xr[i];
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s /= 2) {
    if (static_cast<int>(threadIdx.x) < s) partial[threadIdx.x] += partial[threadIdx.x + s];
    __syncthreads();
  }
  const float inv = 1.0f / sqrtf(static_cast<float>(partial[0] / static_cast<double>(dim)) + eps);
  for (std::int64_t i = threadIdx.x; i < dim; i += blockDim.x) y[r * dim + i] = xr[i] * inv * weight[i];
}

__global__ void rope_kernel(float* x, const std::int32_t* positions, std::int64_t rows, std::int64_t heads,
                            std::int64_t head_dim, std::int64_t n_rot, float theta) {
  const std::int64_t half = n_rot / 2;
  const std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= rows * heads * half) return;
  const std::int64_t i = idx % half, h = (idx / half) % heads, r = idx / (half * heads);
  const double inv_freq = static_cast<double>(static_cast<float>(pow(static_cast<double>(theta),
                                                                     -2.0 * static_cast<double>(i) / static_cast<double>(n_rot))));
  const double angle = static_cast<double>(positions[r]) * inv_freq;
  const float c = static_cast<float>(cos(angle)), s = static_cast<float>(sin(angle));
  float* p = x + r * heads * head_dim + h * head_dim + 2 * i;
  const float x0 = p[0], x1 = p[1];
  p[0] = x0 * c - x1 * s;
  p[1] = x0 * s + x1 * c;
}

__global__ void swiglu_kernel(const float* gate, const float* up, float* out, std::int64_t n) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

__global__ void add_kernel(float* x, const float* y, std::int64_t n) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] += y[i];
}

__global__ void gather_kernel(const float* x, const std::int64_t* rows, std::int64_t dim, float* out) {
  const std::int64_t t = blockIdx.x;
  for (std::int64_t e = threadIdx.x; e < dim; e += blockDim.x) out[t * dim + e] = x[rows[t] * dim + e];
}

__global__ void scatter_kernel(const float* src, std::int64_t dim, void* dst, int dst_type, const std::int64_t* rows) {
  const std::int64_t t = blockIdx.x;
  const std::int64_t base = rows[t] * dim;
  for (std::int64_t e = threadIdx.x; e < dim; e += blockDim.x) {
    const float v = src[t * dim + e];
    if (dst_type == 0) {
      static_cast<float*>(dst)[base + e] = v;
    } else if (dst_type == 1) {
      static_cast<__half*>(dst)[base + e] = __float2half_rn(v);
    } else {
      static_cast<__nv_bfloat16*>(dst)[base + e] = __float2bfloat16_rn(v);
    }
  }
}

unsigned int blocks_for(std::int64_t n, int threads) { return static_cast<unsigned int>((n + threads - 1) / threads); }

}  // namespace

cudaError_t launch_embedding(const void* table, std::int64_t row_bytes, WeightCode code, std::int64_t cols,
                             const std::int32_t* ids, std::int64_t n, float* out, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  embedding_kernel<<<static_cast<unsigned int>(n), 256, 0, stream>>>(static_cast<const unsigned char*>(table),
                                                                     row_bytes, code, cols, ids, out);
  return cudaGetLastError();
}

cudaError_t launch_dequantize(const void* w, std::int64_t row_bytes, WeightCode code, std::int64_t rows,
                              std::int64_t cols, float* out, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  dequantize_kernel<<<static_cast<unsigned int>(rows), 256, 0, stream>>>(static_cast<const unsigned char*>(w),
                                                                         row_bytes, code, cols, out);
  return cudaGetLastError();
}

cudaError_t launch_gemv(const void* w, std::int64_t row_bytes, WeightCode code, std::int64_t n_out, std::int64_t k,
                        const float* x, std::int64_t rows, float* y, cudaStream_t stream) {
  if (rows == 0 || n_out == 0) return cudaSuccess;
  constexpr int kWarpsPerBlock = 8;
  gemv_kernel<<<blocks_for(n_out, kWarpsPerBlock), kWarpsPerBlock * kWarp, 0, stream>>>(
      static_cast<const unsigned char*>(w), row_bytes, code, n_out, k, x, rows, y);
  return cudaGetLastError();
}

cudaError_t launch_rmsnorm(const float* x, const float* weight, float eps, float* y, std::int64_t rows,
                           std::int64_t dim, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  rmsnorm_kernel<<<static_cast<unsigned int>(rows), 256, 0, stream>>>(x, weight, eps, y, dim);
  return cudaGetLastError();
}

cudaError_t launch_rope(float* x, const std::int32_t* positions, std::int64_t rows, std::int64_t heads,
                        std::int64_t head_dim, std::int64_t n_rot, float theta, cudaStream_t stream) {
  const std::int64_t n = rows * heads * (n_rot / 2);
  if (n == 0) return cudaSuccess;
  rope_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(x, positions, rows, heads, head_dim, n_rot, theta);
  return cudaGetLastError();
}

cudaError_t launch_swiglu(const float* gate, const float* up, float* out, std::int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  swiglu_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(gate, up, out, n);
  return cudaGetLastError();
}

cudaError_t launch_add(float* x, const float* y, std::int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  add_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(x, y, n);
  return cudaGetLastError();
}

cudaError_t launch_gather_rows(const float* x, const std::int64_t* rows, std::int64_t n, std::int64_t dim, float* out,
                               cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  gather_kernel<<<static_cast<unsigned int>(n), 256, 0, stream>>>(x, rows, dim, out);
  return cudaGetLastError();
}

cudaError_t launch_scatter_rows(const float* src, std::int64_t dim, void* dst, int dst_type, const std::int64_t* rows,
                                std::int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  scatter_kernel<<<static_cast<unsigned int>(n), 256, 0, stream>>>(src, dim, dst, dst_type, rows);
  return cudaGetLastError();
}

}  // namespace kallpa::cuda
