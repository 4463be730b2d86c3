#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
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
  std::vector<float> nan_first = {std::nanf(""), -2.0f, 1.0f, std::nanf("")};
  EXPECT_EQ(s.sample(nan_first, {}), 2);
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
  EXPECT_EQ(support({.temperature = 1.0f, .top_k = 0, .top_p = 0.85f, .min_p = 0.0f}), 3u);  // .4+.3+.2 reaches .85
  EXPECT_EQ(support({.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.6f}), 2u);   // p >= .24
  EXPECT_EQ(support({.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f}), 5u);
}

TEST(Sampler, RepetitionPenaltyDemotesRecentTokens) {
  Sampler s({.temperature = 0.0f, .repetition_penalty = 2.0f});
  std::vector<float> l = {1.0f, 1.5f, -0.5f};
  const std::int32_t recent[] = {1};
  EXPECT_EQ(s.sample(l, recent), 0);  // 1.5 / 2 = 0.75 < 1.0
  EXPECT_FLOAT_EQ(l[1], 0.75f);
}

TEST(Sampler, LogitBiasBansAndForcesTokens) {
  std::vector<float> l = {3.0f, 1.0f, 0.5f};
  Sampler ban({.temperature = 0.0f, .logit_bias = {{0, -100.0f}}});
  EXPECT_EQ(ban.sample(l, {}), 1);
  EXPECT_FLOAT_EQ(l[0], -97.0f);
  // At any temperature, +100 leaves the others no mass worth drawing.
  Sampler force({.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f, .logit_bias = {{2, 100.0f}}});
  for (int i = 0; i < 200; ++i) {
    std::vector<float> again = {3.0f, 1.0f, 0.5f};
    EXPECT_EQ(force.sample(again, {}), 2);
  }
  // An id past the vocabulary changes nothing (the server refuses it before).
  Sampler outside({.temperature = 0.0f, .logit_bias = {{7, 100.0f}}});
  std::vector<float> same = {3.0f, 1.0f};
  EXPECT_EQ(outside.sample(same, {}), 0);
  EXPECT_EQ(same, (std::vector<float>{3.0f, 1.0f}));
}

