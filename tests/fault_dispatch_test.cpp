// Fault-tolerant dispatch: run-time failures are counted and quarantine a backend at a limit,
// the paranoid check turns forbidden non-finite outputs into failures, calls fall back to the
// next healthy candidate, and strict mode makes any fallback an error.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>

#include "kallpa/dispatcher.h"
#include "kallpa/registry.h"
#include "test_problem.h"

namespace kallpa {
namespace {

using testing::DenseF32Problem;

enum class Mode { reference, error, nan_output };

// Either the reference's answer, an error, or NaN in every output element.
class Backend final : public AttentionBackend {
 public:
  Backend(std::string name, int priority, Mode mode) : name_(std::move(name)), priority_(priority), mode_(mode) {}
  std::string_view name() const noexcept override { return name_; }
  std::string_view version() const noexcept override { return "0"; }
  DeviceKind device_kind() const noexcept override { return DeviceKind::cpu; }
  int priority() const noexcept override { return priority_; }
  Support supports(const ProblemSignature&) const noexcept override { return Support::yes(); }
  Status run(const ValidatedProblem& vp, Workspace ws) noexcept override {
    ++calls;
    if (mode_ == Mode::error) return Status(ErrorCode::backend_failure, name_, "device lost");
    Status s = BackendRegistry::global().find("reference")->run(vp, ws);
    if (mode_ == Mode::nan_output) {
      auto* o = static_cast<float*>(vp.problem().o.data);
      for (std::int64_t n = 0; n < vp.problem().o.numel(); ++n) o[n] = std::numeric_limits<float>::quiet_NaN();
    }
    return s;
  }
  std::atomic<int> calls{0};

