#include "backends/cuda/flash_plan.h"

#include <algorithm>

#include <fmt/format.h>

namespace kallpa::cuda {
namespace {

std::int64_t ceil_div(std::int64_t a, std::int64_t b) noexcept { return (a + b - 1) / b; }

std::string_view code_name(std::int32_t dtype) noexcept {
  switch (dtype) {
    case kF16: return "f16";
    case kBF16: return "bf16";
    default: return "f32";
  }
}

unsigned clamp_unsigned(std::int64_t v) noexcept {
  return static_cast<unsigned>(std::clamp<std::int64_t>(v, 1, 0xffffffffLL));
}

}  // namespace

std::size_t tensor_core_smem_bytes(int head_dim) noexcept {
  // 2-byte elements: Q, and K and V row-major in two stages each (the next tile loads while this
  // one is used), rows padded.
  const auto d = static_cast<std::size_t>(head_dim);
  return 2 * (kTcBlockQ * (d + kTcPad) + 4 * kTcBlockK * (d + kTcPad));
}

std::size_t wgmma_smem_bytes(int head_dim) noexcept {
  // Q and two stages each of K and V, 2-byte elements, unpadded; 1 KiB to align them.
  return 1024 + 2 * static_cast<std::size_t>(head_dim) * (kWgmmaBlockQ + 4 * std::size_t{kWgmmaBlockK});
}

std::size_t generic_smem_bytes(int head_dim, int head_dim_v) noexcept {
  return static_cast<std::size_t>(kGenericWarps) * static_cast<std::size_t>(head_dim + head_dim_v) * sizeof(float);
}

namespace {
// The layout conditions both tensor-core kernels share (16-byte loads of 16-bit rows).
std::string sixteen_bit_layout_refusal(const FlashParams& p, const std::vector<SeqMeta>& meta) {
  if (p.d != p.dv || (p.d != 64 && p.d != 128)) {
    return fmt::format("head dims {}/{}; the tensor-core kernel has D = Dv = 64 or 128", p.d, p.dv);
  }
  if (p.q_ds != 1 || p.k_ds != 1 || p.v_ds != 1 || p.o_ds != 1) {
    return "a view is strided along the head dim; the tensor-core kernel needs unit stride there";
  }
  const auto misaligned_ptr = [](const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr) % 16 != 0; };
  if (misaligned_ptr(p.q) || misaligned_ptr(p.k) || misaligned_ptr(p.v)) {
    return "q, k or v does not start on a 16-byte boundary (the tensor-core kernel loads 8 elements at once)";
  }
  for (std::int64_t s : {p.q_rs, p.q_hs, p.k_rs, p.k_hs, p.k_bs, p.v_rs, p.v_hs, p.v_bs}) {
    if (s % 8 != 0) return fmt::format("a q/k/v stride of {} elements is not a multiple of 8 (16 bytes)", s);
  }
  for (const SeqMeta& m : meta) {
    if (m.q % 8 != 0 || m.k % 8 != 0 || m.v % 8 != 0) {
      return "a sequence's q/k/v rows do not start on a 16-byte boundary";
    }
  }
  return {};
}
}  // namespace

std::string tensor_core_refusal(const FlashParams& p, const std::vector<SeqMeta>& meta) {
  if (p.q_dtype != p.kv_dtype || p.q_dtype != p.o_dtype || p.q_dtype == kF32) {
    return fmt::format("q/kv/o dtypes are {}/{}/{}; the tensor-core kernel takes f16 or bf16 for all of them",
                       code_name(p.q_dtype), code_name(p.kv_dtype), code_name(p.o_dtype));
  }
  if (std::string why = sixteen_bit_layout_refusal(p, meta); !why.empty()) return why;
  if (p.max_sq < kTcMinRows) {
    return fmt::format("at most {} query rows per sequence; below {} the split-KV generic kernel is used", p.max_sq,
                       kTcMinRows);
  }
  return {};
}

