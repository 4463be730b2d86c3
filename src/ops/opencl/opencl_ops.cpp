// The engine's op set (ops/ops.h) on the OpenCL device: memory through the process's one
// OpenClMemory (so activations and the KV cache it hands out are what opencl-flash's run()
// accepts), compute through the kernels of engine_ops.cl, all enqueued on the Runtime's one
// in-order queue without waiting; download() is what waits.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "backends/opencl/cl_memory.h"
#include "backends/opencl/cl_runtime.h"
#include "engine_ops_cl.h"  // generated from engine_ops.cl: kEngineOpsSource
#include "kallpa/ops/ggml_type.h"
#include "kallpa/ops/ops.h"

namespace kallpa::opencl {
namespace {

using ops::GgmlType;
using ops::WeightMatrix;

constexpr int kMatmulTileN = 4;         // outputs per work-group (TN in engine_ops.cl)
constexpr int kPromptTileRows = 8;      // rows of x per work-group of the _r8 kernels
constexpr std::size_t kMaxLanes = 32;   // MAX_LANES in engine_ops.cl
constexpr std::size_t kNormLanes = 64;  // <= 256, the rmsnorm kernel's local array

// The engine program, built once per process (like the attention program) and kept, failure too.
Result<cl_program> engine_program(Runtime& rt) {
  struct Built {
    std::once_flag once;
    Result<cl_program> program = Status(ErrorCode::internal, "opencl", "not built");
  };
  static Built* const built = new Built();  // never destroyed, like the Runtime
  std::call_once(built->once, [&] {
    // Correctly rounded division and sqrt, so RMSNorm's 1/sqrt rounds as the CPU's does; no
    // fast-math, which would let the compiler reorder the matmul sums.
    built->program = build_program(rt.context(), rt.device(), kEngineOpsSource,
                                   "-cl-std=CL1.2 -cl-fp32-correctly-rounded-divide-sqrt", "engine ops");
  });
  return built->program;
}

// A kernel of the engine program and the largest work-group it may run with.
struct Kernel {
  cl_kernel k = nullptr;
  const char* name = "";
  std::size_t max_group = 1;
};

// A device address resolved to its buffer, with the offset in elements of the size bound() checked.
struct Bound {
  cl_mem buffer = nullptr;
  std::uint64_t offset = 0;
};

std::size_t round_up(std::size_t n, std::size_t m) { return (n + m - 1) / m * m; }

std::size_t pow2_floor(std::size_t n) {
  std::size_t p = 1;
  while (p * 2 <= n) p *= 2;
  return p;
}

// The matmul kernels' name stem for a weight type, or nullptr when there is no kernel for it.
const char* matmul_stem(GgmlType t) {
  switch (t) {
    case GgmlType::f32: return "f32";
    case GgmlType::f16: return "f16";
    case GgmlType::bf16: return "bf16";
    case GgmlType::q8_0: return "q8_0";
    case GgmlType::q4_0: return "q4_0";
    case GgmlType::q4_1: return "q4_1";
    default: return nullptr;
  }
}

constexpr std::array<GgmlType, 6> kTypes = {GgmlType::f32,  GgmlType::f16,  GgmlType::bf16,
                                            GgmlType::q8_0, GgmlType::q4_0, GgmlType::q4_1};

int type_slot(GgmlType t) {
  for (std::size_t i = 0; i < kTypes.size(); ++i) {
    if (kTypes[i] == t) return static_cast<int>(i);
  }
  return -1;
}

// The alignment a matrix's data needs on the device (its loads: floats, or the blocks' f16 scales).
std::size_t weight_alignment(GgmlType t) { return t == GgmlType::f32 ? 4 : 2; }

Status unsupported_matrix(const WeightMatrix& w, std::string_view field) {
  if (w.layout != ops::WeightLayout::rows) {
    return Status(ErrorCode::unsupported, std::string(field),
                  fmt::format("{} {}x{} matrix is in a repacked layout; the OpenCL ops read GGUF's row layout",
                              ops::ggml_type_name(w.type), w.rows, w.cols));
  }
  return Status(ErrorCode::unsupported, std::string(field),
                fmt::format("the OpenCL ops have no kernel for {} weights ({}x{}); they have F32, F16, BF16, Q8_0, "
                            "Q4_0, Q4_1",
                            ops::ggml_type_name(w.type), w.rows, w.cols));
}

bool has_kernel(const WeightMatrix& w) { return w.layout == ops::WeightLayout::rows && type_slot(w.type) >= 0; }

class OpenClOps final : public ops::Ops {
 public:
  static Result<std::unique_ptr<ops::Ops>> create(int index) {
    Runtime* rt = Runtime::get();
    if (rt == nullptr) return Status(ErrorCode::unsupported, "device", Runtime::unavailable_reason());
    if (index != rt->index()) {
      return Status(ErrorCode::unsupported, "device",
                    fmt::format("opencl:{} was asked for, but this process uses OpenCL device {} ('{}'); choose "
                                "the device with KALLPA_OPENCL_DEVICE={}",
                                index, rt->index(), rt->limits().name, index));
    }
    OpenClMemory* memory = shared_memory();
    if (memory == nullptr) return Status(ErrorCode::unsupported, "device", Runtime::unavailable_reason());
    Result<cl_program> program = engine_program(*rt);
    if (!program) return program.status();
    auto ops = std::unique_ptr<OpenClOps>(new OpenClOps(*rt, *memory));
    if (Status s = ops->make_kernels(*program); !s) return s;
    return std::unique_ptr<ops::Ops>(std::move(ops));
  }

