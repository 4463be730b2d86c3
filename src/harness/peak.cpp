// FMA peak: many independent multiply-add chains per thread, enough to cover the FMA latency on
// every port. The int16 peak likewise for pairwise-widening int16 multiply-adds into int32
// (Highway's ReorderWidenMulAccumulate: pmaddwd + paddd on x86), what the quantised matmuls'
// integer dot products run on, so that batched decode can be set against it. Bandwidth: every
// thread streams its own slice of a buffer far larger than L3.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "harness/peak.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include <unistd.h>

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
    c0 = hn::MulAdd(c0, a, b);
    c1 = hn::MulAdd(c1, a, b);
    c2 = hn::MulAdd(c2, a, b);
    c3 = hn::MulAdd(c3, a, b);
    c4 = hn::MulAdd(c4, a, b);
    c5 = hn::MulAdd(c5, a, b);
    c6 = hn::MulAdd(c6, a, b);
    c7 = hn::MulAdd(c7, a, b);
    c8 = hn::MulAdd(c8, a, b);
    c9 = hn::MulAdd(c9, a, b);
    c10 = hn::MulAdd(c10, a, b);
    c11 = hn::MulAdd(c11, a, b);
  }
  const auto s =
      hn::Add(hn::Add(hn::Add(c0, c1), hn::Add(c2, c3)),
              hn::Add(hn::Add(hn::Add(c4, c5), hn::Add(c6, c7)), hn::Add(hn::Add(c8, c9), hn::Add(c10, c11))));
  return hn::GetLane(hn::SumOfLanes(df, s));
}

// Each iteration does 10 vector int16 multiply-adds (2 ops per int16 lane each): ten chains cover
// the multiply-add-then-add latency on two ports and, unlike twelve, fit AVX2's registers. Each
// chain multiplies its own sum's halves, so nothing is loop-invariant for the compiler to hoist.
#if HWY_TARGET == HWY_SCALAR
std::int32_t Int16Chains(std::int64_t iterations) {
  std::uint32_t c[10];
  for (int j = 0; j < 10; ++j) c[j] = static_cast<std::uint32_t>(j);
  for (std::int64_t i = 0; i < iterations; ++i) {
    for (std::uint32_t& v : c) {
      const auto lo = static_cast<std::int16_t>(v & 0xffff), hi = static_cast<std::int16_t>(v >> 16);
      v += static_cast<std::uint32_t>(std::int32_t{lo} * 3 + std::int32_t{hi} * 3);
    }
  }
  std::uint32_t sum = 0;
  for (std::uint32_t v : c) sum += v;
  return static_cast<std::int32_t>(sum);
}
#else
std::int32_t Int16Chains(std::int64_t iterations) {
  const hn::ScalableTag<std::int32_t> di;
  const hn::Repartition<std::int16_t, decltype(di)> dw;
  const auto b = hn::Set(dw, std::int16_t{3});
  auto c0 = hn::Set(di, 0), c1 = hn::Set(di, 1), c2 = hn::Set(di, 2), c3 = hn::Set(di, 3);
  auto c4 = hn::Set(di, 4), c5 = hn::Set(di, 5), c6 = hn::Set(di, 6), c7 = hn::Set(di, 7);
  auto c8 = hn::Set(di, 8), c9 = hn::Set(di, 9);
  auto odd = hn::Zero(di);  // the second half of the accumulator, for targets that use one
  for (std::int64_t i = 0; i < iterations; ++i) {
    c0 = hn::ReorderWidenMulAccumulate(di, hn::BitCast(dw, c0), b, c0, odd);
    c1 = hn::ReorderWidenMulAccumulate(di, hn::BitCast(dw, c1), b, c1, odd);
    c2 = hn::ReorderWidenMulAccumulate(di, hn::BitCast(dw, c2), b, c2, odd);
    c3 = hn::ReorderWidenMulAccumulate(di, hn::BitCast(dw, c3), b, c3, odd);
    c4 = hn::ReorderWidenMulAccumulate(di, hn::BitCast(dw, c4), b, c4, odd);
    c5 = hn::ReorderWidenMulAccumulate(di, hn::BitCast(dw, c5), b, c5, odd);
    c6 = hn::ReorderWidenMulAccumulate(di, hn::BitCast(dw, c6), b, c6, odd);
    c7 = hn::ReorderWidenMulAccumulate(di, hn::BitCast(dw, c7), b, c7, odd);
    c8 = hn::ReorderWidenMulAccumulate(di, hn::BitCast(dw, c8), b, c8, odd);
    c9 = hn::ReorderWidenMulAccumulate(di, hn::BitCast(dw, c9), b, c9, odd);
  }
  const auto s = hn::Add(hn::Add(hn::Add(hn::Add(c0, c1), hn::Add(c2, c3)), odd),
                         hn::Add(hn::Add(hn::Add(c4, c5), hn::Add(c6, c7)), hn::Add(c8, c9)));
  // Summed as unsigned: the chains wrap by design, and GCC's int32 lane reduction (an intrinsic
  // written as C int additions) would be signed overflow, which UBSan reports.
  const hn::Rebind<std::uint32_t, decltype(di)> du;
  HWY_ALIGN std::uint32_t lanes[hn::MaxLanes(du)];
  hn::Store(hn::BitCast(du, s), du, lanes);
  std::uint32_t sum = 0;
  for (std::size_t i = 0; i < hn::Lanes(du); ++i) sum += lanes[i];
  return static_cast<std::int32_t>(sum);
}
#endif

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
#include "core/parallel.h"
#include "harness/peak.h"
#include "harness/thp_allocator.h"

