// cuda-flash's kernels (flash_*.cu; what they share is in flash_device.cuh). Each launch returns
// the launch's error (cudaSuccess when it was queued); completion is the caller's business (the
// stream).
#pragma once

#include <cuda_runtime.h>

#include "backends/cuda/flash_params.h"

namespace kallpa::cuda {

// FlashAttention-2 forward on tensor cores (mma.sync m16n8k16, f32 accumulation): q, k, v and o
// all f16 or all bf16, head_dim == head_dim_v in {64, 128}, unit stride along the head dim, every
// address 16-byte aligned. flash_plan.h's tensor_core_refusal() says whether p qualifies.
cudaError_t launch_flash_tensor_core(const FlashParams& p, cudaStream_t stream);
// The numbered versions it dispatches to by p.tc_version (v3 also serves 4 and 5).
cudaError_t launch_tensor_core_v1(const FlashParams& p, cudaStream_t stream);
cudaError_t launch_tensor_core_v2(const FlashParams& p, cudaStream_t stream);
cudaError_t launch_tensor_core_v3(const FlashParams& p, cudaStream_t stream);
// v6-v9 (flash_tc_v6.cu): sm_90a only, and only where wgmma_refusal() is empty.
cudaError_t launch_tensor_core_wgmma(const FlashParams& p, cudaStream_t stream);
// Writes p.num_splits partial results (one per warp); launch_flash_combine merges them.
cudaError_t launch_flash_decode(const FlashParams& p, cudaStream_t stream);

// The generic kernel: any dtypes, head dims and strides, f32 FMAs; split-KV when p.num_splits > 1
// (then launch_flash_combine must follow on the same stream).
cudaError_t launch_flash_generic(const FlashParams& p, cudaStream_t stream);
cudaError_t launch_flash_combine(const FlashParams& p, cudaStream_t stream);

}  // namespace kallpa::cuda