  ~OpenClOps() override {
    clFinish(rt_.queue());
    for (Staging& s : staging_) {
      if (s.done != nullptr) clReleaseEvent(s.done);
    }
    if (scratch_ != nullptr) clReleaseMemObject(scratch_);
    for (Kernel* k : all_kernels()) {
      if (k->k != nullptr) clReleaseKernel(k->k);
    }
  }

  std::string_view device_name() const noexcept override { return name_; }
  Device device() const noexcept override { return Device{DeviceKind::opencl, rt_.index()}; }
  bool host_addressable() const noexcept override { return false; }

  // --- Memory ---------------------------------------------------------------------------------
  Result<void*> allocate(std::size_t bytes, std::string_view what) override {
    Result<void*> r = mem_.allocate(bytes);
    if (!r && r.status().code() == ErrorCode::out_of_memory) {
      return Status(ErrorCode::out_of_memory, std::string(what),
                    fmt::format("{} bytes on {}: {}", bytes, name_, r.status().to_string()));
    }
    return r;
  }

  void free(void* address) noexcept override { mem_.free(address); }

  Status upload(void* dst, const void* host_src, std::size_t bytes) override {
    return mem_.upload(dst, host_src, bytes);
  }

  Status download(void* host_dst, const void* src, std::size_t bytes) override {
    return mem_.download(host_dst, src, bytes);
  }

  Status copy(void* dst, const void* src, std::size_t bytes) override {
    Result<OpenClMemory::Resolved> d = mem_.resolve(dst, 0, static_cast<std::int64_t>(bytes), "copy destination");
    if (!d) return d.status();
    Result<OpenClMemory::Resolved> s = mem_.resolve(src, 0, static_cast<std::int64_t>(bytes), "copy source");
    if (!s) return s.status();
    if (bytes == 0) return {};
    const cl_int err =
        clEnqueueCopyBuffer(rt_.queue(), s->buffer, d->buffer, s->offset, d->offset, bytes, 0, nullptr, nullptr);
    return err == CL_SUCCESS ? Status{} : cl_failure("clEnqueueCopyBuffer", err, fmt::format("{} bytes", bytes));
  }