std::string decode_refusal(const FlashParams& p, const std::vector<SeqMeta>& meta) {
  // q may be f32 (an engine's activations): it is rounded to K's type for the mma, as K is stored.
  if (p.kv_dtype == kF32 || (p.q_dtype != p.kv_dtype && p.q_dtype != kF32)) {
    return fmt::format("q/kv dtypes are {}/{}; the decode kernel takes f16 or bf16 K/V and q of that type or f32",
                       code_name(p.q_dtype), code_name(p.kv_dtype));
  }
  if (std::string why = sixteen_bit_layout_refusal(p, meta); !why.empty()) return why;
  if (std::int64_t{p.max_sq} * p.group > kDecodeMaxRows) {
    return fmt::format("{} query rows x {} heads per KV head is over the decode kernel's {}", p.max_sq, p.group,
                       kDecodeMaxRows);
  }
  return {};
}

std::size_t decode_smem_bytes(int head_dim) noexcept {
  // Per warp: K and V steps of 16 rows x (D + 8) 2-byte elements, two stages each.
  return static_cast<std::size_t>(kDecodeWarps) * 4 * kDecodeStepKeys * static_cast<std::size_t>(head_dim + kTcPad) * 2;
}

LaunchShape decode_launch(const FlashParams& p) noexcept {
  LaunchShape s;
  s.grid[0] = clamp_unsigned(ceil_div(p.num_splits, kDecodeWarps));
  s.grid[1] = clamp_unsigned(p.hkv);
  s.grid[2] = clamp_unsigned(p.batch);
  s.block = kDecodeThreads;
  s.smem_bytes = decode_smem_bytes(p.d);
  return s;
}

bool wgmma_built() noexcept {
#ifdef KALLPA_CUDA_WGMMA_BUILT
  return true;
#else
  return false;
#endif
}

std::string wgmma_refusal(const FlashParams& p, const DeviceFacts& dev) {
  if (!wgmma_built()) return "this build has no sm_90a code (CUDA 12 or later compiles it)";
  if (dev.cc_major != 9 || dev.cc_minor != 0) {
    return fmt::format("device {} has compute capability {}.{}; the wgmma kernel is sm_90a code, for 9.0 only",
                       dev.name, dev.cc_major, dev.cc_minor);
  }
  if (p.softcap > 0.0f || p.alibi != nullptr || !(p.scale > 0.0f)) {
    return "softcap, ALiBi or a non-positive scale; the wgmma kernel has only the lean softmax";
  }
  return {};
}

KernelChoice choose_kernel(const FlashParams& p, const std::vector<SeqMeta>& meta, const DeviceFacts& dev) {
  if (std::string tc = tensor_core_refusal(p, meta); !tc.empty()) {
    if (decode_refusal(p, meta).empty()) return {FlashKernel::decode, std::move(tc)};
    return {FlashKernel::generic, std::move(tc)};
  }
  if (std::string why = wgmma_refusal(p, dev); !why.empty()) return {FlashKernel::tensor_core, std::move(why)};
  return {FlashKernel::wgmma, {}};
}

LaunchShape tensor_core_launch(const FlashParams& p) noexcept {
  const bool wgmma = p.kernel == FlashKernel::wgmma;
  LaunchShape s;
  s.grid[0] = clamp_unsigned(ceil_div(p.max_sq, wgmma ? kWgmmaBlockQ : kTcBlockQ));
  s.grid[1] = clamp_unsigned(p.hq);
  s.grid[2] = clamp_unsigned(p.batch);
  s.block = wgmma ? kWgmmaThreads : kTcThreads;
  s.smem_bytes = wgmma ? wgmma_smem_bytes(p.d) : tensor_core_smem_bytes(p.d);
  return s;
}

