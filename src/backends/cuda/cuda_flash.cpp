// cuda-flash: the attention contract on a CUDA device (the kernels: flash_kernels.h). This file
// plans a launch on the host: it checks that the views are device memory of this backend, resolves
// the per-sequence geometry and copies it, the block table and the ALiBi slopes (host memory in the
// contract) to the device, picks a kernel (choose_kernel(), flash_plan.h: wgmma on a Hopper,
// mma.sync elsewhere, split-KV decode, generic; KV splits where the rows alone cannot fill the
// device) and waits for the result.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "backends/cuda/cuda_device.h"
#include "backends/cuda/flash_kernels.h"
#include "backends/cuda/flash_plan.h"
#include "backends/cuda/flash_support.h"
#include "kallpa/backend.h"
#include "kallpa/registry.h"

namespace kallpa::cuda {
namespace {

std::int64_t stride_at(const TensorView& t, int from_end) noexcept {
  return t.stride[static_cast<std::size_t>(t.rank - from_end)];
}

std::size_t align_up(std::size_t n) noexcept { return (n + 255) / 256 * 256; }

std::int32_t code_of(DType t) noexcept { return static_cast<std::int32_t>(t); }

std::atomic<std::uint64_t> g_tensor_core{0}, g_generic{0}, g_decode{0}, g_split{0}, g_wgmma{0};

std::string_view kernel_name(FlashKernel k) noexcept {
  switch (k) {
    case FlashKernel::wgmma: return "wgmma tensor-core";
    case FlashKernel::tensor_core: return "mma.sync tensor-core";
    case FlashKernel::decode: return "decode";
    default: return "generic";
  }
}

// The chosen prefill kernel; a build without sm_90a code never chooses wgmma (wgmma_refusal()).
cudaError_t launch_forward(const FlashParams& p, cudaStream_t stream) {
#ifdef KALLPA_CUDA_WGMMA_BUILT
  if (p.kernel == FlashKernel::wgmma) return launch_forward_wgmma(p, stream);
#endif
  return launch_forward_tensor_core(p, stream);
}

class CudaFlash final : public AttentionBackend {
 public:
  std::string_view name() const noexcept override { return "cuda-flash"; }
  std::string_view version() const noexcept override { return "1.0.0"; }
  DeviceKind device_kind() const noexcept override { return DeviceKind::cuda; }
  int priority() const noexcept override { return 200; }
  std::string_view description() const noexcept override {
    return "FlashAttention-2 forward on tensor cores (wgmma on Hopper, mma.sync elsewhere; f16/bf16, D 64/128), "
           "split-KV decode on tensor cores (a warp per KV head's query group), generic f32-FMA kernel for the rest; "
           "sm_80+";
  }

  Support supports(const ProblemSignature& sig) const noexcept override {
    try {
      CudaDevice* dev = CudaDevice::get();
      return flash_support(sig, dev != nullptr ? &dev->facts() : nullptr, CudaDevice::unavailable_reason());
    } catch (const std::exception& e) {
      return Support::no(fmt::format("cuda-flash: {}", e.what()));
    }
  }

  DeviceMemory* device_memory() const noexcept override {
    CudaDevice* dev = CudaDevice::get();
    return dev != nullptr ? &dev->memory() : nullptr;
  }

  Status run(const ValidatedProblem& vp, Workspace) noexcept override {
    try {
      return run_impl(vp);
    } catch (const std::bad_alloc&) {
      return Status(ErrorCode::out_of_memory, "cuda-flash", "out of host memory while planning the launch");
    } catch (const std::exception& e) {
      return Status(ErrorCode::internal, "cuda-flash", e.what());
    }
  }