  Result<std::shared_ptr<const void>> place_weights(std::span<WeightMatrix* const> matrices,
                                                    WeightUse /*every use reads the GGUF row layout*/,
                                                    const CopiedFn& copied) override {
    for (std::size_t i = 0; i < matrices.size(); ++i) {
      const WeightMatrix* w = matrices[i];
      if (w == nullptr) return Status::invalid(fmt::format("matrices[{}]", i), "is null");
      if (!has_kernel(*w)) return unsupported_matrix(*w, fmt::format("matrices[{}]", i));
      if (w->data == nullptr && w->rows > 0) return Status::invalid(fmt::format("matrices[{}]", i), "has no data");
    }
    // Freed when the last holder goes; the memory is the process's and outlives every holder.
    auto placed = std::shared_ptr<std::vector<void*>>(new std::vector<void*>(), [mem = &mem_](std::vector<void*>* v) {
      for (void* a : *v) mem->free(a);
      delete v;
    });
    struct Copy {
      void* address;
      std::size_t bytes;
    };
    std::map<const void*, Copy> copies;  // by host data: tied matrices (embedding = output) share one
    std::vector<void*> addresses(matrices.size());
    for (std::size_t i = 0; i < matrices.size(); ++i) {
      const WeightMatrix& w = *matrices[i];
      const std::size_t bytes = static_cast<std::size_t>(w.rows) * w.row_bytes;
      if (auto it = copies.find(w.data); it != copies.end() && it->second.bytes >= bytes) {
        addresses[i] = it->second.address;
        continue;
      }
      Result<void*> a =
          allocate(bytes, fmt::format("weights: {} {}x{} matrix", ops::ggml_type_name(w.type), w.rows, w.cols));
      if (!a) return a.status();
      placed->push_back(*a);
      if (Status s = mem_.upload(*a, w.data, bytes); !s) return s;
      copies[w.data] = Copy{*a, bytes};
      addresses[i] = *a;
      if (copied) copied(w);
    }
    for (std::size_t i = 0; i < matrices.size(); ++i) matrices[i]->data = addresses[i];
    return std::shared_ptr<const void>(placed, placed.get());
  }

  // --- Compute --------------------------------------------------------------------------------
  Status embedding(const WeightMatrix& table, std::span<const std::int32_t> ids, float* out) override {
    if (!has_kernel(table)) return unsupported_matrix(table, "table");
    for (std::size_t t = 0; t < ids.size(); ++t) {
      if (ids[t] < 0 || ids[t] >= table.rows) {
        return Status::invalid(
            "tokens", fmt::format("token id {} (position {}) is outside the vocabulary of {}", ids[t], t, table.rows));
      }
    }
    if (ids.empty() || table.cols == 0) return {};
    const auto n = static_cast<std::int64_t>(ids.size());
    Result<Bound> tb = bind(table.data, static_cast<std::size_t>(table.rows) * table.row_bytes,
                            weight_alignment(table.type), "table.data");
    if (!tb) return tb.status();
    Result<Bound> ob = bind(out, floats(n * table.cols), 4, "out");
    if (!ob) return ob.status();
    std::uint64_t at = 0;
    Result<cl_mem> sb = stage({Piece{ids.data(), ids.size_bytes()}}, &at);
    if (!sb) return sb.status();
    KernelArgs a(embedding_.k, embedding_.name);
    a.mem(tb->buffer)
        .u64(tb->offset * weight_alignment(table.type))
        .u64(table.row_bytes)
        .i32(static_cast<int>(table.type))
        .mem(*sb)
        .u64(at / 4)
        .i64(table.cols)
        .mem(ob->buffer)
        .u64(ob->offset);
    return launch(embedding_, a, {static_cast<std::size_t>(table.cols), static_cast<std::size_t>(n)},
                  {row_group(embedding_), 1});
  }

  Status rmsnorm(const float* x, const float* weight, float eps, float* y, std::int64_t rows,
                 std::int64_t dim) override {
    if (rows <= 0 || dim <= 0) return {};
    Result<Bound> xb = bind(x, floats(rows * dim), 4, "x");
    if (!xb) return xb.status();
    Result<Bound> wb = bind(weight, floats(dim), 4, "weight");
    if (!wb) return wb.status();
    Result<Bound> yb = bind(y, floats(rows * dim), 4, "y");
    if (!yb) return yb.status();
    KernelArgs a(rmsnorm_.k, rmsnorm_.name);
    a.mem(xb->buffer).u64(xb->offset).mem(wb->buffer).u64(wb->offset).f32(eps).mem(yb->buffer).u64(yb->offset).i64(dim);
    const std::size_t lanes = std::min(kNormLanes, pow2_floor(rmsnorm_.max_group));
    return launch(rmsnorm_, a, {lanes, static_cast<std::size_t>(rows)}, {lanes, 1});
  }

