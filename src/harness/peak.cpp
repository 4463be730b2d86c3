// FMA peak: many independent multiply-add chains per thread, enough to cover the FMA latency on
// every port. Bandwidth: every thread streams its own slice of a buffer far larger than L3.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "harness/peak.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

HWY_BEFORE_NAMESPACE();
namespace kallpa::harness {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Returns a value that depends on every FMA so the loop cannot be removed. Each iteration does
// 12 vector FMAs (2 flops per lane each).
float FmaChains(std::int64_t iterations) {
  const hn::ScalableTag<float> df;
  const auto a = hn::Set(df, 1.0000001f);
  const auto b = hn::Set(df, 1e-7f);
  auto c0 = hn::Set(df, 0.0f), c1 = hn::Set(df, 0.1f), c2 = hn::Set(df, 0.2f), c3 = hn::Set(df, 0.3f);
  auto c4 = hn::Set(df, 0.4f), c5 = hn::Set(df, 0.5f), c6 = hn::Set(df, 0.6f), c7 = hn::Set(df, 0.7f);
  auto c8 = hn::Set(df, 0.8f), c9 = hn::Set(df, 0.9f), c10 = hn::Set(df, 1.0f), c11 = hn::Set(df, 1.1f);
  for (std::int64_t i = 0; i < iterations; ++i) {
    c0 = hn::MulAdd(c0, a, b); c1 = hn::MulAdd(c1, a, b); c2 = hn::MulAdd(c2, a, b);
    c3 = hn::MulAdd(c3, a, b); c4 = hn::MulAdd(c4, a, b); c5 = hn::MulAdd(c5, a, b);
    c6 = hn::MulAdd(c6, a, b); c7 = hn::MulAdd(c7, a, b); c8 = hn::MulAdd(c8, a, b);
    c9 = hn::MulAdd(c9, a, b); c10 = hn::MulAdd(c10, a, b); c11 = hn::MulAdd(c11, a, b);
  }
  const auto s = hn::Add(hn::Add(hn::Add(c0, c1), hn::Add(c2, c3)),
                         hn::Add(hn::Add(hn::Add(c4, c5), hn::Add(c6, c7)), hn::Add(hn::Add(c8, c9), hn::Add(c10, c11))));
  return hn::GetLane(hn::SumOfLanes(df, s));
}

std::int64_t FloatLanes() { return static_cast<std::int64_t>(hn::Lanes(hn::ScalableTag<float>())); }

float SumStream(const float* data, std::int64_t count) {
  const hn::ScalableTag<float> df;
  const std::int64_t n = static_cast<std::int64_t>(hn::Lanes(df));
  auto s0 = hn::Zero(df), s1 = hn::Zero(df), s2 = hn::Zero(df), s3 = hn::Zero(df);
  std::int64_t i = 0;
  for (; i + 4 * n <= count; i += 4 * n) {
    s0 = hn::Add(s0, hn::LoadU(df, data + i));
    s1 = hn::Add(s1, hn::LoadU(df, data + i + n));
    s2 = hn::Add(s2, hn::LoadU(df, data + i + 2 * n));
    s3 = hn::Add(s3, hn::LoadU(df, data + i + 3 * n));
  }
  float tail = 0.0f;
  for (; i < count; ++i) tail += data[i];
  return hn::GetLane(hn::SumOfLanes(df, hn::Add(hn::Add(s0, s1), hn::Add(s2, s3)))) + tail;
}

}  // namespace HWY_NAMESPACE
}  // namespace kallpa::harness
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "harness/peak.h"
#include "harness/thp_allocator.h"
#include "core/parallel.h"

namespace kallpa::harness {

HWY_EXPORT(FmaChains);
HWY_EXPORT(FloatLanes);
HWY_EXPORT(SumStream);

namespace {

// Runs fn(thread) on `threads` threads at once and returns the wall time in seconds.
template <typename Fn>
double timed_on_threads(int threads, Fn fn) {
  std::vector<std::thread> pool;
  const auto start = std::chrono::steady_clock::now();
  for (int t = 1; t < threads; ++t) pool.emplace_back(fn, t);
  fn(0);
  for (auto& th : pool) th.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

MachinePeak measure_peak(int threads) {
  MachinePeak peak;
  peak.threads = threads > 0 ? threads : parallel::default_num_threads();
  // Dynamic dispatch takes the best compiled target the CPU supports: the lowest set bit.
  const std::int64_t usable = hwy::SupportedTargets() & HWY_TARGETS;
  peak.simd_target = hwy::TargetName(usable & -usable);
  const std::int64_t lanes = HWY_DYNAMIC_DISPATCH(FloatLanes)();

  std::vector<float> sink(static_cast<std::size_t>(peak.threads));
  // About 8 GFLOP per thread: long enough to swamp thread start-up, short enough to stay ~0.1 s.
  const std::int64_t iterations = 8'000'000'000 / (24 * lanes);
  double best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    best = std::min(best, timed_on_threads(peak.threads, [&](int t) {
                      sink[static_cast<std::size_t>(t)] = HWY_DYNAMIC_DISPATCH(FmaChains)(iterations);
                    }));
  }
  peak.fma_gflops = double(iterations) * 12.0 * double(lanes) * 2.0 * peak.threads / best / 1e9;

  // 512 MiB: far beyond any L3 we expect, so this is DRAM.
  const std::int64_t total = std::int64_t{128} << 20;
  // On huge pages, like the K/V of the attention benchmark (harness/thp_allocator.h).
  std::vector<float, ThpAllocator<float>> buffer(static_cast<std::size_t>(total), 1.0f);
  const std::int64_t slice = total / peak.threads;
  best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    best = std::min(best, timed_on_threads(peak.threads, [&](int t) {
                      sink[static_cast<std::size_t>(t)] +=
                          HWY_DYNAMIC_DISPATCH(SumStream)(buffer.data() + t * slice, slice);
                    }));
  }
  peak.dram_read_gbps = double(slice * peak.threads) * sizeof(float) / best / 1e9;
  volatile float keep = sink[0];
  (void)keep;
  return peak;
}

}  // namespace kallpa::harness
#endif  // HWY_ONCE
