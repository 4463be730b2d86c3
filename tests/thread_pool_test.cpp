// ThreadPool: every task runs once, within the job's thread limit; nested calls run serially;
// callers on several threads; and churn, many back-to-back jobs of every size on more threads than
// cores (so workers are often descheduled, wake late or miss whole jobs), each task's writes
// visible to the caller when parallel_for returns.
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "core/parallel.h"

namespace kallpa {
namespace {

TEST(ThreadPool, RunsEveryTaskOnce) {
  parallel::ThreadPool pool(4);
  for (std::int64_t n : {0, 1, 3, 1000}) {
    std::vector<std::atomic<int>> hits(static_cast<std::size_t>(n));
    std::atomic<int> max_worker{0};
    pool.parallel_for(n, [&](std::int64_t t, int w) {
      hits[static_cast<std::size_t>(t)].fetch_add(1);
      int m = max_worker.load();
      while (w > m && !max_worker.compare_exchange_weak(m, w)) {
      }
    });
    for (auto& h : hits) EXPECT_EQ(h.load(), 1);
    EXPECT_LT(max_worker.load(), 4);
  }
  std::atomic<int> over{0};
  pool.parallel_for(
      100, [&](std::int64_t, int w) { over += w >= 2; }, 2);
  EXPECT_EQ(over.load(), 0);
}

TEST(ThreadPool, ConcurrentAndNestedCalls) {
  parallel::ThreadPool pool(3);
  std::atomic<std::int64_t> sum{0};
  auto job = [&] {
    for (int rep = 0; rep < 50; ++rep)
      pool.parallel_for(20, [&](std::int64_t t, int) {
        pool.parallel_for(3, [&](std::int64_t u, int w) {
          EXPECT_EQ(w, 0);  // nested: serial on the calling thread
          sum += t * 3 + u;
        });
      });
  };
  std::thread a(job), b(job);
  a.join();
  b.join();
  EXPECT_EQ(sum.load(), 2 * 50 * (60 * 59 / 2));
}

TEST(ThreadPool, BackToBackJobsRunEachTaskOnceWithinTheirLimit) {
  parallel::ThreadPool pool(6);  // the test machine has 2 cores: workers often lag behind
  std::vector<std::int64_t> slots(257);
  std::atomic<int> over_limit{0};
  for (int job = 0; job < 3000; ++job) {
    const std::int64_t n = (job * 37) % 258;  // 0 .. 257 tasks, sizes mixed job to job
    const int limit = job % 7;                // 0 = all threads
    const int threads = pool.threads_for(limit);
    pool.parallel_for(
        n,
        [&](std::int64_t t, int w) {
          if (w >= threads) over_limit.fetch_add(1);
          // Plain writes: exactly-once makes them race-free, and parallel_for's return makes
          // them visible to the check below.
          slots[static_cast<std::size_t>(t)] += job + 1;
        },
        limit);
    for (std::int64_t t = 0; t < n; ++t) {
      ASSERT_EQ(slots[static_cast<std::size_t>(t)], job + 1) << "job " << job << " task " << t;
      slots[static_cast<std::size_t>(t)] = 0;
    }
  }
  EXPECT_EQ(over_limit.load(), 0);
}

// A job's function object dies when parallel_for returns; a worker that wakes afterwards must not
// call it (under ASan a call through the dead object fails loudly).
TEST(ThreadPool, LateWorkersNeverCallAFinishedJob) {
  parallel::ThreadPool pool(4);
  for (int job = 0; job < 2000; ++job) {
    auto counter = std::make_unique<std::atomic<std::int64_t>>(0);
    const parallel::ThreadPool::TaskFn fn = [c = counter.get()](std::int64_t t, int) { c->fetch_add(t + 1); };
    const std::int64_t n = 1 + job % 3;
    pool.parallel_for(n, fn);
    ASSERT_EQ(counter->load(), n * (n + 1) / 2);
  }
}

// Jobs issued from several threads at once: one owns the pool, the others run serially; every
// task of every job runs once.
TEST(ThreadPool, CallersOnSeveralThreads) {
  parallel::ThreadPool pool(3);
  constexpr int kCallers = 4, kJobs = 300;
  std::vector<std::int64_t> sums(kCallers, 0);
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      for (int job = 0; job < kJobs; ++job) {
        std::atomic<std::int64_t> s{0};
        pool.parallel_for(50, [&](std::int64_t t, int) { s += t; });
        sums[static_cast<std::size_t>(c)] += s.load();
      }
    });
  }
  for (auto& t : callers) t.join();
  for (std::int64_t s : sums) EXPECT_EQ(s, std::int64_t{kJobs} * (50 * 49 / 2));
}

}  // namespace
}  // namespace kallpa
