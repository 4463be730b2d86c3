// cuda-flash's kernels (forward_*.cu, decode.cu; what they share is in flash_device.cuh). Each launch returns
// the launch's error (cudaSuccess when it was queued); completion is the caller's business (the
// stream).
#pragma once

#include <cuda_runtime.h>

#include "backends/cuda/flash_params.h"

namespace kallpa::cuda {

// FlashAttention-2 forward on tensor cores (f32 accumulation): q, k, v and o all f16 or all bf16,
// head_dim == head_dim_v in {64, 128}, unit stride along the head dim, every address 16-byte
// aligned (flash_plan.h's tensor_core_refusal() says whether p qualifies). mma.sync m16n8k16 on any
// sm_80+ device; wgmma (sm_90a code, built with CUDA 12 or later) only where wgmma_refusal() is
// empty. choose_kernel() picks between them.
cudaError_t launch_forward_tensor_core(const FlashParams& p, cudaStream_t stream);
cudaError_t launch_forward_wgmma(const FlashParams& p, cudaStream_t stream);
// Writes p.num_splits partial results (one per warp); launch_flash_combine merges them.
cudaError_t launch_flash_decode(const FlashParams& p, cudaStream_t stream);

// The generic kernel: any dtypes, head dims and strides, f32 FMAs; split-KV when p.num_splits > 1
// (then launch_flash_combine must follow on the same stream).
cudaError_t launch_flash_generic(const FlashParams& p, cudaStream_t stream);
cudaError_t launch_flash_combine(const FlashParams& p, cudaStream_t stream);

}  // namespace kallpa::cuda
