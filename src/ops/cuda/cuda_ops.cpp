// The engine's op set on a CUDA device (ops/ops.h v2), registered for "cuda[:N]".
//
// Memory comes from the device's CudaMemory (cuda_device.h), the allocator cuda-flash and cudnn
// check their tensors against, so the forward pass hands its activations and KV cache to attention
// as they are. Every op queues on one stream of its own; finish() waits for it before attention
// (which runs on leased streams) reads what the ops wrote.
//
// Matrix products: decode rows through a warp-per-output GEMV that reads the GGUF blocks directly;
// prompt rows through cuBLAS (SGEMM over the weights dequantised to f32, exact activations),
// loaded with dlopen so that kallpa loads where cuBLAS is absent, and the GEMV
// serves every row then.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "backends/cuda/cuda_device.h"
#include "kallpa/ops/ops.h"
#include "ops/cuda/engine_kernels.h"

namespace kallpa::cuda {
namespace {

// The few cuBLAS entry points used, from libcublas loaded at first need.
struct Cublas {
  using Create = cublasStatus_t (*)(cublasHandle_t*);
  using SetStream = cublasStatus_t (*)(cublasHandle_t, cudaStream_t);
  using Sgemm = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const float*,
                                   const float*, int, const float*, int, const float*, float*, int);
  Create create = nullptr;
  SetStream set_stream = nullptr;
  Sgemm sgemm = nullptr;
  std::string why;  // empty when loaded

  static const Cublas& get() {
    static const Cublas c = [] {
      Cublas r;
      void* lib = nullptr;
      for (const char* name : {"libcublas.so.13", "libcublas.so.12", "libcublas.so"}) {
        if ((lib = dlopen(name, RTLD_NOW | RTLD_LOCAL)) != nullptr) break;
      }
      if (lib == nullptr) {
        r.why = "libcublas not found";
        return r;
      }
      r.create = reinterpret_cast<Create>(dlsym(lib, "cublasCreate_v2"));
      r.set_stream = reinterpret_cast<SetStream>(dlsym(lib, "cublasSetStream_v2"));
      r.sgemm = reinterpret_cast<Sgemm>(dlsym(lib, "cublasSgemm_v2"));
      if (r.create == nullptr || r.set_stream == nullptr || r.sgemm == nullptr) r.why = "libcublas lacks a symbol";
      return r;
    }();
    return c;
  }
};

Result<WeightCode> code_of(const ops::WeightMatrix& w) {
  using ops::GgmlType;
  if (w.layout != ops::WeightLayout::rows) {
    return Status(ErrorCode::unsupported, "matmul", "the CUDA ops read GGUF's row layout only");
  }
  switch (w.type) {
    case GgmlType::f32: return WeightCode::f32;
    case GgmlType::f16: return WeightCode::f16;
    case GgmlType::bf16: return WeightCode::bf16;
    case GgmlType::q8_0: return WeightCode::q8_0;
    case GgmlType::q4_0: return WeightCode::q4_0;
    case GgmlType::q4_1: return WeightCode::q4_1;
    default: break;
  }
  return Status(ErrorCode::unsupported, "matmul", "no CUDA kernel for this weight type");
}

class CudaOps final : public ops::Ops {
 public:
  CudaOps(CudaDevice& device, cudaStream_t stream)
      : device_(device), stream_(stream), name_(device.device().to_string()) {}
  ~CudaOps() override {
    (void)device_.make_current();
    (void)cudaStreamSynchronize(stream_);
    for (void* p : {static_cast<void*>(index_scratch_), static_cast<void*>(dequant_scratch_)}) {
      if (p != nullptr) cudaFree(p);
    }
    cudaStreamDestroy(stream_);
  }

  std::string_view device_name() const noexcept override { return name_; }
  Device device() const noexcept override { return device_.device(); }

