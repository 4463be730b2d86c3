// Health checks at registration: canary cases against the reference quarantine wrong backends
// before they can be selected; the check runs once per backend, is thread-safe and skippable.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <thread>

#include "backends/reference/reference.h"
#include "kallpa/conformance.h"
#include "kallpa/dispatcher.h"
#include "kallpa/health.h"
#include "kallpa/registry.h"
#include "support/host_backends.h"
#include "test_problem.h"

namespace kallpa {
namespace {

using testing::DenseF32Problem;

// The reference's answer with one kind of mistake a broken kernel makes.
enum class Fault { none, small_error, nan_on_empty_rows, stray_write, error, wrong_for_decode };

class MutantBackend final : public AttentionBackend {
 public:
  MutantBackend(std::string name, int priority, Fault fault, DeviceKind device = DeviceKind::cpu)
      : name_(std::move(name)), priority_(priority), fault_(fault), device_(device) {}
  std::string_view name() const noexcept override { return name_; }
  std::string_view version() const noexcept override { return "0"; }
  DeviceKind device_kind() const noexcept override { return device_; }
  int priority() const noexcept override { return priority_; }
  Support supports(const ProblemSignature&) const noexcept override { return Support::yes(); }
  Status run(const ValidatedProblem& vp, Workspace ws) noexcept override {
    ++calls;
    if (fault_ == Fault::error) return Status(ErrorCode::backend_failure, name_, "injected failure");
    Status s = reference_().run(vp, ws);
    if (!s) return s;
    const AttentionProblem& p = vp.problem();
    auto* o = static_cast<float*>(p.o.data);
    const bool f32 = p.o.dtype == DType::f32;
    switch (fault_) {
      case Fault::small_error:
        if (f32) o[vp.o_row_offset(0, 0)] += 1e-3f;
        break;
      case Fault::nan_on_empty_rows:
        for (std::int64_t i = 0; i < vp.seqlen_q(0); ++i) {
          const auto keys = vp.visible_keys(0, i);
          if (f32 && keys.first > keys.last) o[vp.o_row_offset(0, i)] = std::numeric_limits<float>::quiet_NaN();
        }
        break;
      case Fault::stray_write:
        // One element before the output: inside the canary's guard region.
        if (f32) o[-1] = 0.5f;
        break;
      case Fault::wrong_for_decode:
        if (f32 && vp.max_seqlen_q() == 1) o[vp.o_row_offset(0, 0)] *= -1.0f;
        break;
      default: break;
    }
    return {};
  }
  std::atomic<int> calls{0};