TEST(Sampler, PresenceAndFrequencyPenaltiesCountGeneratedTokens) {
  Sampler s({.temperature = 0.0f, .presence_penalty = 0.5f, .frequency_penalty = 0.25f});
  std::vector<float> l = {2.0f, 1.8f, 1.0f, 0.0f};
  const std::int32_t prompt_and_generated[] = {2, 2, 2, 0, 0, 3};
  const std::int32_t generated[] = {0, 0, 3};  // the prompt's 2s do not count
  EXPECT_EQ(s.sample(l, prompt_and_generated, generated), 1);
  EXPECT_FLOAT_EQ(l[0], 2.0f - 0.5f - 2 * 0.25f);
  EXPECT_FLOAT_EQ(l[1], 1.8f);
  EXPECT_FLOAT_EQ(l[2], 1.0f);
  EXPECT_FLOAT_EQ(l[3], 0.0f - 0.5f - 0.25f);
  // Negative values encourage repeats.
  Sampler again({.temperature = 0.0f, .presence_penalty = -2.0f});
  std::vector<float> m = {2.0f, 1.8f};
  const std::int32_t one[] = {1};
  EXPECT_EQ(again.sample(m, one, one), 1);
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

// The sampler sorts lazily (and not at all without filters); an oracle that sorts the whole
// vocabulary and applies top-k, min-p and top-p in that order must make the same draw from the
// same random number, on a large vocabulary with ties, a flat tail and a peaked head.
std::int32_t oracle_draw(std::vector<float> logits, const SamplingParams& p, std::uint64_t raw) {
  struct C {
    float logit;
    std::int32_t id;
  };
  std::vector<C> c;
  for (std::int32_t i = 0; i < static_cast<std::int32_t>(logits.size()); ++i)
    c.push_back({logits[i] / p.temperature, i});
  std::sort(c.begin(), c.end(),
            [](const C& a, const C& b) { return a.logit > b.logit || (a.logit == b.logit && a.id < b.id); });
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
  const bool filtered = (p.top_k > 0 && static_cast<std::size_t>(p.top_k) < c.size()) || p.top_p < 1 || p.min_p > 0;
  if (!filtered) {
    // Unfiltered, the sampler walks the whole vocabulary in id order.
    std::vector<std::pair<std::int32_t, double>> by_id;
    for (std::size_t i = 0; i < keep; ++i) by_id.push_back({c[i].id, prob[i]});
    std::sort(by_id.begin(), by_id.end());
    for (std::size_t i = 0; i < keep; ++i) {
      c[i].id = by_id[i].first;
      prob[i] = by_id[i].second;
    }
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
      // Nearly flat: top-p walks most of the vocabulary (the sampler's linear-time sort).
      {.temperature = 40.0f, .top_k = 0, .top_p = 0.95f, .min_p = 0.0f, .seed = 8},
      {.temperature = 40.0f, .top_k = 5000, .top_p = 0.9f, .min_p = 0.0f, .seed = 9},
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

TEST(Sampler, UnfilteredDrawsFollowTheDistributionAcrossBlocks) {
  // 1000 tokens span several of the sampler's sum blocks; the mass sits in a few tokens far
  // apart, in the first, a middle and the last block, plus a flat tail.
  std::vector<double> p(1000, 0.1 / 996);
  p[3] = 0.3;
  p[511] = 0.25;
  p[600] = 0.05;
  p[999] = 0.3;
  Sampler s({.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f, .seed = 11});
  std::map<std::int32_t, int> counts;
  const int n = 40000;
  for (int i = 0; i < n; ++i) {
    auto l = logits_from_probs(p);
    ++counts[s.sample(l, {})];
  }
  int tail = 0;
  for (const auto& [id, count] : counts) {
    if (id != 3 && id != 511 && id != 600 && id != 999) tail += count;
  }
  for (int id : {3, 511, 600, 999}) EXPECT_NEAR(counts[id] / double(n), p[static_cast<std::size_t>(id)], 0.01) << id;
  EXPECT_NEAR(tail / double(n), 0.1, 0.01);
}

TEST(Sampler, MaskedAndNanLogitsAreNeverDrawn) {
  const float inf = std::numeric_limits<float>::infinity();
  for (const SamplingParams& params :
       {SamplingParams{.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f, .seed = 5},
        SamplingParams{.temperature = 1.0f, .top_k = 0, .top_p = 0.99f, .min_p = 0.0f, .seed = 5}}) {
    Sampler s(params);
    std::vector<float> base(700, -inf);
    for (std::size_t i = 0; i < base.size(); i += 3) base[i] = std::nanf("");
    base[2] = -100.0f;  // weighs e^-100 relative to the others: below f32's range, so 0
    base[350] = 0.0f;
    base[698] = 0.5f;
    std::map<std::int32_t, int> seen;
    for (int i = 0; i < 2000; ++i) {
      auto l = base;
      ++seen[s.sample(l, {})];
    }
    EXPECT_EQ(seen.size(), 2u);
    EXPECT_GT(seen[350], 0);
    EXPECT_GT(seen[698], seen[350]);
  }
}

TEST(Sampler, InfiniteLogitsAndTinyTemperaturesAreGreedy) {
  const float inf = std::numeric_limits<float>::infinity();
  Sampler s({.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f, .seed = 1});
  std::vector<float> l = {0.0f, inf, 3.0f, inf};
  EXPECT_EQ(s.sample(l, {}), 1);
  std::vector<float> all_masked = {-inf, -inf, -inf};
  EXPECT_EQ(s.sample(all_masked, {}), 0);
  Sampler tiny({.temperature = 1e-40f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f, .seed = 1});
  std::vector<float> m = {0.5f, 2.0f, 1.0f};
  EXPECT_EQ(tiny.sample(m, {}), 1);
}

TEST(SamplingParams, RejectsOutOfRangeValues) {
  EXPECT_EQ(SamplingParams{.temperature = -1.0f}.validate().field(), "temperature");
  EXPECT_EQ(SamplingParams{.top_p = 0.0f}.validate().field(), "top_p");
  EXPECT_EQ(SamplingParams{.min_p = 1.5f}.validate().field(), "min_p");
  EXPECT_EQ(SamplingParams{.repetition_penalty = 0.0f}.validate().field(), "repetition_penalty");
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(SamplingParams{.presence_penalty = inf}.validate().field(), "presence_penalty");
  EXPECT_EQ(SamplingParams{.frequency_penalty = -inf}.validate().field(), "frequency_penalty");
  EXPECT_EQ((SamplingParams{.logit_bias = {{-1, 1.0f}}}.validate().field()), "logit_bias");
  EXPECT_EQ((SamplingParams{.logit_bias = {{1, inf}}}.validate().field()), "logit_bias");
  EXPECT_TRUE(SamplingParams{}.validate().is_ok());
}

}  // namespace
}  // namespace kallpa::runtime
