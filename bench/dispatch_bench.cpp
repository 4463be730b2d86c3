// Dispatch overhead: what selection costs on a warm cache, apart from any kernel. A no-op backend
// isolates the dispatcher; validate() is measured separately because callers may validate once.
#include <benchmark/benchmark.h>

#include <vector>

#include "kallpa/dispatcher.h"
#include "kallpa/registry.h"

namespace {

class NoopBackend final : public kallpa::AttentionBackend {
 public:
  explicit NoopBackend(std::string name, int priority) : name_(std::move(name)), priority_(priority) {}
  std::string_view name() const noexcept override { return name_; }
  std::string_view version() const noexcept override { return "0"; }
  kallpa::DeviceKind device_kind() const noexcept override { return kallpa::DeviceKind::cpu; }
  int priority() const noexcept override { return priority_; }
  kallpa::Support supports(const kallpa::ProblemSignature&) const noexcept override { return {}; }
  kallpa::Status run(const kallpa::ValidatedProblem&, kallpa::Workspace) noexcept override { return {}; }

 private:
  std::string name_;
  int priority_;
};

struct Setup {
  kallpa::BackendRegistry registry;
  std::vector<float> q, k, v, o;
  kallpa::AttentionProblem problem;
  Setup() {
    for (int i = 0; i < 6; ++i) (void)registry.add(std::make_unique<NoopBackend>("noop" + std::to_string(i), i));
    q.resize(1 * 128 * 32 * 128);
    k.resize(1 * 128 * 8 * 128);
    v.resize(k.size());
    o.resize(q.size());
    problem.q = kallpa::make_contiguous_view(q.data(), kallpa::DType::f32, {1, 128, 32, 128});
    problem.k = kallpa::make_contiguous_view(k.data(), kallpa::DType::f32, {1, 128, 8, 128});
    problem.v = kallpa::make_contiguous_view(v.data(), kallpa::DType::f32, {1, 128, 8, 128});
    problem.o = kallpa::make_contiguous_view(o.data(), kallpa::DType::f32, {1, 128, 32, 128});
    problem.causal = true;
  }
};

void BM_Validate(benchmark::State& state) {
  Setup s;
  for (auto _ : state) benchmark::DoNotOptimize(kallpa::validate(s.problem));
}
BENCHMARK(BM_Validate);

void BM_SelectWarm(benchmark::State& state) {
  Setup s;
  kallpa::Dispatcher d({}, &s.registry);
  auto vp = kallpa::validate(s.problem);
  (void)d.run(*vp);
  for (auto _ : state) benchmark::DoNotOptimize(d.run(*vp));
}
BENCHMARK(BM_SelectWarm);

void BM_ValidateAndRunWarm(benchmark::State& state) {
  Setup s;
  kallpa::Dispatcher d({}, &s.registry);
  (void)d.run(s.problem);
  for (auto _ : state) benchmark::DoNotOptimize(d.run(s.problem));
}
BENCHMARK(BM_ValidateAndRunWarm);

void BM_SelectWarmWithObserver(benchmark::State& state) {
  Setup s;
  kallpa::Dispatcher d({}, &s.registry);
  d.add_observer(std::make_shared<kallpa::StatsObserver>());
  auto vp = kallpa::validate(s.problem);
  (void)d.run(*vp);
  for (auto _ : state) benchmark::DoNotOptimize(d.run(*vp));
}
BENCHMARK(BM_SelectWarmWithObserver);

void BM_SelectCold(benchmark::State& state) {
  Setup s;
  kallpa::Dispatcher d({}, &s.registry);
  auto vp = kallpa::validate(s.problem);
  for (auto _ : state) {
    // A registry change invalidates the cache, forcing a fresh selection every call.
    (void)s.registry.set_health("noop0", kallpa::Health::healthy);
    benchmark::DoNotOptimize(d.run(*vp));
  }
}
BENCHMARK(BM_SelectCold);

}  // namespace

BENCHMARK_MAIN();
