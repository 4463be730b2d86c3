// The oracle itself, checked on problems whose answers follow from the definition by hand.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "backends/reference/reference.h"
#include "kallpa/registry.h"
#include "test_problem.h"

namespace kallpa {
namespace {

using testing::DenseF32Problem;

reference::Output64 compute(const AttentionProblem& p) {
  auto vp = validate(p);
  EXPECT_TRUE(vp.is_ok()) << vp.status().to_string();
  return reference::compute_f64(*vp);
}

TEST(Reference, IsRegisteredWithLowestPriority) {
  AttentionBackend* ref = BackendRegistry::global().find("reference");
  ASSERT_NE(ref, nullptr);
  EXPECT_EQ(ref->priority(), 0);
  EXPECT_EQ(ref->device_kind(), DeviceKind::cpu);
}

TEST(Reference, SingleKeyReturnsItsValueAndScoreAsLse) {
  DenseF32Problem t(1, 1, 1, 1, 1, 4, 3);
  auto r = compute(t.problem);
  for (int c = 0; c < 3; ++c) EXPECT_NEAR(r.o[c], t.v[c], 1e-7);
  double dot = 0;
  for (int c = 0; c < 4; ++c) dot += double(t.q[c]) * t.k[c];
  EXPECT_NEAR(r.lse[0], 0.5 * dot, 1e-6);
}

TEST(Reference, ZeroQueryAveragesValuesOverVisibleKeys) {
  DenseF32Problem t(1, 2, 4, 1, 1, 2, 1);
  std::fill(t.q.begin(), t.q.end(), 0.0f);
  t.problem.causal = true;  // query 0 sits at key 2: sees keys 0..2; query 1 sees 0..3
  auto r = compute(t.problem);
  EXPECT_NEAR(r.o[0], (t.v[0] + t.v[1] + t.v[2]) / 3.0, 1e-6);
  EXPECT_NEAR(r.o[1], (t.v[0] + t.v[1] + t.v[2] + t.v[3]) / 4.0, 1e-6);
  EXPECT_NEAR(r.lse[0], std::log(3.0), 1e-12);
  EXPECT_NEAR(r.lse[1], std::log(4.0), 1e-12);
}

TEST(Reference, GqaMapsQueryHeadsToKvHeadByDivision) {
  DenseF32Problem t(1, 1, 1, 4, 2, 2, 1);
  auto r = compute(t.problem);
  // One key: each query head returns its KV head's value; heads 0,1 -> kv 0; heads 2,3 -> kv 1.
  EXPECT_EQ(r.o[0], t.v[0]);
  EXPECT_EQ(r.o[1], t.v[0]);
  EXPECT_EQ(r.o[2], t.v[1]);
  EXPECT_EQ(r.o[3], t.v[1]);
}

TEST(Reference, FullyMaskedRowsGiveZeroAndMinusInfinity) {
  DenseF32Problem t(1, 3, 1, 1, 1, 2, 2);
  t.problem.causal = true;  // 3 queries, 1 key: queries 0 and 1 see nothing
  auto r = compute(t.problem);
  EXPECT_EQ(r.o[0], 0.0);
  EXPECT_EQ(r.o[3], 0.0);
  EXPECT_EQ(r.lse[0], -std::numeric_limits<double>::infinity());
  EXPECT_EQ(r.lse[1], -std::numeric_limits<double>::infinity());
  EXPECT_TRUE(std::isfinite(r.lse[2]));
}

TEST(Reference, SoftcapAndAlibiFollowTheContract) {
  DenseF32Problem t(1, 1, 2, 1, 1, 1, 1);
  t.q = {2.0f};
  t.k = {3.0f, -1.0f};
  t.v = {1.0f, 0.0f};
  t.problem.scale = 1.0f;
  t.problem.softcap = 4.0f;
  const float slope = 0.5f;
  t.problem.alibi_slopes = &slope;
  auto r = compute(t.problem);
  // Query 0 sits at key 1. s0 = 4 tanh(6/4) - 0.5*1, s1 = 4 tanh(-2/4) - 0.
  const double s0 = 4 * std::tanh(1.5) - 0.5, s1 = 4 * std::tanh(-0.5);
  EXPECT_NEAR(r.o[0], std::exp(s0) / (std::exp(s0) + std::exp(s1)), 1e-12);
  EXPECT_NEAR(r.lse[0], std::log(std::exp(s0) + std::exp(s1)), 1e-12);
}

TEST(Reference, NanInAVisibleKeyPropagatesButMaskedNanDoesNot) {
  DenseF32Problem t(1, 2, 2, 1, 1, 2, 1);
  t.problem.causal = true;
  t.k[2] = std::numeric_limits<float>::quiet_NaN();  // key 1: seen only by query 1
  auto r = compute(t.problem);
  EXPECT_TRUE(std::isfinite(r.o[0]));
  EXPECT_TRUE(std::isnan(r.o[1]));
  EXPECT_TRUE(std::isnan(r.lse[1]));
}

TEST(Reference, BackendWritesRoundedOutputAndLse) {
  DenseF32Problem t(2, 3, 5, 2, 1, 8, 8, true);
  auto vp = validate(t.problem);
  ASSERT_TRUE(vp.is_ok());
  auto expected = reference::compute_f64(*vp);
  AttentionBackend* ref = BackendRegistry::global().find("reference");
  ASSERT_TRUE(ref->run(*vp, {}));
  for (std::size_t n = 0; n < t.o.size(); ++n) EXPECT_EQ(t.o[n], static_cast<float>(expected.o[n]));
  // lse is [B, Hq, Sq]; the oracle's is [row, head].
  EXPECT_EQ(t.lse[(1 * 2 + 1) * 3 + 2], static_cast<float>(expected.lse[(1 * 3 + 2) * 2 + 1]));
}

// An oracle that only has compute_exact, so that compute_rows is the interface's default.
class WholeProblemOracle final : public AttentionOracle {
 public:
  ExactOutput compute_exact(const ValidatedProblem& p) const override { return reference::compute_f64(p); }
};

TEST(Reference, RowsAreTheWholeAnswersRowsInTheOrderAsked) {
  DenseF32Problem t(2, 3, 5, 4, 2, 8, 6);
  t.problem.causal = true;
  t.problem.window_left = 2;
  auto vp = validate(t.problem);
  ASSERT_TRUE(vp.is_ok()) << vp.status().to_string();
  const reference::Output64 all = reference::compute_f64(*vp);
  const std::vector<OutputRow> rows = {{1, 2, 3}, {0, 0, 0}, {1, 0, 1}, {0, 2, 2}, {1, 2, 3}};
  const WholeProblemOracle whole;
  const AttentionOracle* ref = BackendRegistry::global().oracle();
  ASSERT_NE(ref, nullptr);
  for (const AttentionOracle* oracle : {ref, static_cast<const AttentionOracle*>(&whole)}) {
    const ExactRows got = oracle->compute_rows(*vp, rows);
    ASSERT_EQ(got.o.size(), rows.size() * 6);
    ASSERT_EQ(got.lse.size(), rows.size());
    for (std::size_t n = 0; n < rows.size(); ++n) {
      const std::size_t at = static_cast<std::size_t>((rows[n].sequence * 3 + rows[n].query) * 4 + rows[n].head);
      EXPECT_EQ(got.lse[n], all.lse[at]) << "row " << n;
      for (std::size_t c = 0; c < 6; ++c) EXPECT_EQ(got.o[n * 6 + c], all.o[at * 6 + c]) << "row " << n << " c " << c;
    }
  }
}

}  // namespace
}  // namespace kallpa