  Status matmul(const WeightMatrix& w, const float* x, std::int64_t rows, float* y,
                std::int64_t /*decode_rows: every row is computed exactly, whatever its kind*/) override {
    if (!has_kernel(w)) return unsupported_matrix(w, "w");
    if (rows <= 0 || w.rows <= 0) return {};
    const std::size_t align = weight_alignment(w.type);
    Result<Bound> wb = bind(w.data, static_cast<std::size_t>(w.rows) * w.row_bytes, align, "w.data");
    if (!wb) return wb.status();
    Result<Bound> xb = bind(x, floats(rows * w.cols), 4, "x");
    if (!xb) return xb.status();
    Result<Bound> yb = bind(y, floats(rows * w.rows), 4, "y");
    if (!yb) return yb.status();
    // Both tile shapes give every output the same bits (engine_ops.cl), so which one runs may
    // depend on the batch; the lane count may not, and depends on cols alone.
    const bool tiled = rows >= 4;
    const Kernel& k = matmul_[static_cast<std::size_t>(type_slot(w.type))][tiled ? 1 : 0];
    const std::size_t lanes = matmul_lanes(w.cols);
    if (lanes > k.max_group) {
      return Status(
          ErrorCode::unsupported, "w",
          fmt::format("{} needs work-groups of {} on this device, which allows {}", k.name, lanes, k.max_group));
    }
    const std::int64_t tile_rows = tiled ? kPromptTileRows : 1;
    KernelArgs a(k.k, k.name);
    a.mem(wb->buffer)
        .u64(wb->offset * align)
        .u64(w.row_bytes)
        .i64(w.rows)
        .i64(w.cols)
        .mem(xb->buffer)
        .u64(xb->offset)
        .i64(rows)
        .mem(yb->buffer)
        .u64(yb->offset)
        .i64(w.rows);
    return launch(k, a,
                  {lanes, static_cast<std::size_t>((w.rows + kMatmulTileN - 1) / kMatmulTileN),
                   static_cast<std::size_t>((rows + tile_rows - 1) / tile_rows)},
                  {lanes, 1, 1});
  }

  Status rope(float* x, std::span<const std::int32_t> positions, std::int64_t heads, std::int64_t head_dim,
              std::int64_t n_rot, float theta) override {
    if (n_rot < 0 || n_rot > head_dim || n_rot % 2 != 0) {
      return Status::invalid("n_rot", fmt::format("{} must be even and within the head dim {}", n_rot, head_dim));
    }
    const std::int64_t half = n_rot / 2;
    const auto rows = static_cast<std::int64_t>(positions.size());
    if (rows == 0 || half == 0 || heads <= 0) return {};
    Result<Bound> xb = bind(x, floats(rows * heads * head_dim), 4, "x");
    if (!xb) return xb.status();
    // inv_freq exactly as the CPU ops form it: in double, rounded to f32.
    inv_freq_.resize(static_cast<std::size_t>(half));
    for (std::int64_t i = 0; i < half; ++i) {
      inv_freq_[static_cast<std::size_t>(i)] =
          static_cast<float>(std::pow(double(theta), -2.0 * double(i) / double(n_rot)));
    }
    std::uint64_t at[2] = {};
    Result<cl_mem> sb =
        stage({Piece{positions.data(), positions.size_bytes()}, Piece{inv_freq_.data(), inv_freq_.size() * 4}}, at);
    if (!sb) return sb.status();
    const Kernel& k = rope_f64_.k != nullptr && use_fp64_ ? rope_f64_ : rope_f32_;
    KernelArgs a(k.k, k.name);
    a.mem(xb->buffer)
        .u64(xb->offset)
        .mem(*sb)
        .u64(at[0] / 4)
        .mem(*sb)
        .u64(at[1] / 4)
        .i64(heads)
        .i64(head_dim)
        .i64(half);
    return launch(k, a, {static_cast<std::size_t>(half), static_cast<std::size_t>(rows)}, {row_group(k), 1});
  }

  Status swiglu(const float* gate, const float* up, float* out, std::int64_t n) override {
    if (n <= 0) return {};
    Result<Bound> gb = bind(gate, floats(n), 4, "gate");
    if (!gb) return gb.status();
    Result<Bound> ub = bind(up, floats(n), 4, "up");
    if (!ub) return ub.status();
    Result<Bound> ob = bind(out, floats(n), 4, "out");
    if (!ob) return ob.status();
    KernelArgs a(swiglu_.k, swiglu_.name);
    a.mem(gb->buffer).u64(gb->offset).mem(ub->buffer).u64(ub->offset).mem(ob->buffer).u64(ob->offset).i64(n);
    return launch(swiglu_, a, {static_cast<std::size_t>(n)}, {row_group(swiglu_)});
  }

