// y = W x for a batch of x rows, or several W sharing one x (matmul_group: q/k/v, gate/up): for
// quantised weights either use x as given (Activations::f32, the default: weights dequantised to
// f32 in the kernels) or quantise x to Q8/Q16 blocks once, then split every output into tasks of
// (row_chunk output rows) x (kBatchChunk batch rows), all in one parallel_for. The decomposition
// depends only on the shapes, never on the number of threads.
#include <algorithm>
#include <cstdlib>
#include <span>
#include <vector>

#include <fmt/format.h>

#include "core/parallel.h"
#include "kallpa/ops/quant.h"
#include "ops/q16_units.h"
#include "ops/quant_kernels.h"

namespace kallpa::ops {

namespace {

constexpr std::int64_t kBatchChunk = 64;

enum class KernelIsa { scalar, avx2, avx512 };

// The widest ISA this machine has, capped by KALLPA_QUANT_ISA and the options.
KernelIsa kernel_isa(const MatmulOptions& o) noexcept {
  static const KernelIsa machine = [] {
    KernelIsa isa = kernels::avx512_vnni_available() ? KernelIsa::avx512
                    : kernels::avx2_available()      ? KernelIsa::avx2
                                                     : KernelIsa::scalar;
    if (const char* e = std::getenv("KALLPA_QUANT_ISA"); e != nullptr) {
      const std::string_view cap(e);
      if (cap == "scalar") isa = KernelIsa::scalar;
      if (cap == "avx2") isa = std::min(isa, KernelIsa::avx2);
    }
    return isa;
  }();
  switch (o.max_isa) {
    case MatmulOptions::Isa::scalar: return KernelIsa::scalar;
    case MatmulOptions::Isa::avx2: return std::min(machine, KernelIsa::avx2);
    case MatmulOptions::Isa::best: break;
  }
  return machine;
}

}  // namespace

std::string_view quant_kernel_isa() noexcept {
  switch (kernel_isa({})) {
    case KernelIsa::avx512: return "avx512-vnni";
    case KernelIsa::avx2: return "avx2";
    case KernelIsa::scalar: break;
  }
  return "scalar";
}

namespace {

Status check_job(const WeightMatrix& w, std::int64_t batch, std::int64_t ldx, std::int64_t ldy) {
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
  return {};
}

// Output rows per task: enough work per task to amortise scheduling, a multiple of 4 (tasks start
// at a rows4 group), of 16 for batches. Decode-sized batches use small tasks for balance, but at
// most ~64 per matrix: each task costs a shared atomic and a call, and the output head alone has
// 49k rows. A server's batch of decode rows (up to one batch chunk) takes 32 rows per task: with
// 64, SmolLM2's 576-row matrices would make 9 tasks, and one of two threads would idle a ninth of
// the time.
std::int64_t row_chunk_for(const WeightMatrix& w, std::int64_t batch) {
  std::int64_t chunk =
      std::max<std::int64_t>(4, (32 * 1024) / std::max<std::int64_t>(1, static_cast<std::int64_t>(w.row_bytes)));
  chunk = std::min<std::int64_t>(chunk, batch <= 4             ? std::max<std::int64_t>(16, w.rows / 64)
                                        : batch <= kBatchChunk ? 32
                                                               : 64);
  // Batched Q16 kernels (AVX2 from 4 activation rows, AVX-512 from 2) work in 16-row groups and
  // fold a task's leftover rows 4 at a time, several times slower per row; tasks of whole groups
  // leave none (24-row tasks, as SmolLM2's 1536-row matrices would get at batch 4, leave 8;
  // bench/results/quant-matmul.md).
  if (batch >= 2) return (chunk + 15) / 16 * 16;
  return (chunk + 3) / 4 * 4;
}

}  // namespace

Status matmul_group(std::span<const MatmulJob> jobs, const float* x, std::int64_t batch, std::int64_t ldx,
                    const MatmulOptions& options) {
  if (jobs.empty()) return {};
  const std::int64_t k = jobs[0].w->cols;
  bool any_quant = false;  // a matrix with Q8 (and Q16) kernels
  bool any_q16 = false;    // a matrix with Q16 kernels
  for (const MatmulJob& j : jobs) {
    if (j.w == nullptr || j.y == nullptr) return Status::invalid("jobs", "a matmul job has no matrix or output");
    if (j.w->cols != k) {
      return Status::invalid(
          "jobs", fmt::format("matrices of one group must share their input width ({} vs {})", j.w->cols, k));
    }
    if (Status s = check_job(*j.w, batch, ldx, j.ldy); !s) return s;
    any_quant = any_quant || kernels::is_quantized(j.w->type);
    any_q16 = any_q16 || kernels::is_quantized(j.w->type) || kernels::has_q16_unit_kernel(j.w->type);
  }
  if (batch == 0) return {};
  const KernelIsa isa = kernel_isa(options);
  const bool avx2 = isa != KernelIsa::scalar;
  const bool q8 = any_quant && options.activations == MatmulOptions::Activations::q8;
  const bool q16 = any_q16 && options.activations == MatmulOptions::Activations::q16;
  auto& pool = parallel::ThreadPool::global();

  // Quantised activations live in per-thread buffers reused across calls (decode makes hundreds of
  // calls per token); the workers read the caller's.
  thread_local std::vector<BlockQ8x> xq8;
  thread_local std::vector<BlockQ16x> xq16;
  thread_local std::vector<std::int32_t> xq16_pairs;  // the AVX-512 kernel's view of xq16
  const std::int64_t nb = k / kQK;
  const bool pairs = q16 && isa == KernelIsa::avx512 && batch >= kernels::kQ16Avx512MinBatch;
  if (q8) xq8.resize(static_cast<std::size_t>(batch * nb));
  if (q16) xq16.resize(static_cast<std::size_t>(batch * nb));
  if (pairs) xq16_pairs.resize(static_cast<std::size_t>(batch * nb * 16));
  BlockQ8x* const q8_data = xq8.data();
  BlockQ16x* const q16_data = xq16.data();
  std::int32_t* const pairs_data = pairs ? xq16_pairs.data() : nullptr;
  if (q8 || q16) {
    auto quantize = [&](std::int64_t b, int) {
      if (q16) {
        if (avx2) {
          kernels::quantize_row_q16x_avx2(x + b * ldx, q16_data + b * nb, k);
          if (pairs) kernels::pair_q16_activations_avx512(q16_data + b * nb, nb, pairs_data + b * nb * 16);
        } else {
          kernels::quantize_row_q16x_scalar(x + b * ldx, q16_data + b * nb, k);
        }
      } else if (avx2) {
        kernels::quantize_row_q8x_avx2(x + b * ldx, q8_data + b * nb, k);
      } else {
        kernels::quantize_row_q8x_scalar(x + b * ldx, q8_data + b * nb, k);
      }
    };
    if (batch >= 8) {
      pool.parallel_for(batch, quantize, options.max_threads);
    } else {
      for (std::int64_t b = 0; b < batch; ++b) quantize(b, 0);
    }
  }

  // Tasks of every job, one after another: job j owns [first_task[j], first_task[j + 1]).
  struct Plan {
    std::int64_t row_chunk, n_row_tasks;
  };
  std::vector<Plan> plans(jobs.size());
  std::vector<std::int64_t> first_task(jobs.size() + 1, 0);
  const std::int64_t n_batch_tasks = (batch + kBatchChunk - 1) / kBatchChunk;
  for (std::size_t j = 0; j < jobs.size(); ++j) {
    const std::int64_t chunk = row_chunk_for(*jobs[j].w, batch);
    plans[j] = {chunk, (jobs[j].w->rows + chunk - 1) / chunk};
    first_task[j + 1] = first_task[j] + plans[j].n_row_tasks * n_batch_tasks;
  }
  auto task = [&](std::int64_t t, int) {
    const std::size_t j =
        static_cast<std::size_t>(std::upper_bound(first_task.begin(), first_task.end(), t) - first_task.begin() - 1);
    const WeightMatrix& w = *jobs[j].w;
    const std::int64_t ldy = jobs[j].ldy;
    const std::int64_t local = t - first_task[j];
    const std::int64_t bt = local / plans[j].n_row_tasks;
    const std::int64_t rt = local % plans[j].n_row_tasks;
    const std::int64_t r0 = rt * plans[j].row_chunk;
    const std::int64_t nr = std::min(plans[j].row_chunk, w.rows - r0);
    const std::int64_t b0 = bt * kBatchChunk;
    const std::int64_t nbt = std::min(kBatchChunk, batch - b0);
    const std::byte* wr = static_cast<const std::byte*>(w.data) + static_cast<std::size_t>(r0) * w.row_bytes;
    float* yt = jobs[j].y + b0 * ldy + r0;
    const bool quant = kernels::is_quantized(w.type);
    if (q16 && kernels::has_q16_unit_kernel(w.type)) {
      const BlockQ16x* xt = q16_data + b0 * nb;
      if (isa == KernelIsa::avx512) {
        const std::int32_t* pt = pairs ? pairs_data + b0 * nb * 16 : nullptr;
        kernels::gemm_q16_units_avx512(w.type, wr, w.row_bytes, nr, xt, pt, nbt, k, yt, ldy);
      } else if (avx2) {
        kernels::gemm_q16_units_avx2(w.type, wr, w.row_bytes, nr, xt, nbt, k, yt, ldy);
      } else {
        kernels::gemm_q16_scalar(w.type, w.layout, wr, w.row_bytes, nr, xt, nbt, k, yt, ldy);
      }
    } else if (quant && q16) {
      const BlockQ16x* xt = q16_data + b0 * nb;
      if (isa == KernelIsa::avx512) {
        const std::int32_t* pt = pairs ? pairs_data + b0 * nb * 16 : nullptr;
        kernels::gemm_q16_avx512(w.type, w.layout, wr, w.row_bytes, nr, xt, pt, nbt, k, yt, ldy);
      } else if (avx2) {
        kernels::gemm_q16_avx2(w.type, w.layout, wr, w.row_bytes, nr, xt, nbt, k, yt, ldy);
      } else {
        kernels::gemm_q16_scalar(w.type, w.layout, wr, w.row_bytes, nr, xt, nbt, k, yt, ldy);
      }
    } else if (quant && q8) {
      const BlockQ8x* xt = q8_data + b0 * nb;
      if (avx2) {
        kernels::gemm_q_avx2(w.type, w.layout, wr, w.row_bytes, nr, xt, nbt, k, yt, ldy);
      } else {
        kernels::gemm_q_scalar(w.type, w.layout, wr, w.row_bytes, nr, xt, nbt, k, yt, ldy);
      }
    } else if (kernels::is_block_dequant(w.type)) {
      const float* xt = x + b0 * ldx;
      if (isa == KernelIsa::avx512) {
        kernels::gemm_dq_avx512(w.type, wr, w.row_bytes, nr, xt, ldx, nbt, k, yt, ldy);
      } else if (avx2) {
        kernels::gemm_dq_avx2(w.type, wr, w.row_bytes, nr, xt, ldx, nbt, k, yt, ldy);
      } else {
        kernels::gemm_dq_scalar(w.type, wr, w.row_bytes, nr, xt, ldx, nbt, k, yt, ldy);
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
  const std::int64_t n_tasks = first_task.back();
  if (n_tasks == 1) {
    task(0, 0);
  } else if (n_tasks > 1) {
    pool.parallel_for(n_tasks, task, options.max_threads);
  }
  return {};
}

Status matmul(const WeightMatrix& w, const float* x, std::int64_t batch, std::int64_t ldx, float* y, std::int64_t ldy,
              const MatmulOptions& options) {
  const MatmulJob job{&w, y, ldy};
  return matmul_group({&job, 1}, x, batch, ldx, options);
}

}  // namespace kallpa::ops
