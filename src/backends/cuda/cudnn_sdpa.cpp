// cudnn: cuDNN's fused scaled-dot-product attention, the vendor-native path, through cuDNN 9's
// backend graph API with its single SDPA forward operation (CUDNN_BACKEND_OPERATION_SDPA_FWD,
// 9.13+): one operation graph per problem shape, the first execution plan heuristics mode A offers
// that finalizes, cached by shape; tensors are passed per call through a variant pack.
//
// libcudnn is loaded at first use (dlopen), so kallpa loads on machines without cuDNN and this
// backend reports itself unavailable there, with the loader's reason.
#include <cudnn_graph.h>
#include <dlfcn.h>

#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "backends/cuda/cuda_device.h"
#include "backends/cuda/cudnn_support.h"
#include "kallpa/backend.h"
#include "kallpa/registry.h"

namespace kallpa::cuda {
namespace {

// The entry points used, resolved from libcudnn.so.9.
struct CudnnApi {
  decltype(&cudnnGetVersion) GetVersion = nullptr;
  decltype(&cudnnGetErrorString) GetErrorString = nullptr;
  decltype(&cudnnGetLastErrorString) GetLastErrorString = nullptr;
  decltype(&cudnnCreate) Create = nullptr;
  decltype(&cudnnSetStream) SetStream = nullptr;
  decltype(&cudnnBackendCreateDescriptor) CreateDescriptor = nullptr;
  decltype(&cudnnBackendDestroyDescriptor) DestroyDescriptor = nullptr;
  decltype(&cudnnBackendSetAttribute) SetAttribute = nullptr;
  decltype(&cudnnBackendGetAttribute) GetAttribute = nullptr;
  decltype(&cudnnBackendFinalize) Finalize = nullptr;
  decltype(&cudnnBackendExecute) Execute = nullptr;
};

// One backend descriptor, destroyed with its owner; attribute setters keep the first failure.
class Desc {
 public:
  Desc(const CudnnApi& api, cudnnBackendDescriptorType_t type, const char* what) : api_(api), what_(what) {
    check(api_.CreateDescriptor(type, &d_), "create");
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
  ~Desc() {
    if (d_ != nullptr) api_.DestroyDescriptor(d_);
  }
  cudnnBackendDescriptor_t get() const noexcept { return d_; }
  cudnnBackendDescriptor_t release() noexcept {
    cudnnBackendDescriptor_t d = d_;
    d_ = nullptr;
    return d;
  }
  template <typename T>
  Desc& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, std::int64_t count, const T* values) {
    if (error_.empty() && d_ != nullptr) {
      check(api_.SetAttribute(d_, name, type, count, values), fmt::format("attribute {}", static_cast<int>(name)));
    }
    return *this;
  }
  Desc& desc(cudnnBackendAttributeName_t name, const Desc& other) {
    cudnnBackendDescriptor_t d = other.get();
    return set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &d);
  }
  Desc& finalize() {
    if (error_.empty() && d_ != nullptr) check(api_.Finalize(d_), "finalize");
    return *this;
  }
  const std::string& error() const noexcept { return error_; }

 private:
  void check(cudnnStatus_t st, const std::string& step) {
    if (st == CUDNN_STATUS_SUCCESS || !error_.empty()) return;
    char detail[512] = {0};
    api_.GetLastErrorString(detail, sizeof detail);
    error_ = fmt::format("{} {}: {}{}{}", what_, step, api_.GetErrorString(st), detail[0] != '\0' ? ": " : "", detail);
  }
  const CudnnApi& api_;
  const char* what_;
  cudnnBackendDescriptor_t d_ = nullptr;
  std::string error_;
};

// The device, the library and one handle, found once per process; never destroyed (no CUDA or
// cuDNN calls from static destructors).
struct Cudnn {
  CudnnApi api;
  CudaDevice* device = nullptr;
  CudnnFacts facts;
  cudnnHandle_t handle = nullptr;
  std::mutex mu;  // a handle serves one stream at a time
  // By shape key, kept for the process with every descriptor the plan was built from.
  std::map<std::string, std::vector<std::unique_ptr<Desc>>> plans;  // back(): the execution plan
  std::map<std::string, std::string> failed_shapes;                 // shape key -> why no plan
};

template <typename F>
bool resolve(void* lib, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(lib, name));
  return *out != nullptr;
}