  Status add(float* x, const float* y, std::int64_t n) override {
    if (n <= 0) return {};
    Result<Bound> xb = bind(x, floats(n), 4, "x");
    if (!xb) return xb.status();
    Result<Bound> yb = bind(y, floats(n), 4, "y");
    if (!yb) return yb.status();
    KernelArgs a(add_.k, add_.name);
    a.mem(xb->buffer).u64(xb->offset).mem(yb->buffer).u64(yb->offset).i64(n);
    return launch(add_, a, {static_cast<std::size_t>(n)}, {row_group(add_)});
  }

  Status gather_rows(const float* x, std::span<const std::int64_t> rows, std::int64_t dim, float* out) override {
    if (rows.empty() || dim <= 0) return {};
    Result<std::int64_t> top = max_row(rows, "rows");
    if (!top) return top.status();
    const auto n = static_cast<std::int64_t>(rows.size());
    Result<Bound> xb = bind(x, floats((*top + 1) * dim), 4, "x");
    if (!xb) return xb.status();
    Result<Bound> ob = bind(out, floats(n * dim), 4, "out");
    if (!ob) return ob.status();
    std::uint64_t at = 0;
    Result<cl_mem> sb = stage({Piece{rows.data(), rows.size_bytes()}}, &at);
    if (!sb) return sb.status();
    KernelArgs a(gather_.k, gather_.name);
    a.mem(xb->buffer).u64(xb->offset).mem(*sb).u64(at / 8).i64(dim).mem(ob->buffer).u64(ob->offset);
    return launch(gather_, a, {static_cast<std::size_t>(dim), static_cast<std::size_t>(n)}, {row_group(gather_), 1});
  }

  Status scatter_rows(const float* src, std::int64_t dim, void* dst, DType dst_type,
                      std::span<const std::int64_t> rows) override {
    if (rows.empty() || dim <= 0) return {};
    Result<std::int64_t> top = max_row(rows, "rows");
    if (!top) return top.status();
    const auto n = static_cast<std::int64_t>(rows.size());
    const std::size_t esize = dtype_size(dst_type);
    Result<Bound> sb = bind(src, floats(n * dim), 4, "src");
    if (!sb) return sb.status();
    Result<Bound> db = bind(dst, static_cast<std::size_t>((*top + 1) * dim) * esize, esize, "dst");
    if (!db) return db.status();
    std::uint64_t at = 0;
    Result<cl_mem> rb = stage({Piece{rows.data(), rows.size_bytes()}}, &at);
    if (!rb) return rb.status();
    const int code = dst_type == DType::f32 ? 0 : dst_type == DType::f16 ? 1 : 2;
    KernelArgs a(scatter_.k, scatter_.name);
    a.mem(sb->buffer).u64(sb->offset).i64(dim).mem(db->buffer).u64(db->offset).i32(code).mem(*rb).u64(at / 8);
    return launch(scatter_, a, {static_cast<std::size_t>(dim), static_cast<std::size_t>(n)}, {row_group(scatter_), 1});
  }

 private:
  OpenClOps(Runtime& rt, OpenClMemory& mem) : rt_(rt), mem_(mem), name_(fmt::format("opencl:{}", rt.index())) {
    // KALLPA_OPENCL_FP64=0 takes the f32 RoPE path a device without cl_khr_fp64 would, so that it
    // can be tested on one that has it.
    const char* fp64 = std::getenv("KALLPA_OPENCL_FP64");
    use_fp64_ = fp64 == nullptr || std::string_view(fp64) != "0";
  }

  std::vector<Kernel*> all_kernels() {
    std::vector<Kernel*> ks = {&embedding_, &rmsnorm_, &rope_f64_, &rope_f32_, &swiglu_, &add_, &gather_, &scatter_};
    for (auto& pair : matmul_) {
      for (Kernel& k : pair) ks.push_back(&k);
    }
    return ks;
  }