 private:
  std::string name_;
  int priority_;
  Mode mode_;
};

struct Fixture {
  BackendRegistry registry;  // no health check: run-time behaviour only
  Backend* bad;
  Backend* good;
  explicit Fixture(Mode bad_mode) {
    auto b = std::make_unique<Backend>("bad", 100, bad_mode);
    auto g = std::make_unique<Backend>("good", 1, Mode::reference);
    bad = b.get();
    good = g.get();
    EXPECT_TRUE(registry.add(std::move(b)));
    EXPECT_TRUE(registry.add(std::move(g)));
  }
};

DispatchOptions options(int quarantine_after, bool paranoid = false, bool strict = false) {
  DispatchOptions o;
  o.quarantine_after = quarantine_after;
  o.paranoid = paranoid;
  o.strict = strict;
  return o;
}

bool all_finite(const std::vector<float>& v) {
  for (float x : v) {
    if (!std::isfinite(x)) return false;
  }
  return true;
}

TEST(FaultTolerance, RunFailuresQuarantineAfterTheLimitAndCallsStillComplete) {
  Fixture fx(Mode::error);
  Dispatcher d(options(3), &fx.registry);
  for (int i = 0; i < 6; ++i) {
    DenseF32Problem t(1, 4, 4, 2, 1, 8);
    ASSERT_TRUE(d.run(t.problem)) << "call " << i;
    EXPECT_TRUE(all_finite(t.o));
  }
  EXPECT_EQ(fx.bad->calls, 3);  // then never again
  EXPECT_EQ(fx.good->calls, 6);
  auto info = fx.registry.info("bad");
  EXPECT_EQ(info->health, Health::quarantined);
  EXPECT_EQ(info->run_failures, 3u);
  EXPECT_NE(info->health_reason.find("3 run-time failure(s)"), std::string::npos) << info->health_reason;
  EXPECT_NE(info->health_reason.find("device lost"), std::string::npos) << info->health_reason;
  const HealthCounters c = fx.registry.health_counters();
  EXPECT_EQ(c.quarantined_at_run, 1u);
  EXPECT_EQ(c.run_failures, 3u);
}

TEST(FaultTolerance, ZeroLimitCountsButNeverQuarantines) {
  Fixture fx(Mode::error);
  Dispatcher d(options(0), &fx.registry);
  DenseF32Problem t(1, 4, 4, 2, 1, 8);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(d.run(t.problem));
  EXPECT_EQ(fx.bad->calls, 5);
  EXPECT_EQ(fx.registry.info("bad")->health, Health::unchecked);
  EXPECT_EQ(fx.registry.info("bad")->run_failures, 5u);
}

TEST(FaultTolerance, ParanoidCheckCatchesNonFiniteOutputAndFallsBack) {
  {
    Fixture fx(Mode::nan_output);
    Dispatcher trusting(options(2, false), &fx.registry);
    DenseF32Problem t(1, 4, 4, 2, 1, 8);
    ASSERT_TRUE(trusting.run(t.problem));
    EXPECT_FALSE(all_finite(t.o));  // without the check, garbage is served
  }
  Fixture fx(Mode::nan_output);
  Dispatcher paranoid(options(2, true), &fx.registry);
  for (int i = 0; i < 3; ++i) {
    DenseF32Problem t(1, 4, 4, 2, 1, 8, 0, true);
    ASSERT_TRUE(paranoid.run(t.problem));
    EXPECT_TRUE(all_finite(t.o));
  }
  EXPECT_EQ(fx.bad->calls, 2);
  EXPECT_EQ(fx.registry.info("bad")->health, Health::quarantined);
  EXPECT_NE(fx.registry.info("bad")->health_reason.find("non-finite output"), std::string::npos);
}

TEST(FaultTolerance, ParanoidCheckAllowsNaNTheContractAllows) {
  Fixture fx(Mode::error);
  ASSERT_TRUE(fx.registry.set_health("bad", Health::quarantined, "not in this test"));
  Dispatcher paranoid(options(1, true), &fx.registry);
  DenseF32Problem t(1, 4, 4, 2, 1, 8);
  t.q[0] = std::numeric_limits<float>::quiet_NaN();  // row 0, head 0: its output is NaN by contract
  ASSERT_TRUE(paranoid.run(t.problem));
  EXPECT_TRUE(std::isnan(t.o[0]));
  EXPECT_EQ(fx.registry.info("good")->run_failures, 0u);
  EXPECT_EQ(fx.registry.info("good")->health, Health::unchecked);
}

TEST(FaultTolerance, StrictModeTurnsFallbackIntoAnError) {
  Fixture fx(Mode::error);
  Dispatcher strict(options(3, false, true), &fx.registry);  // automatic choice, strict
  DenseF32Problem t(1, 4, 4, 2, 1, 8);
  Status s = strict.run(t.problem);
  EXPECT_EQ(s.code(), ErrorCode::backend_failure);
  EXPECT_EQ(s.field(), "bad");
  EXPECT_NE(s.message().find("device lost"), std::string::npos);
  EXPECT_EQ(fx.good->calls, 0);
  EXPECT_EQ(fx.registry.info("bad")->run_failures, 1u);  // still counted
}

TEST(FaultTolerance, OptionsFromTheEnvironment) {
  setenv("KALLPA_PARANOID", "1", 1);
  setenv("KALLPA_QUARANTINE_AFTER", "7", 1);
  auto o = DispatchOptions::from_env();
  ASSERT_TRUE(o.is_ok()) << o.status().to_string();
  EXPECT_TRUE(o->paranoid);
  EXPECT_EQ(o->quarantine_after, 7);
  setenv("KALLPA_QUARANTINE_AFTER", "-1", 1);
  EXPECT_EQ(DispatchOptions::from_env().status().field(), "KALLPA_QUARANTINE_AFTER");
  setenv("KALLPA_QUARANTINE_AFTER", "3x", 1);
  EXPECT_EQ(DispatchOptions::from_env().status().field(), "KALLPA_QUARANTINE_AFTER");
  unsetenv("KALLPA_QUARANTINE_AFTER");
  setenv("KALLPA_PARANOID", "sometimes", 1);
  EXPECT_EQ(DispatchOptions::from_env().status().field(), "KALLPA_PARANOID");
  unsetenv("KALLPA_PARANOID");
  EXPECT_FALSE(DispatchOptions::from_env()->paranoid);
  EXPECT_EQ(DispatchOptions::from_env()->quarantine_after, 3);
}

}  // namespace
}  // namespace kallpa