 private:
  static Status run_impl(const ValidatedProblem& vp) {
    CudaDevice* dev = CudaDevice::get();
    if (dev == nullptr) return Status(ErrorCode::unsupported, "cuda-flash", CudaDevice::unavailable_reason());
    const AttentionProblem& p = vp.problem();
    CudaMemory& memory = dev->memory();
    const std::pair<const TensorView*, const char*> views[] = {
        {&p.q, "q.data"}, {&p.k, "k.data"}, {&p.v, "v.data"}, {&p.o, "o.data"}, {&p.lse, "lse.data"}};
    for (const auto& [view, what] : views) {
      // A view with no elements (k/v of a pool with zero blocks) is never read (attention.h).
      if (!view->present() || view->numel() == 0) continue;
      const auto [low, high] = view_byte_extent(*view);
      if (Status s = memory.check(view->data, low, high, what); !s) return s;
    }
    if (vp.total_q() == 0) return {};

    const bool paged = p.kv_layout == KvLayout::paged;
    const std::int32_t batch = vp.batch();
    FlashParams fp;
    fp.q = p.q.data;
    fp.k = p.k.data;
    fp.v = p.v.data;
    fp.o = p.o.data;
    fp.lse = static_cast<float*>(p.lse.data);
    fp.q_dtype = code_of(p.q.dtype);
    fp.kv_dtype = code_of(p.k.dtype);
    fp.o_dtype = code_of(p.o.dtype);
    fp.batch = batch;
    fp.hq = vp.hq();
    fp.hkv = vp.hkv();
    fp.group = vp.group_size();
    fp.d = vp.head_dim();
    fp.dv = vp.head_dim_v();
    if (vp.max_seqlen_q() > INT32_MAX || vp.max_seqlen_k() > INT32_MAX) {
      return Status(ErrorCode::unsupported, "cuda-flash", "sequences longer than 2^31 - 1 rows");
    }
    fp.max_sq = static_cast<std::int32_t>(vp.max_seqlen_q());
    fp.total_q = vp.total_q();
    fp.q_rs = stride_at(p.q, 3), fp.q_hs = stride_at(p.q, 2), fp.q_ds = stride_at(p.q, 1);
    fp.k_rs = stride_at(p.k, 3), fp.k_hs = stride_at(p.k, 2), fp.k_ds = stride_at(p.k, 1);
    fp.v_rs = stride_at(p.v, 3), fp.v_hs = stride_at(p.v, 2), fp.v_ds = stride_at(p.v, 1);
    fp.o_rs = stride_at(p.o, 3), fp.o_hs = stride_at(p.o, 2), fp.o_ds = stride_at(p.o, 1);
    if (paged) {
      fp.paged = true;
      fp.k_bs = p.k.stride[0];
      fp.v_bs = p.v.stride[0];
      fp.page_size = static_cast<std::int32_t>(p.k.shape[1]);
      fp.table_stride = p.block_table_stride > 0 ? p.block_table_stride : p.max_blocks_per_seq;
    }
    if (p.lse.present()) {
      const bool packed_lse = p.q_layout == QLayout::packed;  // [Hq, Tq], else [B, Hq, Sq]
      fp.lse_hs = packed_lse ? p.lse.stride[0] : p.lse.stride[1];
      fp.lse_is = packed_lse ? p.lse.stride[1] : p.lse.stride[2];
    }
    fp.causal = p.causal;
    fp.window_left = vp.window_left();
    fp.window_right = vp.window_right();
    fp.scale = vp.scale();
    fp.softcap = p.softcap;

    std::vector<SeqMeta> meta(static_cast<std::size_t>(batch));
    std::int64_t row0 = 0;
    for (std::int32_t b = 0; b < batch; ++b) {
      SeqMeta& m = meta[static_cast<std::size_t>(b)];
      const std::int64_t sq = vp.seqlen_q(b), skv = vp.seqlen_k(b);
      m.q = sq > 0 ? vp.q_row_offset(b, 0) : 0;
      m.o = sq > 0 ? vp.o_row_offset(b, 0) : 0;
      m.lse = sq > 0 && p.lse.present() ? vp.lse_offset(b, 0, 0) : 0;
      m.k = !paged && skv > 0 ? vp.k_row_offset(b, 0) : 0;
      m.v = !paged && skv > 0 ? vp.v_row_offset(b, 0) : 0;
      m.row0 = row0;
      m.sq = static_cast<std::int32_t>(sq);
      m.skv = static_cast<std::int32_t>(skv);
      row0 += sq;
    }

    // fp.alibi gets its device copy below; the choice needs only to know whether there are slopes.
    FlashParams as_run = fp;
    as_run.alibi = p.alibi_slopes;
    const KernelChoice choice = choose_kernel(as_run, meta, dev->facts());
    fp.kernel = choice.kernel;
    const bool tensor_cores = choice.kernel == FlashKernel::tensor_core || choice.kernel == FlashKernel::wgmma;
    const bool decode = choice.kernel == FlashKernel::decode;
    LaunchShape shape;
    // Splits the partial results' scratch allows: each holds an output row, a max and a sum per
    // (query row, head).
    const std::size_t per_split = static_cast<std::size_t>(fp.total_q) * static_cast<std::size_t>(fp.hq) *
                                  (static_cast<std::size_t>(fp.dv) + 2) * sizeof(float);
    const auto max_splits = static_cast<std::int64_t>(kSplitScratchBudget / std::max<std::size_t>(per_split, 1));
    if (tensor_cores) {
      shape = tensor_core_launch(fp);
    } else if (decode) {
      // One warp per (sequence, KV head, split), one wave of them.
      const SplitPlan split =
          plan_decode_splits(std::int64_t{fp.batch} * fp.hkv, vp.max_seqlen_k(), dev->facts().sm_count, max_splits);
      fp.num_splits = split.splits;
      fp.keys_per_split = split.splits > 1 ? split.keys_per_split
                                           : static_cast<std::int32_t>(std::max<std::int64_t>(vp.max_seqlen_k(), 1));
      shape = decode_launch(fp);
    } else {
      const LaunchShape unsplit = generic_launch(fp);
      const SplitPlan split = plan_splits(std::int64_t{unsplit.grid[0]} * unsplit.grid[2], vp.max_seqlen_k(),
                                          dev->facts().sm_count, max_splits);
      fp.num_splits = split.splits;
      fp.keys_per_split = split.keys_per_split;
      shape = generic_launch(fp);
    }
    if (std::string why = grid_refusal(shape); !why.empty()) {
      return Status(ErrorCode::unsupported, "cuda-flash", std::move(why));
    }
    spdlog::trace("cuda-flash: {} kernel, grid {}x{}x{}{}", kernel_name(choice.kernel), shape.grid[0], shape.grid[1],
                  shape.grid[2], choice.why.empty() ? "" : fmt::format(" ({})", choice.why));

    // Scratch layout: sequence geometry, block table, ALiBi slopes, split partials.
    const std::size_t meta_bytes = meta.size() * sizeof(SeqMeta);
    const std::size_t table_entries =
        paged ? static_cast<std::size_t>((batch - 1) * fp.table_stride + p.max_blocks_per_seq) : 0;
    const std::size_t table_bytes = table_entries * sizeof(std::int32_t);
    const std::size_t alibi_bytes = p.alibi_slopes != nullptr ? static_cast<std::size_t>(fp.hq) * sizeof(float) : 0;
    const std::size_t rows = static_cast<std::size_t>(fp.total_q) * static_cast<std::size_t>(fp.hq);
    // The decode kernel always writes partials (one per warp), even unsplit.
    const std::size_t splits = fp.num_splits > 1 || decode ? static_cast<std::size_t>(fp.num_splits) : 0;
    const std::size_t part_o_bytes = splits * rows * static_cast<std::size_t>(fp.dv) * sizeof(float);
    const std::size_t part_ml_bytes = splits * rows * sizeof(float);
    const std::size_t total = align_up(meta_bytes) + align_up(table_bytes) + align_up(alibi_bytes) +
                              align_up(part_o_bytes) + 2 * align_up(part_ml_bytes);

    Result<CudaDevice::Lease> lease = dev->lease();
    if (!lease) return lease.status();
    Result<void*> scratch = lease->scratch(total);
    if (!scratch) return scratch.status();
    const cudaStream_t stream = lease->stream();
    auto* cursor = static_cast<std::byte*>(*scratch);
    auto take = [&cursor](std::size_t bytes) {
      std::byte* at = cursor;
      cursor += align_up(bytes);
      return at;
    };
    auto copy_in = [&](std::byte* dst, const void* src, std::size_t bytes, const char* what) -> Status {
      if (bytes == 0) return {};
      const cudaError_t err = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream);
      return err == cudaSuccess ? Status{} : cuda_failure("cudaMemcpyAsync", err, what);
    };
    std::byte* meta_dev = take(meta_bytes);
    std::byte* table_dev = take(table_bytes);
    std::byte* alibi_dev = take(alibi_bytes);
    if (Status s = copy_in(meta_dev, meta.data(), meta_bytes, "sequence geometry"); !s) return s;
    if (Status s = copy_in(table_dev, p.block_table, table_bytes, "block_table"); !s) return s;
    if (Status s = copy_in(alibi_dev, p.alibi_slopes, alibi_bytes, "alibi_slopes"); !s) return s;
    fp.meta = reinterpret_cast<const SeqMeta*>(meta_dev);
    fp.block_table = paged ? reinterpret_cast<const std::int32_t*>(table_dev) : nullptr;
    fp.alibi = p.alibi_slopes != nullptr ? reinterpret_cast<const float*>(alibi_dev) : nullptr;
    if (splits > 0) {
      fp.part_o = reinterpret_cast<float*>(take(part_o_bytes));
      fp.part_m = reinterpret_cast<float*>(take(part_ml_bytes));
      fp.part_l = reinterpret_cast<float*>(take(part_ml_bytes));
    }