 private:
  static AttentionBackend& reference_() { return *BackendRegistry::global().find("reference"); }
  std::string name_;
  int priority_;
  Fault fault_;
  DeviceKind device_;
};

struct CheckedRegistry {
  BackendRegistry registry;
  MutantBackend* add(std::string name, int priority, Fault fault, DeviceKind device = DeviceKind::cpu) {
    auto b = std::make_unique<MutantBackend>(std::move(name), priority, fault, device);
    MutantBackend* raw = b.get();
    EXPECT_TRUE(registry.add(std::move(b)));
    return raw;
  }
  CheckedRegistry() { registry.set_health_check(run_canaries); }
};

// The core names no backend: the suite and the health check take their oracle from the registry,
// whichever backend says it is one (reference, in-tree).
class ShiftedOracle final : public AttentionOracle {
 public:
  ExactOutput compute_exact(const ValidatedProblem& p) const override {
    ExactOutput r = BackendRegistry::global().oracle()->compute_exact(p);
    for (double& v : r.o) v += 0.5;
    return r;
  }
};

TEST(HealthCheck, TheOracleIsFoundThroughTheRegistry) {
  const AttentionOracle* oracle = BackendRegistry::global().oracle();
  ASSERT_NE(oracle, nullptr);
  EXPECT_EQ(oracle, BackendRegistry::global().find("reference")->oracle());
  CheckedRegistry checked;
  checked.add("mutant-right", 10, Fault::none);
  EXPECT_EQ(checked.registry.oracle(), nullptr);  // none of its backends is an oracle
  // The oracle given is what judges: a wrong one fails the reference itself.
  AttentionBackend& reference = *BackendRegistry::global().find("reference");
  const conformance::Case c = conformance::canary_cases().front();
  EXPECT_TRUE(conformance::run_case(reference, c).passed);
  const ShiftedOracle shifted;
  EXPECT_FALSE(conformance::run_case(reference, c, &shifted).passed);
}

TEST(HealthCheck, CanariesAreAFewSmallCasesOfTheSuite) {
  const auto canaries = conformance::canary_cases();
  EXPECT_GE(canaries.size(), 6u);
  EXPECT_LE(canaries.size(), 12u);
  bool paged = false, decode = false, empty_rows = false;
  for (const auto& c : canaries) {
    paged = paged || c.spec.kv_layout == KvLayout::paged;
    decode = decode || c.spec.seqlens_q[0] == 1;
    empty_rows = empty_rows || c.spec.edge == conformance::Edge::all_masked;
  }
  EXPECT_TRUE(paged && decode && empty_rows);
}

TEST(HealthCheck, BuiltInBackendsAreHealthy) {
  BackendRegistry& global = BackendRegistry::global();
  global.ensure_checked();
  for (const BackendInfo& info : global.list()) {
    if (info.backend->device_kind() != DeviceKind::cpu) continue;
    if (!test_support::runs_here(*info.backend)) {
      // It cannot run in this process (pjrt without a plugin): unchecked, and the reason says why.
      EXPECT_EQ(info.health, Health::unchecked) << info.backend->name();
      EXPECT_NE(info.health_reason.find("none of the"), std::string::npos) << info.health_reason;
      continue;
    }
    EXPECT_EQ(info.health, Health::healthy) << info.backend->name() << ": " << info.health_reason;
  }
  EXPECT_GE(global.health_counters().checked, 1u);
  EXPECT_GT(global.health_counters().check_milliseconds, 0.0);
}

TEST(HealthCheck, QuarantinesEachKindOfWrongBackendWithTheCase) {
  CheckedRegistry r;
  MutantBackend* good = r.add("good", 1, Fault::none);
  r.add("small-error", 100, Fault::small_error);
  r.add("nan-on-empty-rows", 101, Fault::nan_on_empty_rows);
  r.add("stray-write", 102, Fault::stray_write);
  r.add("error", 103, Fault::error);
  r.add("wrong-for-decode", 104, Fault::wrong_for_decode);

  Dispatcher d({}, &r.registry);
  DenseF32Problem t(1, 3, 5, 2, 1, 16);
  ASSERT_TRUE(d.run(t.problem));
  EXPECT_GT(good->calls, 0);

  const std::map<std::string, std::string> expected = {{"small-error", "> allowed"},
                                                       {"nan-on-empty-rows", "NaN where the reference is finite"},
                                                       {"stray-write", "out-of-bounds write"},
                                                       {"error", "run() failed"},
                                                       {"wrong-for-decode", "canary"}};
  for (const auto& [name, words] : expected) {
    auto info = r.registry.info(name);
    ASSERT_TRUE(info.is_ok());
    EXPECT_EQ(info->health, Health::quarantined) << name;
    EXPECT_NE(info->health_reason.find("canary '"), std::string::npos) << name << ": " << info->health_reason;
    EXPECT_NE(info->health_reason.find(words), std::string::npos) << name << ": " << info->health_reason;
  }
  EXPECT_EQ(r.registry.info("good")->health, Health::healthy);
  EXPECT_EQ(r.registry.health_counters().quarantined_at_check, 5u);
  EXPECT_EQ(r.registry.health_counters().checked, 6u);

  // The same answer as the reference: none of the quarantined backends touched o.
  DenseF32Problem want(1, 3, 5, 2, 1, 16);
  ASSERT_TRUE(BackendRegistry::global().find("reference")->run(*validate(want.problem), {}));
  EXPECT_EQ(t.o, want.o);

  for (const Verdict& v : d.explain(validate(t.problem)->signature())) {
    if (v.backend == "good") {
      EXPECT_TRUE(v.selected);
    } else {
      EXPECT_EQ(v.rank, -1) << v.backend;
      EXPECT_NE(v.reason.find("quarantined: canary"), std::string::npos) << v.reason;
    }
  }
}

TEST(HealthCheck, RunsOncePerBackendEvenWithConcurrentFirstCalls) {
  CheckedRegistry r;
  MutantBackend* good = r.add("good", 1, Fault::none);
  MutantBackend* wrong = r.add("wrong", 100, Fault::small_error);
  Dispatcher d({}, &r.registry);
  std::vector<std::thread> threads;
  std::atomic<int> failures{0}, wrong_answers{0};
  DenseF32Problem want(1, 2, 2, 1, 1, 8);
  ASSERT_TRUE(BackendRegistry::global().find("reference")->run(*validate(want.problem), {}));
  for (int n = 0; n < 4; ++n) {
    threads.emplace_back([&] {
      DenseF32Problem t(1, 2, 2, 1, 1, 8);
      for (int i = 0; i < 5; ++i) {
        if (!d.run(t.problem)) ++failures;
        // Callers that arrive while the check runs wait for it: none is served by "wrong".
        if (t.o != want.o) ++wrong_answers;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures, 0);
  EXPECT_EQ(wrong_answers, 0);
  const int canaries = static_cast<int>(conformance::canary_cases().size());
  EXPECT_EQ(good->calls, canaries + 20);
  EXPECT_EQ(wrong->calls, canaries);  // the canaries only: quarantined before any real call

  Dispatcher again({}, &r.registry);
  DenseF32Problem t(1, 2, 2, 1, 1, 8);
  ASSERT_TRUE(again.run(t.problem));
  EXPECT_EQ(good->calls, canaries + 21);

  // A backend registered later is checked before its first selection.
  MutantBackend* late = r.add("late-wrong", 50, Fault::small_error);
  ASSERT_TRUE(d.run(t.problem));
  EXPECT_EQ(r.registry.info("late-wrong")->health, Health::quarantined);
  EXPECT_EQ(late->calls, canaries);  // only the canaries; never selected
  EXPECT_EQ(good->calls, canaries + 22);
}

TEST(HealthCheck, SkippedCheckLeavesBackendsUncheckedAndSelectable) {
  BackendRegistry registry;
  registry.set_health_check(skipped_health_check("test"));
  auto wrong = std::make_unique<MutantBackend>("wrong", 10, Fault::small_error);
  MutantBackend* raw = wrong.get();
  ASSERT_TRUE(registry.add(std::move(wrong)));
  Dispatcher d({}, &registry);
  DenseF32Problem t(1, 2, 2, 1, 1, 8);
  ASSERT_TRUE(d.run(t.problem));
  EXPECT_EQ(raw->calls, 1);  // nothing ran before the real call
  auto info = registry.info("wrong");
  EXPECT_EQ(info->health, Health::unchecked);
  EXPECT_EQ(info->health_reason, "health check skipped by test");
}

TEST(HealthCheck, EnvironmentVariableSkipsTheDefaultCheck) {
  MutantBackend wrong("wrong", 10, Fault::small_error);
  setenv("KALLPA_SKIP_HEALTH_CHECK", "1", 1);
  auto skipped = default_health_check()({&wrong});
  unsetenv("KALLPA_SKIP_HEALTH_CHECK");
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_EQ(skipped[0].health, Health::unchecked);
  EXPECT_NE(skipped[0].reason.find("KALLPA_SKIP_HEALTH_CHECK"), std::string::npos);
  EXPECT_EQ(wrong.calls, 0);
  auto checked = default_health_check()({&wrong});
  EXPECT_EQ(checked[0].health, Health::quarantined);
}

TEST(HealthCheck, OtherDevicesStayUncheckedWithAReason) {
  MutantBackend gpu("gpu", 10, Fault::none, DeviceKind::cuda);
  auto reports = run_canaries({&gpu});
  EXPECT_EQ(reports[0].health, Health::unchecked);
  EXPECT_NE(reports[0].reason.find("cuda"), std::string::npos) << reports[0].reason;
  EXPECT_EQ(gpu.calls, 0);
}

TEST(HealthCheck, ResettingToUncheckedChecksAgain) {
  CheckedRegistry r;
  MutantBackend* good = r.add("good", 1, Fault::none);
  r.registry.ensure_checked();
  const int after_first = good->calls;
  ASSERT_TRUE(r.registry.set_health("good", Health::unchecked));
  r.registry.ensure_checked();
  EXPECT_EQ(good->calls, 2 * after_first);
  EXPECT_EQ(r.registry.info("good")->health, Health::healthy);
}

}  // namespace
}  // namespace kallpa
