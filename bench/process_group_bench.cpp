// The process group's all-gather (kallpa/process_group.h) under `mpirun -np N`: the latency and
// bandwidth terms of the cost model in docs/scale-out.md, measured at the sizes context-parallel
// generation sends. Every rank runs the same fixed iteration counts, since each call is
// collective; rank 0 reports.
//
//   KALLPA_THREADS=1 mpirun -np 2 --oversubscribe ./build/bench/process_group_bench
#include <benchmark/benchmark.h>

#include <cstddef>
#include <utility>
#include <vector>

#include "kallpa/process_group.h"
#include "rank_zero_report.h"

namespace {

using namespace kallpa;

void bm_all_gather(benchmark::State& state) {
  ProcessGroup* group = process_group();
  if (group == nullptr || group->size() < 2) {
    state.SkipWithError("run under mpirun with at least 2 ranks");
    return;
  }
  const auto bytes = static_cast<std::size_t>(state.range(0));
  std::vector<std::byte> mine(bytes, std::byte{1});
  std::vector<std::byte> all(bytes * static_cast<std::size_t>(group->size()));
  for (auto _ : state) {
    if (Status s = group->all_gather(mine.data(), bytes, all.data()); !s) {
      state.SkipWithError(s.to_string().c_str());
      return;
    }
  }
  const auto n = static_cast<double>(state.iterations());
  state.counters["ranks"] = group->size();
  // Bytes each rank receives per call over the time: the ring's per-link throughput.
  state.counters["recv_bytes/s"] =
      benchmark::Counter(static_cast<double>(bytes) * (group->size() - 1) * n, benchmark::Counter::kIsRate);
}

}  // namespace

int main(int argc, char** argv) {
  // 8 bytes: the latency; 2340 bytes: a decode step's partial (o, lse) of SmolLM2 (9 heads x 65
  // floats); 1.5 MiB: a prefill layer's K/V block of a 4k-token prompt split in two.
  for (const auto& [bytes, iterations] :
       {std::pair{8, 2000}, std::pair{2340, 2000}, std::pair{65536, 500}, std::pair{1 << 20, 50}}) {
    benchmark::RegisterBenchmark("all_gather", bm_all_gather)
        ->Arg(bytes)
        ->Iterations(iterations)
        ->Unit(benchmark::kMicrosecond)
        ->UseRealTime();
  }
  benchmark::Initialize(&argc, argv);
  ProcessGroup* group = process_group();
  // The first collective starts MPI and wires the ranks up: outside the timings.
  if (group != nullptr && group->size() > 1) {
    std::byte one{}, all[64]{};
    if (group->size() <= 64 && !group->all_gather(&one, 1, all)) return 1;
  }
  kallpa::bench::run_benchmarks_rank_zero_reports();
  benchmark::Shutdown();
  return 0;
}