  Status make_kernel(cl_program program, const char* name, Kernel* out, bool optional = false) {
    cl_int err = CL_SUCCESS;
    cl_kernel k = clCreateKernel(program, name, &err);
    if (err != CL_SUCCESS) {
      if (optional && err == CL_INVALID_KERNEL_NAME) return {};
      return cl_failure("clCreateKernel", err, name);
    }
    std::size_t wg = 0;
    err = clGetKernelWorkGroupInfo(k, rt_.device(), CL_KERNEL_WORK_GROUP_SIZE, sizeof wg, &wg, nullptr);
    if (err != CL_SUCCESS) {
      clReleaseKernel(k);
      return cl_failure("clGetKernelWorkGroupInfo", err, name);
    }
    *out = Kernel{k, name, std::max<std::size_t>(1, std::min(wg, rt_.limits().max_work_group))};
    return {};
  }

  Status make_kernels(cl_program program) {
    static const std::array<std::array<std::string, 2>, 6> names = [] {
      std::array<std::array<std::string, 2>, 6> n;
      for (std::size_t i = 0; i < kTypes.size(); ++i) {
        n[i] = {fmt::format("matmul_{}_r1", matmul_stem(kTypes[i])),
                fmt::format("matmul_{}_r8", matmul_stem(kTypes[i]))};
      }
      return n;
    }();
    for (std::size_t i = 0; i < kTypes.size(); ++i) {
      for (std::size_t v = 0; v < 2; ++v) {
        if (Status s = make_kernel(program, names[i][v].c_str(), &matmul_[i][v]); !s) return s;
      }
    }
    for (auto [name, k] : {std::pair{"embedding", &embedding_}, std::pair{"rmsnorm", &rmsnorm_},
                           std::pair{"rope_f32", &rope_f32_}, std::pair{"swiglu", &swiglu_}, std::pair{"add", &add_},
                           std::pair{"gather_rows", &gather_}, std::pair{"scatter_rows", &scatter_}}) {
      if (Status s = make_kernel(program, name, k); !s) return s;
    }
    return make_kernel(program, "rope_f64", &rope_f64_, /*optional: only with cl_khr_fp64*/ true);
  }

  // Lanes splitting a row's blocks of 32: a power of two up to half the blocks, at most 32. It
  // fixes the order of the sums, so it depends on cols alone.
  static std::size_t matmul_lanes(std::int64_t cols) {
    const auto blocks = static_cast<std::size_t>((cols + 31) / 32);
    return std::min(kMaxLanes, pow2_floor(std::max<std::size_t>(1, blocks / 2)));
  }

  // Work-items per group of the element-wise kernels (whose global size is rounded up to it): a
  // fixed shape rather than the implementation's choice, which can be 1 for an awkward size.
  static std::size_t row_group(const Kernel& k) { return std::min<std::size_t>(64, pow2_floor(k.max_group)); }

  static std::size_t floats(std::int64_t n) { return static_cast<std::size_t>(n) * sizeof(float); }

  Result<Bound> bind(const void* address, std::size_t bytes, std::size_t element, const char* what) {
    Result<OpenClMemory::Resolved> r = mem_.resolve(address, 0, static_cast<std::int64_t>(bytes), what);
    if (!r) return r.status();
    if (r->offset % element != 0) {
      return Status::invalid(what, fmt::format("starts {} bytes into its buffer, not a multiple of its {}-byte "
                                               "elements",
                                               r->offset, element));
    }
    return Bound{r->buffer, r->offset / element};
  }

  static Result<std::int64_t> max_row(std::span<const std::int64_t> rows, const char* what) {
    std::int64_t top = 0;
    for (std::size_t i = 0; i < rows.size(); ++i) {
      if (rows[i] < 0) return Status::invalid(what, fmt::format("row {} at [{}] is negative", rows[i], i));
      top = std::max(top, rows[i]);
    }
    return top;
  }

