// Trust at run time: a backend's first call in a new size bucket is checked on sampled rows
// against the oracle before its answer is used, shadow verification re-checks live calls at a set
// rate, and every quarantine goes to a journal that holds the build at the next start until a
// fuller check passes.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "kallpa/conformance.h"
#include "kallpa/dispatcher.h"
#include "kallpa/quarantine_journal.h"
#include "kallpa/registry.h"
#include "test_problem.h"

namespace kallpa {
namespace {

using testing::DenseF32Problem;

AttentionBackend& global_reference() { return *BackendRegistry::global().find("reference"); }

// The oracle of a registry made by hand: the global reference under another name.
class Oracle final : public AttentionBackend {
 public:
  std::string_view name() const noexcept override { return "oracle"; }
  std::string_view version() const noexcept override { return "1"; }
  DeviceKind device_kind() const noexcept override { return DeviceKind::cpu; }
  int priority() const noexcept override { return 0; }
  Support supports(const ProblemSignature&) const noexcept override { return Support::yes(); }
  Status run(const ValidatedProblem& vp, Workspace ws) noexcept override { return global_reference().run(vp, ws); }
  const AttentionOracle* oracle() const noexcept override { return global_reference().oracle(); }
};

// The reference's answer, made wrong (every f32 o element + 0.5) when `wrong(problem, call)` says so.
class Rogue final : public AttentionBackend {
 public:
  using Rule = bool (*)(const ValidatedProblem&, int call);
  Rogue(std::string name, Rule wrong) : name_(std::move(name)), wrong_(wrong) {}
  std::string_view name() const noexcept override { return name_; }
  std::string_view version() const noexcept override { return "2.0"; }
  DeviceKind device_kind() const noexcept override { return DeviceKind::cpu; }
  int priority() const noexcept override { return 100; }
  Support supports(const ProblemSignature&) const noexcept override { return Support::yes(); }
  Status run(const ValidatedProblem& vp, Workspace ws) noexcept override {
    const int call = ++calls;
    Status s = global_reference().run(vp, ws);
    const TensorView& o = vp.problem().o;
    if (!s || o.dtype != DType::f32 || !wrong_(vp, call)) return s;
    const std::int64_t hs = o.stride[static_cast<std::size_t>(o.rank - 2)];
    const std::int64_t ds = o.stride[static_cast<std::size_t>(o.rank - 1)];
    for (std::int32_t b = 0; b < vp.batch(); ++b) {
      for (std::int64_t i = 0; i < vp.seqlen_q(b); ++i) {
        for (std::int64_t h = 0; h < vp.hq(); ++h) {
          for (std::int64_t c = 0; c < vp.head_dim_v(); ++c) {
            static_cast<float*>(o.data)[vp.o_row_offset(b, i) + h * hs + c * ds] += 0.5f;
          }
        }
      }
    }
    return s;
  }
  std::atomic<int> calls{0};

