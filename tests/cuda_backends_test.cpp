// cuda-flash and cudnn. Without a CUDA device (CI here) the backends must stay registered, say why
// they are unavailable, and have their device tests reported as skipped with that reason; their
// host-side planning (kernel choice, KV splits, launch shapes, supports() verdicts) is pure and
// tested everywhere. With a device, targeted cases push each kernel path through the conformance
// judge (the full matrix runs in conformance_test.cpp for every registered backend).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kallpa/conformance.h"
#include "kallpa/device.h"
#include "kallpa/registry.h"

#if KALLPA_HAS_CUDA_BACKENDS
#include "backends/cuda/flash_plan.h"
#include "backends/cuda/flash_support.h"
#endif
#if KALLPA_HAS_CUDNN_BACKEND
#include "backends/cuda/cudnn_support.h"
#endif

namespace kallpa {
namespace {

#if KALLPA_HAS_CUDA_BACKENDS

struct CudaBackend {
  AttentionBackend* backend = nullptr;
  std::string why_not;  // non-empty: no device
};

CudaBackend cuda_backend(const char* name) {
  CudaBackend c;
  c.backend = BackendRegistry::global().find(name);
  if (c.backend == nullptr) {
    c.why_not = std::string(name) + " is not registered";
  } else if (c.backend->device_memory() == nullptr) {
    ProblemSignature sig;
    sig.device = Device{DeviceKind::cuda, 0};
    c.why_not = "no CUDA device: " + c.backend->supports(sig).why_not;
  }
  return c;
}

ProblemSignature cuda_sig(DType dtype, int d) {
  ProblemSignature sig;
  sig.device = Device{DeviceKind::cuda, 0};
  sig.q_dtype = sig.kv_dtype = sig.o_dtype = dtype;
  sig.hq = 8;
  sig.hkv = 2;
  sig.head_dim = sig.head_dim_v = d;
  return sig;
}

// ---- availability (runs everywhere) ------------------------------------------------------------

TEST(CudaBackends, AreRegisteredAndSayWhyWithoutADevice) {
  std::vector<const char*> names = {"cuda-flash"};
#if KALLPA_HAS_CUDNN_BACKEND
  names.push_back("cudnn");
#endif
  for (const char* name : names) {
    SCOPED_TRACE(name);
    AttentionBackend* b = BackendRegistry::global().find(name);
    ASSERT_NE(b, nullptr);
    EXPECT_EQ(b->device_kind(), DeviceKind::cuda);
    const Support s = b->supports(cuda_sig(DType::bf16, 128));
    if (b->device_memory() != nullptr) {
      EXPECT_TRUE(s.ok) << s.why_not;
      continue;
    }
    // No device: the reason is the CUDA runtime's (or cuDNN's), and a case is skipped with it.
    ASSERT_FALSE(s.ok);
    EXPECT_FALSE(s.why_not.empty());
    EXPECT_TRUE(s.why_not.find("CUDA") != std::string::npos || s.why_not.find("cuDNN") != std::string::npos)
        << s.why_not;
    const conformance::CaseResult r = conformance::run_case(*b, conformance::canary_cases().front());
    EXPECT_TRUE(r.skipped);
    EXPECT_FALSE(r.passed);
    EXPECT_EQ(r.skip_reason, s.why_not);
  }
}

// ---- cuda-flash's planner (runs everywhere) ----------------------------------------------------

cuda::FlashParams tc_params() {
  cuda::FlashParams p;
  p.q_dtype = p.kv_dtype = p.o_dtype = cuda::kBF16;
  p.d = p.dv = 128;
  p.batch = 2;
  p.hq = 32;
  p.hkv = 8;
  p.group = 4;
  p.max_sq = 4096;
  p.total_q = 8192;
  // Device addresses are never dereferenced by the planner; only their alignment matters.
  p.q = reinterpret_cast<const void*>(std::uintptr_t{0x7f0000001000});
  p.k = reinterpret_cast<const void*>(std::uintptr_t{0x7f0000101000});
  p.v = reinterpret_cast<const void*>(std::uintptr_t{0x7f0000201000});
  p.q_rs = 32 * 128, p.q_hs = 128;
  p.k_rs = p.v_rs = 8 * 128, p.k_hs = p.v_hs = 128;
  return p;
}

TEST(CudaFlashPlan, TensorCoreKernelTakesAlignedSixteenBitHeadDims64And128) {
  std::vector<cuda::SeqMeta> meta(2);
  meta[1].q = 4096 * 32 * 128;
  meta[1].k = meta[1].v = 4096 * 8 * 128;
  cuda::FlashParams p = tc_params();
  EXPECT_EQ(cuda::tensor_core_refusal(p, meta), "");
  p.d = p.dv = 64;
  EXPECT_EQ(cuda::tensor_core_refusal(p, meta), "");

  auto refusal = [&](auto change) {
    cuda::FlashParams x = tc_params();
    std::vector<cuda::SeqMeta> m = meta;
    change(x, m);
    return cuda::tensor_core_refusal(x, m);
  };
  EXPECT_NE(
      refusal([](cuda::FlashParams& x, auto&) { x.q_dtype = x.kv_dtype = x.o_dtype = cuda::kF32; }).find("f16 or bf16"),
      std::string::npos);
  EXPECT_NE(refusal([](cuda::FlashParams& x, auto&) { x.o_dtype = cuda::kF32; }).find("bf16/bf16/f32"),
            std::string::npos);
  EXPECT_NE(refusal([](cuda::FlashParams& x, auto&) { x.d = x.dv = 96; }).find("head dims 96/96"), std::string::npos);
  EXPECT_NE(refusal([](cuda::FlashParams& x, auto&) { x.dv = 64; }).find("head dims 128/64"), std::string::npos);
  EXPECT_NE(refusal([](cuda::FlashParams& x, auto&) { x.k_ds = 2; }).find("unit stride"), std::string::npos);
  EXPECT_NE(refusal([](cuda::FlashParams& x, auto&) { x.v_hs = 132; }).find("not a multiple of 8"), std::string::npos);
  EXPECT_NE(refusal([](cuda::FlashParams& x, auto&) {
              x.q = reinterpret_cast<const void*>(std::uintptr_t{0x7f0000001008});
            }).find("16-byte boundary"),
            std::string::npos);
  EXPECT_NE(refusal([](cuda::FlashParams&, auto& m) { m[1].k += 4; }).find("16-byte boundary"), std::string::npos);
  EXPECT_NE(refusal([](cuda::FlashParams& x, auto&) { x.max_sq = 1; }).find("split-KV"), std::string::npos);
}

TEST(CudaFlashPlan, WgmmaKernelRunsOnlyOnComputeCapability90WithTheLeanSoftmax) {
  cuda::FlashParams p = tc_params();
  cuda::DeviceFacts h200;
  h200.name = "H200";
  h200.cc_major = 9;
  h200.cc_minor = 0;
  if (cuda::wgmma_built()) {
    EXPECT_EQ(cuda::wgmma_refusal(p, h200), "");
  } else {
    EXPECT_NE(cuda::wgmma_refusal(p, h200).find("sm_90a"), std::string::npos);
  }
  cuda::DeviceFacts other = h200;
  for (auto [major, minor] : {std::pair{8, 0}, std::pair{8, 9}, std::pair{10, 0}}) {
    other.cc_major = major;
    other.cc_minor = minor;
    EXPECT_NE(cuda::wgmma_refusal(p, other).find("compute capability"), std::string::npos) << major << "." << minor;
  }
  cuda::FlashParams x = p;
  x.softcap = 30.0f;
  EXPECT_NE(cuda::wgmma_refusal(x, h200).find("softcap"), std::string::npos);
  x = p;
  const float slopes[1] = {0.5f};
  x.alibi = slopes;
  EXPECT_NE(cuda::wgmma_refusal(x, h200), "");
  x = p;
  x.scale = -0.1f;
  EXPECT_NE(cuda::wgmma_refusal(x, h200), "");
}

// choose_kernel()'s rule (flash_plan.h): tensor cores where the problem qualifies -- wgmma on a
// compute capability 9.0 device with the lean softmax, mma.sync elsewhere -- then the split-KV
// decode kernel, then the generic kernel.
TEST(CudaFlashPlan, ChoosesOneKernelByDeviceAndProblem) {
  std::vector<cuda::SeqMeta> meta(2);
  meta[1].q = 4096 * 32 * 128;
  meta[1].k = meta[1].v = 4096 * 8 * 128;
  cuda::DeviceFacts h200;
  h200.name = "H200";
  h200.cc_major = 9;
  cuda::DeviceFacts a100 = h200;
  a100.name = "A100";
  a100.cc_major = 8;
  cuda::DeviceFacts blackwell = h200;
  blackwell.name = "B200";
  blackwell.cc_major = 10;
  const cuda::FlashParams prefill = tc_params();
  // A build without sm_90a code (CUDA 11) has no wgmma kernel to choose.
  const cuda::FlashKernel hopper_prefill =
      cuda::wgmma_built() ? cuda::FlashKernel::wgmma : cuda::FlashKernel::tensor_core;
  EXPECT_EQ(cuda::choose_kernel(prefill, meta, h200).kernel, hopper_prefill);
  EXPECT_EQ(cuda::choose_kernel(prefill, meta, a100).kernel, cuda::FlashKernel::tensor_core);
  EXPECT_NE(cuda::choose_kernel(prefill, meta, a100).why.find("compute capability 8.0"), std::string::npos);
  EXPECT_EQ(cuda::choose_kernel(prefill, meta, blackwell).kernel, cuda::FlashKernel::tensor_core);
  // The Hopper kernel has only the lean softmax: softcap, ALiBi or a negative scale take mma.sync.
  cuda::FlashParams x = prefill;
  x.softcap = 50.0f;
  EXPECT_EQ(cuda::choose_kernel(x, meta, h200).kernel, cuda::FlashKernel::tensor_core);
  x = prefill;
  const float slopes[1] = {0.5f};
  x.alibi = slopes;
  EXPECT_EQ(cuda::choose_kernel(x, meta, h200).kernel, cuda::FlashKernel::tensor_core);
  x = prefill;
  x.scale = -1.0f;
  EXPECT_EQ(cuda::choose_kernel(x, meta, h200).kernel, cuda::FlashKernel::tensor_core);
  // Head dim 64 qualifies too; 96 does not, and a prefill there takes the generic kernel.
  x = prefill;
  x.d = x.dv = 64;
  EXPECT_EQ(cuda::choose_kernel(x, meta, h200).kernel, hopper_prefill);
  x.d = x.dv = 96;
  EXPECT_EQ(cuda::choose_kernel(x, meta, h200).kernel, cuda::FlashKernel::generic);
  EXPECT_NE(cuda::choose_kernel(x, meta, h200).why.find("head dims 96/96"), std::string::npos);
  // f32 everywhere: generic on every device.
  x = prefill;
  x.q_dtype = x.kv_dtype = x.o_dtype = cuda::kF32;
  EXPECT_EQ(cuda::choose_kernel(x, meta, h200).kernel, cuda::FlashKernel::generic);
  EXPECT_EQ(cuda::choose_kernel(x, meta, a100).kernel, cuda::FlashKernel::generic);
  // Decode (one query row, a group of 4 heads per KV head): the split-KV decode kernel on every
  // device, with bf16 or f32 queries over bf16 K/V; generic with f32 K/V.
  x = prefill;
  x.max_sq = 1;
  for (const cuda::DeviceFacts& dev : {h200, a100, blackwell}) {
    EXPECT_EQ(cuda::choose_kernel(x, meta, dev).kernel, cuda::FlashKernel::decode) << dev.name;
  }
  EXPECT_NE(cuda::choose_kernel(x, meta, h200).why.find("split-KV"), std::string::npos);
  x.q_dtype = x.o_dtype = cuda::kF32;
  EXPECT_EQ(cuda::choose_kernel(x, meta, h200).kernel, cuda::FlashKernel::decode);
  x.kv_dtype = cuda::kF32;
  EXPECT_EQ(cuda::choose_kernel(x, meta, h200).kernel, cuda::FlashKernel::generic);
  // A few query rows over a large group: more than 16 rows x heads per KV head is generic.
  x = prefill;
  x.max_sq = 8;
  EXPECT_EQ(cuda::choose_kernel(x, meta, h200).kernel, cuda::FlashKernel::generic);
  x.max_sq = 4;
  EXPECT_EQ(cuda::choose_kernel(x, meta, h200).kernel, cuda::FlashKernel::decode);
}

// The Hopper kernels' shared-memory layout (what wgmma's 128-byte-swizzle descriptors read; the
// device-side check of the same contract is tools/wgmma_probe.cu).
TEST(CudaFlashPlan, SwizzledTilesHoldEveryChunkOnceAsTheHardwareReadsThem) {
  for (int rows : {64, 128}) {
    for (int d : {64, 128}) {
      const int chunks = d / 8;
      std::vector<bool> used(static_cast<std::size_t>(rows * d * 2 / 16), false);
      for (int r = 0; r < rows; ++r) {
        for (int c = 0; c < chunks; ++c) {
          const std::uint32_t off = cuda::swizzled_chunk(rows, r, c);
          ASSERT_EQ(off % 16, 0u);
          ASSERT_LT(off, static_cast<std::uint32_t>(rows * d * 2)) << rows << " rows, D " << d;
          EXPECT_FALSE(used[off / 16]) << "row " << r << " chunk " << c << " overlaps another";
          used[off / 16] = true;
          // Panel c / 8 holds rows of 128 bytes, rows after rows; within a row the hardware finds
          // chunk c at position (c mod 8) xor (r mod 8).
          EXPECT_EQ(off / 128, static_cast<std::uint32_t>((c / 8) * rows + r));
          EXPECT_EQ(off % 128 / 16, static_cast<std::uint32_t>((c % 8) ^ (r % 8)));
        }
      }
      // A column of chunks over an 8-row atom covers all eight 16-byte positions: all 32 banks.
      for (int c = 0; c < chunks; ++c) {
        unsigned positions = 0;
        for (int r = 0; r < 8; ++r) positions |= 1u << (cuda::swizzled_chunk(rows, r, c) % 128 / 16);
        EXPECT_EQ(positions, 0xffu) << "chunk column " << c;
      }
    }
  }
}

TEST(CudaFlashPlan, LaunchShapesCoverEveryRowHeadAndSequence) {
  cuda::FlashParams p = tc_params();
  p.max_sq = 4097;
  p.kernel = cuda::FlashKernel::tensor_core;
  // mma.sync: 128 query rows per block (32 per warp); the Q tile and two stages of K and V tiles,
  // (128 + 8)-element rows of 2 bytes: over the 48 KiB default (the launcher opts in), under
  // sm_80's 163 KiB and sm_90's 227 KiB.
  const cuda::LaunchShape tc = cuda::tensor_core_launch(p);
  EXPECT_EQ(tc.grid[0], 33u);  // ceil(4097 / 128) query tiles
  EXPECT_EQ(tc.grid[1], 32u);  // query heads
  EXPECT_EQ(tc.grid[2], 2u);   // sequences
  EXPECT_EQ(tc.block, static_cast<unsigned>(cuda::kTcThreads));
  EXPECT_EQ(tc.smem_bytes, 2u * (128 * 136 + 4 * 64 * 136));
  EXPECT_EQ(cuda::tensor_core_smem_bytes(64), 2u * (128 * 72 + 4 * 64 * 72));
  // wgmma (Hopper): two warpgroups (256 threads) of 64 rows, unpadded Q and two stages of 128-key
  // K and V tiles plus 1 KiB of alignment slack: 161 KiB at D 128, under sm_90's 227 KiB.
  p.kernel = cuda::FlashKernel::wgmma;
  const cuda::LaunchShape hopper = cuda::tensor_core_launch(p);
  EXPECT_EQ(hopper.grid[0], 33u);
  EXPECT_EQ(hopper.grid[1], 32u);
  EXPECT_EQ(hopper.grid[2], 2u);
  EXPECT_EQ(hopper.block, 256u);
  EXPECT_EQ(hopper.smem_bytes, 1024u + 2u * (128 * 128 + 4 * 128 * 128));
  EXPECT_LE(hopper.smem_bytes, 227u * 1024u);
  EXPECT_EQ(cuda::wgmma_smem_bytes(64), 1024u + 2u * (128 * 64 + 4 * 128 * 64));

  p.max_sq = 3;
  p.d = 80;
  p.dv = 48;
  p.num_splits = 5;
  const cuda::LaunchShape g = cuda::generic_launch(p);
  EXPECT_EQ(g.grid[0], 24u);  // 3 rows x 32 heads, 4 (row, head) pairs per block
  EXPECT_EQ(g.grid[1], 5u);
  EXPECT_EQ(g.grid[2], 2u);
  EXPECT_EQ(g.smem_bytes, 4u * (80 + 48) * 4);
  EXPECT_EQ(cuda::grid_refusal(g), "");
  p.batch = 70000;
  EXPECT_NE(cuda::grid_refusal(cuda::generic_launch(p)).find("65535"), std::string::npos);
}

TEST(CudaFlashPlan, SplitsTheKvSequenceOnlyWhenRowsCannotFillTheDevice) {
  // Prefill: plenty of blocks, no split.
  EXPECT_EQ(cuda::plan_splits(132 * 8, 32768, 132).splits, 1);
  // Short KV: not worth it.
  EXPECT_EQ(cuda::plan_splits(8, 300, 132).splits, 1);
  // The caller's memory budget caps the splits.
  EXPECT_EQ(cuda::plan_splits(8, 32768, 132, 1).splits, 1);
  EXPECT_EQ(cuda::plan_splits(8, 32768, 132, 3).splits, 3);
  // Decode over 32k keys with 8 blocks of (row, head) pairs on 132 SMs.
  for (std::int64_t skv : {512, 1000, 4097, 32768, 1 << 20}) {
    SCOPED_TRACE(skv);
    const cuda::SplitPlan s = cuda::plan_splits(8, skv, 132);
    ASSERT_GT(s.splits, 1);
    EXPECT_LE(s.splits, cuda::kMaxSplits);
    EXPECT_EQ(s.keys_per_split % 32, 0);
    EXPECT_GE(s.keys_per_split, cuda::kMinKeysPerSplit);
    // Every key is in exactly one split and no split is empty.
    EXPECT_GE(std::int64_t{s.splits} * s.keys_per_split, skv);
    EXPECT_LT(std::int64_t{s.splits - 1} * s.keys_per_split, skv);
    // No more blocks than the target (8 per multiprocessor), give or take one split.
    EXPECT_LE(8 * std::int64_t{s.splits}, cuda::kSplitBlocksPerSm * 132 + 8);
  }
}

TEST(CudaFlashPlan, DecodeKernelTakesUpToSixteenRowsPerKvHeadAndAWarpPerSplit) {
  cuda::FlashParams p = tc_params();  // 32 query heads over 8 KV heads: a group of 4
  const std::vector<cuda::SeqMeta> meta(2);
  p.max_sq = 1;
  EXPECT_EQ(cuda::decode_refusal(p, meta), "");
  EXPECT_NE(cuda::tensor_core_refusal(p, meta), "");
  p.max_sq = 4;  // 4 rows x 4 heads: exactly one 16-row tile
  EXPECT_EQ(cuda::decode_refusal(p, meta), "");
  p.max_sq = 5;
  EXPECT_NE(cuda::decode_refusal(p, meta).find("over the decode kernel's 16"), std::string::npos);
  p.max_sq = 1;
  p.q_dtype = p.o_dtype = cuda::kF32;  // an engine's f32 activations against a 16-bit KV cache
  EXPECT_EQ(cuda::decode_refusal(p, meta), "");
  p.kv_dtype = cuda::kF32;
  EXPECT_NE(cuda::decode_refusal(p, meta).find("f16 or bf16 K/V"), std::string::npos);
  p.q_dtype = p.kv_dtype = p.o_dtype = cuda::kBF16;
  p.k_rs = 8 * 128 + 4;  // the layout conditions are the tensor-core kernel's
  EXPECT_NE(cuda::decode_refusal(p, meta).find("multiple of 8"), std::string::npos);
  p.k_rs = 8 * 128;

  p.num_splits = 9;
  const cuda::LaunchShape s = cuda::decode_launch(p);
  EXPECT_EQ(s.grid[0], 3u);  // 9 splits, a warp each, 4 warps per block
  EXPECT_EQ(s.grid[1], 8u);  // KV heads
  EXPECT_EQ(s.grid[2], 2u);  // sequences
  EXPECT_EQ(s.block, static_cast<unsigned>(cuda::kDecodeThreads));
  // Per warp, K and V steps of 16 x (128 + 8) 2-byte elements, two stages each.
  EXPECT_EQ(s.smem_bytes, 4u * 4 * 16 * 136 * 2);

  // Its splits fill the device's resident warps once: 8 sequences x 8 KV heads on 132 SMs of 12
  // warps each take 1584 / 64 = 24 splits (of 1366 keys, rounded up to 1376): 384 blocks of the
  // 396 that fit at once.
  cuda::SplitPlan plan = cuda::plan_decode_splits(64, 32768, 132);
  EXPECT_EQ(plan.splits, 24);
  EXPECT_EQ(plan.keys_per_split, 1376);
  EXPECT_GE(std::int64_t{plan.splits} * plan.keys_per_split, 32768);
  for (std::int64_t units : {1, 3, 8, 64, 500, 1584}) {
    for (std::int64_t skv : {100, 600, 5000, 32768, 1 << 20}) {
      SCOPED_TRACE(testing::Message() << units << " units, " << skv << " keys");
      plan = cuda::plan_decode_splits(units, skv, 132);
      EXPECT_LE(units * plan.splits, std::max<std::int64_t>(units, 1584));  // never a second wave of its own making
      EXPECT_LE(plan.splits, cuda::kMaxSplits);
      if (plan.splits > 1) {
        EXPECT_GE(plan.keys_per_split, cuda::kMinKeysPerSplit);
        EXPECT_GE(std::int64_t{plan.splits} * plan.keys_per_split, skv);
        EXPECT_LT(std::int64_t{plan.splits - 1} * plan.keys_per_split, skv);
      }
    }
  }
  EXPECT_EQ(cuda::plan_decode_splits(8, 32768, 132, 5).splits, 5);  // the caller's memory budget
}

TEST(CudaFlashSupport, TakesTheWholeContractOnItsDeviceAndSaysWhyNotElsewhere) {
  cuda::DeviceFacts h200;
  h200.index = 0;
  h200.name = "NVIDIA H200";
  h200.sm_count = 132;
  h200.cc_major = 9;
  h200.smem_per_block_optin = 232448;

  EXPECT_EQ(cuda::flash_support(cuda_sig(DType::bf16, 128), nullptr, "CUDA runtime: no device").why_not,
            "CUDA runtime: no device");
  ProblemSignature sig = cuda_sig(DType::f32, 80);
  sig.head_dim_v = 48;
  sig.kv_layout = KvLayout::paged;
  sig.page_size = 7;
  sig.causal = sig.window = sig.softcap = sig.alibi = sig.lse = true;
  sig.unit_stride_last_dim = false;
  EXPECT_TRUE(cuda::flash_support(sig, &h200, "").ok);
  sig.q_dtype = DType::bf16;  // mixed dtypes go to the generic kernel
  EXPECT_TRUE(cuda::flash_support(sig, &h200, "").ok);

  sig.device = Device::cpu();
  const Support host = cuda::flash_support(sig, &h200, "");
  EXPECT_FALSE(host.ok);
  EXPECT_NE(host.why_not.find("device_memory()"), std::string::npos) << host.why_not;
  sig.device = Device{DeviceKind::cuda, 3};
  EXPECT_NE(cuda::flash_support(sig, &h200, "").why_not.find("cuda:3"), std::string::npos);

  sig = cuda_sig(DType::f16, 20000);
  const Support huge = cuda::flash_support(sig, &h200, "");
  EXPECT_FALSE(huge.ok);
  EXPECT_NE(huge.why_not.find("shared memory"), std::string::npos) << huge.why_not;
}

#if KALLPA_HAS_CUDNN_BACKEND
TEST(CudnnSupport, RefusesWhatCudnnsFusedAttentionDoesNotComputeWithReasons) {
  const cuda::CudnnFacts h200{0, "NVIDIA H200", 9, 91900};
  const cuda::CudnnFacts a100{0, "NVIDIA A100", 8, 91900};
  EXPECT_TRUE(cuda::cudnn_support(cuda_sig(DType::bf16, 128), &h200, "").ok);
  EXPECT_TRUE(cuda::cudnn_support(cuda_sig(DType::f16, 256), &h200, "").ok);
  EXPECT_EQ(cuda::cudnn_support(cuda_sig(DType::bf16, 128), nullptr, "cuDNN 9 is not loadable").why_not,
            "cuDNN 9 is not loadable");

  auto why = [](ProblemSignature sig, const cuda::CudnnFacts& f) {
    const Support s = cuda::cudnn_support(sig, &f, "");
    EXPECT_FALSE(s.ok);
    return s.why_not;
  };
  ProblemSignature s = cuda_sig(DType::f32, 128);
  EXPECT_NE(why(s, h200).find("not f32"), std::string::npos);
  s = cuda_sig(DType::bf16, 128);
  s.o_dtype = DType::f32;
  EXPECT_NE(why(s, h200).find("one dtype"), std::string::npos);
  s = cuda_sig(DType::bf16, 128);
  s.softcap = true;
  EXPECT_NE(why(s, h200).find("softcap"), std::string::npos);
  s = cuda_sig(DType::bf16, 128);
  s.alibi = true;
  EXPECT_NE(why(s, h200).find("ALiBi"), std::string::npos);
  s = cuda_sig(DType::bf16, 128);
  s.causal = true;
  EXPECT_NE(why(s, h200).find("causal"), std::string::npos);
  s = cuda_sig(DType::bf16, 128);
  s.window = true;
  EXPECT_NE(why(s, h200).find("sliding-window"), std::string::npos);
  s = cuda_sig(DType::bf16, 128);
  s.kv_layout = KvLayout::paged;
  EXPECT_NE(why(s, h200).find("page-table"), std::string::npos);
  s = cuda_sig(DType::bf16, 128);
  s.q_layout = QLayout::packed;
  EXPECT_NE(why(s, h200).find("dense layouts only"), std::string::npos);
  s = cuda_sig(DType::bf16, 72);
  s.head_dim_v = 64;
  EXPECT_NE(why(s, h200).find("D == Dv"), std::string::npos);
  EXPECT_NE(why(cuda_sig(DType::bf16, 256), a100).find("up to 128"), std::string::npos);
  EXPECT_NE(why(cuda_sig(DType::bf16, 60), h200).find("multiples of 8"), std::string::npos);
  s = cuda_sig(DType::bf16, 128);
  s.device = Device::cpu();
  EXPECT_NE(why(s, h200).find("device_memory()"), std::string::npos);
}
#endif

// ---- on a device ---------------------------------------------------------------------------------

conformance::Case make_case(std::string name, DType dtype, std::vector<std::int32_t> sq, std::vector<std::int32_t> skv,
                            int hq, int hkv, int d) {
  conformance::Case c;
  c.name = std::move(name);
  c.spec.dtype = dtype;
  c.spec.seqlens_q = std::move(sq);
  c.spec.seqlens_k = std::move(skv);
  c.spec.hq = hq;
  c.spec.hkv = hkv;
  c.spec.head_dim = c.spec.head_dim_v = d;
  c.spec.seed = 0x6b616c6c;
  return c;
}

// Prefill shapes that qualify for the tensor-core kernel: both 16-bit dtypes and head dims, tile
// edges (rows and keys not multiples of 64), GQA, causal with Sq < Skv and Sq > Skv, windows,
// softcap with ALiBi, packed and paged layouts, lse, and masked keys holding NaN.
std::vector<conformance::Case> tensor_core_cases() {
  std::vector<conformance::Case> cases;
  for (DType dt : {DType::bf16, DType::f16}) {
    for (int d : {64, 128}) {
      const std::string tag = std::string(dtype_name(dt)) + "/d" + std::to_string(d);
      auto c = make_case(tag + "/causal_gqa_lse", dt, {200, 200}, {200, 200}, 4, 2, d);
      c.spec.causal = true;
      c.spec.lse = true;
      cases.push_back(c);
      c = make_case(tag + "/chunked_prefill", dt, {100}, {300}, 2, 1, d);
      c.spec.causal = true;
      cases.push_back(c);
      c = make_case(tag + "/causal_sq_gt_skv", dt, {130}, {40}, 2, 2, d);
      c.spec.causal = true;
      c.spec.lse = true;
      cases.push_back(c);
      c = make_case(tag + "/window_softcap_alibi", dt, {150}, {150}, 4, 4, d);
      c.spec.window_left = 37;
      c.spec.window_right = 5;
      c.spec.softcap = 20.0f;
      c.spec.alibi = true;
      c.spec.lse = true;
      cases.push_back(c);
    }
  }
  auto c = make_case("bf16/d128/packed_causal", DType::bf16, {70, 0, 129}, {90, 10, 129}, 4, 1, 128);
  c.spec.q_layout = QLayout::packed;
  c.spec.kv_layout = KvLayout::packed;
  c.spec.causal = true;
  c.spec.lse = true;
  cases.push_back(c);
  c = make_case("f16/d64/paged16_causal", DType::f16, {40, 77}, {300, 77}, 4, 2, 64);
  c.spec.q_layout = QLayout::packed;  // dense q needs equal query lengths
  c.spec.kv_layout = KvLayout::paged;
  c.spec.page_size = 16;
  c.spec.causal = true;
  cases.push_back(c);
  // Several 128-key tiles (the Hopper kernels' pipeline over stages), causal and not.
  c = make_case("bf16/d128/causal_gqa_700", DType::bf16, {700}, {700}, 8, 2, 128);
  c.spec.causal = true;
  c.spec.lse = true;
  cases.push_back(c);
  c = make_case("f16/d64/rows_96_keys_1100", DType::f16, {96}, {1100}, 4, 4, 64);
  cases.push_back(c);
  c = make_case("f16/d128/window_600", DType::f16, {600}, {600}, 2, 1, 128);
  c.spec.window_left = 200;
  c.spec.window_right = 0;
  cases.push_back(c);
  c = make_case("bf16/d64/nan_in_masked_kv", DType::bf16, {64}, {192}, 2, 1, 64);
  c.spec.causal = true;
  c.spec.window_left = 50;
  c.spec.edge = conformance::Edge::nan_in_masked_kv;
  cases.push_back(c);
  return cases;
}

// Whether cuda-flash must run case c on the Hopper kernel (wgmma_refusal() on this device and the
// case's softmax).
bool hopper_wgmma_expected(const conformance::Case& c) {
  const cuda::DeviceFacts* dev = cuda::active_device_facts();
  if (dev == nullptr) return false;
  cuda::FlashParams p;
  p.scale = 1.0f;
  p.softcap = c.spec.softcap;
  const float slope = 1.0f;
  p.alibi = c.spec.alibi ? &slope : nullptr;
  return cuda::wgmma_refusal(p, *dev).empty();
}

#define REQUIRE_CUDA(name, var)               \
  const CudaBackend var = cuda_backend(name); \
  if (!var.why_not.empty()) GTEST_SKIP() << var.why_not

void expect_passes(AttentionBackend& backend, const conformance::Case& c) {
  const conformance::CaseResult r = conformance::run_case(backend, c);
  EXPECT_FALSE(r.skipped) << c.name << ": " << r.skip_reason;
  EXPECT_TRUE(r.passed || r.skipped) << c.name << ": " << r.failure;
}

// The tensor-core prefill cases take the tensor-core kernels, the Hopper one wherever it applies.
TEST(CudaFlashDevice, TensorCoreKernelsPassPrefillCases) {
  REQUIRE_CUDA("cuda-flash", cf);
  for (const conformance::Case& c : tensor_core_cases()) {
    const cuda::LaunchCounts before = cuda::launch_counts();
    expect_passes(*cf.backend, c);
    const cuda::LaunchCounts after = cuda::launch_counts();
    EXPECT_GT(after.tensor_core, before.tensor_core) << c.name << " did not take the tensor-core kernel";
    if (hopper_wgmma_expected(c)) {
      EXPECT_GT(after.wgmma, before.wgmma) << c.name << " did not take the wgmma kernel";
    } else {
      EXPECT_EQ(after.wgmma, before.wgmma) << c.name << " took the wgmma kernel where it does not apply";
    }
  }
}

// Decode shapes (one or two query rows, thousands of keys) that the planner splits over the keys.
std::vector<conformance::Case> split_kv_cases() {
  std::vector<conformance::Case> cases;
  auto c = make_case("bf16/d128/decode_5000_lse", DType::bf16, {1, 1}, {5000, 5000}, 8, 2, 128);
  c.spec.lse = true;
  cases.push_back(c);
  c = make_case("f32/d64/decode_3000_causal", DType::f32, {1}, {3000}, 4, 1, 64);
  c.spec.causal = true;
  cases.push_back(c);
  c = make_case("f16/d128/paged_decode_alibi_window", DType::f16, {2, 1}, {2100, 1500}, 8, 1, 128);
  c.spec.q_layout = QLayout::packed;
  c.spec.kv_layout = KvLayout::paged;
  c.spec.page_size = 16;
  c.spec.alibi = true;
  c.spec.window_left = 1200;
  c.spec.lse = true;
  cases.push_back(c);
  // Three query rows x a group of 4 (12 of the decode kernel's 16 rows), causal from the bottom
  // right with a window that leaves some splits without a visible key.
  c = make_case("bf16/d64/decode3_causal_window_lse", DType::bf16, {3, 2}, {700, 900}, 8, 2, 64);
  c.spec.q_layout = QLayout::packed;
  c.spec.kv_layout = KvLayout::packed;
  c.spec.causal = true;
  c.spec.window_left = 100;
  c.spec.lse = true;
  cases.push_back(c);
  return cases;
}

// The device tests' cases must themselves be valid: each builds and passes on cpu-flash, which runs
// everywhere (two once failed only on the GPU machine: paged K/V with unequal query lengths needs
// packed q).
TEST(CudaFlashCases, AreWellFormedAndPassOnTheCpu) {
  AttentionBackend* cpu = BackendRegistry::global().find("cpu-flash");
  ASSERT_NE(cpu, nullptr);
  for (const conformance::Case& c : tensor_core_cases()) expect_passes(*cpu, c);
  for (const conformance::Case& c : split_kv_cases()) expect_passes(*cpu, c);
}

TEST(CudaFlashDevice, SplitKvDecodePassesAndSplits) {
  REQUIRE_CUDA("cuda-flash", cf);
  const std::vector<conformance::Case> cases = split_kv_cases();
  for (const conformance::Case& k : cases) {
    const cuda::LaunchCounts before = cuda::launch_counts();
    expect_passes(*cf.backend, k);
    EXPECT_GT(cuda::launch_counts().split_kv, before.split_kv) << k.name << " was not split";
  }
}

// 16-bit decode with at most 16 query rows x heads per KV head takes the tensor-core decode kernel,
// split or not (a short KV sequence is one split).
TEST(CudaFlashDevice, DecodeKernelTakesSixteenBitDecode) {
  REQUIRE_CUDA("cuda-flash", cf);
  std::vector<conformance::Case> cases;
  for (const conformance::Case& c : split_kv_cases()) {
    if (c.spec.dtype != DType::f32) cases.push_back(c);
  }
  auto c = make_case("f16/d128/decode_short_kv_softcap", DType::f16, {1, 1}, {40, 40}, 4, 1, 128);
  c.spec.softcap = 30.0f;
  c.spec.lse = true;
  cases.push_back(c);
  for (const conformance::Case& k : cases) {
    const cuda::LaunchCounts before = cuda::launch_counts();
    expect_passes(*cf.backend, k);
    EXPECT_GT(cuda::launch_counts().decode, before.decode) << k.name << " did not take the decode kernel";
  }
}

TEST(CudaFlashDevice, GenericKernelTakesOddHeadDimsAndMixedDtypes) {
  REQUIRE_CUDA("cuda-flash", cf);
  auto c = make_case("f16/d80_dv48/causal", DType::f16, {33, 33}, {47, 47}, 6, 2, 80);
  c.spec.head_dim_v = 48;
  c.spec.causal = true;
  c.spec.lse = true;
  const cuda::LaunchCounts before = cuda::launch_counts();
  expect_passes(*cf.backend, c);
  EXPECT_GT(cuda::launch_counts().generic, before.generic);
}

TEST(CudaFlashDevice, PassesTheCanaries) {
  REQUIRE_CUDA("cuda-flash", cf);
  for (const conformance::Case& c : conformance::canary_cases()) expect_passes(*cf.backend, c);
}

#if KALLPA_HAS_CUDNN_BACKEND
TEST(CudnnDevice, MatchesTheReferenceOnDenseNonCausalCases) {
  REQUIRE_CUDA("cudnn", cd);
  std::vector<conformance::Case> cases;
  for (DType dt : {DType::bf16, DType::f16}) {
    auto c = make_case(std::string(dtype_name(dt)) + "/d128/gqa_lse", dt, {256, 256}, {256, 256}, 8, 2, 128);
    c.spec.lse = true;
    cases.push_back(c);
    cases.push_back(make_case(std::string(dtype_name(dt)) + "/d64/sq100_skv300", dt, {100}, {300}, 4, 4, 64));
    cases.push_back(make_case(std::string(dtype_name(dt)) + "/d128/decode", dt, {1, 1}, {4096, 4096}, 8, 1, 128));
  }
  for (const conformance::Case& c : cases) expect_passes(*cd.backend, c);
}
#endif

#else  // !KALLPA_HAS_CUDA_BACKENDS

TEST(CudaBackends, AreNotBuiltWithoutNvcc) {
  GTEST_SKIP() << "cuda-flash and cudnn are not built: no CUDA compiler at configure time (or KALLPA_WITH_CUDA=OFF)";
}

#endif

}  // namespace
}  // namespace kallpa
