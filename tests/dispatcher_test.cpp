// Selection, strict mode, fallback, explain and telemetry, on a private registry of fake backends.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <thread>

#include "kallpa/dispatcher.h"
#include "kallpa/registry.h"
#include "test_problem.h"

namespace kallpa {
namespace {

using testing::DenseF32Problem;

// A backend that writes a marker value into o, so tests can see who ran.
class FakeBackend final : public AttentionBackend {
 public:
  FakeBackend(std::string name, int priority, float marker, DeviceKind device = DeviceKind::cpu)
      : name_(std::move(name)), priority_(priority), marker_(marker), device_(device) {}

  std::string_view name() const noexcept override { return name_; }
  std::string_view version() const noexcept override { return "0"; }
  DeviceKind device_kind() const noexcept override { return device_; }
  int priority() const noexcept override { return priority_; }
  Support supports(const ProblemSignature& sig) const noexcept override {
    if (max_head_dim_ && sig.head_dim > max_head_dim_) return Support::no("head dim too large");
    return Support::yes();
  }
  std::size_t workspace_size(const ValidatedProblem&) const noexcept override { return workspace_; }
  Status run(const ValidatedProblem& vp, Workspace ws) noexcept override {
    ++calls;
    if (ws.bytes < workspace_ || (workspace_ && reinterpret_cast<std::uintptr_t>(ws.data) % 64 != 0)) {
      return Status(ErrorCode::internal, "workspace", "too small or misaligned");
    }
    if (fail) return Status(ErrorCode::internal, name_, "injected failure");
    static_cast<float*>(vp.problem().o.data)[0] = marker_;
    return {};
  }

  std::atomic<int> calls{0};
  bool fail = false;
  int max_head_dim_ = 0;
  std::size_t workspace_ = 0;

