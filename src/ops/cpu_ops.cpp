#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <string_view>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define KALLPA_X86 1
#endif

#include <cstring>
#include <new>

#include <fmt/format.h>

#include "core/parallel.h"
#include "kallpa/ops/ops.h"
#include "kallpa/ops/quant.h"
#include "ops/repack.h"
#include "ops/rope_table.h"
#include "ops/vector_exp.h"

namespace kallpa::ops {
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

constexpr float kSqrt2OverPi = 0.7978845608028654f;

#if KALLPA_X86
// The vectorised part of swiglu (a multiple of 8 elements); returns how many it did. The tail
// and non-AVX2 machines use std::exp.
__attribute__((target("avx2,fma"))) std::int64_t swiglu_avx2(const float* gate, const float* up, float* out,
                                                             std::int64_t n) {
  std::int64_t i = 0;
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp_avx2(_mm256_xor_ps(g, sign));
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
  }
  return i;
}

// The same for geglu, with GELU's tanh form written as a sigmoid:
// 0.5 g (1 + tanh(u)) = g / (1 + exp(-2u)), u = sqrt(2/pi) (g + 0.044715 g^3).
__attribute__((target("avx2,fma"))) std::int64_t geglu_avx2(const float* gate, const float* up, float* out,
                                                            std::int64_t n) {
  std::int64_t i = 0;
  const __m256 one = _mm256_set1_ps(1.0f), minus_two_k = _mm256_set1_ps(-2.0f * kSqrt2OverPi),
               cubic = _mm256_set1_ps(0.044715f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(cubic, g), _mm256_mul_ps(g, g), g);
    const __m256 e = exp_avx2(_mm256_mul_ps(minus_two_k, inner));
    const __m256 gelu = _mm256_div_ps(g, _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(gelu, _mm256_loadu_ps(up + i)));
  }
  return i;
}
#endif

class CpuOps final : public Ops {
 public:
  std::string_view device_name() const noexcept override { return "cpu"; }
  Device device() const noexcept override { return Device::cpu(); }
  bool host_addressable() const noexcept override { return true; }

  Result<void*> allocate(std::size_t bytes, std::string_view what) override {
    void* p = ::operator new (std::max<std::size_t>(bytes, 1), std::align_val_t{256}, std::nothrow);
    if (p == nullptr) {
      return Status(ErrorCode::out_of_memory, std::string(what), fmt::format("cannot allocate {} bytes", bytes));
    }
    return p;
  }
  void free(void* address) noexcept override {
    if (address != nullptr) ::operator delete (address, std::align_val_t{256});
  }
  Status upload(void* dst, const void* host_src, std::size_t bytes) override {
    if (bytes > 0) std::memcpy(dst, host_src, bytes);
    return {};
  }
  Status download(void* host_dst, const void* src, std::size_t bytes) override {
    if (bytes > 0) std::memcpy(host_dst, src, bytes);
    return {};
  }
  Status copy(void* dst, const void* src, std::size_t bytes) override {
    if (bytes > 0) std::memmove(dst, src, bytes);
    return {};
  }
  // Matrix products read the weights repacked for the SIMD kernels (ops/repack.h); lookups read
  // them where they are (the model file's mapping), so nothing is copied for them.
  Result<std::shared_ptr<const void>> place_weights(std::span<WeightMatrix* const> matrices, WeightUse use,
                                                    const CopiedFn& copied) override {
    if (use == WeightUse::lookup) return std::shared_ptr<const void>();
    auto packed = std::make_shared<RepackedWeights>();
    if (Status s = packed->repack({matrices.begin(), matrices.end()}, copied); !s) return s;
    return std::shared_ptr<const void>(std::move(packed));
  }
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  // Activations of quantised matrix products (kallpa/ops/quant.h). By default every row, prompt
  // and decode alike, goes through 16-bit blocks: the f32 path is bound by expanding weights to
  // floats (decode) and by f32 FMAs (prompts), where vpdpwssd does twice the multiply-adds per
  // instruction. KALLPA_MATMUL_ACTIVATIONS=f32 makes every row exact, =q8 puts every row through
  // Q8 blocks (llama.cpp's choice; measurably changes greedy answers).
  // Two tables, as Gemma 3's local and global layers alternate between two sets of frequencies;
  // a third set replaces the one used less recently.
  std::mutex rope_mu_;
  RopeTable rope_tables_[2];
  int rope_last_ = 0;
  const MatmulOptions::Activations activations_ = [] {
    using Act = MatmulOptions::Activations;
    const char* e = std::getenv("KALLPA_MATMUL_ACTIVATIONS");
    const std::string_view v = e != nullptr ? e : "";
    return v == "f32" ? Act::f32 : v == "q8" ? Act::q8 : Act::q16;
  }();

