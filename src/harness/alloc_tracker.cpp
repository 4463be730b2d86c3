// Replaces the global operator new/delete of any program that links the harness. Sizes come from
// malloc_usable_size on both sides, so the count stays consistent whatever form of delete runs.
#include "harness/alloc_tracker.h"

#include <malloc.h>

#include <atomic>
#include <cstdlib>
#include <new>

namespace kallpa::harness {
namespace {
std::atomic<std::size_t> g_in_use{0};
std::atomic<std::size_t> g_peak{0};

void note_alloc(void* p) noexcept {
  const std::size_t now = g_in_use.fetch_add(malloc_usable_size(p), std::memory_order_relaxed) + malloc_usable_size(p);
  std::size_t peak = g_peak.load(std::memory_order_relaxed);
  while (now > peak && !g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}
void note_free(void* p) noexcept {
  if (p) g_in_use.fetch_sub(malloc_usable_size(p), std::memory_order_relaxed);
}
void* allocate(std::size_t n, std::size_t align) {
  if (n == 0) n = 1;
  void* p =
      align > alignof(std::max_align_t) ? std::aligned_alloc(align, (n + align - 1) / align * align) : std::malloc(n);
  if (!p) throw std::bad_alloc();
  note_alloc(p);
  return p;
}
}  // namespace

std::size_t heap_bytes_in_use() noexcept { return g_in_use.load(std::memory_order_relaxed); }
void reset_heap_peak() noexcept { g_peak.store(g_in_use.load(std::memory_order_relaxed), std::memory_order_relaxed); }
std::size_t heap_peak_bytes() noexcept { return g_peak.load(std::memory_order_relaxed); }

}  // namespace kallpa::harness

void* operator new(std::size_t n) { return kallpa::harness::allocate(n, 0); }
void* operator new[](std::size_t n) { return kallpa::harness::allocate(n, 0); }
void* operator new(std::size_t n, std::align_val_t a) {
  return kallpa::harness::allocate(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a) {
  return kallpa::harness::allocate(n, static_cast<std::size_t>(a));
}
// The nothrow forms too: a library that allocates with them (std::stable_sort's buffer) would
// otherwise free through ours memory it got from the default allocator.
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return kallpa::harness::allocate(n, 0);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t n, const std::nothrow_t& t) noexcept { return operator new(n, t); }
void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  try {
    return kallpa::harness::allocate(n, static_cast<std::size_t>(a));
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t n, std::align_val_t a, const std::nothrow_t& t) noexcept {
  return operator new(n, a, t);
}
void operator delete(void* p, const std::nothrow_t&) noexcept {
  kallpa::harness::note_free(p);
  std::free(p);
}
void operator delete[](void* p, const std::nothrow_t&) noexcept {
  kallpa::harness::note_free(p);
  std::free(p);
}
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept {
  kallpa::harness::note_free(p);
  std::free(p);
}
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept {
  kallpa::harness::note_free(p);
  std::free(p);
}
void operator delete(void* p) noexcept {
  kallpa::harness::note_free(p);
  std::free(p);
}
void operator delete[](void* p) noexcept {
  kallpa::harness::note_free(p);
  std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
  kallpa::harness::note_free(p);
  std::free(p);
}
void operator delete[](void* p, std::size_t) noexcept {
  kallpa::harness::note_free(p);
  std::free(p);
}
void operator delete(void* p, std::align_val_t) noexcept {
  kallpa::harness::note_free(p);
  std::free(p);
}
void operator delete[](void* p, std::align_val_t) noexcept {
  kallpa::harness::note_free(p);
  std::free(p);
}
void operator delete(void* p, std::size_t, std::align_val_t) noexcept {
  kallpa::harness::note_free(p);
  std::free(p);
}
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept {
  kallpa::harness::note_free(p);
  std::free(p);
}
