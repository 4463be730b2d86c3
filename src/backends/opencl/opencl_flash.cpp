// opencl-flash: the attention contract on an OpenCL device (flash_attention.cl). This file plans a
// launch from the validated problem on the host: it resolves the views' device addresses to
// buffers, packs the per-sequence geometry and the host index arrays into small device buffers,
// picks the tile sizes that fit the device's local memory, and runs the kernel.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "backends/opencl/cl_memory.h"
#include "backends/opencl/cl_runtime.h"
#include "kallpa/backend.h"
#include "kallpa/registry.h"

namespace kallpa::opencl {
namespace {

constexpr int kMetaStride = 8;  // longs per sequence; META_* in flash_attention.cl
constexpr int kMaxTile = 64;

int dtype_code(DType t) noexcept {
  switch (t) {
    case DType::f32: return 0;
    case DType::f16: return 1;
    case DType::bf16: return 2;
  }
  return 0;
}

// Local memory one work-group needs for BQ rows and BK keys (the kernel's local arguments).
std::size_t local_bytes(std::int64_t bq, std::int64_t bk, std::int64_t d, std::int64_t dv) noexcept {
  const std::int64_t floats = bq * d + bk * d + bk * dv + bq * bk + bq * dv + 3 * bq;
  return static_cast<std::size_t>(floats * 4 + 2 * bq * 8);
}

struct Tiles {
  int bq = 0;
  int bk = 0;
};

// The largest tiles (BQ up to the rows one (sequence, KV head) has, both up to 64) that fit in
// `budget` bytes; BQ = 0 when even 1 x 1 does not.
Tiles pick_tiles(std::int64_t max_rows, std::int64_t d, std::int64_t dv, std::size_t budget) noexcept {
  Tiles t{1, kMaxTile};
  while (t.bq < kMaxTile && t.bq < max_rows) t.bq *= 2;
  while (local_bytes(t.bq, t.bk, d, dv) > budget) {
    if (t.bk >= t.bq && t.bk > 1) {
      t.bk /= 2;
    } else if (t.bq > 1) {
      t.bq /= 2;
    } else {
      return {0, 0};
    }
  }
  return t;
}

struct MemRelease {
  void operator()(cl_mem m) const noexcept { clReleaseMemObject(m); }
};
using MemPtr = std::unique_ptr<std::remove_pointer_t<cl_mem>, MemRelease>;
struct EventRelease {
  void operator()(cl_event e) const noexcept { clReleaseEvent(e); }
};
using EventPtr = std::unique_ptr<std::remove_pointer_t<cl_event>, EventRelease>;

std::int64_t stride_at(const TensorView& t, int from_end) noexcept {
  return t.stride[static_cast<std::size_t>(t.rank - from_end)];
}

class OpenClFlash final : public AttentionBackend {
 public:
  std::string_view name() const noexcept override { return "opencl-flash"; }
  std::string_view version() const noexcept override { return "1.0.0"; }
  DeviceKind device_kind() const noexcept override { return DeviceKind::opencl; }
  int priority() const noexcept override { return 100; }
  std::string_view description() const noexcept override {
    return "work-group tiled online softmax in OpenCL (local-memory K/V tiles), any OpenCL 1.2 device";
  }

  Support supports(const ProblemSignature& sig) const noexcept override {
    Runtime* rt = Runtime::get();
    if (rt == nullptr) return Support::no(Runtime::unavailable_reason());
    if (sig.device.kind != DeviceKind::opencl || sig.device.index != rt->index()) {
      return Support::no(
          fmt::format("the tensors are on {}; opencl-flash runs on opencl:{} ('{}'): put them "
                      "there through its device_memory()",
                      sig.device.to_string(), rt->index(), rt->limits().name));
    }
    const std::size_t need = local_bytes(1, 1, sig.head_dim, sig.head_dim_v);
    if (need > rt->limits().local_mem_bytes) {
      return Support::no(fmt::format("head dims {}/{} need {} bytes of local memory even with 1x1 tiles; '{}' has {}",
                                     sig.head_dim, sig.head_dim_v, need, rt->limits().name,
                                     rt->limits().local_mem_bytes));
    }
    return Support::yes();
  }

