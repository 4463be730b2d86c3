// Every registered attention backend on the same shapes, side by side in one Google Benchmark run
// (the llm.c habit: versions of a kernel are compared in one table). `kallpa bench attention` is
// the richer, user-facing version of this with peak fractions; this one feeds tooling that
// understands Google Benchmark's output.
#include <benchmark/benchmark.h>

#include <memory>
#include <string>
#include <vector>

#include "harness/problem_instance.h"
#include "kallpa/dispatcher.h"
#include "kallpa/registry.h"

namespace {

void run_backend(benchmark::State& state, const std::string& backend, const std::string& shape) {
  auto spec = kallpa::parse_problem_spec(shape);
  auto inst = kallpa::harness::ProblemInstance::create(*spec);
  if (!inst) {
    state.SkipWithError(inst.status().to_string().c_str());
    return;
  }
  auto vp = kallpa::validate((*inst)->problem());
  kallpa::Dispatcher dispatcher({{backend}, true});
  for (auto _ : state) {
    kallpa::Status s = dispatcher.run(*vp);
    if (!s) {
      state.SkipWithError(s.to_string().c_str());
      return;
    }
  }
  state.counters["GFLOP/s"] = benchmark::Counter((*inst)->flops() / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["KV_GB/s"] =
      benchmark::Counter((*inst)->kv_bytes() / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

}  // namespace

int main(int argc, char** argv) {
  // The oracle is orders of magnitude slower; it only runs on the small shape.
  const std::vector<std::string> shapes = {
      "b=1,sq=256,skv=256,hq=8,d=64,dtype=f16,causal",
      "b=1,sq=1024,skv=1024,hq=8,d=128,dtype=f16,causal",
      "b=1,sq=1,skv=4096,hq=32,hkv=8,d=64,dtype=f16",
  };
  for (const kallpa::BackendInfo& info : kallpa::BackendRegistry::global().list()) {
    const std::string name(info.backend->name());
    for (const std::string& shape : shapes) {
      if (name == "reference" && shape != shapes.front()) continue;
      benchmark::RegisterBenchmark((name + "/" + shape).c_str(),
                                   [name, shape](benchmark::State& st) { run_backend(st, name, shape); })
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