namespace kallpa::harness {

HWY_EXPORT(FmaChains);
HWY_EXPORT(FloatLanes);
HWY_EXPORT(Int16Chains);
HWY_EXPORT(SumStream);

StreamRead stream_read(std::span<const std::span<const std::byte>> buffers, int max_threads) {
  // 1 MiB chunks: enough to stream, small enough to balance the threads.
  constexpr std::int64_t kChunkFloats = std::int64_t{1} << 18;
  struct Chunk {
    const float* data;
    std::int64_t count;
  };
  std::vector<Chunk> chunks;
  for (std::span<const std::byte> b : buffers) {
    const auto* f = reinterpret_cast<const float*>(b.data());
    const auto n = static_cast<std::int64_t>(b.size() / sizeof(float));
    for (std::int64_t i = 0; i < n; i += kChunkFloats) chunks.push_back({f + i, std::min(kChunkFloats, n - i)});
  }
  auto& pool = parallel::ThreadPool::global();
  std::vector<float> sink(static_cast<std::size_t>(pool.num_threads()), 0.0f);
  const auto start = std::chrono::steady_clock::now();
  pool.parallel_for(
      static_cast<std::int64_t>(chunks.size()),
      [&](std::int64_t c, int worker) {
        const Chunk& ch = chunks[static_cast<std::size_t>(c)];
        sink[static_cast<std::size_t>(worker)] += HWY_DYNAMIC_DISPATCH(SumStream)(ch.data, ch.count);
      },
      max_threads);
  StreamRead r;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (float s : sink) r.sum += s;
  return r;
}

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
  volatile float keep = sink[0];
  (void)keep;

  std::vector<std::int32_t> int_sink(static_cast<std::size_t>(peak.threads));
  // About 8 G ops per thread, as above: 10 vectors of 2 * lanes int16 products, 2 ops each.
  const std::int64_t int_iterations = 8'000'000'000 / (40 * lanes);
  best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    best = std::min(best, timed_on_threads(peak.threads, [&](int t) {
                      int_sink[static_cast<std::size_t>(t)] = HWY_DYNAMIC_DISPATCH(Int16Chains)(int_iterations);
                    }));
  }
  peak.int16_gops = double(int_iterations) * 10.0 * double(2 * lanes) * 2.0 * peak.threads / best / 1e9;
  volatile std::int32_t keep_int = int_sink[0];
  (void)keep_int;

  for (int name : {_SC_LEVEL3_CACHE_SIZE, _SC_LEVEL2_CACHE_SIZE}) {
    if (const long bytes = sysconf(name); bytes > 0) {
      peak.last_level_cache_bytes = bytes;
      break;
    }
  }

  // 512 MiB: far beyond any L3 we expect, so this is DRAM.
  const std::int64_t total = std::int64_t{128} << 20;
  // On huge pages, like the K/V of the attention benchmark (harness/thp_allocator.h).
  std::vector<float, ThpAllocator<float>> buffer(static_cast<std::size_t>(total), 1.0f);
  const std::span<const std::byte> bytes = std::as_bytes(std::span<const float>(buffer));
  best = 1e30;
  for (int rep = 0; rep < 3; ++rep) best = std::min(best, stream_read({&bytes, 1}, peak.threads).seconds);
  peak.dram_read_gbps = static_cast<double>(bytes.size()) / best / 1e9;
  return peak;
}

}  // namespace kallpa::harness
#endif  // HWY_ONCE
