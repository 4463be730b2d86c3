#include "core/parallel.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>

namespace kallpa::parallel {

namespace {
// How many tasks this thread is inside. A parallel_for from inside a task runs serially, even when
// the pool happens to be free at that moment: otherwise a task running on the serial fallback of a
// busy pool could fan out its nested work, and the worker ids it sees would depend on timing.
thread_local int t_task_depth = 0;
// Decode runs hundreds of tiny parallel_for calls per token; a condition-variable wake-up costs
// tens of microseconds each. Workers and the caller first spin this many rounds (~20-50 us) on an
// atomic before they block, which keeps back-to-back jobs cheap without burning an idle core.
constexpr int kSpinRounds = 4000;
inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

struct TaskScope {
  TaskScope() { ++t_task_depth; }
  ~TaskScope() { --t_task_depth; }
  TaskScope(const TaskScope&) = delete;
  TaskScope& operator=(const TaskScope&) = delete;
};
}  // namespace

int default_num_threads() noexcept {
  if (const char* env = std::getenv("KALLPA_THREADS")) {
    char* end = nullptr;
    const long v = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && v > 0 && v <= 4096) return static_cast<int>(v);
  }
  const unsigned hc = std::thread::hardware_concurrency();
  return hc == 0 ? 1 : static_cast<int>(std::min(hc, 4096u));
}

ThreadPool::ThreadPool(int num_threads) : num_threads_(std::max(1, num_threads)) {}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

ThreadPool& ThreadPool::global() {
  // Leaked on purpose: workers must not be joined during static destruction of a shared library.
  static ThreadPool* pool = new ThreadPool(default_num_threads());
  return *pool;
}

int ThreadPool::threads_for(int max_threads) const noexcept {
  return max_threads <= 0 ? num_threads_ : std::min(max_threads, num_threads_);
}

void ThreadPool::start_workers() {
  std::call_once(started_, [this] {
    workers_.reserve(static_cast<std::size_t>(num_threads_ - 1));
    for (int w = 1; w < num_threads_; ++w) workers_.emplace_back([this, w] { worker_loop(w); });
  });
}

void ThreadPool::worker_loop(int worker) {
  std::uint64_t seen = 0;
  for (;;) {
    const TaskFn* fn = nullptr;
    std::int64_t n = 0;
    for (int spin = 0; spin < kSpinRounds && published_job_.load(std::memory_order_acquire) == seen; ++spin) {
      cpu_relax();
    }
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_ || (job_id_ != seen && worker <= active_workers_); });
      if (stop_) return;
      seen = job_id_;
      fn = fn_;
      n = n_;
    }
    {
      TaskScope scope;
      for (std::int64_t t; (t = next_.fetch_add(1, std::memory_order_relaxed)) < n;) (*fn)(t, worker);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--running_ == 0) done_.notify_all();
    }
  }
}


void ThreadPool::parallel_for(std::int64_t n, const TaskFn& fn, int max_threads) {
  if (n <= 0) return;
  const int threads = static_cast<int>(std::min<std::int64_t>(threads_for(max_threads), n));
  std::unique_lock<std::mutex> job(job_mu_, std::defer_lock);
  if (threads > 1 && t_task_depth == 0) job.try_lock();
  if (!job.owns_lock()) {
    TaskScope scope;
    for (std::int64_t t = 0; t < n; ++t) fn(t, 0);
    return;
  }
  start_workers();
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    n_ = n;
    next_.store(0, std::memory_order_relaxed);
    active_workers_ = threads - 1;
    running_ = threads - 1;
    ++job_id_;
    published_job_.store(job_id_, std::memory_order_release);
  }
  wake_.notify_all();
  {
    TaskScope scope;
    for (std::int64_t t; (t = next_.fetch_add(1, std::memory_order_relaxed)) < n;) fn(t, 0);
  }
  for (int spin = 0; spin < kSpinRounds && running_.load(std::memory_order_acquire) != 0; ++spin) cpu_relax();
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [&] { return running_ == 0; });
  fn_ = nullptr;
}

}  // namespace kallpa::parallel
