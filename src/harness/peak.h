// The machine's own ceilings, measured rather than looked up, so that every benchmark figure can
// be given as a fraction of what this machine can do.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace kallpa::harness {

struct MachinePeak {
  int threads = 1;
  double fma_gflops = 0.0;      // f32 fused multiply-add throughput, all threads
  double int16_gops = 0.0;      // int16 x int16 -> int32 multiply-accumulate (2 ops each), all threads
  double dram_read_gbps = 0.0;  // streaming reads of a buffer far larger than the caches
  // The largest data cache the OS reports (L3, else L2; 0: unknown). A decode whose K/V fits in it
  // reads (some of) it from cache on repeated calls, so its GB/s is not a DRAM figure.
  std::int64_t last_level_cache_bytes = 0;
  std::string simd_target;  // the Highway target that ran, e.g. "AVX2" or "AVX3"
};

// Takes about a second. `threads` <= 0 means the default thread count.
MachinePeak measure_peak(int threads);

// Reads every byte of `buffers` once as floats (a plain streaming sum, the least work a kernel
// reading them can do; a trailing part of a float is skipped), in chunks over kallpa's thread pool
// (the one the CPU kernels use), at most max_threads threads (0: all). Timed next to a kernel on
// the same bytes, it gives that kernel's fraction of the bandwidth available at that moment; the
// DRAM peak is its best of three on a buffer far beyond the caches.
struct StreamRead {
  double seconds = 0.0;
  double sum = 0.0;  // of every float read: what was read, and what keeps the reads from being elided
};
StreamRead stream_read(std::span<const std::span<const std::byte>> buffers, int max_threads);

}  // namespace kallpa::harness
