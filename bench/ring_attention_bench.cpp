// Context-parallel attention across MPI ranks (docs/scale-out.md): the same problem on one rank
// (cpu-flash, the ring's local backend) and under `mpirun -np N` (ring), with the share of each call
// that a rank spends waiting on transfers rather than computing. Every rank runs the benchmark with
// the same fixed iteration count, since a ring call is collective; rank 0 reports.
//
//   KALLPA_THREADS=1 ./build/bench/ring_attention_bench                       # 1 rank
//   KALLPA_THREADS=1 mpirun -np 2 --oversubscribe ./build/bench/ring_attention_bench
#include <benchmark/benchmark.h>

#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "harness/problem_instance.h"
#include "kallpa/problem_spec.h"
#include "kallpa/process_group.h"
#include "kallpa/registry.h"
#include "rank_zero_report.h"

namespace {

using namespace kallpa;

double counter(const AttentionBackend& backend, const std::string& name) {
  for (const BackendCounter& c : backend.counters()) {
    if (c.name == name) return c.value;
  }
  return 0.0;
}

void bm_attention(benchmark::State& state, const std::string& spec_text) {
  const ProcessGroup* group = process_group();
  const bool ring = group != nullptr && group->size() > 1;
  AttentionBackend* backend = BackendRegistry::global().find(ring ? "ring" : "cpu-flash");
  Result<ProblemSpec> spec = parse_problem_spec(spec_text);
  if (backend == nullptr || !spec) {
    state.SkipWithError("no backend or a bad spec");
    return;
  }
  auto instance = harness::ProblemInstance::create(*spec, 7);
  if (!instance) {
    state.SkipWithError(instance.status().to_string().c_str());
    return;
  }
  Result<ValidatedProblem> vp = validate((*instance)->problem());
  if (!vp) {
    state.SkipWithError(vp.status().to_string().c_str());
    return;
  }
  std::vector<unsigned char> ws(backend->workspace_size(*vp) + 64);
  const double wait0 = counter(*backend, "ring_wait_seconds");
  const double compute0 = counter(*backend, "ring_compute_seconds");
  for (auto _ : state) {
    if (Status s = backend->run(*vp, Workspace{ws.data(), ws.size()}); !s) {
      state.SkipWithError(s.to_string().c_str());
      return;
    }
  }
  const auto n = static_cast<double>(state.iterations());
  state.counters["ranks"] = ring ? group->size() : 1;
  state.counters["wait_ms"] = (counter(*backend, "ring_wait_seconds") - wait0) / n * 1e3;
  state.counters["compute_ms"] = (counter(*backend, "ring_compute_seconds") - compute0) / n * 1e3;
  state.counters["GFLOP/s"] = benchmark::Counter((*instance)->flops() * n / 1e9, benchmark::Counter::kIsRate);
}

}  // namespace

int main(int argc, char** argv) {
  // A prefill of 8k tokens and a 512-token chunk over 64k keys (GQA 8:2, d = 64): compute-bound;
  // one decode row over 64 keys: the ring's per-call latency.
  const std::pair<const char*, int> specs[] = {{"b=1,sq=8192,skv=8192,hq=8,hkv=2,d=64,causal", 3},
                                               {"b=1,sq=512,skv=65536,hq=8,hkv=2,d=64,causal", 3},
                                               {"b=1,sq=1,skv=64,hq=8,hkv=2,d=64,causal", 200}};
  for (const auto& [spec, iterations] : specs) {
    benchmark::RegisterBenchmark(spec, bm_attention, std::string(spec))
        ->Iterations(iterations)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  }
  benchmark::Initialize(&argc, argv);
  kallpa::bench::run_benchmarks_rank_zero_reports();
  benchmark::Shutdown();
  return 0;
}
