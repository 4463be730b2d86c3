// What cuda-flash's host code hands its kernels (flash_kernels.h): plain data, no CUDA types, so
// that the planner (flash_plan.h) and its tests build without the toolkit's headers.
#pragma once

#include <cstdint>

namespace kallpa::cuda {

// dtype codes shared by host and device: the values of kallpa::DType.
enum DTypeCode : std::int32_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

// One sequence's geometry, resolved on the host from the validated problem. Offsets are in
// elements from the view's data pointer; k and v are unused (0) for paged KV, whose rows go
// through the block table.
struct SeqMeta {
  std::int64_t q = 0;
  std::int64_t o = 0;
  std::int64_t lse = 0;
  std::int64_t k = 0;
  std::int64_t v = 0;
  std::int64_t row0 = 0;  // index of this sequence's first query among all B sequences' queries
  std::int32_t sq = 0;
  std::int32_t skv = 0;
};

// The kernels cuda-flash runs; choose_kernel() (flash_plan.h) picks one per problem.
enum class FlashKernel : std::int32_t {
  generic,      // forward_generic.cu: any dtypes, head dims and strides, f32 FMAs, split-KV
  decode,       // decode.cu: split-KV decode on tensor cores (a warp per KV head's query group)
  tensor_core,  // forward_tensor_core.cu: FlashAttention-2 on mma.sync (sm_80 and later)
  wgmma,        // forward_wgmma.cu: FlashAttention-2 on Hopper's wgmma (compute capability 9.0)
};

struct FlashParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;  // nullptr: not wanted

  std::int32_t q_dtype = kF32;
  std::int32_t kv_dtype = kF32;
  std::int32_t o_dtype = kF32;

  const SeqMeta* meta = nullptr;              // device, [batch]
  const std::int32_t* block_table = nullptr;  // device, paged only
  const float* alibi = nullptr;               // device, [hq], nullptr when off

  std::int32_t batch = 0;
  std::int32_t hq = 0;
  std::int32_t hkv = 0;
  std::int32_t group = 1;  // hq / hkv
  std::int32_t d = 0;
  std::int32_t dv = 0;
  std::int32_t max_sq = 0;
  std::int64_t total_q = 0;

  // Strides in elements: row (token), head, dim; block for paged K/V.
  std::int64_t q_rs = 0, q_hs = 0, q_ds = 1;
  std::int64_t k_rs = 0, k_hs = 0, k_ds = 1, k_bs = 0;
  std::int64_t v_rs = 0, v_hs = 0, v_ds = 1, v_bs = 0;
  std::int64_t o_rs = 0, o_hs = 0, o_ds = 1;
  std::int64_t lse_hs = 0, lse_is = 0;

  bool paged = false;
  std::int32_t page_size = 0;
  std::int64_t table_stride = 0;

  bool causal = false;
  std::int64_t window_left = -1;
  std::int64_t window_right = -1;
  float scale = 1.0f;
  float softcap = 0.0f;

  // Split-KV: num_splits > 1 makes the generic kernel write partial results here (device memory),
  // [num_splits, total_q, hq, dv] unnormalised outputs and [num_splits, total_q, hq] row max and
  // sum (m in log2 units), which the combine kernel merges into o and lse.
  std::int32_t num_splits = 1;
  std::int32_t keys_per_split = 0;  // a multiple of 32
  float* part_o = nullptr;
  float* part_m = nullptr;
  float* part_l = nullptr;

  // The kernel chosen for this problem: the launch shape of the tensor-core kernels depends on it.
  FlashKernel kernel = FlashKernel::generic;
};

}  // namespace kallpa::cuda