  Status embedding(const WeightMatrix& table, std::span<const std::int32_t> ids, float* out) override {
    for (std::size_t t = 0; t < ids.size(); ++t) {
      if (ids[t] < 0 || ids[t] >= table.rows) {
        return Status::invalid("tokens", "token id " + std::to_string(ids[t]) + " is outside the vocabulary of " +
                                             std::to_string(table.rows));
      }
      Status s = dequantize_rows(table, ids[t], 1, out + static_cast<std::int64_t>(t) * table.cols);
      if (!s) return s;
    }
    return {};
  }

  Status rmsnorm(const float* x, const float* weight, float eps, float* y, std::int64_t rows,
                 std::int64_t dim) override {
    for_rows(rows, dim, [&](std::int64_t r) {
      const float* xr = x + r * dim;
      float* yr = y + r * dim;
      double sum = 0.0;
      for (std::int64_t i = 0; i < dim; ++i) sum += double(xr[i]) * xr[i];
      const float inv = 1.0f / std::sqrt(static_cast<float>(sum / double(dim)) + eps);
      for (std::int64_t i = 0; i < dim; ++i) yr[i] = xr[i] * inv * weight[i];
    });
    return {};
  }

  Status matmul(const WeightMatrix& w, const float* x, std::int64_t rows, float* y, std::int64_t decode_rows) override {
    const MatmulJob job{&w, y, w.rows};
    return matmul_group({&job, 1}, x, rows, decode_rows);
  }

  // Prompt and decode rows take the same activations, so decode_rows changes nothing here.
  Status matmul_group(std::span<const MatmulJob> jobs, const float* x, std::int64_t rows, std::int64_t) override {
    if (jobs.empty()) return {};
    MatmulOptions o;
    o.activations = activations_;
    return ops::matmul_group(jobs, x, rows, jobs[0].w->cols, o);
  }

  Status rope(float* x, std::span<const std::int32_t> positions, std::int64_t heads, std::int64_t head_dim,
              std::int64_t n_rot, float theta) override {
    return rope_ext(x, positions, heads, head_dim, n_rot, RopeParams{.theta = theta});
  }

  Status rope_ext(float* x, std::span<const std::int32_t> positions, std::int64_t heads, std::int64_t head_dim,
                  std::int64_t n_rot, const RopeParams& params) override {
    const std::int64_t half = n_rot / 2;
    if (!params.freq_factors.empty() && static_cast<std::int64_t>(params.freq_factors.size()) != half) {
      return Status::invalid("freq_factors",
                             fmt::format("{} factors for {} rotary pairs", params.freq_factors.size(), half));
    }
    std::int64_t end = 0;
    for (std::int32_t p : positions) end = std::max<std::int64_t>(end, std::int64_t{p} + 1);
    std::lock_guard<std::mutex> lock(rope_mu_);
    int pick = 1 - rope_last_;
    for (int t = 0; t < 2; ++t) {
      if (rope_tables_[t].holds(n_rot, params.theta, params.freq_scale, params.freq_factors)) pick = t;
    }
    rope_last_ = pick;
    RopeTable& table = rope_tables_[pick];
    const std::vector<float>& inv_freq =
        table.prepare(n_rot, params.theta, end, params.freq_scale, params.freq_factors);
    // Adjacent pairs are (2i, 2i + 1), halves (i, i + half).
    const bool adjacent = params.style == RopeStyle::adjacent;
    const std::int64_t first = adjacent ? 2 : 1, second = adjacent ? 1 : half;
    const auto rows = static_cast<std::int64_t>(positions.size());
    for_rows(rows, heads * head_dim, [&](std::int64_t r) {
      const std::int32_t pos = positions[static_cast<std::size_t>(r)];
      const float* cs = table.row(pos);
      thread_local std::vector<float> direct;  // positions beyond the table
      if (cs == nullptr) {
        direct.resize(static_cast<std::size_t>(2 * half));
        RopeTable::cos_sin(double(pos), inv_freq, direct.data());
        cs = direct.data();
      }
      float* row = x + r * heads * head_dim;
      for (std::int64_t i = 0; i < half; ++i) {
        const float c = cs[2 * i], s = cs[2 * i + 1];
        for (std::int64_t h = 0; h < heads; ++h) {
          float* p = row + h * head_dim + first * i;
          const float x0 = p[0], x1 = p[second];
          p[0] = x0 * c - x1 * s;
          p[second] = x0 * s + x1 * c;
        }
      }
    });
    return {};
  }

