// A small reusable thread pool for CPU kernels.
//
//   kallpa::parallel::ThreadPool& pool = kallpa::parallel::ThreadPool::global();
//   pool.parallel_for(n_tasks, [&](std::int64_t task, int worker) { ... }, max_threads);
//
// Tasks are handed out dynamically (an atomic counter), so callers that want a good balance put
// the heaviest tasks first. `worker` is in [0, threads used) and is stable for the duration of one
// task, so it can index per-thread scratch. The pool runs one job at a time; a parallel_for issued
// while another job is running (from another thread, or nested from inside a task) runs serially on
// the calling thread with worker 0, so it never deadlocks and never oversubscribes the cores.
// Results never depend on which worker ran a task; callers keep it that way by making their task
// decomposition independent of the thread count.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kallpa::parallel {

// KALLPA_THREADS if set to a positive integer, else std::thread::hardware_concurrency() (>= 1).
int default_num_threads() noexcept;

class ThreadPool {
 public:
  using TaskFn = std::function<void(std::int64_t task, int worker)>;

  // A pool that runs jobs on `num_threads` threads in total: the caller plus num_threads - 1
  // workers (started lazily on the first job that needs them).
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // The process-wide pool, sized by default_num_threads().
  static ThreadPool& global();

  int num_threads() const noexcept { return num_threads_; }

  // Runs fn(task, worker) for every task in [0, n) on at most min(max_threads, num_threads())
  // threads (max_threads <= 0: all), and returns when all are done. fn must not throw.
  void parallel_for(std::int64_t n, const TaskFn& fn, int max_threads = 0);

  // How many threads a parallel_for with this max_threads would use at most.
  int threads_for(int max_threads) const noexcept;

 private:
  void worker_loop(int worker);
  void start_workers();
  // Claims and runs tasks of job `gen` (fn, n) until none is left unclaimed.
  void run_tasks(std::uint32_t gen, const TaskFn* fn, std::int64_t n, int worker);

  const int num_threads_;
  std::vector<std::thread> workers_;
  std::once_flag started_;

  std::mutex job_mu_;  // held by the thread that owns the running job

  // A job is published as (generation, fn, n). A thread claims task i by moving claim_ from
  // (gen, i) to (gen, i + 1), so a worker that arrives late, or wakes only after the job is over,
  // claims nothing and is never waited for: the caller waits for completed_ == n, that is, only
  // for tasks that some thread actually took. Without this a worker that the OS had not scheduled
  // (a busy core) held every call up until it ran, for nothing.
  static constexpr std::uint32_t kClosed = 0xffffffffu;  // claim_ index while a job is set up
  std::atomic<std::uint64_t> claim_{kClosed};            // generation << 32 | next task
  std::atomic<const TaskFn*> fn_{nullptr};
  std::atomic<std::int64_t> n_{0};
  std::atomic<int> active_workers_{0};       // workers (besides the caller) taking part in the job
  std::atomic<std::int64_t> completed_{0};   // tasks of the current job that have finished
  std::atomic<std::uint32_t> published_{0};  // the current job's generation (waking, spinning)
  std::uint32_t generation_ = 0;             // the last generation published (job_mu_ holder)

  std::mutex mu_;  // guards the sleeping and waking below
  std::condition_variable wake_;
  std::condition_variable done_;
  bool stop_ = false;
};

}  // namespace kallpa::parallel