LaunchShape generic_launch(const FlashParams& p) noexcept {
  LaunchShape s;
  s.grid[0] = clamp_unsigned(ceil_div(std::int64_t{p.max_sq} * p.hq, kGenericWarps));
  s.grid[1] = clamp_unsigned(p.num_splits);
  s.grid[2] = clamp_unsigned(p.batch);
  s.block = kGenericThreads;
  s.smem_bytes = generic_smem_bytes(p.d, p.dv);
  return s;
}

namespace {
// At most `wanted` splits (also capped by kMinKeysPerSplit keys each, the caller's memory and
// kMaxSplits), each a whole number of 32-key chunks; none when that leaves one.
SplitPlan split_keys(std::int64_t wanted, std::int64_t max_seqlen_k, std::int64_t max_splits) noexcept {
  SplitPlan plan;
  std::int64_t splits =
      std::min({wanted, max_seqlen_k / kMinKeysPerSplit, std::min<std::int64_t>(max_splits, kMaxSplits)});
  if (splits <= 1) return plan;
  const std::int64_t keys = ceil_div(ceil_div(max_seqlen_k, splits), 32) * 32;
  splits = ceil_div(max_seqlen_k, keys);  // rounding the chunk up may leave the last split empty
  if (splits <= 1) return plan;
  plan.splits = static_cast<int>(splits);
  plan.keys_per_split = static_cast<int>(keys);
  return plan;
}
}  // namespace

SplitPlan plan_splits(std::int64_t blocks_without_split, std::int64_t max_seqlen_k, int sm_count,
                      std::int64_t max_splits) noexcept {
  const std::int64_t target = kSplitBlocksPerSm * std::int64_t{std::max(sm_count, 1)};
  if (blocks_without_split <= 0 || blocks_without_split >= target || max_seqlen_k < 2 * kMinKeysPerSplit) {
    return {};
  }
  return split_keys(ceil_div(target, blocks_without_split), max_seqlen_k, max_splits);
}

SplitPlan plan_decode_splits(std::int64_t units, std::int64_t max_seqlen_k, int sm_count,
                             std::int64_t max_splits) noexcept {
  if (units <= 0) return {};
  const std::int64_t resident = std::int64_t{kDecodeResidentWarpsPerSm} * std::max(sm_count, 1);
  return split_keys(resident / units, max_seqlen_k, max_splits);
}

std::string grid_refusal(const LaunchShape& shape) {
  if (shape.grid[0] > 0x7fffffffu) return fmt::format("grid x of {} is over CUDA's 2^31 - 1", shape.grid[0]);
  if (shape.grid[1] > 65535u)
    return fmt::format("grid y of {} (query heads or KV splits) is over CUDA's 65535", shape.grid[1]);
  if (shape.grid[2] > 65535u)
    return fmt::format("a batch of {} sequences is over CUDA's grid limit of 65535", shape.grid[2]);
  return {};
}

}  // namespace kallpa::cuda

// ---- supports() ---------------------------------------------------------------------------------
#include "backends/cuda/flash_support.h"

namespace kallpa::cuda {

Support flash_support(const ProblemSignature& sig, const DeviceFacts* device, std::string_view unavailable) {
  if (device == nullptr) return Support::no(std::string(unavailable));
  if (sig.device.kind != DeviceKind::cuda || sig.device.index != device->index) {
    return Support::no(
        fmt::format("the tensors are on {}; cuda-flash runs on cuda:{} ('{}'): put them there "
                    "through its device_memory()",
                    sig.device.to_string(), device->index, device->name));
  }
  // Every dtype, layout, mask and head dim has the generic kernel; its only limit is shared memory
  // for one q row and one output row per warp.
  const std::size_t need = generic_smem_bytes(sig.head_dim, sig.head_dim_v);
  if (need > device->smem_per_block_optin) {
    return Support::no(fmt::format("head dims {}/{} need {} bytes of shared memory per block; '{}' allows {}",
                                   sig.head_dim, sig.head_dim_v, need, device->name, device->smem_per_block_optin));
  }
  return Support::yes();
}

}  // namespace kallpa::cuda
