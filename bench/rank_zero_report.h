// Runs the registered benchmarks on every rank of an MPI job, with rank 0 alone reporting: a
// collective call must be made by every rank the same number of times, and one table is enough.
#pragma once

#include <vector>

#include <benchmark/benchmark.h>

#include "kallpa/process_group.h"

namespace kallpa::bench {

inline void run_benchmarks_rank_zero_reports() {
  class NullReporter : public benchmark::BenchmarkReporter {
   public:
    bool ReportContext(const Context&) override { return true; }
    void ReportRuns(const std::vector<Run>&) override {}
  };
  const ProcessGroup* group = process_group();
  if (group != nullptr && group->rank() != 0) {
    NullReporter quiet;
    benchmark::RunSpecifiedBenchmarks(&quiet);
  } else {
    benchmark::RunSpecifiedBenchmarks();
  }
}

}  // namespace kallpa::bench