  DeviceMemory* device_memory() const noexcept override { return memory(); }

  Status run(const ValidatedProblem& vp, Workspace) noexcept override {
    try {
      return run_impl(vp);
    } catch (const std::bad_alloc&) {
      return Status(ErrorCode::out_of_memory, "opencl-flash", "out of host memory while planning the launch");
    } catch (const std::exception& e) {
      return Status(ErrorCode::internal, "opencl-flash", e.what());
    }
  }

 private:
  Result<cl_kernel> kernel(Runtime& rt) {
    std::lock_guard lock(kernel_mu_);
    if (kernel_ != nullptr) return kernel_;
    Result<cl_program> program = rt.program();
    if (!program) return program.status();
    cl_int err = CL_SUCCESS;
    cl_kernel k = clCreateKernel(*program, "flash_attention", &err);
    if (err != CL_SUCCESS) return cl_failure("clCreateKernel", err, "flash_attention");
    std::size_t wg = 0;
    err = clGetKernelWorkGroupInfo(k, rt.device(), CL_KERNEL_WORK_GROUP_SIZE, sizeof wg, &wg, nullptr);
    if (err != CL_SUCCESS) {
      clReleaseKernel(k);
      return cl_failure("clGetKernelWorkGroupInfo", err, "CL_KERNEL_WORK_GROUP_SIZE");
    }
    cl_ulong static_local = 0;
    clGetKernelWorkGroupInfo(k, rt.device(), CL_KERNEL_LOCAL_MEM_SIZE, sizeof static_local, &static_local, nullptr);
    // 64 work-items: wide enough for a GPU wavefront and for PoCL's vectorisation across
    // work-items, small enough that the per-row loops keep most of them busy.
    work_group_ = std::max<std::size_t>(1, std::min<std::size_t>({64, wg, rt.limits().max_work_group}));
    local_budget_ = rt.limits().local_mem_bytes > static_local
                        ? rt.limits().local_mem_bytes - static_cast<std::size_t>(static_local)
                        : 0;
    kernel_ = k;
    return kernel_;
  }

