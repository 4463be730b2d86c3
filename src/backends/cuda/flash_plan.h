// cuda-flash's host-side planning as pure functions (no CUDA calls), shared by the kernels'
// launchers and the backend and unit-tested on machines without a GPU: which kernel a problem
// qualifies for, how many KV splits a decode gets, and the launch shapes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "backends/cuda/flash_params.h"

namespace kallpa::cuda {

// The mma.sync prefill kernel (forward_tensor_core.cu): 4 warps, 128 query rows (32 per warp) x
// 64 keys per step; rows of its shared-memory tiles are padded by 8 elements so that the
// quad-strided fragment loads hit distinct banks.
inline constexpr int kTcThreads = 128;
inline constexpr int kTcBlockQ = 128;
inline constexpr int kTcBlockK = 64;
inline constexpr int kTcPad = 8;
// The Hopper prefill kernel (forward_wgmma.cu): two warpgroups of 64 query rows against 128-key
// tiles stored in wgmma's swizzled layout (no padding), two stages each of K and V; 1 KiB of slack
// aligns the tiles to the swizzle's 1024-byte atoms.
inline constexpr int kWgmmaThreads = 256;
inline constexpr int kWgmmaBlockQ = 128;
inline constexpr int kWgmmaBlockK = 128;
// The Hopper kernel's tiles in shared memory: wgmma's canonical 128-byte-swizzle layout, the head
// dim cut into 64-element panels (128-byte rows), a panel's rows consecutive, and within each
// 8-row, 1024-byte atom the 16-byte chunk c of row r stored at chunk position c ^ (r % 8) -- the
// XOR the hardware applies on reading, which also spreads a column of chunks over all banks. Byte
// offset of chunk c8 (elements 8 c8 .. 8 c8 + 7) of row r, in a tile of `rows` rows.
constexpr std::uint32_t swizzled_chunk(int rows, int r, int c8) noexcept {
  return static_cast<std::uint32_t>((c8 / 8) * rows * 128 + r * 128 + (((c8 % 8) ^ (r % 8)) * 16));
}
// Below this many query rows a 64-row tile is mostly empty; the generic kernel with split-KV wins.
inline constexpr std::int64_t kTcMinRows = 16;

// The generic kernel: one warp per (query row, head), 4 per block.
inline constexpr int kGenericWarps = 4;
inline constexpr int kGenericThreads = 32 * kGenericWarps;
// A split of the KV sequence is worth its partial result and merge only above this many keys.
inline constexpr std::int64_t kMinKeysPerSplit = 256;
inline constexpr int kMaxSplits = 128;
// Decode is bound by memory latency: a multiprocessor needs several 4-warp blocks in flight.
inline constexpr int kSplitBlocksPerSm = 8;

// The split-KV decode kernel on tensor cores: one warp per (sequence, KV head, key split) holds
// every query row of the KV head's group -- (query row, head) pairs, at most one 16-row mma tile --
// and streams 16-key steps through two shared-memory stages of its own.
inline constexpr int kDecodeWarps = 4;
inline constexpr int kDecodeThreads = 32 * kDecodeWarps;
inline constexpr int kDecodeMaxRows = 16;
inline constexpr int kDecodeStepKeys = 16;
// Blocks of the decode kernel resident per multiprocessor: its launch bound, which holds it to 168
// registers, and three blocks' shared memory (70 KiB each at D 128) fit an SM.
inline constexpr int kDecodeBlocksPerSm = 3;
inline constexpr int kDecodeResidentWarpsPerSm = kDecodeWarps * kDecodeBlocksPerSm;

// What the planner needs to know of the device (cudaDeviceProp, read once).
struct DeviceFacts {
  int index = 0;
  std::string name;
  int sm_count = 1;
  int cc_major = 0;
  int cc_minor = 0;
  std::size_t smem_per_block_optin = 48 * 1024;  // cudaDevAttrMaxSharedMemoryPerBlockOptin
};

struct LaunchShape {
  unsigned grid[3] = {1, 1, 1};
  unsigned block = 1;
  std::size_t smem_bytes = 0;
};

// Shared memory of the mma.sync (tensor_core_smem_bytes) and Hopper (wgmma_smem_bytes) prefill
// kernels, and of the generic kernel.
std::size_t tensor_core_smem_bytes(int head_dim) noexcept;
std::size_t wgmma_smem_bytes(int head_dim) noexcept;
std::size_t generic_smem_bytes(int head_dim, int head_dim_v) noexcept;
// Empty when the Hopper kernel can run p on device `dev`, else why not: a Hopper (compute
// capability 9.0 exactly: sm_90a code runs nowhere else), a build with that code, and the lean
// softmax's conditions (no softcap or ALiBi, scale > 0).
std::string wgmma_refusal(const FlashParams& p, const DeviceFacts& dev);
// Whether this build has the Hopper kernel's sm_90a code (CUDA 12 or later compiles it).
bool wgmma_built() noexcept;

// Empty when p (with its per-sequence geometry) can take the tensor-core kernel, else why not.
std::string tensor_core_refusal(const FlashParams& p, const std::vector<SeqMeta>& meta);
// Empty when p can take the tensor-core decode kernel (the tensor-core kernel's dtype, head-dim
// and alignment conditions, and at most kDecodeMaxRows query rows x heads per KV head), else why not.
std::string decode_refusal(const FlashParams& p, const std::vector<SeqMeta>& meta);
std::size_t decode_smem_bytes(int head_dim) noexcept;

// Which kernel runs p (with its per-sequence geometry) on device `dev`, one rule:
//   1. the tensor-core prefill kernels where tensor_core_refusal() is empty (16-bit q/k/v/o, D = Dv
//      = 64 or 128, 16-byte aligned rows, at least kTcMinRows query rows): wgmma on a compute
//      capability 9.0 device with the lean softmax (wgmma_refusal() empty), else mma.sync;
//   2. else the split-KV decode kernel where decode_refusal() is empty (16-bit K/V, at most
//      kDecodeMaxRows query rows x heads per KV head);
//   3. else the generic kernel, which takes the whole contract.
// p.alibi need only be non-null when the problem has slopes (it is not read). `why` says why the
// faster kernels did not apply (empty for wgmma).
struct KernelChoice {
  FlashKernel kernel = FlashKernel::generic;
  std::string why;
};
KernelChoice choose_kernel(const FlashParams& p, const std::vector<SeqMeta>& meta, const DeviceFacts& dev);

// x: query tiles (kTcBlockQ or kWgmmaBlockQ rows, by p.kernel) of the longest sequence, y: query
// heads, z: sequences.
LaunchShape tensor_core_launch(const FlashParams& p) noexcept;
// x: (query row, head) pairs of the longest sequence / 4, y: KV splits, z: sequences.
LaunchShape generic_launch(const FlashParams& p) noexcept;
// x: key splits / 4 (a warp each; p.num_splits of them), y: KV heads, z: sequences.
LaunchShape decode_launch(const FlashParams& p) noexcept;

struct SplitPlan {
  int splits = 1;
  int keys_per_split = 0;  // multiple of 32; 0 when splits == 1
};
// About kSplitBlocksPerSm blocks per multiprocessor: when the query rows alone give fewer, the KV
// sequence is split (each split at least kMinKeysPerSplit keys).
// `max_splits` caps the partial results' memory (the caller's budget); at most kMaxSplits.
SplitPlan plan_splits(std::int64_t blocks_without_split, std::int64_t max_seqlen_k, int sm_count,
                      std::int64_t max_splits = kMaxSplits) noexcept;
// The decode kernel's splits (a warp each): as many as fit resident on the device at once, so the
// keys stream in one wave -- a second, partial wave would leave most multiprocessors idle while
// it runs -- and each split at least kMinKeysPerSplit keys. `units` is sequences x KV heads.
SplitPlan plan_decode_splits(std::int64_t units, std::int64_t max_seqlen_k, int sm_count,
                             std::int64_t max_splits = kMaxSplits) noexcept;
// Device memory the split partials are allowed (part_o, part_m, part_l together).
inline constexpr std::size_t kSplitScratchBudget = std::size_t{256} << 20;

// How many times cuda-flash launched each kernel in this process (so tests can tell which path a
// problem took). Defined beside the backend.
struct LaunchCounts {
  std::uint64_t tensor_core = 0;
  std::uint64_t generic = 0;
  std::uint64_t decode = 0;    // tensor-core decode launches (each followed by a combine)
  std::uint64_t split_kv = 0;  // generic or decode launches with num_splits > 1
  std::uint64_t wgmma = 0;     // tensor-core launches that ran the Hopper kernel
};
LaunchCounts launch_counts() noexcept;
// The facts of the device cuda-flash runs on; nullptr when there is none. Defined beside the backend.
const DeviceFacts* active_device_facts() noexcept;

// Empty when the grid fits CUDA's limits (y and z at most 65535, x below 2^31), else why not.
std::string grid_refusal(const LaunchShape& shape);

}  // namespace kallpa::cuda