Cudnn* create(std::string* why) noexcept {
  try {
    CudaDevice* device = CudaDevice::get();
    if (device == nullptr) {
      *why = CudaDevice::unavailable_reason();
      return nullptr;
    }
    void* lib = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_LOCAL);
    std::string first_error = lib == nullptr ? dlerror() : "";
#ifdef KALLPA_CUDNN_DIR
    if (lib == nullptr) lib = dlopen(KALLPA_CUDNN_DIR "/libcudnn.so.9", RTLD_NOW | RTLD_LOCAL);
#endif
    if (lib == nullptr) {
      *why = fmt::format("cuDNN 9 is not loadable: {}", first_error);
      return nullptr;
    }
    auto* c = new Cudnn();
    CudnnApi& a = c->api;
    if (!resolve(lib, "cudnnGetVersion", &a.GetVersion) || !resolve(lib, "cudnnGetErrorString", &a.GetErrorString) ||
        !resolve(lib, "cudnnGetLastErrorString", &a.GetLastErrorString) || !resolve(lib, "cudnnCreate", &a.Create) ||
        !resolve(lib, "cudnnSetStream", &a.SetStream) ||
        !resolve(lib, "cudnnBackendCreateDescriptor", &a.CreateDescriptor) ||
        !resolve(lib, "cudnnBackendDestroyDescriptor", &a.DestroyDescriptor) ||
        !resolve(lib, "cudnnBackendSetAttribute", &a.SetAttribute) ||
        !resolve(lib, "cudnnBackendGetAttribute", &a.GetAttribute) ||
        !resolve(lib, "cudnnBackendFinalize", &a.Finalize) || !resolve(lib, "cudnnBackendExecute", &a.Execute)) {
      *why = fmt::format("libcudnn.so.9 lacks a backend-API entry point: {}", dlerror());
      delete c;
      return nullptr;
    }
    c->device = device;
    c->facts.device_index = device->index();
    c->facts.device_name = device->facts().name;
    c->facts.cc_major = device->facts().cc_major;
    c->facts.cudnn_version = static_cast<long>(a.GetVersion());
    if (c->facts.cudnn_version < kCudnnMinVersion) {
      *why = fmt::format("cuDNN {} is older than 9.13, which introduced the fused SDPA operation descriptor",
                         c->facts.cudnn_version);
      delete c;
      return nullptr;
    }
    if (Status s = device->make_current(); !s) {
      *why = s.to_string();
      delete c;
      return nullptr;
    }
    if (const cudnnStatus_t st = a.Create(&c->handle); st != CUDNN_STATUS_SUCCESS) {
      *why = fmt::format("cudnnCreate failed: {}", a.GetErrorString(st));
      delete c;
      return nullptr;
    }
    spdlog::debug("cudnn: cuDNN {} on cuda:{}", c->facts.cudnn_version, c->facts.device_index);
    return c;
  } catch (const std::exception& e) {
    *why = fmt::format("cuDNN setup failed: {}", e.what());
    return nullptr;
  }
}

std::string& reason_storage() {
  static std::string reason;
  return reason;
}

Cudnn* cudnn() noexcept {
  static Cudnn* const c = create(&reason_storage());
  return c;
}

enum Uid : std::int64_t { kUidQ = 1, kUidK, kUidV, kUidO, kUidStats, kUidScale };

struct TensorShape {
  std::int64_t dims[4];
  std::int64_t strides[4];
};

// attention.h's [B, S, H, D] views as cuDNN's [B, H, S, D] dims with the views' own strides.
TensorShape bshd(const TensorView& t) {
  return {{t.shape[0], t.shape[2], t.shape[1], t.shape[3]}, {t.stride[0], t.stride[2], t.stride[1], t.stride[3]}};
}

std::unique_ptr<Desc> tensor(const CudnnApi& api, std::int64_t uid, cudnnDataType_t type, const TensorShape& s,
                             bool by_value, const char* what) {
  auto t = std::make_unique<Desc>(api, CUDNN_BACKEND_TENSOR_DESCRIPTOR, what);
  const std::int64_t alignment = by_value ? 4 : 16;
  t->set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type)
      .set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, s.dims)
      .set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, s.strides)
      .set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid)
      .set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment);
  if (by_value) {
    const bool yes = true;
    t->set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &yes);
  }
  t->finalize();
  return t;
}

