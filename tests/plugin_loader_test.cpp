// Plugins through the C ABI: loading and version rules, failures reported by path and reason,
// and every fault-injection plugin (tests/plugins/) caught by the health check or at run time.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "kallpa/conformance.h"
#include "kallpa/dispatcher.h"
#include "kallpa/health.h"
#include "kallpa/observer.h"
#include "kallpa/plugin.h"
#include "kallpa/plugin_abi.h"
#include "kallpa/registry.h"
#include "support/fault_plugins.h"
#include "support/reference_stand_in.h"
#include "test_problem.h"

namespace kallpa {
namespace {

using testing::DenseF32Problem;

using testing::fault_plugin;

using testing::contains;

// A registry like the global one: checked with canaries, with the reference as a fallback.
struct PluginRegistry {
  BackendRegistry registry;
  PluginRegistry() {
    registry.set_health_check(run_canaries);
    EXPECT_TRUE(registry.add(std::make_unique<testing::ReferenceStandIn>(/*is_oracle=*/false)));
  }
  PluginLoadReport load(const std::string& name) { return load_plugin(fault_plugin(name), registry); }
};

// The reference's output for the test problem.
std::vector<float> reference_output(std::int64_t sq, std::int64_t skv) {
  DenseF32Problem want(1, sq, skv, 4, 2, 16);
  want.problem.causal = true;
  EXPECT_TRUE(BackendRegistry::global().find("reference")->run(*validate(want.problem), {}));
  return want.o;
}

TEST(Plugin, CorrectPluginLoadsPassesItsHealthCheckAndIsSelected) {
  PluginRegistry r;
  PluginLoadReport rep = r.load("good");
  ASSERT_TRUE(rep.status) << rep.status.to_string();
  EXPECT_EQ(rep.backend, "fault-good");
  AttentionBackend* b = r.registry.find("fault-good");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->priority(), 1000);
  EXPECT_EQ(b->device_kind(), DeviceKind::cpu);
  EXPECT_TRUE(contains(std::string(b->description()), "fault-injection"));

