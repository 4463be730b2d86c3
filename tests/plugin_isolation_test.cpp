// Isolated plugins (plugin.h) and the rogues' gallery (tests/plugins/fault_plugin.cpp): a plugin
// that segfaults, aborts, hangs, writes past its output, leaks or lies in supports() costs its host
// process and a fallback, never this process; the dispatcher answers what the reference answers,
// the rogue is quarantined, and no host is left behind as a zombie or an open fd.
#include <dirent.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "kallpa/conformance.h"
#include "kallpa/dispatcher.h"
#include "kallpa/health.h"
#include "kallpa/plugin.h"
#include "kallpa/registry.h"
#include "support/fault_plugins.h"
#include "support/reference_stand_in.h"
#include "test_problem.h"

namespace kallpa {
namespace {

using testing::DenseF32Problem;

using testing::fault_plugin;

using testing::contains;

// Children of this process that have ended but were not waited for.
int zombie_children() {
  int zombies = 0;
  const std::string me = std::to_string(getpid());
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string pid = entry.path().filename();
    if (pid.find_first_not_of("0123456789") != std::string::npos) continue;
    std::FILE* f = std::fopen((entry.path() / "stat").c_str(), "r");
    if (f == nullptr) continue;
    char line[1024] = {};
    const bool got = std::fgets(line, sizeof line, f) != nullptr;
    std::fclose(f);
    if (!got) continue;
    // "pid (comm) state ppid ...": comm may hold spaces, so read after its closing parenthesis.
    const char* close = std::strrchr(line, ')');
    char state = 0;
    int ppid = 0;
    if (close != nullptr && std::sscanf(close + 1, " %c %d", &state, &ppid) == 2 && std::to_string(ppid) == me &&
        state == 'Z') {
      ++zombies;
    }
  }
  return zombies;
}

std::size_t open_fds() {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

double counter(const AttentionBackend& backend, const std::string& name) {
  for (const BackendCounter& c : backend.counters()) {
    if (c.name == name) return c.value;
  }
  ADD_FAILURE() << "no counter " << name;
  return -1;
}

// A registry like the global one: checked with canaries, with the reference as a fallback and the
// oracle.
struct Gallery {
  BackendRegistry registry;
  explicit Gallery(bool health_check = true) {
    if (health_check) registry.set_health_check(run_canaries);
    EXPECT_TRUE(registry.add(std::make_unique<testing::ReferenceStandIn>(/*is_oracle=*/true)));
  }
};

PluginOptions isolated() {
  PluginOptions o;
  o.timeout = std::chrono::milliseconds(1500);
  o.guard_pages = true;
  o.memory_limit_mib = 256;
  return o;
}

// The test problem: B sequences of one query (decode) over `skv` keys, causal.
std::unique_ptr<DenseF32Problem> decode(std::int64_t b = 2, std::int64_t skv = 37) {
  auto t = std::make_unique<DenseF32Problem>(b, 1, skv, 4, 2, 16);
  t->problem.causal = true;
  return t;
}

std::vector<float> reference_output(DenseF32Problem& t) {
  std::vector<float> keep = t.o;
  EXPECT_TRUE(BackendRegistry::global().find("reference")->run(*validate(t.problem), {}));
  std::vector<float> want = t.o;
  t.o = keep;
  return want;
}

TEST(IsolatedPlugin, PassesTheQuickSuiteThroughTheArena) {
  Gallery g(false);
  PluginLoadReport rep = load_plugin(fault_plugin("good"), g.registry, isolated());
  ASSERT_TRUE(rep.status) << rep.status.to_string();
  AttentionBackend* backend = g.registry.find("fault-good");
  ASSERT_NE(backend, nullptr);
  EXPECT_TRUE(contains(std::string(backend->description()), "(isolated)"));
  EXPECT_EQ(backend->priority(), 1000);
  EXPECT_EQ(backend->version(), "1.0.0");
  // Strided, packed and paged layouts, lse, ALiBi, softcap, f16/bf16: every case of the quick tier
  // goes through the arena and back, judged with its guard bytes around o and lse in this process.
  const conformance::Report report =
      conformance::run_suite(*backend, conformance::generate_cases(conformance::Tier::quick));
  EXPECT_EQ(report.failed(), 0u);
  for (const conformance::CaseResult& r : report.results) {
    if (!r.passed && !r.skipped) ADD_FAILURE() << r.case_name << ": " << r.failure;
  }
  EXPECT_GT(report.passed(), 100u);
  EXPECT_EQ(counter(*backend, "host_starts"), 1.0);
  EXPECT_EQ(counter(*backend, "hosts_lost"), 0.0);
  EXPECT_GT(counter(*backend, "host_pid"), 0.0);
}

// A rogue that passes its canaries, then misbehaves on its next call.
struct Rogue {
  std::string fault;
  std::string reason;  // words of the quarantine reason
};

class RogueAtRunTime : public ::testing::TestWithParam<Rogue> {};

TEST_P(RogueAtRunTime, CostsOneFallbackAndAQuarantineNeverThisProcess) {
  const Rogue rogue = GetParam();
  const std::size_t fds_before = open_fds();
  {
    const std::string after = std::to_string(conformance::canary_cases().size());
    setenv("KALLPA_FAULT_AFTER", after.c_str(), 1);
    Gallery g;
    PluginLoadReport rep = load_plugin(fault_plugin(rogue.fault), g.registry, isolated());
    unsetenv("KALLPA_FAULT_AFTER");
    ASSERT_TRUE(rep.status) << rep.status.to_string();
    g.registry.ensure_checked();
    ASSERT_EQ(g.registry.info(rep.backend)->health, Health::healthy) << g.registry.info(rep.backend)->health_reason;
    const AttentionBackend& backend = *g.registry.find(rep.backend);
    const auto host = static_cast<pid_t>(counter(backend, "host_pid"));

    Dispatcher d({}, &g.registry);  // quarantine_after = 3: a lost host needs only one
    const std::vector<float> want = reference_output(*decode());
    // The leak needs a few calls to pass the memory limit; the others fail on the first.
    for (int call = 0; call < 12 && g.registry.info(rep.backend)->health != Health::quarantined; ++call) {
      auto t = decode();
      ASSERT_TRUE(d.run(t->problem)) << call;
      for (std::size_t n = 0; n < want.size(); ++n) ASSERT_NEAR(t->o[n], want[n], 1e-5) << call << " @" << n;
    }
    auto info = g.registry.info(rep.backend);
    EXPECT_EQ(info->health, Health::quarantined);
    EXPECT_EQ(info->run_failures, 1u);
    EXPECT_TRUE(contains(info->health_reason, "backend_lost")) << info->health_reason;
    EXPECT_TRUE(contains(info->health_reason, rogue.reason)) << info->health_reason;
    EXPECT_EQ(counter(backend, "hosts_lost"), 1.0);
    EXPECT_EQ(counter(backend, "host_pid"), 0.0);
    EXPECT_NE(kill(host, 0), 0) << "the lost host still exists";
    EXPECT_EQ(zombie_children(), 0);

    // The service goes on without it.
    auto t = decode();
    ASSERT_TRUE(d.run(t->problem));
    EXPECT_EQ(t->o, want);
  }
  EXPECT_EQ(open_fds(), fds_before) << "an fd of the host (socket, arena) leaked";
  EXPECT_EQ(zombie_children(), 0);
}

INSTANTIATE_TEST_SUITE_P(Gallery, RogueAtRunTime,
                         ::testing::Values(Rogue{"segv", "killed by signal 11 (SIGSEGV)"},
                                           Rogue{"abort", "killed by signal 6 (SIGABRT)"},
                                           Rogue{"hang", "within 1500 ms (watchdog)"},
                                           Rogue{"oob", "wrote 1 byte(s) past the end of o"},
                                           Rogue{"leak", "past the limit of 256 MiB"}),
                         [](const auto& param_info) { return param_info.param.fault; });

// Rogues that only the run-time checks can catch, through the whole path a served call takes: an
// isolated plugin, canaries it passes, a dispatcher with the checks on, and the global oracle.
TEST(IsolatedPlugin, WrongOnlyBeyond4096KeysIsCaughtAtTheFirstCallOfThatSize) {
  Gallery g;
  PluginLoadReport rep = load_plugin(fault_plugin("large"), g.registry, isolated());
  ASSERT_TRUE(rep.status) << rep.status.to_string();
  g.registry.ensure_checked();
  ASSERT_EQ(g.registry.info(rep.backend)->health, Health::healthy);  // the canaries never go past 4,096 keys
  DispatchOptions options;
  options.first_use_check = true;
  options.verify_rate = 0.0;
  Dispatcher d(options, &g.registry);

  auto small = decode(2, 300);
  const std::vector<float> small_want = reference_output(*small);
  ASSERT_TRUE(d.run(small->problem));
  EXPECT_EQ(small->o, small_want);

  // The first call past 4,096 keys: the plugin's answer is checked before it is used, found wrong,
  // and the call is answered by the next candidate. Its caller never sees the wrong answer.
  auto large = decode(1, 5000);
  const std::vector<float> large_want = reference_output(*large);
  ASSERT_TRUE(d.run(large->problem));
  for (std::size_t n = 0; n < large_want.size(); ++n) ASSERT_NEAR(large->o[n], large_want[n], 1e-5) << n;
  const BackendInfo info = *g.registry.info(rep.backend);
  EXPECT_EQ(info.verification.first_use_mismatches, 1u);
  ASSERT_EQ(info.quarantined_buckets.size(), 1u);
  EXPECT_EQ(info.quarantined_buckets[0], size_bucket(*validate(large->problem)).to_string());
  EXPECT_EQ(info.health, Health::healthy);  // quarantined for that bucket only

  // It still serves the size it answers right; the large size goes elsewhere.
  auto again = decode(1, 5000);
  ASSERT_TRUE(d.run(again->problem));
  for (std::size_t n = 0; n < large_want.size(); ++n) ASSERT_NEAR(again->o[n], large_want[n], 1e-5) << n;
  EXPECT_EQ(counter(*g.registry.find(rep.backend), "hosts_lost"), 0.0);
}

TEST(IsolatedPlugin, WrongOnOneCallInThreeIsCaughtByShadowVerification) {
  const std::string after = std::to_string(conformance::canary_cases().size());
  setenv("KALLPA_FAULT_AFTER", after.c_str(), 1);
  Gallery g;
  PluginLoadReport rep = load_plugin(fault_plugin("flaky"), g.registry, isolated());
  unsetenv("KALLPA_FAULT_AFTER");
  ASSERT_TRUE(rep.status) << rep.status.to_string();
  g.registry.ensure_checked();
  ASSERT_EQ(g.registry.info(rep.backend)->health, Health::healthy);
  DispatchOptions options;
  options.first_use_check = false;
  options.verify_rate = 1.0;  // every call; the default (1 in 1,000) catches it as surely, later
  Dispatcher d(options, &g.registry);
  const std::vector<float> want = reference_output(*decode());
  int calls = 0;
  for (; calls < 6 && g.registry.info(rep.backend)->health != Health::quarantined; ++calls) {
    auto t = decode();
    ASSERT_TRUE(d.run(t->problem)) << calls;
    for (std::size_t n = 0; n < want.size(); ++n) ASSERT_NEAR(t->o[n], want[n], 1e-5) << calls << " @" << n;
  }
  EXPECT_EQ(calls, 3);  // the third call was the wrong one, and the caller got the right answer
  const BackendInfo info = *g.registry.info(rep.backend);
  EXPECT_EQ(info.health, Health::quarantined);
  EXPECT_TRUE(contains(info.health_reason, "shadow")) << info.health_reason;
  EXPECT_EQ(info.verification.shadow_mismatches, 1u);
}

TEST(IsolatedPlugin, ALiarInSupportsIsCaughtByItsCanaries) {
  Gallery g;
  PluginLoadReport rep = load_plugin(fault_plugin("liar"), g.registry, isolated());
  ASSERT_TRUE(rep.status) << rep.status.to_string();
  Dispatcher d({}, &g.registry);
  DenseF32Problem t(1, 3, 20, 4, 2, 16);
  t.problem.softcap = 5.0f;
  t.problem.causal = true;
  const std::vector<float> want = reference_output(t);
  ASSERT_TRUE(d.run(t.problem));
  EXPECT_EQ(t.o, want);
  auto info = g.registry.info("fault-liar");
  EXPECT_EQ(info->health, Health::quarantined);
  EXPECT_TRUE(contains(info->health_reason, "canary '")) << info->health_reason;
}

TEST(IsolatedPlugin, AThrowingPluginFailsItsCallsButKeepsItsHost) {
  // An exception is caught at the boundary inside the host: an ordinary failure, counted to the
  // limit like any other, and the host lives on.
  Gallery g(false);
  PluginLoadReport rep = load_plugin(fault_plugin("throw"), g.registry, isolated());
  ASSERT_TRUE(rep.status) << rep.status.to_string();
  DispatchOptions options;
  options.quarantine_after = 2;
  Dispatcher d(options, &g.registry);
  DenseF32Problem t(1, 1, 9, 4, 2, 16);
  const std::vector<float> want = reference_output(t);
  for (int call = 0; call < 3; ++call) {
    ASSERT_TRUE(d.run(t.problem));
    EXPECT_EQ(t.o, want);
  }
  auto info = g.registry.info("fault-throw");
  EXPECT_EQ(info->health, Health::quarantined);
  EXPECT_TRUE(contains(info->health_reason, "plugin threw from run(): injected exception")) << info->health_reason;
  EXPECT_EQ(counter(*g.registry.find("fault-throw"), "hosts_lost"), 0.0);
  EXPECT_GT(counter(*g.registry.find("fault-throw"), "host_pid"), 0.0);
}

TEST(IsolatedPlugin, ALostHostIsRestartedAfterItsBackoff) {
  setenv("KALLPA_FAULT_AFTER", "1", 1);  // read by each host at its start
  struct UnsetFaultAfter {               // also when an assertion below returns early
    ~UnsetFaultAfter() { unsetenv("KALLPA_FAULT_AFTER"); }
  } unset_fault_after;
  Gallery g(false);  // unchecked, and never quarantined below: the host must come back
  PluginLoadReport rep = load_plugin(fault_plugin("segv"), g.registry, isolated());
  ASSERT_TRUE(rep.status) << rep.status.to_string();
  DispatchOptions options;
  options.quarantine_after = 0;
  Dispatcher d(options, &g.registry);
  DenseF32Problem t(1, 1, 9, 4, 2, 16);
  const std::vector<float> want = reference_output(t);
  const AttentionBackend& backend = *g.registry.find("fault-segv");
  ASSERT_TRUE(d.run(t.problem));  // the plugin's first call: fine
  ASSERT_TRUE(d.run(t.problem));  // its second: the host dies, the reference answers
  EXPECT_EQ(t.o, want);
  EXPECT_EQ(counter(backend, "hosts_lost"), 1.0);
  ASSERT_TRUE(d.run(t.problem));  // within the backoff: no restart, a fallback at once
  EXPECT_EQ(counter(backend, "host_starts"), 1.0);
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  ASSERT_TRUE(d.run(t.problem));  // a fresh host, whose first call is fine again
  EXPECT_EQ(t.o, want);
  EXPECT_EQ(counter(backend, "host_starts"), 2.0);
  EXPECT_EQ(counter(backend, "hosts_lost"), 1.0);
  EXPECT_EQ(g.registry.info("fault-segv")->health, Health::unchecked);
}

TEST(IsolatedPlugin, AMissingHostIsAClearErrorAtLoad) {
  Gallery g(false);
  PluginOptions o = isolated();
  o.host_path = "/nonexistent/kallpa-plugin-host";
  PluginLoadReport rep = load_plugin(fault_plugin("good"), g.registry, o);
  EXPECT_EQ(rep.status.code(), ErrorCode::not_found);
  EXPECT_TRUE(contains(rep.status.message(), "/nonexistent/kallpa-plugin-host")) << rep.status.to_string();

  setenv("KALLPA_PLUGIN_HOST", "/nonexistent/host", 1);
  Result<std::string> found = find_plugin_host();
  rep = load_plugin(fault_plugin("good"), g.registry, isolated());
  unsetenv("KALLPA_PLUGIN_HOST");
  EXPECT_FALSE(found.is_ok());
  EXPECT_EQ(rep.status.code(), ErrorCode::not_found);
  EXPECT_TRUE(contains(rep.status.message(), "/nonexistent/host")) << rep.status.to_string();
  EXPECT_EQ(g.registry.find("fault-good"), nullptr);
  // Without the override it is found beside the library.
  ASSERT_TRUE(find_plugin_host().is_ok()) << find_plugin_host().status().to_string();
}

TEST(IsolatedPlugin, LoadFailuresInTheHostAreReportedLikeInProcess) {
  Gallery g(false);
  PluginLoadReport major = load_plugin(fault_plugin("wrong-major"), g.registry, isolated());
  EXPECT_EQ(major.status.code(), ErrorCode::invalid_argument);
  EXPECT_TRUE(contains(major.status.message(), "ABI 2.")) << major.status.to_string();
  PluginLoadReport init = load_plugin(fault_plugin("init-error"), g.registry, isolated());
  EXPECT_EQ(init.status.code(), ErrorCode::backend_failure);
  EXPECT_TRUE(contains(init.status.message(), "no accelerator found")) << init.status.to_string();
  EXPECT_EQ(zombie_children(), 0);
}

TEST(IsolatedPlugin, OptionsFromTheEnvironmentAreCheckedAndNamed) {
  setenv("KALLPA_PLUGIN_TIMEOUT_MS", "250", 1);
  setenv("KALLPA_PLUGIN_MEMORY_LIMIT_MIB", "64", 1);
  setenv("KALLPA_PARANOID", "1", 1);
  Result<PluginOptions> o = PluginOptions::from_env();
  ASSERT_TRUE(o.is_ok()) << o.status().to_string();
  EXPECT_EQ(o->timeout, std::chrono::milliseconds(250));
  EXPECT_EQ(o->memory_limit_mib, 64u);
  EXPECT_TRUE(o->guard_pages);
  EXPECT_EQ(o->isolation, PluginIsolation::process);
  setenv("KALLPA_PLUGIN_TIMEOUT_MS", "0", 1);
  o = PluginOptions::from_env();
  EXPECT_EQ(o.status().field(), "KALLPA_PLUGIN_TIMEOUT_MS");
  unsetenv("KALLPA_PLUGIN_TIMEOUT_MS");
  unsetenv("KALLPA_PLUGIN_MEMORY_LIMIT_MIB");
  unsetenv("KALLPA_PARANOID");
}

}  // namespace
}  // namespace kallpa