  Status run_impl(const ValidatedProblem& vp) {
    Runtime* rt = Runtime::get();
    if (rt == nullptr) return Status(ErrorCode::unsupported, "opencl-flash", Runtime::unavailable_reason());
    OpenClMemory* memory = OpenClFlash::memory();
    Result<cl_kernel> k = kernel(*rt);
    if (!k) return k.status();
    const AttentionProblem& p = vp.problem();
    if (vp.total_q() == 0) return {};

    // Each view's device buffer and element offset.
    struct Bound {
      cl_mem buffer = nullptr;
      std::int64_t elem = 0;
    };
    auto bind = [&](const TensorView& t, const char* what) -> Result<Bound> {
      // A view with no elements (k/v of a pool with zero blocks) is never read: it needs no buffer,
      // and its pointer need not be device memory at all (attention.h, degenerate shapes).
      if (t.numel() == 0) return Bound{};
      const auto [low, high] = view_byte_extent(t);
      Result<OpenClMemory::Resolved> r = memory->resolve(t.data, low, high, what);
      if (!r) return r.status();
      const std::size_t esize = dtype_size(t.dtype);
      if (r->offset % esize != 0) {
        return Status::invalid(
            what,
            fmt::format("starts {} bytes into its buffer, not a multiple of its {}-byte elements", r->offset, esize));
      }
      return Bound{r->buffer, static_cast<std::int64_t>(r->offset / esize)};
    };
    Result<Bound> q = bind(p.q, "q.data"), kk = bind(p.k, "k.data"), v = bind(p.v, "v.data"), o = bind(p.o, "o.data");
    for (const Result<Bound>* r : {&q, &kk, &v, &o}) {
      if (!*r) return r->status();
    }
    Bound lse;
    if (p.lse.present()) {
      Result<Bound> l = bind(p.lse, "lse.data");
      if (!l) return l.status();
      lse = *l;
    }

    const bool paged = p.kv_layout == KvLayout::paged;
    const std::int32_t batch = vp.batch();
    std::vector<cl_long> meta(static_cast<std::size_t>(batch) * kMetaStride, 0);
    std::int64_t lse_hs = 0, lse_is = 0;
    if (p.lse.present()) {
      const bool packed_lse = p.q_layout == QLayout::packed;  // [Hq, Tq], else [B, Hq, Sq]
      lse_hs = packed_lse ? p.lse.stride[0] : p.lse.stride[1];
      lse_is = packed_lse ? p.lse.stride[1] : p.lse.stride[2];
    }
    std::int64_t max_sq = 0;
    for (std::int32_t b = 0; b < batch; ++b) {
      cl_long* m = &meta[static_cast<std::size_t>(b) * kMetaStride];
      const std::int64_t sq = vp.seqlen_q(b), skv = vp.seqlen_k(b);
      max_sq = std::max(max_sq, sq);
      m[0] = q->elem + (sq > 0 ? vp.q_row_offset(b, 0) : 0);
      m[1] = o->elem + (sq > 0 ? vp.o_row_offset(b, 0) : 0);
      m[2] = lse.elem + (sq > 0 && p.lse.present() ? vp.lse_offset(b, 0, 0) : 0);
      m[3] = kk->elem + (!paged && skv > 0 ? vp.k_row_offset(b, 0) : 0);
      m[4] = v->elem + (!paged && skv > 0 ? vp.v_row_offset(b, 0) : 0);
      m[5] = sq;
      m[6] = skv;
    }

    const std::int64_t group = vp.group_size();
    const Tiles tiles = pick_tiles(max_sq * group, vp.head_dim(), vp.head_dim_v(), local_budget_);
    if (tiles.bq == 0) {
      return Status(ErrorCode::unsupported, "opencl-flash",
                    fmt::format("head dims {}/{} do not fit the device's {} bytes of local memory", vp.head_dim(),
                                vp.head_dim_v(), local_budget_));
    }

    cl_int err = CL_SUCCESS;
    auto make_input = [&](const void* data, std::size_t bytes, const char* what) -> Result<MemPtr> {
      MemPtr m(
          clCreateBuffer(rt->context(), CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR, bytes, const_cast<void*>(data), &err));
      if (err != CL_SUCCESS) return cl_failure("clCreateBuffer", err, what);
      return m;
    };
    Result<MemPtr> meta_buf = make_input(meta.data(), meta.size() * sizeof(cl_long), "sequence geometry");
    if (!meta_buf) return meta_buf.status();
    MemPtr table_buf, alibi_buf;
    std::int64_t table_stride = 0;
    // A table with no entries (zero blocks per sequence: every seqlens_k is 0) is never read; an
    // OpenCL buffer cannot be empty, so the kernel gets none.
    const std::int64_t max_blocks = paged ? p.max_blocks_per_seq : 0;
    if (paged && max_blocks > 0) {
      table_stride = p.block_table_stride > 0 ? p.block_table_stride : max_blocks;
      const std::size_t entries = static_cast<std::size_t>((batch - 1) * table_stride + max_blocks);
      Result<MemPtr> t = make_input(p.block_table, entries * sizeof(std::int32_t), "block_table");
      if (!t) return t.status();
      table_buf = std::move(*t);
    }
    if (p.alibi_slopes != nullptr) {
      Result<MemPtr> a = make_input(p.alibi_slopes, static_cast<std::size_t>(vp.hq()) * sizeof(float), "alibi_slopes");
      if (!a) return a.status();
      alibi_buf = std::move(*a);
    }

    const TensorView &tq = p.q, &tk = p.k, &tv = p.v, &to = p.o;
    const std::int64_t d = vp.head_dim(), dv = vp.head_dim_v();
    const std::int64_t bq = tiles.bq, bk = tiles.bk;
    EventPtr done;
    {
      // clSetKernelArg on one kernel object is not thread-safe; enqueueing is.
      std::lock_guard lock(kernel_mu_);
      KernelArgs a(*k, "flash_attention");
      a.mem(q->buffer)
          .mem(kk->buffer)
          .mem(v->buffer)
          .mem(o->buffer)
          .mem(lse.buffer)
          .mem(meta_buf->get())
          .mem(table_buf.get())
          .mem(alibi_buf.get());
      a.i32(dtype_code(tq.dtype))
          .i32(dtype_code(tk.dtype))
          .i32(dtype_code(to.dtype))
          .i32(d)
          .i32(dv)
          .i32(group)
          .i32(bq)
          .i32(bk);
      a.i64(stride_at(tq, 3)).i64(stride_at(tq, 2)).i64(stride_at(tq, 1));
      a.i64(stride_at(tk, 3)).i64(stride_at(tk, 2)).i64(stride_at(tk, 1)).i64(paged ? tk.stride[0] : 0);
      a.i64(stride_at(tv, 3)).i64(stride_at(tv, 2)).i64(stride_at(tv, 1)).i64(paged ? tv.stride[0] : 0);
      a.i64(stride_at(to, 3)).i64(stride_at(to, 2)).i64(stride_at(to, 1));
      a.i64(lse_hs).i64(lse_is).i32(paged ? tk.shape[1] : 0).i64(table_stride);
      a.i32(p.causal ? 1 : 0).i64(vp.window_left()).i64(vp.window_right()).f32(vp.scale()).f32(p.softcap);
      a.i32(p.lse.present() ? 1 : 0).i32(p.alibi_slopes != nullptr ? 1 : 0);
      a.local(static_cast<std::size_t>(bq * d * 4))
          .local(static_cast<std::size_t>(bk * d * 4))
          .local(static_cast<std::size_t>(bk * dv * 4))
          .local(static_cast<std::size_t>(bq * bk * 4))
          .local(static_cast<std::size_t>(bq * dv * 4));
      a.local(static_cast<std::size_t>(bq * 4))
          .local(static_cast<std::size_t>(bq * 4))
          .local(static_cast<std::size_t>(bq * 4))
          .local(static_cast<std::size_t>(bq * 8))
          .local(static_cast<std::size_t>(bq * 8));
      if (Status s = a.status(); !s) return s;
      const std::int64_t blocks = (max_sq * group + bq - 1) / bq;
      const std::size_t local[3] = {work_group_, 1, 1};
      const std::size_t global[3] = {static_cast<std::size_t>(blocks) * work_group_, static_cast<std::size_t>(vp.hkv()),
                                     static_cast<std::size_t>(batch)};
      cl_event event = nullptr;
      err = clEnqueueNDRangeKernel(rt->queue(), *k, 3, nullptr, global, local, 0, nullptr, &event);
      if (err != CL_SUCCESS) {
        return cl_failure(
            "clEnqueueNDRangeKernel", err,
            fmt::format("global {}x{}x{}, local {}, tiles {}x{}", global[0], global[1], global[2], local[0], bq, bk));
      }
      done.reset(event);
    }
    cl_event e = done.get();
    err = clWaitForEvents(1, &e);
    if (err != CL_SUCCESS) return cl_failure("clWaitForEvents", err, "flash_attention");
    return {};
  }

  // The process's one OpenCL memory, which the engine's OpenCL ops allocate from too.
  static OpenClMemory* memory() noexcept { return shared_memory(); }

  std::mutex kernel_mu_;
  cl_kernel kernel_ = nullptr;  // kept for the process's life, like the program
  std::size_t work_group_ = 64;
  std::size_t local_budget_ = 0;
};

KALLPA_REGISTER_BACKEND(OpenClFlash);

}  // namespace
}  // namespace kallpa::opencl
