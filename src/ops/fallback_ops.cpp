#include "ops/fallback_ops.h"

#include <spdlog/spdlog.h>

namespace kallpa::ops {

FallbackOps::FallbackOps(std::unique_ptr<Ops> device, bool strict)
    : device_(std::move(device)), cpu_(make_cpu_ops()), strict_(strict) {}

std::map<std::string, std::uint64_t> FallbackOps::fallbacks() const {
  std::lock_guard lock(mu_);
  return counts_;
}

bool FallbackOps::fall_back(const Status& s, const char* op) {
  if (s || s.code() != ErrorCode::unsupported || strict_) return false;
  std::lock_guard lock(mu_);
  if (counts_[op]++ == 0) {
    spdlog::warn("{}: {} runs on the CPU, with copies ({}); counted in kallpa_op_fallbacks_total", device_name(), op,
                 s.to_string());
  }
  return true;
}

Result<std::vector<float>> FallbackOps::down(const float* src, std::int64_t n) {
  std::vector<float> host(static_cast<std::size_t>(n));
  if (Status s = device_->download(host.data(), src, host.size() * 4); !s) return s;
  return host;
}

Result<std::shared_ptr<const void>> FallbackOps::place_weights(std::span<WeightMatrix* const> matrices, WeightUse use,
                                                               const CopiedFn& copied) {
  auto all = device_->place_weights(matrices, use, copied);
  if (all || !fall_back(all.status(), "place_weights")) return all;
  // One by one: what the device takes goes there, the rest stays with the CPU.
  auto holders = std::make_shared<std::vector<std::shared_ptr<const void>>>();
  for (WeightMatrix* m : matrices) {
    WeightMatrix copy = *m;
    WeightMatrix* one[] = {&copy};
    auto placed = device_->place_weights(one, use, copied);
    if (!placed) {
      if (placed.status().code() != ErrorCode::unsupported) return placed.status();
      placed = cpu_->place_weights(one, use, copied);
      if (!placed) return placed.status();
      host_weights_.insert(copy.data);
    }
    *m = copy;
    holders->push_back(std::move(*placed));
  }
  return std::shared_ptr<const void>(std::move(holders));
}

Status FallbackOps::embedding(const WeightMatrix& table, std::span<const std::int32_t> ids, float* out) {
  if (!on_host(table)) {
    Status s = device_->embedding(table, ids, out);
    if (!fall_back(s, "embedding")) return s;
    return Status(ErrorCode::unsupported, "embedding", std::string(device_name()) + " cannot look up this table");
  }
  fall_back(Status(ErrorCode::unsupported, "embedding", "the table is in host memory"), "embedding");
  std::vector<float> host(ids.size() * static_cast<std::size_t>(table.cols));
  if (Status s = cpu_->embedding(table, ids, host.data()); !s) return s;
  return up(out, host);
}

Status FallbackOps::rmsnorm(const float* x, const float* weight, float eps, float* y, std::int64_t rows,
                            std::int64_t dim) {
  Status s = device_->rmsnorm(x, weight, eps, y, rows, dim);
  if (!fall_back(s, "rmsnorm")) return s;
  auto hx = down(x, rows * dim);
  auto hw = down(weight, dim);
  if (!hx) return hx.status();
  if (!hw) return hw.status();
  if (!(s = cpu_->rmsnorm(hx->data(), hw->data(), eps, hx->data(), rows, dim))) return s;
  return up(y, *hx);
}

Status FallbackOps::matmul(const WeightMatrix& w, const float* x, std::int64_t rows, float* y,
                           std::int64_t decode_rows) {
  const MatmulJob job{&w, y, w.rows};
  return matmul_group({&job, 1}, x, rows, decode_rows);
}

Status FallbackOps::matmul_group(std::span<const MatmulJob> jobs, const float* x, std::int64_t rows,
                                 std::int64_t decode_rows) {
  bool any_host = false;
  for (const MatmulJob& j : jobs) any_host = any_host || on_host(*j.w);
  if (!any_host) {
    Status s = device_->matmul_group(jobs, x, rows, decode_rows);
    if (!fall_back(s, "matmul")) return s;
  } else {
    fall_back(Status(ErrorCode::unsupported, "matmul", "a weight matrix is in host memory"), "matmul");
  }
  if (jobs.empty()) return {};
  auto hx = down(x, rows * jobs[0].w->cols);
  if (!hx) return hx.status();
  for (const MatmulJob& j : jobs) {
    WeightMatrix w = *j.w;
    std::vector<std::byte> bytes;
    if (!on_host(w)) {
      // The device holds it in the file's layout; a copy lets the CPU kernels read it.
      if (w.layout != WeightLayout::rows) {
        return Status(ErrorCode::unsupported, "matmul", "the device's weight layout has no CPU kernel");
      }
      bytes.resize(static_cast<std::size_t>(w.rows) * w.row_bytes);
      if (Status s = device_->download(bytes.data(), w.data, bytes.size()); !s) return s;
      w.data = bytes.data();
    }
    std::vector<float> hy(static_cast<std::size_t>(rows * w.rows));
    if (Status s = cpu_->matmul(w, hx->data(), rows, hy.data(), decode_rows); !s) return s;
    if (Status s = up(j.y, hy); !s) return s;
  }
  return {};
}

Status FallbackOps::rope(float* x, std::span<const std::int32_t> positions, std::int64_t heads, std::int64_t head_dim,
                         std::int64_t n_rot, float theta) {
  Status s = device_->rope(x, positions, heads, head_dim, n_rot, theta);
  if (!fall_back(s, "rope")) return s;
  auto hx = down(x, static_cast<std::int64_t>(positions.size()) * heads * head_dim);
  if (!hx) return hx.status();
  if (!(s = cpu_->rope(hx->data(), positions, heads, head_dim, n_rot, theta))) return s;
  return up(x, *hx);
}

Status FallbackOps::rope_ext(float* x, std::span<const std::int32_t> positions, std::int64_t heads,
                             std::int64_t head_dim, std::int64_t n_rot, const RopeParams& params) {
  Status s = device_->rope_ext(x, positions, heads, head_dim, n_rot, params);
  if (!fall_back(s, "rope")) return s;
  auto hx = down(x, static_cast<std::int64_t>(positions.size()) * heads * head_dim);
  if (!hx) return hx.status();
  if (!(s = cpu_->rope_ext(hx->data(), positions, heads, head_dim, n_rot, params))) return s;
  return up(x, *hx);
}

Status FallbackOps::geglu(const float* gate, const float* up_in, float* out, std::int64_t n) {
  Status s = device_->geglu(gate, up_in, out, n);
  if (!fall_back(s, "geglu")) return s;
  auto hg = down(gate, n);
  auto hu = down(up_in, n);
  if (!hg) return hg.status();
  if (!hu) return hu.status();
  if (!(s = cpu_->geglu(hg->data(), hu->data(), hg->data(), n))) return s;
  return up(out, *hg);
}

Status FallbackOps::layernorm(const float* x, const float* weight, const float* bias, float eps, float* y,
                              std::int64_t rows, std::int64_t dim) {
  Status s = device_->layernorm(x, weight, bias, eps, y, rows, dim);
  if (!fall_back(s, "layernorm")) return s;
  auto hx = down(x, rows * dim);
  auto hw = down(weight, dim);
  auto hb = down(bias, dim);
  if (!hx) return hx.status();
  if (!hw) return hw.status();
  if (!hb) return hb.status();
  if (!(s = cpu_->layernorm(hx->data(), hw->data(), hb->data(), eps, hx->data(), rows, dim))) return s;
  return up(y, *hx);
}

Status FallbackOps::gelu_erf(float* x, std::int64_t n) {
  Status s = device_->gelu_erf(x, n);
  if (!fall_back(s, "gelu_erf")) return s;
  auto hx = down(x, n);
  if (!hx) return hx.status();
  if (!(s = cpu_->gelu_erf(hx->data(), n))) return s;
  return up(x, *hx);
}

Status FallbackOps::scale(float* x, float factor, std::int64_t n) {
  Status s = device_->scale(x, factor, n);
  if (!fall_back(s, "scale")) return s;
  auto hx = down(x, n);
  if (!hx) return hx.status();
  if (!(s = cpu_->scale(hx->data(), factor, n))) return s;
  return up(x, *hx);
}

Status FallbackOps::add_bias(float* x, const float* bias, std::int64_t rows, std::int64_t dim) {
  Status s = device_->add_bias(x, bias, rows, dim);
  if (!fall_back(s, "add_bias")) return s;
  auto hx = down(x, rows * dim);
  auto hb = down(bias, dim);
  if (!hx) return hx.status();
  if (!hb) return hb.status();
  if (!(s = cpu_->add_bias(hx->data(), hb->data(), rows, dim))) return s;
  return up(x, *hx);
}

Status FallbackOps::swiglu(const float* gate, const float* up_in, float* out, std::int64_t n) {
  Status s = device_->swiglu(gate, up_in, out, n);
  if (!fall_back(s, "swiglu")) return s;
  auto hg = down(gate, n);
  auto hu = down(up_in, n);
  if (!hg) return hg.status();
  if (!hu) return hu.status();
  if (!(s = cpu_->swiglu(hg->data(), hu->data(), hg->data(), n))) return s;
  return up(out, *hg);
}

Status FallbackOps::add(float* x, const float* y, std::int64_t n) {
  Status s = device_->add(x, y, n);
  if (!fall_back(s, "add")) return s;
  auto hx = down(x, n);
  auto hy = down(y, n);
  if (!hx) return hx.status();
  if (!hy) return hy.status();
  if (!(s = cpu_->add(hx->data(), hy->data(), n))) return s;
  return up(x, *hx);
}

Status FallbackOps::gather_rows(const float* x, std::span<const std::int64_t> rows, std::int64_t dim, float* out) {
  Status s = device_->gather_rows(x, rows, dim, out);
  if (!fall_back(s, "gather_rows")) return s;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    if (!(s = device_->copy(out + static_cast<std::int64_t>(i) * dim, x + rows[i] * dim,
                            static_cast<std::size_t>(dim) * 4))) {
      return s;
    }
  }
  return {};
}

Status FallbackOps::scatter_rows(const float* src, std::int64_t dim, void* dst, DType dst_type,
                                 std::span<const std::int64_t> rows) {
  Status s = device_->scatter_rows(src, dim, dst, dst_type, rows);
  if (!fall_back(s, "scatter_rows")) return s;
  auto hs = down(src, static_cast<std::int64_t>(rows.size()) * dim);
  if (!hs) return hs.status();
  // Converted on the host into consecutive rows, then each row to its place.
  const std::size_t row_bytes = static_cast<std::size_t>(dim) * dtype_size(dst_type);
  std::vector<std::byte> converted(rows.size() * row_bytes);
  std::vector<std::int64_t> dense(rows.size());
  for (std::size_t i = 0; i < rows.size(); ++i) dense[i] = static_cast<std::int64_t>(i);
  if (!(s = cpu_->scatter_rows(hs->data(), dim, converted.data(), dst_type, dense))) return s;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    if (!(s = device_->upload(static_cast<std::byte*>(dst) + static_cast<std::size_t>(rows[i]) * row_bytes,
                              converted.data() + i * row_bytes, row_bytes))) {
      return s;
    }
  }
  return {};
}

}  // namespace kallpa::ops