    (tensor_cores ? g_tensor_core : decode ? g_decode : g_generic).fetch_add(1, std::memory_order_relaxed);
    if (fp.num_splits > 1) g_split.fetch_add(1, std::memory_order_relaxed);
    if (choice.kernel == FlashKernel::wgmma) g_wgmma.fetch_add(1, std::memory_order_relaxed);
    if (tensor_cores) {
      if (const cudaError_t err = launch_forward(fp, stream); err != cudaSuccess) {
        return cuda_failure("flash_tensor_core launch", err,
                            fmt::format("grid {}x{}x{}, {} bytes shared", shape.grid[0], shape.grid[1], shape.grid[2],
                                        shape.smem_bytes));
      }
    } else if (decode) {
      if (const cudaError_t err = launch_flash_decode(fp, stream); err != cudaSuccess) {
        return cuda_failure("flash_decode_tc launch", err,
                            fmt::format("grid {}x{}x{}, {} bytes shared", shape.grid[0], shape.grid[1], shape.grid[2],
                                        shape.smem_bytes));
      }
      if (const cudaError_t err = launch_flash_combine(fp, stream); err != cudaSuccess) {
        return cuda_failure("flash_combine launch", err, fmt::format("{} splits", fp.num_splits));
      }
    } else {
      if (const cudaError_t err = launch_flash_generic(fp, stream); err != cudaSuccess) {
        return cuda_failure("flash_generic launch", err,
                            fmt::format("grid {}x{}x{}, {} bytes shared", shape.grid[0], shape.grid[1], shape.grid[2],
                                        shape.smem_bytes));
      }
      if (fp.num_splits > 1) {
        if (const cudaError_t err = launch_flash_combine(fp, stream); err != cudaSuccess) {
          return cuda_failure("flash_combine launch", err, fmt::format("{} splits", fp.num_splits));
        }
      }
    }
    const cudaError_t err = cudaStreamSynchronize(stream);
    return err == cudaSuccess ? Status{} : cuda_failure("cudaStreamSynchronize", err, "cuda-flash kernels");
  }
};

KALLPA_REGISTER_BACKEND(CudaFlash);

}  // namespace

const DeviceFacts* active_device_facts() noexcept {
  const CudaDevice* dev = CudaDevice::get();
  return dev != nullptr ? &dev->facts() : nullptr;
}

LaunchCounts launch_counts() noexcept {
  return {g_tensor_core.load(std::memory_order_relaxed), g_generic.load(std::memory_order_relaxed),
          g_decode.load(std::memory_order_relaxed), g_split.load(std::memory_order_relaxed),
          g_wgmma.load(std::memory_order_relaxed)};
}

}  // namespace kallpa::cuda