 private:
  std::string name_;
  int priority_;
  float marker_;
  DeviceKind device_;
};

struct Fixture {
  BackendRegistry registry;
  FakeBackend* fast;
  FakeBackend* slow;
  FakeBackend* gpu;
  Fixture() {
    auto f = std::make_unique<FakeBackend>("fast", 100, 1.0f);
    auto s = std::make_unique<FakeBackend>("slow", 0, 2.0f);
    auto g = std::make_unique<FakeBackend>("gpu", 500, 3.0f, DeviceKind::cuda);
    fast = f.get();
    slow = s.get();
    gpu = g.get();
    EXPECT_TRUE(registry.add(std::move(s)));
    EXPECT_TRUE(registry.add(std::move(f)));
    EXPECT_TRUE(registry.add(std::move(g)));
  }
};

TEST(Registry, OrdersByPriorityAndRefusesDuplicates) {
  Fixture fx;
  auto list = fx.registry.list();
  ASSERT_EQ(list.size(), 3u);
  EXPECT_EQ(list[0].backend->name(), "gpu");
  EXPECT_EQ(list[1].backend->name(), "fast");
  EXPECT_EQ(list[2].backend->name(), "slow");
  Status dup = fx.registry.add(std::make_unique<FakeBackend>("fast", 1, 0.0f));
  EXPECT_EQ(dup.code(), ErrorCode::invalid_argument);
  EXPECT_EQ(fx.registry.info("nope").status().code(), ErrorCode::not_found);
}

TEST(Dispatcher, AutomaticChoiceTakesHighestPriorityOnTheDevice) {
  Fixture fx;
  Dispatcher d({}, &fx.registry);
  DenseF32Problem t(1, 2, 2, 1, 1, 8);
  ASSERT_TRUE(d.run(t.problem));
  EXPECT_EQ(t.o[0], 1.0f);  // "fast"; "gpu" is on another device
  EXPECT_EQ(fx.gpu->calls, 0);
}

TEST(Dispatcher, ExplicitListFirstSupportedWins) {
  Fixture fx;
  fx.fast->max_head_dim_ = 4;
  Dispatcher d({{"fast", "slow"}, false}, &fx.registry);
  DenseF32Problem t(1, 2, 2, 1, 1, 8);
  ASSERT_TRUE(d.run(t.problem));
  EXPECT_EQ(t.o[0], 2.0f);
}

TEST(Dispatcher, StrictModeRefusesUnsupportedChoice) {
  Fixture fx;
  fx.fast->max_head_dim_ = 4;
  Dispatcher d({{"fast"}, true}, &fx.registry);
  DenseF32Problem t(1, 2, 2, 1, 1, 8);
  Status s = d.run(t.problem);
  EXPECT_EQ(s.code(), ErrorCode::unsupported);
  EXPECT_NE(s.message().find("head dim too large"), std::string::npos) << s.to_string();
  EXPECT_EQ(fx.slow->calls, 0);

  Dispatcher lenient({{"fast"}, false}, &fx.registry);
  ASSERT_TRUE(lenient.run(t.problem));
  EXPECT_EQ(t.o[0], 2.0f);  // fell back to the automatic order
}

TEST(Dispatcher, StrictModeRejectsUnknownName) {
  Fixture fx;
  Dispatcher d({{"nosuch"}, true}, &fx.registry);
  DenseF32Problem t(1, 2, 2, 1, 1, 8);
  EXPECT_EQ(d.run(t.problem).code(), ErrorCode::not_found);
}

TEST(Dispatcher, RunFailureFallsBackAndIsCounted) {
  Fixture fx;
  fx.fast->fail = true;
  auto stats = std::make_shared<StatsObserver>();
  Dispatcher d({}, &fx.registry);
  d.add_observer(stats);
  DenseF32Problem t(1, 2, 2, 1, 1, 8);
  ASSERT_TRUE(d.run(t.problem));
  ASSERT_TRUE(d.run(t.problem));
  EXPECT_EQ(t.o[0], 2.0f);
  auto snap = stats->snapshot();
  EXPECT_EQ(snap["fast"].calls, 2u);
  EXPECT_EQ(snap["fast"].failures, 2u);
  EXPECT_EQ(snap["slow"].calls, 2u);
  EXPECT_EQ(snap["slow"].fallbacks, 2u);
  EXPECT_EQ(snap["slow"].failures, 0u);
}

TEST(Dispatcher, StrictModeTurnsRunFailureIntoError) {
  Fixture fx;
  fx.fast->fail = true;
  Dispatcher d({{"fast", "slow"}, true}, &fx.registry);
  DenseF32Problem t(1, 2, 2, 1, 1, 8);
  Status s = d.run(t.problem);
  EXPECT_EQ(s.code(), ErrorCode::backend_failure);
  EXPECT_EQ(s.field(), "fast");
  EXPECT_EQ(fx.slow->calls, 0);
}

TEST(Dispatcher, AllFailingIsAnError) {
  Fixture fx;
  fx.fast->fail = true;
  fx.slow->fail = true;
  Dispatcher d({}, &fx.registry);
  DenseF32Problem t(1, 2, 2, 1, 1, 8);
  EXPECT_EQ(d.run(t.problem).code(), ErrorCode::backend_failure);
}

TEST(Dispatcher, QuarantinedBackendsAreNeverSelectedAndCacheFollowsRegistry) {
  Fixture fx;
  Dispatcher d({}, &fx.registry);
  DenseF32Problem t(1, 2, 2, 1, 1, 8);
  ASSERT_TRUE(d.run(t.problem));
  EXPECT_EQ(t.o[0], 1.0f);
  ASSERT_TRUE(fx.registry.set_health("fast", Health::quarantined, "canary failed"));
  ASSERT_TRUE(d.run(t.problem));
  EXPECT_EQ(t.o[0], 2.0f);
  auto verdicts = d.explain(validate(t.problem)->signature());
  for (const Verdict& v : verdicts) {
    if (v.backend == "fast") {
      EXPECT_FALSE(v.selected);
      EXPECT_NE(v.reason.find("quarantined"), std::string::npos);
    }
  }
}

TEST(Dispatcher, InvalidProblemNeverReachesABackend) {
  Fixture fx;
  Dispatcher d({}, &fx.registry);
  DenseF32Problem t(1, 2, 2, 1, 1, 8);
  t.problem.k.shape[3] = 3;
  Status s = d.run(t.problem);
  EXPECT_EQ(s.code(), ErrorCode::invalid_argument);
  EXPECT_EQ(fx.fast->calls + fx.slow->calls, 0);
}

TEST(Dispatcher, ExplainGivesEveryVerdict) {
  Fixture fx;
  fx.fast->max_head_dim_ = 4;
  Dispatcher d({}, &fx.registry);
  DenseF32Problem t(1, 2, 2, 1, 1, 8);
  auto verdicts = d.explain(validate(t.problem)->signature());
  ASSERT_EQ(verdicts.size(), 3u);
  for (const Verdict& v : verdicts) {
    if (v.backend == "gpu") {
      EXPECT_TRUE(v.supported);
      EXPECT_NE(v.reason.find("runs on cuda"), std::string::npos) << v.reason;
    } else if (v.backend == "fast") {
      EXPECT_FALSE(v.supported);
      EXPECT_EQ(v.reason, "head dim too large");
    } else {
      EXPECT_TRUE(v.selected);
      EXPECT_EQ(v.rank, 0);
    }
  }
}

TEST(Dispatcher, WorkspaceIsProvidedAligned) {
  Fixture fx;
  fx.fast->workspace_ = 1000;
  Dispatcher d({}, &fx.registry);
  DenseF32Problem t(1, 2, 2, 1, 1, 8);
  ASSERT_TRUE(d.run(t.problem));
  EXPECT_EQ(t.o[0], 1.0f);
}

TEST(Dispatcher, ConcurrentCallsAreSafe) {
  Fixture fx;
  auto stats = std::make_shared<StatsObserver>();
  Dispatcher d({}, &fx.registry);
  d.add_observer(stats);
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int n = 0; n < 4; ++n) {
    threads.emplace_back([&] {
      DenseF32Problem t(1, 2, 2, 1, 1, 8);
      for (int i = 0; i < 200; ++i) {
        if (!d.run(t.problem)) ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures, 0);
  EXPECT_EQ(stats->snapshot()["fast"].calls, 800u);
}

TEST(DispatchOptions, ParsesListsAndEnvironment) {
  auto list = DispatchOptions::parse_backend_list("cpu-flash, reference");
  ASSERT_TRUE(list.is_ok());
  EXPECT_EQ(*list, (std::vector<std::string>{"cpu-flash", "reference"}));
  EXPECT_EQ(DispatchOptions::parse_backend_list("a,,b").status().code(), ErrorCode::parse_error);

  setenv("KALLPA_ATTENTION", "slow,fast", 1);
  setenv("KALLPA_ATTENTION_STRICT", "1", 1);
  auto opts = DispatchOptions::from_env();
  ASSERT_TRUE(opts.is_ok());
  EXPECT_EQ(opts->backends, (std::vector<std::string>{"slow", "fast"}));
  EXPECT_TRUE(opts->strict);
  setenv("KALLPA_ATTENTION_STRICT", "maybe", 1);
  EXPECT_EQ(DispatchOptions::from_env().status().field(), "KALLPA_ATTENTION_STRICT");
  unsetenv("KALLPA_ATTENTION");
  unsetenv("KALLPA_ATTENTION_STRICT");
}

TEST(StatsObserver, QuantilesComeFromTheHistogram) {
  StatsObserver s;
  ProblemSignature sig;
  for (int i = 0; i < 90; ++i) s.on_dispatch({"x", &sig, std::chrono::microseconds(3), Outcome::ok, false, nullptr});
  for (int i = 0; i < 10; ++i) s.on_dispatch({"x", &sig, std::chrono::milliseconds(5), Outcome::ok, false, nullptr});
  auto x = s.snapshot()["x"];
  EXPECT_EQ(x.calls, 100u);
  EXPECT_LE(x.quantile_seconds(0.5), 4.1e-6);
  EXPECT_GE(x.quantile_seconds(0.99), 4e-3);
  EXPECT_NEAR(x.min_seconds, 3e-6, 1e-9);
  EXPECT_NEAR(x.max_seconds, 5e-3, 1e-9);
}

}  // namespace
}  // namespace kallpa