class CudnnSdpa final : public AttentionBackend {
 public:
  std::string_view name() const noexcept override { return "cudnn"; }
  std::string_view version() const noexcept override { return "1.0.0"; }
  DeviceKind device_kind() const noexcept override { return DeviceKind::cuda; }
  // Below cuda-flash: it covers a subset of the contract, and is the comparison point.
  int priority() const noexcept override { return 150; }
  std::string_view description() const noexcept override {
    return "cuDNN's fused flash attention (backend graph API, single SDPA forward operation); dense, non-causal, "
           "f16/bf16";
  }

  Support supports(const ProblemSignature& sig) const noexcept override {
    try {
      Cudnn* c = cudnn();
      return cudnn_support(sig, c != nullptr ? &c->facts : nullptr, reason_storage());
    } catch (const std::exception& e) {
      return Support::no(fmt::format("cudnn: {}", e.what()));
    }
  }

  DeviceMemory* device_memory() const noexcept override {
    Cudnn* c = cudnn();
    return c != nullptr ? &c->device->memory() : nullptr;
  }

  Status run(const ValidatedProblem& vp, Workspace) noexcept override {
    try {
      return run_impl(vp);
    } catch (const std::bad_alloc&) {
      return Status(ErrorCode::out_of_memory, "cudnn", "out of host memory while building the graph");
    } catch (const std::exception& e) {
      return Status(ErrorCode::internal, "cudnn", e.what());
    }
  }

