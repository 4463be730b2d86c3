#include <cmath>
#include <vector>

#include "core/parallel.h"
#include "kallpa/runtime/ops.h"

namespace kallpa::runtime {
namespace {

// Below this many elements a parallel_for costs more than it saves.
constexpr std::int64_t kParallelGrain = 1 << 14;

template <typename Fn>
void for_rows(std::int64_t rows, std::int64_t row_elements, Fn fn) {
  if (rows > 1 && rows * row_elements >= kParallelGrain) {
    parallel::ThreadPool::global().parallel_for(rows, [&](std::int64_t r, int) { fn(r); });
  } else {
    for (std::int64_t r = 0; r < rows; ++r) fn(r);
  }
}

class CpuOps final : public Ops {
 public:
  std::string_view device_name() const noexcept override { return "cpu"; }

  Status embedding(const model::WeightMatrix& table, std::span<const std::int32_t> ids, float* out) override {
    for (std::size_t t = 0; t < ids.size(); ++t) {
      if (ids[t] < 0 || ids[t] >= table.rows) {
        return Status::invalid("tokens", "token id " + std::to_string(ids[t]) + " is outside the vocabulary of " +
                                             std::to_string(table.rows));
      }
      Status s = model::dequantize_rows(table, ids[t], 1, out + static_cast<std::int64_t>(t) * table.cols);
      if (!s) return s;
    }
    return {};
  }

  void rmsnorm(const float* x, const float* weight, float eps, float* y, std::int64_t rows,
               std::int64_t dim) override {
    for_rows(rows, dim, [&](std::int64_t r) {
      const float* xr = x + r * dim;
      float* yr = y + r * dim;
      double sum = 0.0;
      for (std::int64_t i = 0; i < dim; ++i) sum += double(xr[i]) * xr[i];
      const float inv = 1.0f / std::sqrt(static_cast<float>(sum / double(dim)) + eps);
      for (std::int64_t i = 0; i < dim; ++i) yr[i] = xr[i] * inv * weight[i];
    });
  }

  Status matmul(const model::WeightMatrix& w, const float* x, std::int64_t rows, float* y) override {
    return model::matmul(w, x, rows, w.cols, y, w.rows);
  }

  void rope(float* x, std::span<const std::int32_t> positions, std::int64_t heads, std::int64_t head_dim,
            std::int64_t n_rot, float theta) override {
    const std::int64_t half = n_rot / 2;
    std::vector<float> inv_freq(static_cast<std::size_t>(half));
    for (std::int64_t i = 0; i < half; ++i) {
      inv_freq[static_cast<std::size_t>(i)] =
          static_cast<float>(std::pow(double(theta), -2.0 * double(i) / double(n_rot)));
    }
    const auto rows = static_cast<std::int64_t>(positions.size());
    for_rows(rows, heads * head_dim, [&](std::int64_t r) {
      const double pos = positions[static_cast<std::size_t>(r)];
      float* row = x + r * heads * head_dim;
      for (std::int64_t i = 0; i < half; ++i) {
        // Angle in double: positions reach tens of thousands, where f32 angles lose digits.
        const double angle = pos * double(inv_freq[static_cast<std::size_t>(i)]);
        const auto c = static_cast<float>(std::cos(angle)), s = static_cast<float>(std::sin(angle));
        for (std::int64_t h = 0; h < heads; ++h) {
          float* p = row + h * head_dim + 2 * i;
          const float x0 = p[0], x1 = p[1];
          p[0] = x0 * c - x1 * s;
          p[1] = x0 * s + x1 * c;
        }
      }
    });
  }

  void swiglu(const float* gate, const float* up, float* out, std::int64_t n) override {
    for (std::int64_t i = 0; i < n; ++i) {
      const float g = gate[i];
      out[i] = g / (1.0f + std::exp(-g)) * up[i];
    }
  }

  void add(float* x, const float* y, std::int64_t n) override {
    for (std::int64_t i = 0; i < n; ++i) x[i] += y[i];
  }
};

}  // namespace

std::unique_ptr<Ops> make_cpu_ops() { return std::make_unique<CpuOps>(); }

}  // namespace kallpa::runtime