  Dispatcher d({}, &r.registry);
  for (std::int64_t sq : {7, 1}) {  // prefill and decode
    DenseF32Problem t(1, sq, 9, 4, 2, 16);
    t.problem.causal = true;
    ASSERT_TRUE(d.run(t.problem));
    EXPECT_EQ(d.candidates(validate(t.problem)->signature())->front(), b);
    const std::vector<float> want = reference_output(sq, 9);
    for (std::size_t n = 0; n < want.size(); ++n) ASSERT_NEAR(t.o[n], want[n], 1e-6) << n;
  }
  EXPECT_EQ(r.registry.info("fault-good")->health, Health::healthy);
}

TEST(Plugin, OlderMinorAbiLoads) {
  PluginRegistry r;
  PluginLoadReport rep = r.load("old-minor");
  ASSERT_TRUE(rep.status) << rep.status.to_string();
  AttentionBackend* b = r.registry.find("fault-old-minor");
  ASSERT_NE(b, nullptr);
  // ABI 1.0 has no description: kallpa did not read past the 1.0 table.
  EXPECT_TRUE(contains(std::string(b->description()), "fault-old-minor.so")) << b->description();
  r.registry.ensure_checked();
  EXPECT_EQ(r.registry.info("fault-old-minor")->health, Health::healthy)
      << r.registry.info("fault-old-minor")->health_reason;
}

TEST(Plugin, WrongMajorIsRefusedWithBothVersions) {
  PluginRegistry r;
  PluginLoadReport rep = r.load("wrong-major");
  EXPECT_FALSE(rep.status);
  EXPECT_EQ(rep.status.field(), fault_plugin("wrong-major"));
  EXPECT_TRUE(contains(rep.status.message(), "plugin ABI " + std::to_string(KALLPA_PLUGIN_ABI_MAJOR + 1) + "."))
      << rep.status.message();
  EXPECT_TRUE(contains(rep.status.message(), "major version must match")) << rep.status.message();
  EXPECT_EQ(r.registry.find("fault-wrong-major"), nullptr);
}

TEST(Plugin, LibrariesThatAreNotUsableAreReportedByPathAndReason) {
  PluginRegistry r;
  PluginLoadReport no_entry = r.load("no-entry");
  EXPECT_FALSE(no_entry.status);
  EXPECT_TRUE(contains(no_entry.status.message(), KALLPA_PLUGIN_ENTRY_POINT)) << no_entry.status.message();
  PluginLoadReport init = r.load("init-error");
  EXPECT_FALSE(init.status);
  EXPECT_TRUE(contains(init.status.message(), "initialisation failed: no accelerator found")) << init.status.message();
  PluginLoadReport missing = load_plugin("/nonexistent/libnothing.so", r.registry);
  EXPECT_EQ(missing.status.code(), ErrorCode::not_found);
  EXPECT_EQ(missing.status.field(), "/nonexistent/libnothing.so");
  EXPECT_EQ(r.registry.list().size(), 1u);  // only the reference: nothing half-registered

  PluginLoadReport twice_first = r.load("good");
  PluginLoadReport twice_second = r.load("good");
  EXPECT_TRUE(twice_first.status);
  EXPECT_FALSE(twice_second.status);
  EXPECT_TRUE(contains(twice_second.status.message(), "already registered")) << twice_second.status.message();
}

// Slowness is not a fault: a slow backend that computes the right answer stays healthy and
// selected (falling back would change nothing but the backend), and its latency shows in the
// dispatcher's stats, which is where an operator sees it (/metrics in the server).
TEST(Plugin, SlowPluginStaysHealthyAndItsLatencyIsVisible) {
  PluginRegistry r;
  ASSERT_TRUE(r.load("slow").status);
  auto stats = std::make_shared<StatsObserver>();
  Dispatcher d({}, &r.registry);
  d.add_observer(stats);
  DenseF32Problem t(1, 7, 9, 4, 2, 16);
  t.problem.causal = true;
  ASSERT_TRUE(d.run(t.problem));
  const std::vector<float> want = reference_output(7, 9);
  for (std::size_t n = 0; n < want.size(); ++n) ASSERT_NEAR(t.o[n], want[n], 1e-6) << n;
  EXPECT_EQ(r.registry.info("fault-slow")->health, Health::healthy);
  const auto snap = stats->snapshot();
  ASSERT_EQ(snap.count("fault-slow"), 1u);
  const StatsObserver::BackendStats& s = snap.at("fault-slow");
  EXPECT_EQ(s.calls, 1u);
  EXPECT_EQ(s.failures, 0u);
  EXPECT_EQ(s.fallbacks, 0u);
  // The plugin sleeps 25 ms in every run: a lower bound that holds on any machine.
  EXPECT_GE(s.max_seconds, 0.025);
  EXPECT_GE(s.quantile_seconds(1.0), 0.025);
}

TEST(Plugin, PathListLoadsFilesAndDirectoriesAndCarriesOn) {
  PluginRegistry r;
  const std::string list = std::string("/nonexistent:") + KALLPA_TEST_PLUGIN_DIR + "::" + fault_plugin("good");
  std::vector<PluginLoadReport> reports = load_plugins(list, r.registry);
  std::size_t loaded = 0, failed = 0;
  for (const PluginLoadReport& rep : reports) (rep.status ? loaded : failed) += 1;
  // The directory holds 19 libraries, 3 of which cannot load; "good" comes twice (once refused).
  EXPECT_EQ(reports.size(), 21u);
  EXPECT_EQ(loaded, 16u);
  EXPECT_EQ(failed, 5u);
  EXPECT_EQ(reports.front().status.code(), ErrorCode::not_found);
  EXPECT_NE(r.registry.find("fault-offby"), nullptr);
}

TEST(Plugin, EveryInjectedFaultIsQuarantinedByTheHealthCheck) {
  PluginRegistry r;
  const std::map<std::string, std::string> faults = {{"offby", "> allowed"},
                                                     {"decode", "> allowed"},
                                                     {"error", "injected failure: device lost"},
                                                     {"nan", "NaN where the reference is finite"},
                                                     {"throw", "plugin threw from run(): injected exception"}};
  for (const auto& [fault, _] : faults) ASSERT_TRUE(r.load(fault).status) << fault;
  Dispatcher d({}, &r.registry);
  DenseF32Problem t(1, 1, 9, 4, 2, 16);  // decode, the engine's shape
  t.problem.causal = true;
  ASSERT_TRUE(d.run(t.problem));
  EXPECT_EQ(t.o, reference_output(1, 9));
  for (const auto& [fault, words] : faults) {
    auto info = r.registry.info("fault-" + fault);
    EXPECT_EQ(info->health, Health::quarantined) << fault;
    EXPECT_TRUE(contains(info->health_reason, "canary '")) << fault << ": " << info->health_reason;
    EXPECT_TRUE(contains(info->health_reason, words)) << fault << ": " << info->health_reason;
  }
  // The decode fault only shows on one-query canaries.
  EXPECT_TRUE(contains(r.registry.info("fault-decode")->health_reason, "sq1"))
      << r.registry.info("fault-decode")->health_reason;
}

// Faults that start after the health check: the plugin passes its canaries, then breaks.
class RunTimeFault : public ::testing::TestWithParam<std::string> {};

TEST_P(RunTimeFault, IsCountedQuarantinedAndFallenBackFrom) {
  const std::string fault = GetParam();
  const std::string after = std::to_string(conformance::canary_cases().size());
  setenv("KALLPA_FAULT_AFTER", after.c_str(), 1);
  PluginRegistry r;
  PluginLoadReport rep = r.load(fault);
  unsetenv("KALLPA_FAULT_AFTER");
  ASSERT_TRUE(rep.status) << rep.status.to_string();
  r.registry.ensure_checked();
  ASSERT_EQ(r.registry.info(rep.backend)->health, Health::healthy) << r.registry.info(rep.backend)->health_reason;

  DispatchOptions options;
  options.paranoid = true;  // needed for the NaN fault; harmless for the others
  options.quarantine_after = 2;
  Dispatcher d(options, &r.registry);
  const std::vector<float> want = reference_output(1, 9);
  for (int call = 0; call < 4; ++call) {
    DenseF32Problem t(1, 1, 9, 4, 2, 16);
    t.problem.causal = true;
    ASSERT_TRUE(d.run(t.problem)) << call;
    for (std::size_t n = 0; n < want.size(); ++n) ASSERT_NEAR(t.o[n], want[n], 1e-6) << call;
  }
  auto info = r.registry.info(rep.backend);
  EXPECT_EQ(info->health, Health::quarantined);
  EXPECT_EQ(info->run_failures, 2u);
  EXPECT_TRUE(contains(info->health_reason, "2 run-time failure(s)")) << info->health_reason;
  EXPECT_EQ(r.registry.health_counters().quarantined_at_run, 1u);

  DispatchOptions strict = options;
  strict.strict = true;
  ASSERT_TRUE(r.registry.set_health(rep.backend, Health::healthy));
  Dispatcher s(strict, &r.registry);
  DenseF32Problem t(1, 1, 9, 4, 2, 16);
  EXPECT_EQ(s.run(t.problem).code(), ErrorCode::backend_failure);  // no fallback in strict mode
}

INSTANTIATE_TEST_SUITE_P(Faults, RunTimeFault, ::testing::Values("error", "nan", "throw"),
                         [](const auto& param_info) { return param_info.param; });

}  // namespace
}  // namespace kallpa
