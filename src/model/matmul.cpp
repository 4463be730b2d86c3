// y = W x for a batch of x rows: for quantised weights either use x as given (Activations::f32,
// the default: weights dequantised to f32 in the kernels) or quantise x to Q8 blocks first
// (Activations::q8), then split the output into tasks of (kRowChunk output rows) x (kBatchChunk batch rows) over the thread pool.
// The decomposition depends only on the shapes, never on the number of threads.
#include <algorithm>
#include <cstdlib>
#include <vector>

#include <fmt/format.h>

#include "core/parallel.h"
#include "kallpa/model/quant.h"
#include "model/quant_kernels.h"

namespace kallpa::model {

namespace {

constexpr std::int64_t kBatchChunk = 64;

bool use_avx2(const MatmulOptions& o) noexcept {
  static const bool env_scalar = [] {
    const char* e = std::getenv("KALLPA_QUANT_ISA");
    return e != nullptr && std::string_view(e) == "scalar";
  }();
  return !o.force_scalar && !env_scalar && kernels::avx2_available();
}

}  // namespace

std::string_view quant_kernel_isa() noexcept { return use_avx2({}) ? "avx2" : "scalar"; }

Status matmul(const WeightMatrix& w, const float* x, std::int64_t batch, std::int64_t ldx, float* y,
              std::int64_t ldy, const MatmulOptions& options) {
  if (!is_compute_supported(w.type)) {
    return {ErrorCode::unsupported, "w.type", fmt::format("no matmul kernel for {}", ggml_type_name(w.type))};
  }
  if (w.rows < 0 || w.cols <= 0 || batch < 0 || ldx < w.cols || ldy < w.rows || w.data == nullptr ||
      w.row_bytes != row_size(w.type, w.cols) || w.row_bytes == 0) {
    return {ErrorCode::invalid_argument, "w",
            fmt::format("bad matmul shapes: W {}x{} ({} bytes/row), batch {}, ldx {}, ldy {}", w.rows, w.cols,
                        w.row_bytes, batch, ldx, ldy)};
  }
  if (w.layout == WeightLayout::rows4 && (!kernels::is_quantized(w.type) || w.rows % 4 != 0)) {
    return {ErrorCode::invalid_argument, "w.layout",
            fmt::format("the rows4 layout needs a quantised type and rows % 4 == 0 (got {} with {} rows)",
                        ggml_type_name(w.type), w.rows)};
  }
  if (batch == 0 || w.rows == 0) return {};
  const bool avx2 = use_avx2(options);
  const bool quant = kernels::is_quantized(w.type);
  const bool quant_q8 = quant && options.activations == MatmulOptions::Activations::q8;
  const bool quant_q16 = quant && options.activations == MatmulOptions::Activations::q16;
  const std::int64_t k = w.cols;
  const auto* wp = static_cast<const std::byte*>(w.data);
  auto& pool = parallel::ThreadPool::global();

  // Quantised activations live in per-thread buffers reused across calls (decode makes hundreds of
  // calls per token).
  thread_local std::vector<BlockQ8x> xq;
  thread_local std::vector<BlockQ16x> xq16;
  const std::int64_t nb = k / kQK;
  if (quant_q8 || quant_q16) {
    if (quant_q8) xq.resize(static_cast<std::size_t>(batch * nb));
    if (quant_q16) xq16.resize(static_cast<std::size_t>(batch * nb));
    BlockQ8x* const q8 = xq.data();
    BlockQ16x* const q16 = xq16.data();
    auto quantize = [&, q8, q16](std::int64_t b, int) {
      if (quant_q16) {
        if (avx2) {
          kernels::quantize_row_q16x_avx2(x + b * ldx, q16 + b * nb, k);
        } else {
          kernels::quantize_row_q16x_scalar(x + b * ldx, q16 + b * nb, k);
        }
      } else if (avx2) {
        kernels::quantize_row_q8x_avx2(x + b * ldx, q8 + b * nb, k);
      } else {
        kernels::quantize_row_q8x_scalar(x + b * ldx, q8 + b * nb, k);
      }
    };
    if (batch >= 8) {
      pool.parallel_for(batch, quantize, options.max_threads);
    } else {
      for (std::int64_t b = 0; b < batch; ++b) quantize(b, 0);
    }
  }

  // Output rows per task: enough work per task to amortise scheduling, a multiple of 4.
  const std::int64_t row_bytes_total = static_cast<std::int64_t>(w.row_bytes);
  std::int64_t row_chunk = std::max<std::int64_t>(4, (32 * 1024) / std::max<std::int64_t>(1, row_bytes_total));
  row_chunk = std::min<std::int64_t>(row_chunk, batch <= 4 ? 16 : 64);  // decode: finer, for balance
  row_chunk = (row_chunk + 3) / 4 * 4;  // tasks start at a rows4 group
  const std::int64_t n_row_tasks = (w.rows + row_chunk - 1) / row_chunk;
  const std::int64_t n_batch_tasks = (batch + kBatchChunk - 1) / kBatchChunk;
  const BlockQ8x* const q8_data = xq.data();      // the caller's thread_local buffers, read by
  const BlockQ16x* const q16_data = xq16.data();  // every worker
  auto task = [&](std::int64_t t, int) {
    const std::int64_t bt = t / n_row_tasks;
    const std::int64_t rt = t % n_row_tasks;
    const std::int64_t r0 = rt * row_chunk;
    const std::int64_t nr = std::min(row_chunk, w.rows - r0);
    const std::int64_t b0 = bt * kBatchChunk;
    const std::int64_t nbt = std::min(kBatchChunk, batch - b0);
    const std::byte* wr = wp + static_cast<std::size_t>(r0) * w.row_bytes;
    float* yt = y + b0 * ldy + r0;
    if (quant_q16) {
      const BlockQ16x* xt = q16_data + b0 * nb;
      if (avx2) {
        kernels::gemm_q16_avx2(w.type, w.layout, wr, w.row_bytes, nr, xt, nbt, k, yt, ldy);
      } else {
        kernels::gemm_q16_scalar(w.type, w.layout, wr, w.row_bytes, nr, xt, nbt, k, yt, ldy);
      }
    } else if (quant_q8) {
      const BlockQ8x* xt = q8_data + b0 * nb;
      if (avx2) {
        kernels::gemm_q_avx2(w.type, w.layout, wr, w.row_bytes, nr, xt, nbt, k, yt, ldy);
      } else {
        kernels::gemm_q_scalar(w.type, w.layout, wr, w.row_bytes, nr, xt, nbt, k, yt, ldy);
      }
    } else if (quant) {
      const float* xt = x + b0 * ldx;
      if (avx2) {
        kernels::gemm_qf_avx2(w.type, w.layout, wr, w.row_bytes, nr, xt, ldx, nbt, k, yt, ldy);
      } else {
        kernels::gemm_qf_scalar(w.type, w.layout, wr, w.row_bytes, nr, xt, ldx, nbt, k, yt, ldy);
      }
    } else {
      const float* xt = x + b0 * ldx;
      if (avx2) {
        kernels::gemm_f_avx2(w.type, wr, w.row_bytes, nr, xt, ldx, nbt, k, yt, ldy);
      } else {
        kernels::gemm_f_scalar(w.type, wr, w.row_bytes, nr, xt, ldx, nbt, k, yt, ldy);
      }
    }
  };
  const std::int64_t n_tasks = n_row_tasks * n_batch_tasks;
  if (n_tasks == 1) {
    task(0, 0);
  } else {
    pool.parallel_for(n_tasks, task, options.max_threads);
  }
  return {};
}

}  // namespace kallpa::model
