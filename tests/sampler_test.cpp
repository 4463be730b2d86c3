#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "kallpa/runtime/sampler.h"

namespace kallpa::runtime {
namespace {

std::vector<float> logits_from_probs(const std::vector<double>& p) {
  std::vector<float> l;
  for (double x : p) l.push_back(static_cast<float>(std::log(x)));
  return l;
}

TEST(Sampler, GreedyPicksArgmaxAndLowestIdOnTies) {
  Sampler s({.temperature = 0.0f});
  std::vector<float> l = {0.1f, 3.0f, -1.0f, 3.0f};
  EXPECT_EQ(s.sample(l, {}), 1);
}

TEST(Sampler, SameSeedSameSequenceDifferentSeedDiffers) {
  std::vector<float> base(50);
  for (std::size_t i = 0; i < base.size(); ++i) base[i] = static_cast<float>(std::sin(double(i)));
  auto draw = [&](std::uint64_t seed) {
    Sampler s({.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f, .seed = seed});
    std::vector<std::int32_t> out;
    for (int i = 0; i < 40; ++i) {
      auto l = base;
      out.push_back(s.sample(l, {}));
    }
    return out;
  };
  EXPECT_EQ(draw(7), draw(7));
  EXPECT_NE(draw(7), draw(8));
}

TEST(Sampler, DrawsFollowTheDistribution) {
  Sampler s({.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f, .seed = 3});
  const std::vector<double> p = {0.5, 0.3, 0.2};
  std::map<std::int32_t, int> counts;
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    auto l = logits_from_probs(p);
    ++counts[s.sample(l, {})];
  }
  for (int id = 0; id < 3; ++id) EXPECT_NEAR(counts[id] / double(n), p[static_cast<std::size_t>(id)], 0.02) << id;
}

TEST(Sampler, TopKTopPAndMinPRestrictTheSupport) {
  const std::vector<double> p = {0.4, 0.3, 0.2, 0.06, 0.04};
  auto support = [&](SamplingParams params) {
    Sampler s(params);
    std::map<std::int32_t, int> seen;
    for (int i = 0; i < 3000; ++i) {
      auto l = logits_from_probs(p);
      ++seen[s.sample(l, {})];
    }
    return seen.size();
  };
  EXPECT_EQ(support({.temperature = 1.0f, .top_k = 2, .top_p = 1.0f, .min_p = 0.0f}), 2u);
  EXPECT_EQ(support({.temperature = 1.0f, .top_k = 0, .top_p = 0.85f, .min_p = 0.0f}), 3u);   // .4+.3+.2 reaches .85
  EXPECT_EQ(support({.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.6f}), 2u);    // p >= .24
  EXPECT_EQ(support({.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f}), 5u);
}

TEST(Sampler, RepetitionPenaltyDemotesRecentTokens) {
  Sampler s({.temperature = 0.0f, .repetition_penalty = 2.0f});
  std::vector<float> l = {1.0f, 1.5f, -0.5f};
  const std::int32_t recent[] = {1};
  EXPECT_EQ(s.sample(l, recent), 0);  // 1.5 / 2 = 0.75 < 1.0
  EXPECT_FLOAT_EQ(l[1], 0.75f);
}

TEST(Sampler, LowTemperatureConcentrates) {
  Sampler s({.temperature = 0.05f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f, .seed = 1});
  int top = 0;
  for (int i = 0; i < 500; ++i) {
    std::vector<float> l = {1.0f, 0.8f, 0.5f};
    top += s.sample(l, {}) == 0;
  }
  EXPECT_GT(top, 480);
}

TEST(SamplingParams, RejectsOutOfRangeValues) {
  EXPECT_EQ(SamplingParams{.temperature = -1.0f}.validate().field(), "temperature");
  EXPECT_EQ(SamplingParams{.top_p = 0.0f}.validate().field(), "top_p");
  EXPECT_EQ(SamplingParams{.min_p = 1.5f}.validate().field(), "min_p");
  EXPECT_EQ(SamplingParams{.repetition_penalty = 0.0f}.validate().field(), "repetition_penalty");
  EXPECT_TRUE(SamplingParams{}.validate().is_ok());
}

}  // namespace
}  // namespace kallpa::runtime
