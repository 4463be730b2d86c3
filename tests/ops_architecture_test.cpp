// The ops the architectures beyond Llama add (kallpa/ops/ops.h): NeoX-style and scaled RoPE,
// the GELU-tanh gated product, scaling and bias rows, on the CPU against direct formulas; and a
// device lacking them falls back to the CPU with the same results (FallbackOps), or refuses when
// strict.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kallpa/ops/ops.h"
#include "ops/fallback_ops.h"

namespace kallpa::ops {
namespace {

std::vector<float> random_values(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

// The rotation as RopeParams defines it, computed directly in double per element.
std::vector<float> direct_rope(std::vector<float> x, const std::vector<std::int32_t>& positions, std::int64_t heads,
                               std::int64_t head_dim, std::int64_t n_rot, const RopeParams& p) {
  const std::int64_t half = n_rot / 2;
  for (std::size_t r = 0; r < positions.size(); ++r) {
    for (std::int64_t i = 0; i < half; ++i) {
      double inv = double(p.freq_scale) * std::pow(double(p.theta), -2.0 * double(i) / double(n_rot));
      if (!p.freq_factors.empty()) inv /= double(p.freq_factors[static_cast<std::size_t>(i)]);
      const double angle = double(positions[r]) * double(static_cast<float>(inv));
      const auto c = static_cast<float>(std::cos(angle)), s = static_cast<float>(std::sin(angle));
      for (std::int64_t h = 0; h < heads; ++h) {
        float* head = x.data() + static_cast<std::int64_t>(r) * heads * head_dim + h * head_dim;
        float* a = p.style == RopeStyle::adjacent ? head + 2 * i : head + i;
        float* b = p.style == RopeStyle::adjacent ? head + 2 * i + 1 : head + i + half;
        const float x0 = *a, x1 = *b;
        *a = x0 * c - x1 * s;
        *b = x0 * s + x1 * c;
      }
    }
  }
  return x;
}

TEST(OpsArchitecture, RopeStylesScalingAndFactorsEqualTheDirectRotation) {
  auto cpu = make_cpu_ops();
  const std::vector<std::int32_t> positions{0, 5, 1, 300, 77};
  const std::int64_t heads = 3, head_dim = 32;
  const std::vector<float> factors{1.0f, 1.5f, 2.0f, 4.0f, 8.0f, 8.0f, 16.0f, 32.0f, 1.0f, 1.0f, 2.0f, 3.0f};
  struct Case {
    RopeParams params;
    std::int64_t n_rot;
  };
  const Case cases[] = {
      {{.style = RopeStyle::halves, .theta = 10000.0f}, 32},
      {{.style = RopeStyle::halves, .theta = 1e6f}, 32},      // a second table (Gemma 3's global layers)
      {{.style = RopeStyle::halves, .theta = 10000.0f}, 32},  // back to the first
      {{.style = RopeStyle::halves, .theta = 10000.0f}, 24},  // partial rotary width
      {{.style = RopeStyle::halves, .theta = 1e6f, .freq_scale = 0.125f}, 32},
      {{.style = RopeStyle::adjacent, .theta = 500000.0f, .freq_factors = factors}, 24},
      {{.style = RopeStyle::adjacent, .theta = 10000.0f}, 32},
  };
  for (const Case& c : cases) {
    const auto x = random_values(positions.size() * heads * head_dim, 11);
    auto got = x;
    ASSERT_TRUE(cpu->rope_ext(got.data(), positions, heads, head_dim, c.n_rot, c.params));
    const auto want = direct_rope(x, positions, heads, head_dim, c.n_rot, c.params);
    for (std::size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(got[i], want[i]) << "theta " << c.params.theta << " n_rot " << c.n_rot << " element " << i;
    }
  }
  // Factors must be one per rotary pair.
  auto x = random_values(heads * head_dim, 3);
  const std::vector<float> three{1.0f, 2.0f, 3.0f};
  const Status bad =
      cpu->rope_ext(x.data(), std::vector<std::int32_t>{1}, heads, head_dim, 32, RopeParams{.freq_factors = three});
  EXPECT_EQ(bad.code(), ErrorCode::invalid_argument);
  EXPECT_EQ(bad.field(), "freq_factors");
}

TEST(OpsArchitecture, GegluScaleAndBiasFollowTheirFormulas) {
  auto cpu = make_cpu_ops();
  const std::int64_t n = 37;
  const auto gate = random_values(n, 1), up = random_values(n, 2);
  std::vector<float> out(n);
  ASSERT_TRUE(cpu->geglu(gate.data(), up.data(), out.data(), n));
  for (std::int64_t i = 0; i < n; ++i) {
    const double g = gate[i];
    const double want = 0.5 * g * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (g + 0.044715 * g * g * g))) * up[i];
    EXPECT_NEAR(out[i], want, 1e-6 * std::max(1.0, std::fabs(want))) << i;
  }
  auto x = random_values(n, 3);
  const auto x0 = x;
  ASSERT_TRUE(cpu->scale(x.data(), 25.25f, n));
  for (std::int64_t i = 0; i < n; ++i) EXPECT_EQ(x[i], x0[i] * 25.25f);