  // Runs a kernel over `global` (rounded up to whole work-groups when `local` is given).
  Status launch(const Kernel& k, const KernelArgs& args, std::initializer_list<std::size_t> global,
                std::initializer_list<std::size_t> local = {}) {
    if (!args.status()) return args.status();
    std::array<std::size_t, 3> g{}, l{};
    const auto dims = static_cast<cl_uint>(global.size());
    std::copy(global.begin(), global.end(), g.begin());
    std::copy(local.begin(), local.end(), l.begin());
    for (cl_uint d = 0; d < dims; ++d) {
      if (g[d] == 0) return {};
      if (local.size() > 0) g[d] = round_up(g[d], l[d]);
    }
    const cl_int err = clEnqueueNDRangeKernel(rt_.queue(), k.k, dims, nullptr, g.data(),
                                              local.size() > 0 ? l.data() : nullptr, 0, nullptr, nullptr);
    if (err != CL_SUCCESS) {
      return cl_failure("clEnqueueNDRangeKernel", err,
                        fmt::format("{}: global {}x{}x{}, local {}x{}x{}", k.name, g[0], g[1], g[2], l[0], l[1], l[2]));
    }
    return {};
  }

  struct Piece {
    const void* data;
    std::size_t bytes;
  };

  // Copies small host arrays (ids, positions, row numbers) into the device scratch buffer, each
  // at a 64-byte aligned offset (returned in `offsets`), without waiting for the copy: the host
  // bytes go through one of a few staging slots, each reused only once its last copy has finished,
  // and the in-order queue runs the copy after the kernels that read the scratch before.
  Result<cl_mem> stage(std::initializer_list<Piece> pieces, std::uint64_t* offsets) {
    std::size_t total = 0;
    for (const Piece& p : pieces) total = round_up(total, 64) + p.bytes;
    if (total > scratch_bytes_) {
      // A released buffer lives until the kernels queued on it have run.
      if (scratch_ != nullptr) clReleaseMemObject(scratch_);
      scratch_ = nullptr;
      const std::size_t bytes = std::max<std::size_t>({total, 2 * scratch_bytes_, 4096});
      cl_int err = CL_SUCCESS;
      scratch_ = clCreateBuffer(rt_.context(), CL_MEM_READ_ONLY, bytes, nullptr, &err);
      if (err != CL_SUCCESS) {
        scratch_bytes_ = 0;
        return cl_failure("clCreateBuffer", err, fmt::format("{} bytes of index scratch", bytes));
      }
      scratch_bytes_ = bytes;
    }
    Staging& slot = staging_[next_slot_];
    next_slot_ = (next_slot_ + 1) % staging_.size();
    if (slot.done != nullptr) {
      const cl_int err = clWaitForEvents(1, &slot.done);
      clReleaseEvent(slot.done);
      slot.done = nullptr;
      if (err != CL_SUCCESS) return cl_failure("clWaitForEvents", err, "index scratch copy");
    }
    slot.host.resize(total);
    std::size_t at = 0;
    std::size_t i = 0;
    for (const Piece& p : pieces) {
      at = round_up(at, 64);
      if (p.bytes > 0) std::memcpy(slot.host.data() + at, p.data, p.bytes);
      offsets[i++] = at;
      at += p.bytes;
    }
    if (total == 0) return scratch_;
    const cl_int err =
        clEnqueueWriteBuffer(rt_.queue(), scratch_, CL_FALSE, 0, total, slot.host.data(), 0, nullptr, &slot.done);
    if (err != CL_SUCCESS) return cl_failure("clEnqueueWriteBuffer", err, "index scratch");
    return scratch_;
  }

  struct Staging {
    std::vector<std::byte> host;
    cl_event done = nullptr;
  };

  Runtime& rt_;
  OpenClMemory& mem_;
  std::string name_;
  bool use_fp64_ = true;
  Kernel embedding_, rmsnorm_, rope_f64_, rope_f32_, swiglu_, add_, gather_, scatter_;
  std::array<std::array<Kernel, 2>, 6> matmul_{};  // by type_slot, then [decode-sized, row-tiled]
  cl_mem scratch_ = nullptr;
  std::size_t scratch_bytes_ = 0;
  std::array<Staging, 4> staging_;
  std::size_t next_slot_ = 0;
  std::vector<float> inv_freq_;
};

// Registers the OpenCL ops at load time, under DeviceKind::opencl.
const struct Registrar {
  Registrar() {
    ops::register_ops(DeviceKind::opencl, [](int index) { return OpenClOps::create(index); });
  }
} registrar;

}  // namespace
}  // namespace kallpa::opencl