  Status swiglu(const float* gate, const float* up, float* out, std::int64_t n) override {
    std::int64_t i = 0;
#if KALLPA_X86
    if (avx2) i = swiglu_avx2(gate, up, out, n);
#endif
    for (; i < n; ++i) {
      const float g = gate[i];
      out[i] = g / (1.0f + std::exp(-g)) * up[i];
    }
    return {};
  }

  Status geglu(const float* gate, const float* up, float* out, std::int64_t n) override {
    std::int64_t i = 0;
#if KALLPA_X86
    if (avx2) i = geglu_avx2(gate, up, out, n);
#endif
    for (; i < n; ++i) {
      const float g = gate[i];
      out[i] = g / (1.0f + std::exp(-2.0f * kSqrt2OverPi * (g + 0.044715f * g * g * g))) * up[i];
    }
    return {};
  }

  Status layernorm(const float* x, const float* weight, const float* bias, float eps, float* y, std::int64_t rows,
                   std::int64_t dim) override {
    for_rows(rows, dim, [&](std::int64_t r) {
      const float* xr = x + r * dim;
      float* yr = y + r * dim;
      double sum = 0.0;
      for (std::int64_t i = 0; i < dim; ++i) sum += xr[i];
      const double mean = sum / double(dim);
      double squares = 0.0;
      for (std::int64_t i = 0; i < dim; ++i) squares += (xr[i] - mean) * (xr[i] - mean);
      const auto inv = static_cast<float>(1.0 / std::sqrt(squares / double(dim) + double(eps)));
      const auto m = static_cast<float>(mean);
      for (std::int64_t i = 0; i < dim; ++i) yr[i] = (xr[i] - m) * inv * weight[i] + bias[i];
    });
    return {};
  }

  Status gelu_erf(float* x, std::int64_t n) override {
    for (std::int64_t i = 0; i < n; ++i) x[i] = 0.5f * x[i] * (1.0f + std::erf(x[i] * 0.70710678118654752f));
    return {};
  }

  Status scale(float* x, float s, std::int64_t n) override {
    for (std::int64_t i = 0; i < n; ++i) x[i] *= s;
    return {};
  }

  Status add_bias(float* x, const float* bias, std::int64_t rows, std::int64_t dim) override {
    for (std::int64_t r = 0; r < rows; ++r) {
      float* row = x + r * dim;
      for (std::int64_t i = 0; i < dim; ++i) row[i] += bias[i];
    }
    return {};
  }

  Status add(float* x, const float* y, std::int64_t n) override {
    for (std::int64_t i = 0; i < n; ++i) x[i] += y[i];
    return {};
  }

  Status gather_rows(const float* x, std::span<const std::int64_t> rows, std::int64_t dim, float* out) override {
    for (std::size_t i = 0; i < rows.size(); ++i) {
      std::memcpy(out + static_cast<std::int64_t>(i) * dim, x + rows[i] * dim, static_cast<std::size_t>(dim) * 4);
    }
    return {};
  }

  Status scatter_rows(const float* src, std::int64_t dim, void* dst, DType dst_type,
                      std::span<const std::int64_t> rows) override {
    const std::size_t esize = dtype_size(dst_type);
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const float* s = src + static_cast<std::int64_t>(i) * dim;
      std::byte* d = static_cast<std::byte*>(dst) + static_cast<std::size_t>(rows[i] * dim) * esize;
      switch (dst_type) {
        case DType::f32: std::memcpy(d, s, static_cast<std::size_t>(dim) * 4); break;
        case DType::f16:
        case DType::bf16: {
          const auto type = dst_type == DType::f16 ? GgmlType::f16 : GgmlType::bf16;
          if (Status st = quantize_row(type, s, d, dim); !st) return st;
          break;
        }
      }
    }
    return {};
  }
};

}  // namespace

std::unique_ptr<Ops> make_cpu_ops() { return std::make_unique<CpuOps>(); }

}  // namespace kallpa::ops
