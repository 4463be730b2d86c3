// The engine's vectorised exp, max and softmax weights (ops/vector_exp.h) against scalar
// math, and the sampler's use of them: masked (-inf) logits are never drawn.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "kallpa/runtime/sampler.h"
#include "ops/vector_exp.h"

namespace kallpa::ops {
namespace {

TEST(VectorExp, WithinAFewUlpOfStdExpOverTheNormalRange) {
  std::vector<float> x;
  for (float v = -87.0f; v <= 88.0f; v += 0.01171875f) x.push_back(v);
  x.push_back(0.0f);
  std::vector<float> y = x;
  exp_inplace(y.data(), static_cast<std::int64_t>(y.size()));  // not a multiple of 8: the tail too
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double want = std::exp(double(x[i]));
    EXPECT_NEAR(y[i], want, want * 4e-7) << "x = " << x[i];
  }
}

TEST(VectorExp, MaxIgnoringNanSkipsNanAndCoversTheTail) {
  const float nan = std::nanf(""), inf = std::numeric_limits<float>::infinity();
  for (std::size_t n : {0u, 1u, 7u, 8u, 9u, 23u, 64u}) {
    for (std::size_t at = 0; at < n; ++at) {  // the largest in every position: vector body and tail
      std::vector<float> x(n);
      for (std::size_t i = 0; i < n; ++i) x[i] = (i % 3 == 0) ? nan : -static_cast<float>(i);
      x[at] = 5.0f;
      EXPECT_EQ(max_ignoring_nan(x.data(), static_cast<std::int64_t>(n)), 5.0f) << n << " " << at;
    }
    std::vector<float> all_nan(n, nan);
    EXPECT_EQ(max_ignoring_nan(all_nan.data(), static_cast<std::int64_t>(n)), -inf) << n;
  }
}

TEST(VectorExp, ShiftedExpIsASoftmaxWeightWithMaskedEntriesZero) {
  const float nan = std::nanf(""), inf = std::numeric_limits<float>::infinity();
  std::vector<float> x;
  for (int i = 0; i < 37; ++i) x.push_back(static_cast<float>(i) * 0.37f - 3.0f);
  x[4] = nan;
  x[9] = -inf;
  x[20] = -500.0f;  // (x - shift) * scale far below -87: 0, not exp(-87)
  x[33] = nan;
  std::vector<float> y(x.size(), -1.0f);
  const float shift = 10.0f, scale = 1.25f;
  shifted_exp(x.data(), y.data(), static_cast<std::int64_t>(x.size()), shift, scale);
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i]) || x[i] == -inf || x[i] == -500.0f) {
      EXPECT_EQ(y[i], 0.0f) << i;
      continue;
    }
    const float arg = (x[i] - shift) * scale;  // the f32 argument: its own rounding is not exp's error
    const double want = std::exp(double(arg));
    EXPECT_NEAR(y[i], want, want * 4e-7) << i;
  }
}

TEST(Sampler, MaskedLogitsAreNeverDrawn) {
  std::vector<float> logits(1000, -std::numeric_limits<float>::infinity());
  logits[17] = 0.5f;
  logits[600] = 0.0f;
  logits[999] = -100.0f;  // finite but far below: e^-100 relative, drawn essentially never
  runtime::Sampler s({.temperature = 2.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f, .seed = 3});
  int hits17 = 0, hits600 = 0;
  for (int i = 0; i < 4000; ++i) {
    std::vector<float> l = logits;
    const std::int32_t t = s.sample(l, {});
    ASSERT_TRUE(t == 17 || t == 600) << "drew " << t;
    (t == 17 ? hits17 : hits600)++;
  }
  // p(17) = e^0.25 / (e^0.25 + 1) = 0.562; 4000 draws put it within 0.54-0.58 with ~4.5 sigma.
  EXPECT_NEAR(hits17 / 4000.0, 0.562, 0.02);
}

}  // namespace
}  // namespace kallpa::ops
