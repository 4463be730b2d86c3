// An allocator for the benchmark's big buffers (K/V, the DRAM bandwidth probe): 2 MiB-aligned
// and advised for transparent huge pages, as the engine's KV cache is (src/ops/huge_buffer.h).
// Without the advice a machine in THP `madvise` mode maps them with 4 KiB pages, which costs
// streaming kernels a TLB miss every 4 KiB and stops the hardware prefetchers at every page
// boundary: decode attention would be measured slower than the engine runs it.
// KALLPA_BENCH_HUGE_PAGES=0 advises against huge pages instead, to measure the difference.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <new>

namespace kallpa::harness {

inline bool bench_huge_pages() noexcept {
  const char* env = std::getenv("KALLPA_BENCH_HUGE_PAGES");
  return env == nullptr || std::strcmp(env, "0") != 0;
}

template <typename T>
struct ThpAllocator {
  using value_type = T;
  static constexpr std::size_t kHuge = std::size_t{2} << 20;

  ThpAllocator() noexcept = default;
  template <typename U>
  ThpAllocator(const ThpAllocator<U>&) noexcept {}

  T* allocate(std::size_t n) {
    const std::size_t bytes = n * sizeof(T);
    if (bytes < kHuge) {  // small buffers: the heap, as before
      if (void* p = std::malloc(bytes == 0 ? 1 : bytes)) return static_cast<T*>(p);
      throw std::bad_alloc();
    }
    const std::size_t rounded = (bytes + kHuge - 1) / kHuge * kHuge;
    void* p = std::aligned_alloc(kHuge, rounded);
    if (p == nullptr) throw std::bad_alloc();
    // Advice only: where THP is off, the buffer simply keeps 4 KiB pages.
    (void)madvise(p, rounded, bench_huge_pages() ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t) noexcept { std::free(p); }

  template <typename U>
  bool operator==(const ThpAllocator<U>&) const noexcept {
    return true;
  }
};

}  // namespace kallpa::harness
