// The operations the model's forward pass is written against. A device implements them over its
// own memory; the forward pass (src/model/llama_model.cpp) calls only these and the attention
// dispatcher, so it never changes per device. Activations are row-major f32 matrices.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "kallpa/model/quant.h"
#include "kallpa/status.h"

namespace kallpa::runtime {

class Ops {
 public:
  virtual ~Ops() = default;
  virtual std::string_view device_name() const noexcept = 0;

  // out[t] = row ids[t] of the table, dequantised (out: ids.size() x table.cols).
  virtual Status embedding(const model::WeightMatrix& table, std::span<const std::int32_t> ids, float* out) = 0;
  // y = x / rms(x) * weight, per row of `dim` (x and y may alias).
  virtual void rmsnorm(const float* x, const float* weight, float eps, float* y, std::int64_t rows,
                       std::int64_t dim) = 0;
  // y[rows, w.rows] = x[rows, w.cols] . W^T. The last `decode_rows` rows are single-token decode
  // steps, the rows before them prompt tokens. A device may compute the two kinds differently (the
  // CPU ops quantise decode rows' activations to 16 bits, model/quant.h, and keep prompt rows
  // exact), but each row's result must depend only on the row and its kind, never on the rest of
  // the batch: that is what makes a sequence's tokens the same alone and batched.
  virtual Status matmul(const model::WeightMatrix& w, const float* x, std::int64_t rows, float* y,
                        std::int64_t decode_rows) = 0;
  // The products of several matrices with one x (a layer's q/k/v, gate/up), each y[rows, w.rows]
  // (job.ldy == w.rows). Each y is what matmul() gives; a device may run them together (the CPU
  // ops do, in one pass over the thread pool). The default runs them one by one.
  virtual Status matmul_group(std::span<const model::MatmulJob> jobs, const float* x, std::int64_t rows,
                              std::int64_t decode_rows) {
    for (const model::MatmulJob& j : jobs) {
      if (j.w == nullptr || j.ldy != j.w->rows) return Status::invalid("jobs", "ldy must equal the matrix's rows");
      if (Status s = matmul(*j.w, x, rows, j.y, decode_rows); !s) return s;
    }
    return {};
  }
  // Rotary embedding in GGUF's llama convention: adjacent pairs (x[2i], x[2i+1]) of the first
  // n_rot dims of each head rotate by pos * theta^(-2i / n_rot). x: rows x (heads * head_dim).
  virtual void rope(float* x, std::span<const std::int32_t> positions, std::int64_t heads, std::int64_t head_dim,
                    std::int64_t n_rot, float theta) = 0;
  // out = silu(gate) * up, element-wise (out may alias gate).
  virtual void swiglu(const float* gate, const float* up, float* out, std::int64_t n) = 0;
  // x += y, element-wise.
  virtual void add(float* x, const float* y, std::int64_t n) = 0;
};

// Host implementation, threaded through the kallpa thread pool.
std::unique_ptr<Ops> make_cpu_ops();

}  // namespace kallpa::runtime