 private:
  static Status run_impl(const ValidatedProblem& vp) {
    Cudnn* c = cudnn();
    if (c == nullptr) return Status(ErrorCode::unsupported, "cudnn", reason_storage());
    if (Support s = cudnn_support(vp.signature(), &c->facts, reason_storage()); !s.ok) {
      return Status(ErrorCode::unsupported, "cudnn", s.why_not);
    }
    const AttentionProblem& p = vp.problem();
    CudaMemory& memory = c->device->memory();
    const std::pair<const TensorView*, const char*> views[] = {
        {&p.q, "q.data"}, {&p.k, "k.data"}, {&p.v, "v.data"}, {&p.o, "o.data"}, {&p.lse, "lse.data"}};
    for (const auto& [view, what] : views) {
      if (!view->present()) continue;
      const auto [low, high] = view_byte_extent(*view);
      if (Status s = memory.check(view->data, low, high, what); !s) return s;
      // The tensors are declared 16-byte aligned to cuDNN, which its kernels rely on.
      if (reinterpret_cast<std::uintptr_t>(view->data) % 16 != 0) {
        return Status(ErrorCode::unsupported, "cudnn", fmt::format("{} is not 16-byte aligned", what));
      }
    }
    if (vp.total_q() == 0) return {};
    if (vp.max_seqlen_k() == 0) return write_empty_rows(*c, vp);

    const cudnnDataType_t type = p.q.dtype == DType::bf16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF;
    const TensorShape q = bshd(p.q), k = bshd(p.k), v = bshd(p.v), o = bshd(p.o);
    // lse [B, Hq, Sq] is cuDNN's stats tensor [B, H, S, 1] (natural-log logsumexp, f32).
    const bool with_lse = p.lse.present();
    const TensorShape stats = with_lse ? TensorShape{{p.lse.shape[0], p.lse.shape[1], p.lse.shape[2], 1},
                                                     {p.lse.stride[0], p.lse.stride[1], p.lse.stride[2], 1}}
                                       : TensorShape{};
    std::string key = fmt::format("{}|{}|lse{}", static_cast<int>(type), fmt::join(q.dims, ","), with_lse);
    for (const TensorShape* s : {&q, &k, &v, &o, &stats})
      key += fmt::format("|{}|{}", fmt::join(s->dims, ","), fmt::join(s->strides, ","));

    std::lock_guard lock(c->mu);
    if (Status s = c->device->make_current(); !s) return s;
    Result<cudnnBackendDescriptor_t> plan = plan_for(*c, key, type, q, k, v, o, with_lse ? &stats : nullptr);
    if (!plan) return plan.status();

    std::int64_t workspace_bytes = 0, count = 0;
    if (const cudnnStatus_t st = c->api.GetAttribute(*plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64,
                                                     1, &count, &workspace_bytes);
        st != CUDNN_STATUS_SUCCESS) {
      return Status(ErrorCode::backend_failure, "cudnnBackendGetAttribute", c->api.GetErrorString(st));
    }
    Result<CudaDevice::Lease> lease = c->device->lease();
    if (!lease) return lease.status();
    void* workspace = nullptr;
    if (workspace_bytes > 0) {
      Result<void*> w = lease->scratch(static_cast<std::size_t>(workspace_bytes));
      if (!w) return w.status();
      workspace = *w;
    }
    if (const cudnnStatus_t st = c->api.SetStream(c->handle, lease->stream()); st != CUDNN_STATUS_SUCCESS) {
      return Status(ErrorCode::backend_failure, "cudnnSetStream", c->api.GetErrorString(st));
    }
    float scale = vp.scale();
    std::vector<std::int64_t> uids = {kUidQ, kUidK, kUidV, kUidO, kUidScale};
    std::vector<void*> pointers = {p.q.data, p.k.data, p.v.data, p.o.data, &scale};
    if (with_lse) {
      uids.push_back(kUidStats);
      pointers.push_back(p.lse.data);
    }
    Desc pack(c->api, CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, "variant pack");
    pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, static_cast<std::int64_t>(uids.size()), uids.data())
        .set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, static_cast<std::int64_t>(pointers.size()),
             pointers.data())
        .set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace)
        .finalize();
    if (!pack.error().empty()) return Status(ErrorCode::backend_failure, "cudnn", pack.error());
    if (const cudnnStatus_t st = c->api.Execute(c->handle, *plan, pack.get()); st != CUDNN_STATUS_SUCCESS) {
      char detail[512] = {0};
      c->api.GetLastErrorString(detail, sizeof detail);
      return Status(ErrorCode::backend_failure, "cudnnBackendExecute",
                    fmt::format("{}: {}", c->api.GetErrorString(st), detail));
    }
    const cudaError_t err = cudaStreamSynchronize(lease->stream());
    return err == cudaSuccess ? Status{} : cuda_failure("cudaStreamSynchronize", err, "cudnn SDPA");
  }

  // Dense batches share one Skv; with none, every row is o = 0, lse = -inf (attention.h), which
  // cuDNN does not define: written here, row by row, touching only the views' elements.
  static Status write_empty_rows(Cudnn& c, const ValidatedProblem& vp) {
    const AttentionProblem& p = vp.problem();
    if (Status s = c.device->make_current(); !s) return s;
    const std::size_t esize = dtype_size(p.o.dtype);
    const std::vector<std::byte> zeros(static_cast<std::size_t>(vp.head_dim_v()) * esize, std::byte{0});
    const float neg_inf = -std::numeric_limits<float>::infinity();
    for (std::int64_t b = 0; b < p.o.shape[0]; ++b) {
      for (std::int64_t i = 0; i < p.o.shape[1]; ++i) {
        for (std::int64_t h = 0; h < p.o.shape[2]; ++h) {
          auto* row = static_cast<std::byte*>(p.o.data) +
                      (b * p.o.stride[0] + i * p.o.stride[1] + h * p.o.stride[2]) * static_cast<std::int64_t>(esize);
          if (const cudaError_t err = cudaMemcpy(row, zeros.data(), zeros.size(), cudaMemcpyHostToDevice);
              err != cudaSuccess) {
            return cuda_failure("cudaMemcpy", err, "zero rows for an empty KV sequence");
          }
          if (!p.lse.present()) continue;
          auto* l = static_cast<float*>(p.lse.data) + b * p.lse.stride[0] + h * p.lse.stride[1] + i * p.lse.stride[2];
          if (const cudaError_t err = cudaMemcpy(l, &neg_inf, sizeof neg_inf, cudaMemcpyHostToDevice);
              err != cudaSuccess) {
            return cuda_failure("cudaMemcpy", err, "lse = -inf for an empty KV sequence");
          }
        }
      }
    }
    return {};
  }

  // The execution plan for one shape: built on first use and kept; a shape no engine takes is
  // remembered with its reason, so it is refused at once next time.
  static Result<cudnnBackendDescriptor_t> plan_for(Cudnn& c, const std::string& key, cudnnDataType_t type,
                                                   const TensorShape& q, const TensorShape& k, const TensorShape& v,
                                                   const TensorShape& o, const TensorShape* stats) {
    if (auto it = c.plans.find(key); it != c.plans.end()) return it->second.back()->get();
    if (auto it = c.failed_shapes.find(key); it != c.failed_shapes.end()) {
      return Status(ErrorCode::unsupported, "cudnn", it->second);
    }
    auto fail = [&](std::string why) -> Status {
      c.failed_shapes.emplace(key, why);
      return Status(ErrorCode::unsupported, "cudnn", std::move(why));
    };
    const CudnnApi& api = c.api;
    const TensorShape scalar{{1, 1, 1, 1}, {1, 1, 1, 1}};
    // Everything stays alive beside the plan: the backend API does not promise that a finalized
    // plan owns copies of the graph it was built from.
    std::vector<std::unique_ptr<Desc>> tensors;
    tensors.push_back(tensor(api, kUidQ, type, q, false, "q tensor"));
    tensors.push_back(tensor(api, kUidK, type, k, false, "k tensor"));
    tensors.push_back(tensor(api, kUidV, type, v, false, "v tensor"));
    tensors.push_back(tensor(api, kUidO, type, o, false, "o tensor"));
    tensors.push_back(tensor(api, kUidScale, CUDNN_DATA_FLOAT, scalar, true, "scale tensor"));
    if (stats != nullptr) tensors.push_back(tensor(api, kUidStats, CUDNN_DATA_FLOAT, *stats, false, "stats tensor"));
    for (const auto& t : tensors) {
      if (!t->error().empty()) return fail(t->error());
    }
    auto op = std::make_unique<Desc>(api, CUDNN_BACKEND_OPERATION_SDPA_FWD_DESCRIPTOR, "SDPA forward operation");
    op->desc(CUDNN_ATTR_OPERATION_SDPA_FWD_QDESC, *tensors[0])
        .desc(CUDNN_ATTR_OPERATION_SDPA_FWD_KDESC, *tensors[1])
        .desc(CUDNN_ATTR_OPERATION_SDPA_FWD_VDESC, *tensors[2])
        .desc(CUDNN_ATTR_OPERATION_SDPA_FWD_ODESC, *tensors[3])
        .desc(CUDNN_ATTR_OPERATION_SDPA_FWD_SCALEDESC, *tensors[4]);
    if (stats != nullptr) op->desc(CUDNN_ATTR_OPERATION_SDPA_FWD_STATSDESC, *tensors[5]);
    op->finalize();
    if (!op->error().empty()) return fail(op->error());

    auto graph = std::make_unique<Desc>(api, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph");
    cudnnBackendDescriptor_t ops[1] = {op->get()};
    graph->set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, ops)
        .set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &c.handle)
        .finalize();
    if (!graph->error().empty()) return fail(graph->error());

    auto heur = std::make_unique<Desc>(api, CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "engine heuristics");
    const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
    heur->desc(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, *graph)
        .set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode)
        .finalize();
    if (!heur->error().empty()) return fail(heur->error());
    constexpr int kMaxConfigs = 8;
    std::vector<std::unique_ptr<Desc>> configs;
    std::vector<cudnnBackendDescriptor_t> raw;
    for (int n = 0; n < kMaxConfigs; ++n) {
      configs.push_back(std::make_unique<Desc>(api, CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine config"));
      if (!configs.back()->error().empty()) return fail(configs.back()->error());
      raw.push_back(configs.back()->get());
    }
    std::int64_t found = 0;
    if (const cudnnStatus_t st = api.GetAttribute(heur->get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                  CUDNN_TYPE_BACKEND_DESCRIPTOR, kMaxConfigs, &found, raw.data());
        st != CUDNN_STATUS_SUCCESS) {
      return fail(fmt::format("engine heuristics results: {}", api.GetErrorString(st)));
    }
    std::string errors;
    for (std::int64_t n = 0; n < found && n < kMaxConfigs; ++n) {
      auto plan = std::make_unique<Desc>(api, CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, "execution plan");
      plan->set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &c.handle)
          .set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
               &raw[static_cast<std::size_t>(n)])
          .finalize();
      if (plan->error().empty()) {
        const cudnnBackendDescriptor_t kept = plan->get();
        std::vector<std::unique_ptr<Desc>> keep = std::move(tensors);
        keep.push_back(std::move(op));
        keep.push_back(std::move(graph));
        keep.push_back(std::move(heur));
        for (auto& cfg : configs) keep.push_back(std::move(cfg));
        keep.push_back(std::move(plan));
        c.plans.emplace(key, std::move(keep));
        return kept;
      }
      errors += (errors.empty() ? "" : "; ") + plan->error();
    }
    return fail(found == 0 ? std::string("cuDNN's heuristics offer no engine for this shape")
                           : fmt::format("no engine config finalized: {}", errors));
  }
};

KALLPA_REGISTER_BACKEND(CudnnSdpa);

}  // namespace
}  // namespace kallpa::cuda
