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

void ThreadPool::run_tasks(std::uint32_t gen, const TaskFn* fn, std::int64_t n, int worker) {
  TaskScope scope;
  std::uint64_t c = claim_.load(std::memory_order_acquire);
  for (;;) {
    const auto index = static_cast<std::int64_t>(c & 0xffffffffu);
    if (static_cast<std::uint32_t>(c >> 32) != gen || index >= n) return;
    if (!claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
    (*fn)(index, worker);  // fn is alive: the job was open when this task was claimed
    if (completed_.fetch_add(1, std::memory_order_acq_rel) + 1 == n && worker != 0) {
      std::lock_guard<std::mutex> lock(mu_);  // the caller may be asleep on done_
      done_.notify_all();
    }
    c = claim_.load(std::memory_order_acquire);
  }
}

void ThreadPool::worker_loop(int worker) {
  std::uint32_t seen = 0;
  for (;;) {
    for (int spin = 0; spin < kSpinRounds && published_.load(std::memory_order_acquire) == seen; ++spin) {
      cpu_relax();
    }
    if (published_.load(std::memory_order_acquire) == seen) {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_ || published_.load(std::memory_order_acquire) != seen; });
      if (stop_) return;
    }
    seen = published_.load(std::memory_order_acquire);
    if (worker > active_workers_.load(std::memory_order_acquire)) continue;
    // fn_ and n_ may already belong to a later job; then claim_ carries that job's generation
    // (it was closed before they were written) and run_tasks claims nothing.
    const TaskFn* fn = fn_.load(std::memory_order_acquire);
    const std::int64_t n = n_.load(std::memory_order_acquire);
    if (fn != nullptr) run_tasks(seen, fn, n, worker);
  }
}

void ThreadPool::parallel_for(std::int64_t n, const TaskFn& fn, int max_threads) {
  if (n <= 0) return;
  // Task indices live in 32 bits of claim_; larger jobs (never seen in practice) go in slices.
  constexpr std::int64_t kMaxTasks = 0x7fffffff;
  if (n > kMaxTasks) {
    for (std::int64_t first = 0; first < n; first += kMaxTasks) {
      const TaskFn slice = [&fn, first](std::int64_t t, int worker) { fn(first + t, worker); };
      parallel_for(std::min(kMaxTasks, n - first), slice, max_threads);
    }
    return;
  }
  const int threads = static_cast<int>(std::min<std::int64_t>(threads_for(max_threads), n));
  std::unique_lock<std::mutex> job(job_mu_, std::defer_lock);
  if (threads > 1 && t_task_depth == 0) job.try_lock();
  if (!job.owns_lock()) {
    TaskScope scope;
    for (std::int64_t t = 0; t < n; ++t) fn(t, 0);
    return;
  }
  start_workers();
  // Set the job up behind a closed claim word with the new generation, so that no straggler of
  // the previous job can claim from it with the old fn, then open it and wake the workers.
  if (++generation_ == 0) ++generation_;  // 0 is what a fresh worker has seen
  const std::uint32_t gen = generation_;
  claim_.store(static_cast<std::uint64_t>(gen) << 32 | kClosed, std::memory_order_seq_cst);
  fn_.store(&fn, std::memory_order_release);
  n_.store(n, std::memory_order_release);
  active_workers_.store(threads - 1, std::memory_order_release);
  completed_.store(0, std::memory_order_release);
  claim_.store(static_cast<std::uint64_t>(gen) << 32, std::memory_order_release);
  {
    std::lock_guard<std::mutex> lock(mu_);
    published_.store(gen, std::memory_order_release);
  }
  wake_.notify_all();
  run_tasks(gen, &fn, n, 0);
  for (int spin = 0; spin < kSpinRounds && completed_.load(std::memory_order_acquire) != n; ++spin) cpu_relax();
  if (completed_.load(std::memory_order_acquire) != n) {
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [&] { return completed_.load(std::memory_order_acquire) == n; });
  }
}

}  // namespace kallpa::parallel
