// What run-time trust costs (dispatcher.h): decode through a Dispatcher on cpu-flash with shadow
// verification off, at the default rate and on every call, side by side; and the one-off cost of a
// first-use check per size bucket (decode at 1k..64k keys, a 512x512 prefill), read from the
// registry's own counters (VerificationCounters::first_use_seconds).
#include <benchmark/benchmark.h>

#include <chrono>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kallpa/dispatcher.h"
#include "kallpa/registry.h"

namespace {

using kallpa::AttentionBackend;
using kallpa::BackendRegistry;

// A global backend under the same name in a private registry, so that every run starts with no
// bucket verified.
class Forward final : public AttentionBackend {
 public:
  explicit Forward(AttentionBackend& b) : b_(b) {}
  std::string_view name() const noexcept override { return b_.name(); }
  std::string_view version() const noexcept override { return b_.version(); }
  kallpa::DeviceKind device_kind() const noexcept override { return b_.device_kind(); }
  int priority() const noexcept override { return b_.priority(); }
  kallpa::Support supports(const kallpa::ProblemSignature& s) const noexcept override { return b_.supports(s); }
  std::size_t workspace_size(const kallpa::ValidatedProblem& p) const noexcept override { return b_.workspace_size(p); }
  kallpa::Status run(const kallpa::ValidatedProblem& p, kallpa::Workspace w) noexcept override { return b_.run(p, w); }
  const kallpa::AttentionOracle* oracle() const noexcept override { return b_.oracle(); }

 private:
  AttentionBackend& b_;
};

std::unique_ptr<BackendRegistry> private_registry() {
  auto r = std::make_unique<BackendRegistry>();
  for (const char* name : {"cpu-flash", "reference"}) {
    (void)r->add(std::make_unique<Forward>(*BackendRegistry::global().find(name)));
  }
  return r;
}

// Llama-3-8B-like heads: 32 q heads over 8 KV heads of 128, f32.
struct Problem {
  std::vector<float> q, k, v, o;
  kallpa::AttentionProblem problem;
  Problem(std::int64_t batch, std::int64_t sq, std::int64_t skv) {
    std::mt19937 rng(1);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    auto fill = [&](std::vector<float>& x, std::int64_t n) {
      x.resize(static_cast<std::size_t>(n));
      for (float& e : x) e = dist(rng);
    };
    fill(q, batch * sq * 32 * 128);
    fill(k, batch * skv * 8 * 128);
    fill(v, batch * skv * 8 * 128);
    o.assign(q.size(), 0.0f);
    problem.q = kallpa::make_contiguous_view(q.data(), kallpa::DType::f32, {batch, sq, 32, 128});
    problem.k = kallpa::make_contiguous_view(k.data(), kallpa::DType::f32, {batch, skv, 8, 128});
    problem.v = kallpa::make_contiguous_view(v.data(), kallpa::DType::f32, {batch, skv, 8, 128});
    problem.o = kallpa::make_contiguous_view(o.data(), kallpa::DType::f32, {batch, sq, 32, 128});
    problem.causal = true;
  }
};

// Arg 0: keys; arg 1: verification rate in calls per million (0, 1000 = the default, 1000000).
void BM_DecodeVerify(benchmark::State& state) {
  auto registry = private_registry();
  kallpa::DispatchOptions options;
  options.verify_rate = static_cast<double>(state.range(1)) / 1e6;
  options.verify_seed = 1;
  kallpa::Dispatcher d(options, registry.get());
  Problem p(8, 1, state.range(0));
  auto vp = kallpa::validate(p.problem);
  if (!d.run(*vp)) state.SkipWithError("decode failed");  // first use: checked once, outside the timing
  for (auto _ : state) benchmark::DoNotOptimize(d.run(*vp));
  state.SetItemsProcessed(state.iterations() * 8);  // tokens decoded
  const kallpa::VerificationCounters v = registry->info("cpu-flash")->verification;
  state.counters["shadow_checks"] = static_cast<double>(v.shadow_checks);
  state.counters["shadow_ms_per_check"] = v.shadow_checks ? 1e3 * v.shadow_seconds / double(v.shadow_checks) : 0.0;
}
BENCHMARK(BM_DecodeVerify)
    ->ArgsProduct({{4096}, {0, 1000, 1000000}})
    ->ArgNames({"keys", "rate_ppm"})
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(2.0);

// What the checks add to every call when none runs: the draw for shadow verification and the size
// bucket's lookup, on a no-op backend (no kernel), verification off (arg 0) and at its defaults
// (arg 1, first-use on, 1 in 1,000). The registry has no oracle, so a drawn check is counted
// unverifiable and costs nothing more.
class Noop final : public AttentionBackend {
 public:
  std::string_view name() const noexcept override { return "noop"; }
  std::string_view version() const noexcept override { return "0"; }
  kallpa::DeviceKind device_kind() const noexcept override { return kallpa::DeviceKind::cpu; }
  int priority() const noexcept override { return 1; }
  kallpa::Support supports(const kallpa::ProblemSignature&) const noexcept override { return {}; }
  kallpa::Status run(const kallpa::ValidatedProblem&, kallpa::Workspace) noexcept override { return {}; }
};

void BM_PerCallOverhead(benchmark::State& state) {
  BackendRegistry registry;
  (void)registry.add(std::make_unique<Noop>());
  kallpa::DispatchOptions options;
  if (state.range(0) == 0) {
    options.first_use_check = false;
    options.verify_rate = 0.0;
  }
  kallpa::Dispatcher d(options, &registry);
  Problem p(8, 1, 64);
  auto vp = kallpa::validate(p.problem);
  (void)d.run(*vp);
  for (auto _ : state) benchmark::DoNotOptimize(d.run(*vp));
}
BENCHMARK(BM_PerCallOverhead)->Arg(0)->Arg(1)->ArgNames({"checks"});

// Arg 0: keys; arg 1: queries per sequence (1 = decode). One first call per iteration on a fresh
// registry: its time, and the check's share of it.
void BM_FirstUseCheck(benchmark::State& state) {
  Problem p(1, state.range(1), state.range(0));
  auto vp = kallpa::validate(p.problem);
  double check_seconds = 0.0, call_seconds = 0.0;
  for (auto _ : state) {
    state.PauseTiming();
    auto registry = private_registry();
    kallpa::DispatchOptions options;
    options.verify_rate = 0.0;
    kallpa::Dispatcher d(options, registry.get());
    state.ResumeTiming();
    const auto start = std::chrono::steady_clock::now();
    if (!d.run(*vp)) state.SkipWithError("call failed");
    call_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    check_seconds += registry->info("cpu-flash")->verification.first_use_seconds;
  }
  const double n = static_cast<double>(state.iterations());
  state.counters["check_ms"] = 1e3 * check_seconds / n;
  state.counters["first_call_ms"] = 1e3 * call_seconds / n;
}
BENCHMARK(BM_FirstUseCheck)
    ->Args({1024, 1})
    ->Args({4096, 1})
    ->Args({16384, 1})
    ->Args({65536, 1})
    ->Args({512, 512})
    ->ArgNames({"keys", "queries"})
    ->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
