#include <gtest/gtest.h>

#include <cmath>
#include <algorithm>
#include <map>
#include <random>

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

// The sampler sorts lazily; an oracle that sorts the whole vocabulary and applies top-k, min-p and
// top-p in that order must make the same draw from the same random number, on a large vocabulary
// with ties, a flat tail and a peaked head.
std::int32_t oracle_draw(std::vector<float> logits, const SamplingParams& p, std::uint64_t raw) {
  struct C {
    float logit;
    std::int32_t id;
  };
  std::vector<C> c;
  for (std::int32_t i = 0; i < static_cast<std::int32_t>(logits.size()); ++i) c.push_back({logits[i] / p.temperature, i});
  std::sort(c.begin(), c.end(), [](const C& a, const C& b) { return a.logit > b.logit || (a.logit == b.logit && a.id < b.id); });
  std::size_t keep = c.size();
  if (p.top_k > 0 && static_cast<std::size_t>(p.top_k) < keep) keep = static_cast<std::size_t>(p.top_k);
  std::vector<double> prob(keep);
  double sum = 0;
  for (std::size_t i = 0; i < keep; ++i) sum += prob[i] = std::exp(double(c[i].logit) - c[0].logit);
  for (double& x : prob) x /= sum;
  if (p.min_p > 0) {
    std::size_t n = 1;
    while (n < keep && prob[n] >= double(p.min_p) * prob[0]) ++n;
    keep = n;
  }
  if (p.top_p < 1) {
    double cum = 0;
    std::size_t n = 0;
    while (n < keep) {
      cum += prob[n++];
      if (cum >= double(p.top_p)) break;
    }
    keep = n;
  }
  double total = 0;
  for (std::size_t i = 0; i < keep; ++i) total += prob[i];
  const double u = static_cast<double>(raw >> 11) * (1.0 / 9007199254740992.0) * total;
  double acc = 0;
  for (std::size_t i = 0; i < keep; ++i) {
    acc += prob[i];
    if (u < acc) return c[i].id;
  }
  return c[keep - 1].id;
}

TEST(Sampler, LazySortingDrawsWhatAFullSortDraws) {
  std::mt19937_64 gen(42);
  std::vector<float> base(49152);
  for (std::size_t i = 0; i < base.size(); ++i) {
    base[i] = static_cast<float>(std::sin(double(i) * 0.37) * 3.0);
    if (i % 97 == 0) base[i] = 12.0f - static_cast<float>(i % 5);  // a peaked head with ties
  }
  const SamplingParams params[] = {
      {.temperature = 0.8f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f, .seed = 1},
      {.temperature = 1.5f, .top_k = 0, .top_p = 0.9f, .min_p = 0.0f, .seed = 2},
      {.temperature = 1.0f, .top_k = 40, .top_p = 1.0f, .min_p = 0.0f, .seed = 3},
      {.temperature = 0.7f, .top_k = 100, .top_p = 0.95f, .min_p = 0.05f, .seed = 4},
      {.temperature = 2.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.01f, .seed = 5},
      {.temperature = 5.0f, .top_k = 0, .top_p = 0.99f, .min_p = 0.0f, .seed = 6},
      {.temperature = 3.0f, .top_k = 0, .top_p = 0.5f, .min_p = 0.001f, .seed = 7},
  };
  int mismatches = 0, draws = 0;
  for (const SamplingParams& p : params) {
    Sampler s(p);
    std::mt19937_64 rng(p.seed);
    for (int step = 0; step < 30; ++step) {
      std::vector<float> l = base;
      for (float& x : l) x += static_cast<float>(std::uniform_real_distribution<double>(-0.5, 0.5)(gen));
      const std::uint64_t raw = rng();
      const std::int32_t want = oracle_draw(l, p, raw);
      const std::int32_t got = s.sample(l, {});
      ++draws;
      // Sums in another order may move a draw that lands within rounding of a boundary.
      if (got != want) ++mismatches;
    }
  }
  EXPECT_LE(mismatches, 1) << "of " << draws;
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
