// The cost per call of running a plugin isolated (include/kallpa/plugin.h) next to the same plugin
// in process: the fault-injection "good" plugin (tests/plugins, the example's naive attention),
// loaded three ways: in process, isolated, isolated with guard pages (paranoid). Decode and a small
// prefill, f32, called through the backend directly (no dispatcher, no health check).
//   plugin_isolation_bench [--benchmark_filter=...]   (KALLPA_BENCH_PLUGIN=LIB picks another plugin)
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kallpa/attention.h"
#include "kallpa/plugin.h"
#include "kallpa/registry.h"

namespace {

using namespace kallpa;

std::string plugin_path() {
  if (const char* env = std::getenv("KALLPA_BENCH_PLUGIN"); env != nullptr && *env != '\0') return env;
#ifdef KALLPA_BENCH_PLUGIN
  return KALLPA_BENCH_PLUGIN;
#else
  return {};
#endif
}

enum Mode { in_process = 0, isolated = 1, isolated_guarded = 2 };

AttentionBackend* backend(Mode mode) {
  static BackendRegistry registries[3];
  static AttentionBackend* loaded[3] = {};
  if (loaded[mode] != nullptr) return loaded[mode];
  PluginOptions o;
  o.isolation = mode == in_process ? PluginIsolation::in_process : PluginIsolation::process;
  o.guard_pages = mode == isolated_guarded;
  PluginLoadReport r = load_plugin(plugin_path(), registries[mode], o);
  if (!r.status) return nullptr;
  loaded[mode] = registries[mode].find(r.backend);
  return loaded[mode];
}

struct Problem {
  std::vector<float> q, k, v, o;
  AttentionProblem p;
  Problem(std::int64_t b, std::int64_t sq, std::int64_t skv, std::int64_t hq, std::int64_t hkv, std::int64_t d) {
    std::mt19937 rng(7);
    std::normal_distribution<float> dist;
    auto fill = [&](std::vector<float>& x, std::int64_t n) {
      x.resize(static_cast<std::size_t>(n));
      for (float& e : x) e = dist(rng);
    };
    fill(q, b * sq * hq * d);
    fill(k, b * skv * hkv * d);
    fill(v, b * skv * hkv * d);
    o.assign(static_cast<std::size_t>(b * sq * hq * d), 0.0f);
    p.q = make_contiguous_view(q.data(), DType::f32, {b, sq, hq, d});
    p.k = make_contiguous_view(k.data(), DType::f32, {b, skv, hkv, d});
    p.v = make_contiguous_view(v.data(), DType::f32, {b, skv, hkv, d});
    p.o = make_contiguous_view(o.data(), DType::f32, {b, sq, hq, d});
    p.causal = true;
  }
};

void run(benchmark::State& state, Mode mode, std::int64_t b, std::int64_t sq, std::int64_t skv) {
  AttentionBackend* be = backend(mode);
  if (be == nullptr) {
    state.SkipWithError("the plugin did not load (set KALLPA_BENCH_PLUGIN)");
    return;
  }
  Problem t(b, sq, skv, 8, 2, 64);
  auto vp = validate(t.p);
  std::vector<unsigned char> ws(be->workspace_size(*vp) + 64);
  for (auto _ : state) {
    Status s = be->run(*vp, Workspace{ws.data(), ws.size() - 64});
    if (!s) {
      state.SkipWithError(s.to_string().c_str());
      return;
    }
    benchmark::DoNotOptimize(t.o.data());
  }
  state.counters["bytes_in"] = static_cast<double>((t.q.size() + t.k.size() + t.v.size()) * sizeof(float));
}

// Decode: 4 sequences x 1 query x 1024 keys; a tiny decode (1 x 1 x 64: the fixed cost of a round
// trip); prefill: 1 x 128 x 128. Hq 8, Hkv 2, D 64.
void decode(benchmark::State& s, Mode m) { run(s, m, 4, 1, 1024); }
void tiny_decode(benchmark::State& s, Mode m) { run(s, m, 1, 1, 64); }
void prefill(benchmark::State& s, Mode m) { run(s, m, 1, 128, 128); }

BENCHMARK_CAPTURE(decode, in_process, in_process)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(decode, isolated, isolated)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(decode, isolated_guarded, isolated_guarded)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(tiny_decode, in_process, in_process)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(tiny_decode, isolated, isolated)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(tiny_decode, isolated_guarded, isolated_guarded)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(prefill, in_process, in_process)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(prefill, isolated, isolated)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(prefill, isolated_guarded, isolated_guarded)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