  const std::int64_t rows = 3, dim = 5;
  auto m = random_values(rows * dim, 4);
  const auto m0 = m;
  const auto bias = random_values(dim, 5);
  ASSERT_TRUE(cpu->add_bias(m.data(), bias.data(), rows, dim));
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t i = 0; i < dim; ++i) EXPECT_EQ(m[r * dim + i], m0[r * dim + i] + bias[i]);
  }
}

// A device with only the Llama ops: the new ones default to unsupported.
class LlamaOnlyDevice final : public Ops {
 public:
  LlamaOnlyDevice() : cpu_(make_cpu_ops()) {}
  std::string_view device_name() const noexcept override { return "llama-only"; }
  Device device() const noexcept override { return Device::cpu(); }
  Result<void*> allocate(std::size_t bytes, std::string_view what) override { return cpu_->allocate(bytes, what); }
  void free(void* address) noexcept override { cpu_->free(address); }
  Status upload(void* dst, const void* src, std::size_t bytes) override { return cpu_->upload(dst, src, bytes); }
  Status download(void* dst, const void* src, std::size_t bytes) override { return cpu_->download(dst, src, bytes); }
  Status copy(void* dst, const void* src, std::size_t bytes) override { return cpu_->copy(dst, src, bytes); }
  Result<std::shared_ptr<const void>> place_weights(std::span<WeightMatrix* const> m, WeightUse use,
                                                    const CopiedFn& copied) override {
    return cpu_->place_weights(m, use, copied);
  }
  Status embedding(const WeightMatrix& t, std::span<const std::int32_t> ids, float* out) override {
    return cpu_->embedding(t, ids, out);
  }
  Status rmsnorm(const float* x, const float* w, float eps, float* y, std::int64_t r, std::int64_t d) override {
    return cpu_->rmsnorm(x, w, eps, y, r, d);
  }
  Status matmul(const WeightMatrix& w, const float* x, std::int64_t rows, float* y, std::int64_t decode) override {
    return cpu_->matmul(w, x, rows, y, decode);
  }
  Status rope(float* x, std::span<const std::int32_t> pos, std::int64_t h, std::int64_t d, std::int64_t n_rot,
              float theta) override {
    ++plain_ropes;
    return cpu_->rope(x, pos, h, d, n_rot, theta);
  }
  Status swiglu(const float* g, const float* u, float* out, std::int64_t n) override {
    return cpu_->swiglu(g, u, out, n);
  }
  Status add(float* x, const float* y, std::int64_t n) override { return cpu_->add(x, y, n); }
  Status gather_rows(const float* x, std::span<const std::int64_t> rows, std::int64_t dim, float* out) override {
    return cpu_->gather_rows(x, rows, dim, out);
  }
  Status scatter_rows(const float* src, std::int64_t dim, void* dst, DType type,
                      std::span<const std::int64_t> rows) override {
    return cpu_->scatter_rows(src, dim, dst, type, rows);
  }
  int plain_ropes = 0;

 private:
  std::unique_ptr<Ops> cpu_;
};

TEST(OpsArchitecture, ADeviceWithoutTheNewOpsFallsBackToTheCpuOrRefusesWhenStrict) {
  auto cpu = make_cpu_ops();
  auto device = std::make_unique<LlamaOnlyDevice>();
  LlamaOnlyDevice* dev = device.get();
  FallbackOps ops(std::move(device), /*strict=*/false);
  const std::vector<std::int32_t> positions{3, 9};
  const RopeParams neox{.style = RopeStyle::halves, .theta = 10000.0f};
  auto a = random_values(2 * 2 * 16, 7), b = a;
  ASSERT_TRUE(ops.rope_ext(a.data(), positions, 2, 16, 16, neox));
  ASSERT_TRUE(cpu->rope_ext(b.data(), positions, 2, 16, 16, neox));
  EXPECT_EQ(a, b);
  // Plain parameters stay on the device's own rope.
  ASSERT_TRUE(ops.rope_ext(a.data(), positions, 2, 16, 16, RopeParams{.theta = 10000.0f}));
  EXPECT_EQ(dev->plain_ropes, 1);

  auto g = random_values(8, 1), u = random_values(8, 2), want = g;
  ASSERT_TRUE(ops.geglu(g.data(), u.data(), g.data(), 8));
  ASSERT_TRUE(cpu->geglu(want.data(), u.data(), want.data(), 8));
  EXPECT_EQ(g, want);
  ASSERT_TRUE(ops.scale(g.data(), 2.0f, 8));
  ASSERT_TRUE(ops.add_bias(g.data(), u.data(), 1, 8));
  const auto counts = ops.fallbacks();
  EXPECT_EQ(counts.at("rope"), 1u);
  EXPECT_EQ(counts.at("geglu"), 1u);
  EXPECT_EQ(counts.at("scale"), 1u);
  EXPECT_EQ(counts.at("add_bias"), 1u);

  FallbackOps strict(std::make_unique<LlamaOnlyDevice>(), /*strict=*/true);
  const Status refused = strict.geglu(g.data(), u.data(), g.data(), 8);
  EXPECT_EQ(refused.code(), ErrorCode::unsupported);
  EXPECT_EQ(strict.rope_ext(a.data(), positions, 2, 16, 16, neox).code(), ErrorCode::unsupported);
}

}  // namespace
}  // namespace kallpa::ops
