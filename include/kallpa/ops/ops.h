// The operations the model's forward pass is written against, version 2: memory and compute on
// one device. A device implements them over its own memory; the forward pass
// (src/model/llama_model.cpp) calls only these and the attention dispatcher, so it never changes
// per device.
//
// Addresses. Every pointer an op takes (activations, weights' data, the KV cache) is an address in
// the ops' own memory, following device.h's address rule: on the host it is an ordinary pointer; on
// a device it must never be dereferenced on the host, but pointer arithmetic within an allocation is
// valid. Spans of indices (token ids, positions, row numbers) are host memory on every device: the
// caller plans on the host and the device copies what its kernels need.
//
// Activations are row-major f32 matrices. Ops on one Ops object run in call order; download()
// returns when the bytes are on the host (so it also waits for the ops before it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "kallpa/ops/quant.h"
#include "kallpa/status.h"
#include "kallpa/tensor.h"

namespace kallpa::ops {

inline constexpr int kOpsVersion = 2;

// How rotary embedding pairs a head's first n_rot dims: adjacent (x[2i], x[2i+1]), GGUF's llama
// convention (the converter permutes Llama's Q/K rows into it); halves (x[i], x[i + n_rot/2]), the
// GPT-NeoX convention that Qwen, Gemma and Phi-3 files keep. Pair i rotates by
// pos * freq_scale * theta^(-2i / n_rot) / freq_factors[i] in both.
enum class RopeStyle : std::uint8_t { adjacent, halves };
struct RopeParams {
  RopeStyle style = RopeStyle::adjacent;
  float theta = 10000.0f;
  float freq_scale = 1.0f;                   // linear position scaling (1 = none)
  std::span<const float> freq_factors = {};  // n_rot / 2 divisors in host memory, or empty (none)
  bool plain() const noexcept { return style == RopeStyle::adjacent && freq_scale == 1.0f && freq_factors.empty(); }
};

class Ops {
 public:
  virtual ~Ops() = default;
  virtual int version() const noexcept { return kOpsVersion; }
  // "cpu", "opencl:0", "cuda:0".
  virtual std::string_view device_name() const noexcept = 0;
  // The device this memory is on (what attention problems over it are tagged with).
  virtual Device device() const noexcept = 0;
  // Whether addresses from allocate() may be read and written by the host directly (the CPU).
  virtual bool host_addressable() const noexcept { return false; }

  // --- Memory -------------------------------------------------------------------------------
  // At least 256-byte aligned, contents unspecified; out_of_memory names `what` when it fails.
  virtual Result<void*> allocate(std::size_t bytes, std::string_view what) = 0;
  virtual void free(void* address) noexcept = 0;  // nullptr is ignored
  virtual Status upload(void* dst, const void* host_src, std::size_t bytes) = 0;
  virtual Status download(void* host_dst, const void* src, std::size_t bytes) = 0;
  virtual Status copy(void* dst, const void* src, std::size_t bytes) = 0;  // within this memory
  // Returns when the ops queued so far have run, for readers outside these ops: the attention
  // backend reads q and the KV cache, perhaps on a queue of its own (CUDA streams), and writes its
  // output before its run() returns. A device whose attention shares the ops' in-order queue
  // (OpenCL here) need not wait.
  virtual Status finish() { return {}; }
  // Makes this device's copies of weight matrices given in the host's GGUF layout: rewrites each
  // matrix (data, and layout if the device prefers another for `use`) in place. The returned holder
  // keeps the copies alive; the host matrices are not needed afterwards (the CPU may keep reading
  // them where it copies nothing). f32 vectors (norm weights) are placed as 1-row f32 matrices.
  // `copied` (may be empty) is called with a matrix as it was given, or with a range of its rows
  // (the same matrix with data and rows narrowed), once its copy is made: the caller may drop that
  // memory from then on (a model drops the file's pages as it goes, so that the file and the
  // copies are never resident whole at the same time).
  enum class WeightUse { matmul, lookup };  // lookup: embedding tables and norm weights
  using CopiedFn = std::function<void(const WeightMatrix& original)>;
  virtual Result<std::shared_ptr<const void>> place_weights(std::span<WeightMatrix* const> matrices, WeightUse use,
                                                            const CopiedFn& copied) = 0;