  Result<void*> allocate(std::size_t bytes, std::string_view what) override {
    if (Status s = current(); !s) return s;
    auto p = device_.memory().allocate(bytes);
    if (!p) return Status(ErrorCode::out_of_memory, std::string(what), p.status().message());
    return p;
  }
  void free(void* address) noexcept override {
    if (address == nullptr) return;
    (void)cudaStreamSynchronize(stream_);  // queued ops may still read it
    device_.memory().free(address);
  }
  Status upload(void* dst, const void* src, std::size_t bytes) override {
    if (Status s = current(); !s) return s;
    return check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync", "upload");
  }
  Status download(void* dst, const void* src, std::size_t bytes) override {
    if (Status s = current(); !s) return s;
    if (Status s =
            check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync", "download");
        !s) {
      return s;
    }
    return finish();
  }
  Status copy(void* dst, const void* src, std::size_t bytes) override {
    if (Status s = current(); !s) return s;
    return check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_), "cudaMemcpyAsync", "copy");
  }
  Status finish() override {
    if (Status s = current(); !s) return s;
    return check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize", "finish");
  }

  Result<std::shared_ptr<const void>> place_weights(std::span<ops::WeightMatrix* const> matrices, WeightUse,
                                                    const CopiedFn& copied) override {
    for (const ops::WeightMatrix* m : matrices) {
      if (auto c = code_of(*m); !c) return c.status();
    }
    // Tied matrices (the embedding table as the output head) are copied once.
    std::map<const void*, void*> copies;
    auto release = [this](std::vector<void*>* v) {
      for (void* p : *v) free(p);
      delete v;
    };
    std::shared_ptr<std::vector<void*>> holder(new std::vector<void*>(), release);
    for (ops::WeightMatrix* m : matrices) {
      auto [it, fresh] = copies.emplace(m->data, nullptr);
      if (fresh) {
        const std::size_t bytes = static_cast<std::size_t>(m->rows) * m->row_bytes;
        auto p = allocate(bytes, "weights");
        if (!p) return p.status();
        holder->push_back(*p);
        if (Status s = upload(*p, m->data, bytes); !s) return s;
        it->second = *p;
      }
    }
    // The uploads are queued: the originals are needed until they have run.
    if (Status s = finish(); !s) return s;
    for (ops::WeightMatrix* m : matrices) {
      const ops::WeightMatrix original = *m;
      m->data = copies.at(original.data);
      if (copied) copied(original);
    }
    return std::shared_ptr<const void>(std::move(holder));
  }

  Status embedding(const ops::WeightMatrix& table, std::span<const std::int32_t> ids, float* out) override {
    for (std::int32_t id : ids) {
      if (id < 0 || id >= table.rows) {
        return Status::invalid("tokens", fmt::format("token id {} is outside the vocabulary of {}", id, table.rows));
      }
    }
    auto code = code_of(table);
    if (!code) return code.status();
    auto dev_ids = stage(ids.data(), ids.size_bytes());
    if (!dev_ids) return dev_ids.status();
    return check(launch_embedding(table.data, static_cast<std::int64_t>(table.row_bytes), *code, table.cols,
                                  static_cast<const std::int32_t*>(*dev_ids), static_cast<std::int64_t>(ids.size()),
                                  out, stream_),
                 "embedding");
  }

  Status rmsnorm(const float* x, const float* weight, float eps, float* y, std::int64_t rows,
                 std::int64_t dim) override {
    if (Status s = current(); !s) return s;
    return check(launch_rmsnorm(x, weight, eps, y, rows, dim, stream_), "rmsnorm");
  }

  Status matmul(const ops::WeightMatrix& w, const float* x, std::int64_t rows, float* y,
                std::int64_t decode_rows) override {
    if (Status s = current(); !s) return s;
    auto code = code_of(w);
    if (!code) return code.status();
    decode_rows = std::clamp<std::int64_t>(decode_rows, 0, rows);
    const std::int64_t prompt_rows = rows - decode_rows;
    std::int64_t done = 0;
    if (prompt_rows > 0 && Cublas::get().why.empty()) {
      if (Status s = gemm(w, *code, x, prompt_rows, y); !s) return s;
      done = prompt_rows;
    }
    return check(launch_gemv(w.data, static_cast<std::int64_t>(w.row_bytes), *code, w.rows, w.cols, x + done * w.cols,
                             rows - done, y + done * w.rows, stream_),
                 "matmul");
  }

  Status rope(float* x, std::span<const std::int32_t> positions, std::int64_t heads, std::int64_t head_dim,
              std::int64_t n_rot, float theta) override {
    auto dev = stage(positions.data(), positions.size_bytes());
    if (!dev) return dev.status();
    return check(launch_rope(x, static_cast<const std::int32_t*>(*dev), static_cast<std::int64_t>(positions.size()),
                             heads, head_dim, n_rot, theta, stream_),
                 "rope");
  }
  Status swiglu(const float* gate, const float* up, float* out, std::int64_t n) override {
    if (Status s = current(); !s) return s;
    return check(launch_swiglu(gate, up, out, n, stream_), "swiglu");
  }
  Status add(float* x, const float* y, std::int64_t n) override {
    if (Status s = current(); !s) return s;
    return check(launch_add(x, y, n, stream_), "add");
  }
  Status gather_rows(const float* x, std::span<const std::int64_t> rows, std::int64_t dim, float* out) override {
    auto dev = stage(rows.data(), rows.size_bytes());
    if (!dev) return dev.status();
    return check(launch_gather_rows(x, static_cast<const std::int64_t*>(*dev), static_cast<std::int64_t>(rows.size()),
                                    dim, out, stream_),
                 "gather_rows");
  }
  Status scatter_rows(const float* src, std::int64_t dim, void* dst, DType dst_type,
                      std::span<const std::int64_t> rows) override {
    auto dev = stage(rows.data(), rows.size_bytes());
    if (!dev) return dev.status();
    return check(launch_scatter_rows(src, dim, dst, static_cast<int>(dst_type), static_cast<const std::int64_t*>(*dev),
                                     static_cast<std::int64_t>(rows.size()), stream_),
                 "scatter_rows");
  }

 private:
  // CUDA's current device is per thread, and the ops may be called from any (the server's
  // scheduler thread, a test's): each op makes its device current first.
  Status current() const { return device_.make_current(); }
  static Status check(cudaError_t err, const char* call, std::string_view what = {}) {
    return err == cudaSuccess ? Status{} : cuda_failure(call, err, what);
  }
  static Status check(cudaError_t err, std::string_view op) {
    return err == cudaSuccess ? Status{} : cuda_failure("kernel launch", err, op);
  }

  // Host index arrays to the device, in a scratch buffer that grows; the copy is queued on the
  // stream, so it lands after the ops before it have read the old contents.
  Result<void*> stage(const void* host, std::size_t bytes) {
    if (Status s = current(); !s) return s;
    if (bytes > index_bytes_) {
      if (Status s = finish(); !s) return s;
      if (index_scratch_ != nullptr) cudaFree(index_scratch_);
      index_scratch_ = nullptr;
      index_bytes_ = std::max<std::size_t>(bytes, 64 << 10);
      if (const cudaError_t err = cudaMalloc(&index_scratch_, index_bytes_); err != cudaSuccess) {
        index_bytes_ = 0;
        return cuda_failure("cudaMalloc", err, "index scratch");
      }
    }
    if (Status s = upload(index_scratch_, host, bytes); !s) return s;
    return index_scratch_;
  }

  // y[rows, w.rows] = x . W^T through cuBLAS over W dequantised to f32 (row-major y is the
  // column-major product W^T(col) . x(col)).
  Status gemm(const ops::WeightMatrix& w, WeightCode code, const float* x, std::int64_t rows, float* y) {
    const Cublas& blas = Cublas::get();
    if (handle_ == nullptr) {
      if (blas.create(&handle_) != CUBLAS_STATUS_SUCCESS ||
          blas.set_stream(handle_, stream_) != CUBLAS_STATUS_SUCCESS) {
        handle_ = nullptr;
        return Status(ErrorCode::backend_failure, "cublas", "cublasCreate/cublasSetStream failed");
      }
    }
    const std::size_t bytes = static_cast<std::size_t>(w.rows * w.cols) * sizeof(float);
    if (bytes > dequant_bytes_) {
      if (Status s = finish(); !s) return s;
      if (dequant_scratch_ != nullptr) cudaFree(dequant_scratch_);
      dequant_scratch_ = nullptr;
      if (const cudaError_t err = cudaMalloc(&dequant_scratch_, bytes); err != cudaSuccess) {
        dequant_bytes_ = 0;
        return cuda_failure("cudaMalloc", err, "dequantised weights");
      }
      dequant_bytes_ = bytes;
    }
    if (Status s = check(launch_dequantize(w.data, static_cast<std::int64_t>(w.row_bytes), code, w.rows, w.cols,
                                           dequant_scratch_, stream_),
                         "dequantize");
        !s) {
      return s;
    }
    const float one = 1.0f, zero = 0.0f;
    const auto n = static_cast<int>(w.rows), k = static_cast<int>(w.cols), m = static_cast<int>(rows);
    if (blas.sgemm(handle_, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, dequant_scratch_, k, x, k, &zero, y, n) !=
        CUBLAS_STATUS_SUCCESS) {
      return Status(ErrorCode::backend_failure, "cublas", "cublasSgemm failed");
    }
    return {};
  }

  CudaDevice& device_;
  cudaStream_t stream_;
  std::string name_;
  void* index_scratch_ = nullptr;
  std::size_t index_bytes_ = 0;
  float* dequant_scratch_ = nullptr;
  std::size_t dequant_bytes_ = 0;
  cublasHandle_t handle_ = nullptr;
};

Result<std::unique_ptr<ops::Ops>> make_cuda_ops(int index) {
  CudaDevice* device = CudaDevice::get();
  if (device == nullptr) return Status(ErrorCode::unsupported, "device", CudaDevice::unavailable_reason());
  if (index != device->index()) {
    return Status(ErrorCode::unsupported, "device",
                  fmt::format("cuda:{} was asked for, but this process uses cuda:{}; choose it with "
                              "KALLPA_CUDA_DEVICE={}",
                              index, device->index(), index));
  }
  if (Status s = device->make_current(); !s) return s;
  cudaStream_t stream = nullptr;
  if (const cudaError_t err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); err != cudaSuccess) {
    return cuda_failure("cudaStreamCreateWithFlags", err, "engine ops");
  }
  if (!Cublas::get().why.empty()) {
    spdlog::warn("cuda ops: {}; prompt rows use the GEMV kernel instead of cuBLAS", Cublas::get().why);
  }
  return std::unique_ptr<ops::Ops>(std::make_unique<CudaOps>(*device, stream));
}

const bool registered = [] {
  ops::register_ops(DeviceKind::cuda, make_cuda_ops);
  return true;
}();

}  // namespace
}  // namespace kallpa::cuda
