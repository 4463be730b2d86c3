// ThreadPool::parallel_for on decode-sized jobs (a few dozen short tasks, as a matmul of one token
// makes hundreds of per step), on an idle machine and with every core but one kept busy by a
// nice-19 spinner, the way a build, a second service or the server's own HTTP threads share a
// small machine. Compare builds side by side; the busy case shows what a caller pays when a worker
// it hands a job to is not on a core.
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <thread>
#include <vector>

#include <benchmark/benchmark.h>

#include "core/parallel.h"

namespace {

// Spinners at the lowest priority on all cores but one, for the lifetime of the object.
class BusyCores {
 public:
  explicit BusyCores(int n) {
    for (int i = 0; i < n; ++i) {
      threads_.emplace_back([this] {
        setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 19);
        volatile double x = 1.0;
        while (!stop_.load(std::memory_order_relaxed)) x = std::sqrt(x + 1.0);
      });
    }
  }
  ~BusyCores() {
    stop_ = true;
    for (auto& t : threads_) t.join();
  }
  BusyCores(const BusyCores&) = delete;
  BusyCores& operator=(const BusyCores&) = delete;

 private:
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

void BM_ParallelForSmallJobs(benchmark::State& state) {
  const auto tasks = state.range(0);
  const bool busy = state.range(1) != 0;
  auto& pool = kallpa::parallel::ThreadPool::global();
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  BusyCores spinners(busy ? std::max(1, cores - 1) : 0);
  std::vector<double> out(static_cast<std::size_t>(tasks));
  const kallpa::parallel::ThreadPool::TaskFn fn = [&](std::int64_t t, int) {
    double v = static_cast<double>(t);
    for (int i = 0; i < 2000; ++i) v = v * 0.999 + 1.0;  // ~2 us of work per task
    out[static_cast<std::size_t>(t)] = v;
  };
  for (auto _ : state) {
    pool.parallel_for(tasks, fn);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations() * tasks);
  state.SetLabel(busy ? "other cores busy (nice 19)" : "idle machine");
}
BENCHMARK(BM_ParallelForSmallJobs)->ArgsProduct({{8, 32}, {0, 1}})->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