  // --- Compute --------------------------------------------------------------------------------
  // out[t] = row ids[t] of the table, dequantised (out: ids.size() x table.cols); invalid_argument
  // (field "tokens") for an id outside the table.
  virtual Status embedding(const WeightMatrix& table, std::span<const std::int32_t> ids, float* out) = 0;
  // y = x / rms(x) * weight, per row of `dim` (x and y may alias; weight is `dim` f32 values).
  virtual Status rmsnorm(const float* x, const float* weight, float eps, float* y, std::int64_t rows,
                         std::int64_t dim) = 0;
  // y[rows, w.rows] = x[rows, w.cols] . W^T. The last `decode_rows` rows are single-token decode
  // steps, the rows before them prompt tokens. A device may compute the two kinds differently (the
  // CUDA ops run prompt rows through cuBLAS on dequantised weights and decode rows through their
  // GEMV; the CPU ops quantise every row's activations to 16 bits, ops/quant.h), but each row's
  // result must depend only on the row and its kind, never on the rest of the batch: that is what
  // makes a sequence's tokens the same alone and batched.
  virtual Status matmul(const WeightMatrix& w, const float* x, std::int64_t rows, float* y,
                        std::int64_t decode_rows) = 0;
  // The products of several matrices with one x (a layer's q/k/v, gate/up), each y[rows, w.rows]
  // (job.ldy == w.rows). Each y is what matmul() gives; a device may run them together (the CPU
  // ops do, in one pass over the thread pool). The default runs them one by one.
  virtual Status matmul_group(std::span<const MatmulJob> jobs, const float* x, std::int64_t rows,
                              std::int64_t decode_rows);
  // Rotary embedding in GGUF's llama convention: adjacent pairs (x[2i], x[2i+1]) of the first
  // n_rot dims of each head rotate by pos * theta^(-2i / n_rot). x: rows x (heads * head_dim);
  // positions: one per row.
  virtual Status rope(float* x, std::span<const std::int32_t> positions, std::int64_t heads, std::int64_t head_dim,
                      std::int64_t n_rot, float theta) = 0;
  // Rotary embedding as `params` says. The default serves plain() params with rope() and says
  // unsupported for the rest, which a device's FallbackOps then runs on the CPU.
  virtual Status rope_ext(float* x, std::span<const std::int32_t> positions, std::int64_t heads, std::int64_t head_dim,
                          std::int64_t n_rot, const RopeParams& params);
  // out = silu(gate) * up, element-wise (out may alias gate).
  virtual Status swiglu(const float* gate, const float* up, float* out, std::int64_t n) = 0;
  // out = gelu(gate) * up with GELU's tanh approximation, 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715
  // g^3))), element-wise (out may alias gate). Default: unsupported.
  virtual Status geglu(const float* gate, const float* up, float* out, std::int64_t n);
  // y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias, per row of `dim` (x and y may alias;
  // weight and bias are `dim` f32 values; the variance is the population one, as BERT's). Default:
  // unsupported.
  virtual Status layernorm(const float* x, const float* weight, const float* bias, float eps, float* y,
                           std::int64_t rows, std::int64_t dim);
  // x = gelu(x) in its exact form, x * (1 + erf(x / sqrt 2)) / 2, element-wise (BERT's "gelu").
  // Default: unsupported.
  virtual Status gelu_erf(float* x, std::int64_t n);
  // x *= s, element-wise. Default: unsupported.
  virtual Status scale(float* x, float s, std::int64_t n);
  // Row r of x (rows x dim) += bias (dim floats in this memory). Default: unsupported.
  virtual Status add_bias(float* x, const float* bias, std::int64_t rows, std::int64_t dim);
  // x += y, element-wise.
  virtual Status add(float* x, const float* y, std::int64_t n) = 0;
  // out row i = x row rows[i], rows of `dim` floats (out must not overlap x).
  virtual Status gather_rows(const float* x, std::span<const std::int64_t> rows, std::int64_t dim, float* out) = 0;
  // Row rows[i] of dst (`dim` elements of dst_type per row: f32, f16 or bf16, rounded to nearest
  // even) = row i of src. How K and V enter a paged cache.
  virtual Status scatter_rows(const float* src, std::int64_t dim, void* dst, DType dst_type,
                              std::span<const std::int64_t> rows) = 0;
};

// Host implementation, threaded through the kallpa thread pool.
std::unique_ptr<Ops> make_cpu_ops();

// Device ops are found by device kind, so that the engine asks for "opencl:0" and never names an
// implementation. A device library registers its factory at load time (a static registrar).
using OpsFactory = std::function<Result<std::unique_ptr<Ops>>(int index)>;
void register_ops(DeviceKind kind, OpsFactory factory);
// "cpu", "opencl", "opencl:1", "cuda:0"; unsupported (field "device") with the reason when the
// kind has no ops in this build or its device is absent, invalid_argument for a malformed name.
Result<std::unique_ptr<Ops>> make_ops(std::string_view device);

}  // namespace kallpa::ops