 private:
  std::string name_;
  Rule wrong_;
};

bool beyond_4096(const ValidatedProblem& vp, int) { return vp.max_seqlen_k() > 4096; }
bool every_third(const ValidatedProblem&, int call) { return call % 3 == 0; }
bool always(const ValidatedProblem&, int) { return true; }
bool never(const ValidatedProblem&, int) { return false; }

struct Fixture {
  BackendRegistry registry;  // no health check: run-time behaviour only
  Rogue* rogue;
  explicit Fixture(Rogue::Rule wrong, std::string name = "rogue") {
    auto r = std::make_unique<Rogue>(std::move(name), wrong);
    rogue = r.get();
    EXPECT_TRUE(registry.add(std::move(r)));
    EXPECT_TRUE(registry.add(std::make_unique<Oracle>()));
  }
};

DispatchOptions checks(bool first_use, double rate, std::uint64_t seed = 7) {
  DispatchOptions o;
  o.first_use_check = first_use;
  o.verify_rate = rate;
  o.verify_seed = seed;
  return o;
}

// The reference's o for the same inputs.
std::vector<float> expected(const DenseF32Problem& p) {
  AttentionProblem ap = p.problem;
  std::vector<float> o(p.o.size(), 0.0f);
  ap.o.data = o.data();
  EXPECT_TRUE(global_reference().run(*validate(ap), {}));
  return o;
}

void expect_near(const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t n = 0; n < got.size(); ++n) ASSERT_NEAR(got[n], want[n], 1e-5) << "element " << n;
}

std::string temp_journal(const std::string& name) {
  const auto path = std::filesystem::temp_directory_path() /
                    ("kallpa_" + name + "_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
                     std::to_string(reinterpret_cast<std::uintptr_t>(&name)) + ".jsonl");
  std::filesystem::remove(path);
  return path.string();
}

TEST(SizeBucket, PowerOfTwoOfTheLongestSequencePhaseDtypeLayoutDevice) {
  DenseF32Problem decode(2, 1, 4096, 2, 1, 16), prefill(1, 8, 4097, 2, 1, 16);
  const SizeBucket a = size_bucket(*validate(decode.problem)), b = size_bucket(*validate(prefill.problem));
  EXPECT_EQ(a.keys_log2, 12);
  EXPECT_TRUE(a.decode);
  EXPECT_EQ(b.keys_log2, 13);
  EXPECT_FALSE(b.decode);
  EXPECT_NE(a.key(), b.key());
  EXPECT_EQ(a.to_string(), "keys<=2^12/decode/f32/unpaged/cpu");
}

TEST(FirstUseCheck, WrongOnlyBeyond4096KeysIsCaughtBeforeItsFirstWrongAnswerReachesTheCaller) {
  Fixture fx(beyond_4096);
  Dispatcher d(checks(true, 0.0), &fx.registry);

  DenseF32Problem small(1, 1, 1024, 4, 2, 32);
  ASSERT_TRUE(d.run(small.problem));
  EXPECT_EQ(fx.rogue->calls.load(), 1);  // its answer was used (and checked) at 1k keys
  expect_near(small.o, expected(small));

  DenseF32Problem big(1, 1, 8192, 4, 2, 32, 0, /*with_lse=*/true);
  ASSERT_TRUE(d.run(big.problem));
  EXPECT_EQ(fx.rogue->calls.load(), 2);  // it ran; its answer was caught and the oracle re-ran the call
  expect_near(big.o, expected(big));
  const SizeBucket bucket = size_bucket(*validate(big.problem));
  EXPECT_EQ(fx.registry.bucket_trust(*fx.rogue, bucket), BucketTrust::quarantined);
  EXPECT_EQ(fx.registry.bucket_trust(*fx.rogue, size_bucket(*validate(small.problem))), BucketTrust::verified);

  // Quarantined for that bucket only: not run there again, still serving the bucket it passed.
  const BackendInfo info = *fx.registry.info("rogue");
  EXPECT_EQ(info.health, Health::unchecked);
  ASSERT_EQ(info.quarantined_buckets.size(), 1u);
  EXPECT_EQ(info.quarantined_buckets[0], bucket.to_string());
  EXPECT_EQ(info.verification.first_use_checks, 2u);
  EXPECT_EQ(info.verification.first_use_mismatches, 1u);
  EXPECT_GT(info.verification.first_use_seconds, 0.0);
  EXPECT_EQ(fx.registry.health_counters().buckets_quarantined, 1u);

  std::fill(big.o.begin(), big.o.end(), 0.0f);
  ASSERT_TRUE(d.run(big.problem));
  EXPECT_EQ(fx.rogue->calls.load(), 2);
  expect_near(big.o, expected(big));
  ASSERT_TRUE(d.run(small.problem));
  EXPECT_EQ(fx.rogue->calls.load(), 3);
  EXPECT_EQ(fx.registry.info("rogue")->verification.first_use_checks, 2u);  // verified once per bucket
}

TEST(FirstUseCheck, OffTrustsTheBackendAsBefore) {
  Fixture fx(beyond_4096);
  Dispatcher d(checks(false, 0.0), &fx.registry);
  DenseF32Problem big(1, 1, 8192, 2, 1, 16);
  ASSERT_TRUE(d.run(big.problem));
  EXPECT_NEAR(big.o[0], expected(big)[0] + 0.5f, 1e-5);  // the wrong answer: nothing checked it
  EXPECT_EQ(fx.registry.info("rogue")->verification.first_use_checks, 0u);
}

TEST(FirstUseCheck, ConcurrentFirstCallsInOneBucketAllGetTheRightAnswer) {
  Fixture fx(beyond_4096);
  Dispatcher d(checks(true, 0.0), &fx.registry);
  constexpr int kThreads = 4;
  std::vector<std::unique_ptr<DenseF32Problem>> problems;
  for (int t = 0; t < kThreads; ++t)
    problems.push_back(std::make_unique<DenseF32Problem>(1, 1, 5000, 2, 1, 16, 0, false, t + 1));
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      if (!d.run(problems[static_cast<std::size_t>(t)]->problem)) ++failures;
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  for (const auto& p : problems) expect_near(p->o, expected(*p));
  const BackendInfo info = *fx.registry.info("rogue");
  // Each call that found the bucket unverified checked; none used an unchecked answer.
  EXPECT_EQ(info.verification.first_use_checks, static_cast<std::uint64_t>(fx.rogue->calls.load()));
  EXPECT_EQ(info.verification.first_use_mismatches, info.verification.first_use_checks);
  EXPECT_EQ(info.quarantined_buckets.size(), 1u);  // one bucket, however many found it
}

TEST(FirstUseCheck, WithoutAnOracleTheCallIsCountedUnverifiableAndServed) {
  BackendRegistry registry;
  auto r = std::make_unique<Rogue>("rogue", never);
  Rogue* rogue = r.get();
  ASSERT_TRUE(registry.add(std::move(r)));
  Dispatcher d(checks(true, 1.0), &registry);
  DenseF32Problem p(1, 1, 64, 2, 1, 16);
  ASSERT_TRUE(d.run(p.problem));
  ASSERT_TRUE(d.run(p.problem));
  EXPECT_EQ(rogue->calls.load(), 2);
  const BackendInfo info = *registry.info("rogue");
  EXPECT_EQ(info.verification.unverifiable, 2u);  // the first-use check, then a shadow check
  EXPECT_EQ(info.verification.first_use_checks, 0u);
  EXPECT_EQ(registry.bucket_trust(*rogue, size_bucket(*validate(p.problem))), BucketTrust::unverifiable);
}

TEST(ShadowVerification, WrongOneCallInThreeIsCaughtOnTheCheckedCallAndQuarantinedEntirely) {
  Fixture fx(every_third);
  const std::string path = temp_journal("shadow");
  fx.registry.set_journal(std::make_shared<QuarantineJournal>(path));
  Dispatcher d(checks(false, 1.0), &fx.registry);
  DenseF32Problem p(2, 3, 200, 4, 2, 32);
  const std::vector<float> want = expected(p);
  for (int call = 1; call <= 5; ++call) {
    std::fill(p.o.begin(), p.o.end(), 0.0f);
    ASSERT_TRUE(d.run(p.problem)) << "call " << call;
    expect_near(p.o, want);  // the third call's wrong answer never reached the caller
  }
  EXPECT_EQ(fx.rogue->calls.load(), 3);  // quarantined at its third call, never run again
  const BackendInfo info = *fx.registry.info("rogue");
  EXPECT_EQ(info.health, Health::quarantined);
  EXPECT_NE(info.health_reason.find("shadow check"), std::string::npos) << info.health_reason;
  EXPECT_EQ(info.verification.shadow_checks, 3u);
  EXPECT_EQ(info.verification.shadow_mismatches, 1u);
  EXPECT_EQ(fx.registry.health_counters().quarantined_by_verification, 1u);

  const std::vector<JournalRecord> records = QuarantineJournal(path).read();
  ASSERT_EQ(records.size(), 1u);
  EXPECT_EQ(records[0].event, "quarantined");
  EXPECT_EQ(records[0].backend, "rogue");
  EXPECT_EQ(records[0].identity, "rogue@2.0");
  EXPECT_EQ(records[0].source, "shadow_check");
  EXPECT_EQ(records[0].scope, "backend");
  EXPECT_FALSE(records[0].time.empty());
  std::filesystem::remove(path);
}

TEST(ShadowVerification, ASeededRateChecksAboutThatFractionOfCalls) {
  Fixture fx(never);
  Dispatcher d(checks(false, 0.25, 42), &fx.registry);
  DenseF32Problem p(1, 1, 32, 2, 1, 16);
  for (int n = 0; n < 400; ++n) ASSERT_TRUE(d.run(p.problem));
  const std::uint64_t checked = fx.registry.info("rogue")->verification.shadow_checks;
  EXPECT_GT(checked, 60u);  // 100 expected; binomial(400, 0.25) stays within these bounds
  EXPECT_LT(checked, 140u);
  EXPECT_EQ(fx.registry.info("rogue")->verification.shadow_mismatches, 0u);
}

TEST(ShadowVerification, RatesParseAsFractionsOrOneInN) {
  EXPECT_DOUBLE_EQ(*DispatchOptions::parse_rate("0.001"), 0.001);
  EXPECT_DOUBLE_EQ(*DispatchOptions::parse_rate("1/1000"), 0.001);
  EXPECT_DOUBLE_EQ(*DispatchOptions::parse_rate("0"), 0.0);
  EXPECT_DOUBLE_EQ(*DispatchOptions::parse_rate("1"), 1.0);
  for (const char* bad : {"", "-0.1", "1.5", "2/3", "1/0", "x", "1/x"}) {
    EXPECT_EQ(DispatchOptions::parse_rate(bad).status().code(), ErrorCode::parse_error) << bad;
  }
  ::setenv("KALLPA_VERIFY_RATE", "1/10", 1);
  ::setenv("KALLPA_FIRST_USE_CHECK", "0", 1);
  auto o = DispatchOptions::from_env();
  ::unsetenv("KALLPA_VERIFY_RATE");
  ::unsetenv("KALLPA_FIRST_USE_CHECK");
  ASSERT_TRUE(o);
  EXPECT_DOUBLE_EQ(o->verify_rate, 0.1);
  EXPECT_FALSE(o->first_use_check);
  ::setenv("KALLPA_VERIFY_RATE", "often", 1);
  auto bad = DispatchOptions::from_env();
  ::unsetenv("KALLPA_VERIFY_RATE");
  EXPECT_EQ(bad.status().field(), "KALLPA_VERIFY_RATE");
}

// A fuller check for a registry made by hand: the canary cases, judged by the global oracle.
std::vector<HealthReport> canary_recheck(const std::vector<AttentionBackend*>& backends) {
  std::vector<HealthReport> out;
  for (AttentionBackend* b : backends) {
    HealthReport r{Health::healthy, {}};
    for (const conformance::Case& c : conformance::canary_cases()) {
      const conformance::CaseResult result = conformance::run_case(*b, c);
      if (!result.skipped && !result.passed) r = {Health::quarantined, c.name + ": " + result.failure};
    }
    out.push_back(r);
  }
  return out;
}

TEST(QuarantineJournal, ARestartKeepsTheBuildQuarantinedUntilTheFullerCheckPasses) {
  const std::string path = temp_journal("restart");
  {
    // First process: the rogue is caught at 8k keys (first use) and quarantined by hand.
    Fixture fx(beyond_4096);
    fx.registry.set_journal(std::make_shared<QuarantineJournal>(path));
    Dispatcher d(checks(true, 0.0), &fx.registry);
    DenseF32Problem big(1, 1, 8192, 2, 1, 16);
    ASSERT_TRUE(d.run(big.problem));
    ASSERT_TRUE(fx.registry.set_health("oracle", Health::quarantined, "by hand"));
  }
  std::vector<JournalRecord> records = QuarantineJournal(path).read();
  ASSERT_EQ(records.size(), 2u);
  EXPECT_EQ(records[0].source, "first_use_check");
  EXPECT_EQ(records[0].scope, "keys<=2^13/decode/f32/unpaged/cpu");
  EXPECT_EQ(records[1].source, "manual");
  EXPECT_EQ(open_quarantines(records).size(), 2u);
  {
    // Second start, same builds, a fuller check that the rogue fails: it stays quarantined.
    Fixture fx(always);
    fx.registry.set_journal(std::make_shared<QuarantineJournal>(path));
    fx.registry.set_recheck(canary_recheck);
    fx.registry.ensure_checked();
    const BackendInfo info = *fx.registry.info("rogue");
    EXPECT_EQ(info.health, Health::quarantined);
    EXPECT_NE(info.health_reason.find("held by the quarantine journal"), std::string::npos) << info.health_reason;
    Dispatcher d(checks(true, 0.0), &fx.registry);
    DenseF32Problem p(1, 1, 64, 2, 1, 16);
    const int before = fx.rogue->calls.load();  // the recheck ran it directly
    ASSERT_TRUE(d.run(p.problem));
    EXPECT_EQ(fx.rogue->calls.load(), before);  // the dispatcher never chose it
    expect_near(p.o, expected(p));
    EXPECT_EQ(fx.registry.info("oracle")->health, Health::healthy);  // passed its recheck
  }
  records = QuarantineJournal(path).read();
  ASSERT_EQ(records.size(), 4u);  // the rogue's failed recheck, and the oracle's clearance
  EXPECT_EQ(records[2].event == "cleared" ? records[3].source : records[2].source, "recheck");
  {
    // Third start: the rogue (right up to 4,096 keys) passes the fuller check and is cleared.
    Fixture fx(beyond_4096);
    fx.registry.set_journal(std::make_shared<QuarantineJournal>(path));
    fx.registry.set_recheck(canary_recheck);
    fx.registry.ensure_checked();
    EXPECT_EQ(fx.registry.info("rogue")->health, Health::healthy);
    EXPECT_EQ(fx.registry.health_counters().journal_cleared, 1u);
  }
  records = QuarantineJournal(path).read();
  EXPECT_TRUE(open_quarantines(records).empty());
  EXPECT_EQ(records.back().event, "cleared");
  EXPECT_EQ(records.back().identity, "rogue@2.0");
  std::filesystem::remove(path);
}

TEST(QuarantineJournal, HeldWithoutAFullerCheckAndCorruptLinesSkipped) {
  const std::string path = temp_journal("corrupt");
  {
    std::ofstream out(path);
    out << "{\"event\":\"quarantined\",\"backend\":\"rogue\",\"identity\":\"rogue@2.0\",\"scope\":\"backend\","
           "\"source\":\"health_check\",\"reason\":\"canary\",\"time\":\"2025-01-01T00:00:00Z\"}\n"
        << "not json at all\n"
        << "{\"event\":\"maybe\",\"identity\":\"x\"}\n"
        << "{\"event\":\"quarantined\",\"backend\":\"gone\",\"identity\":\"gone@1\"}\n";
  }
  const std::vector<JournalRecord> records = QuarantineJournal(path).read();
  ASSERT_EQ(records.size(), 2u);
  EXPECT_EQ(records[0].reason, "canary");
  EXPECT_EQ(records[1].identity, "gone@1");

  Fixture fx(never);
  fx.registry.set_journal(std::make_shared<QuarantineJournal>(path));
  fx.registry.ensure_checked();
  const BackendInfo info = *fx.registry.info("rogue");
  EXPECT_EQ(info.health, Health::quarantined);
  EXPECT_NE(info.health_reason.find("no fuller check is configured"), std::string::npos) << info.health_reason;
  EXPECT_EQ(fx.registry.info("oracle")->health, Health::unchecked);  // not in the journal
  std::filesystem::remove(path);
}

TEST(QuarantineJournal, AnUnwritableJournalNeverFailsTheCall) {
  Fixture fx(every_third);
  fx.registry.set_journal(std::make_shared<QuarantineJournal>("/proc/kallpa-no-such-dir/journal.jsonl"));
  Dispatcher d(checks(false, 1.0), &fx.registry);
  DenseF32Problem p(1, 1, 64, 2, 1, 16);
  for (int n = 0; n < 4; ++n) ASSERT_TRUE(d.run(p.problem));
  expect_near(p.o, expected(p));
  EXPECT_EQ(fx.registry.info("rogue")->health, Health::quarantined);
}

TEST(QuarantineJournal, IdentityIsNameAtVersionByDefault) {
  Rogue r("rogue", never);
  EXPECT_EQ(r.identity(), "rogue@2.0");
}

}  // namespace
}  // namespace kallpa
