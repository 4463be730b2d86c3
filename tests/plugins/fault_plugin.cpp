// Fault-injection plugins for the tests: the example's naive attention behind the plugin ABI, with
// one fault compiled in (KALLPA_FAULT). Each one is a way a kernel from elsewhere goes wrong:
//
//   offby        every output row is off by 1e-3 in its first element (a subtly wrong kernel)
//   decode       drops the newest key when a sequence has one query (wrong for one shape only)
//   error        run() returns an error
//   nan          writes NaN into every row's first element
//   throw        run() throws a C++ exception across the C boundary
//   old-minor    correct, but built for ABI 1.0: its table ends before 1.1's description
//   wrong-major  declares ABI major 2
//   init-error   the entry point fails (no device) and returns NULL with a reason
//   good         correct, high priority (the control)
//   slow         correct, 25 ms late per call
//
// The rogues' gallery: faults an isolated plugin (plugin.h) must survive, each one costing only the
// plugin host's process:
//   segv         writes through a wild pointer (SIGSEGV)
//   abort        calls abort() (SIGABRT), as a failed assertion does
//   hang         never returns from run()
//   oob          writes the 16 bytes just past the end of o (its own output buffer)
//   leak         keeps 32 MiB of touched heap per call, never freed
//   liar         says yes to every signature in supports(), and ignores softcap and ALiBi in run()
//   large        right up to 4,096 keys per sequence, wrong beyond (an overflow the canaries never
//                reach): every row's first element is off by 0.25 when a sequence has more keys
//   flaky        wrong on one call in three (a race in a kernel), the same 0.25 off
//
// The run-time faults (error, nan, throw and the rogues but liar and large) start after KALLPA_FAULT_AFTER
// successful calls (default 0), so a test can let a plugin pass its health check and break after.
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <thread>
#include <vector>

#include "kallpa/plugin_abi.h"
#include "naive_attention.h"

#define KALLPA_FAULT_OFFBY 1
#define KALLPA_FAULT_DECODE 2
#define KALLPA_FAULT_ERROR 3
#define KALLPA_FAULT_NAN 4
#define KALLPA_FAULT_THROW 5
#define KALLPA_FAULT_OLD_MINOR 6
#define KALLPA_FAULT_WRONG_MAJOR 7
#define KALLPA_FAULT_INIT_ERROR 8
#define KALLPA_FAULT_GOOD 9
#define KALLPA_FAULT_SLOW 10
#define KALLPA_FAULT_SEGV 11
#define KALLPA_FAULT_ABORT 12
#define KALLPA_FAULT_HANG 13
#define KALLPA_FAULT_OOB 14
#define KALLPA_FAULT_LEAK 15
#define KALLPA_FAULT_LIAR 16
#define KALLPA_FAULT_LARGE 17
#define KALLPA_FAULT_FLAKY 18

#ifndef KALLPA_FAULT
#error "define KALLPA_FAULT"
#endif
#define KALLPA_FAULT_SLOW_MS 25

namespace {

std::atomic<long> g_calls{0};
long g_fault_after = 0;

[[maybe_unused]] bool faulting() { return g_calls.fetch_add(1) >= g_fault_after; }

// Sets element 0 of every (row, head) of o to f(old value).
template <typename F>
void for_each_row_head(const kallpa_problem* p, F&& f) {
  const int orank = p->o.rank;
  const std::int64_t o_hs = p->o.stride[orank - 2];
  for (std::int32_t b = 0; b < p->batch; ++b) {
    for (std::int64_t i = 0; i < naive_seqlen_q(p, b); ++i) {
      for (std::int64_t h = 0; h < p->signature->hq; ++h) {
        const std::int64_t at = naive_o_row(p, b, i) + h * o_hs;
        naive_store(&p->o, at, f(naive_load(&p->o, at)));
      }
    }
  }
}

[[maybe_unused]] std::vector<void*> g_leaked;

std::int32_t supports(void*, const kallpa_signature* s, char* why_not, std::size_t capacity) {
#if KALLPA_FAULT == KALLPA_FAULT_LIAR
  (void)s;
  (void)why_not;
  (void)capacity;
  return 1;
#endif
  if (s->device_kind != KALLPA_DEVICE_CPU) {
    std::snprintf(why_not, capacity, "host memory only");
    return 0;
  }
  return 1;
}

std::size_t workspace(void*, const kallpa_problem* p) { return naive_workspace_size(p); }

std::int32_t run(void*, const kallpa_problem* p, void* ws, std::size_t ws_bytes, char* error, std::size_t capacity) {
#if KALLPA_FAULT == KALLPA_FAULT_DECODE
  // The off-by-one a decode fast path might have: a sequence with one query loses its newest key
  // (computed as the same sequence one key shorter). Paged and dense KV only.
  kallpa_problem shorter = *p;
  std::vector<std::int32_t> seqlens;
  if (p->signature->kv_layout == KALLPA_KV_PAGED) {
    seqlens.assign(p->seqlens_k, p->seqlens_k + p->batch);
    for (std::int32_t b = 0; b < p->batch; ++b) {
      if (naive_seqlen_q(p, b) == 1 && seqlens[static_cast<std::size_t>(b)] > 1) --seqlens[static_cast<std::size_t>(b)];
    }
    shorter.seqlens_k = seqlens.data();
  } else if (p->signature->kv_layout == KALLPA_KV_DENSE && p->signature->q_layout == KALLPA_Q_DENSE &&
             p->q.shape[1] == 1 && p->k.shape[1] > 1) {
    shorter.k.shape[1] -= 1;
    shorter.v.shape[1] -= 1;
  }
  p = &shorter;
#elif KALLPA_FAULT == KALLPA_FAULT_LIAR
  // Claimed every feature; quietly drops the two it never implemented.
  kallpa_problem plain = *p;
  plain.softcap = 0.0f;
  plain.alibi_slopes = nullptr;
  p = &plain;
#endif
  const std::int32_t rc = naive_attention(p, ws, ws_bytes, error, capacity);
  if (rc != KALLPA_PLUGIN_OK) return rc;
#if KALLPA_FAULT == KALLPA_FAULT_OFFBY
  for_each_row_head(p, [](float x) { return x + 1e-3f; });
#elif KALLPA_FAULT == KALLPA_FAULT_ERROR
  if (faulting()) {
    std::snprintf(error, capacity, "injected failure: device lost");
    return KALLPA_PLUGIN_BACKEND_FAILURE;
  }
#elif KALLPA_FAULT == KALLPA_FAULT_NAN
  if (faulting()) for_each_row_head(p, [](float) { return std::numeric_limits<float>::quiet_NaN(); });
#elif KALLPA_FAULT == KALLPA_FAULT_THROW
  if (faulting()) throw std::runtime_error("injected exception from a C++ plugin");
#elif KALLPA_FAULT == KALLPA_FAULT_SLOW
  // Right, only late: a hung driver or a throttled device. Not a fault the dispatcher may act on
  // (slowness is no reason to serve from another backend); it must show in the latency stats.
  if (faulting()) std::this_thread::sleep_for(std::chrono::milliseconds(KALLPA_FAULT_SLOW_MS));
#elif KALLPA_FAULT == KALLPA_FAULT_SEGV
  if (faulting()) {
    volatile std::uintptr_t address = 64;  // volatile: a pointer the compiler cannot see through
    *reinterpret_cast<volatile int*>(address) = 1;
  }
#elif KALLPA_FAULT == KALLPA_FAULT_ABORT
  if (faulting()) std::abort();
#elif KALLPA_FAULT == KALLPA_FAULT_HANG
  if (faulting()) {
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  }
#elif KALLPA_FAULT == KALLPA_FAULT_OOB
  if (faulting()) {
    // The byte just past o's last element, and the 15 after it.
    std::int64_t last = 0;
    for (int d = 0; d < p->o.rank; ++d) last += (p->o.shape[d] - 1) * p->o.stride[d];
    const std::size_t element = p->o.dtype == KALLPA_DTYPE_F32 ? 4 : 2;
    volatile unsigned char* past =
        static_cast<unsigned char*>(p->o.data) + (last + 1) * static_cast<std::int64_t>(element);
    for (int i = 0; i < 16; ++i) past[i] = 0xff;
  }
#elif KALLPA_FAULT == KALLPA_FAULT_LARGE
  bool large = false;
  for (std::int32_t b = 0; b < p->batch; ++b) large = large || naive_seqlen_k(p, b) > 4096;
  if (large) for_each_row_head(p, [](float x) { return x + 0.25f; });
#elif KALLPA_FAULT == KALLPA_FAULT_FLAKY
  if (faulting() && (g_calls.load() - g_fault_after) % 3 == 0) for_each_row_head(p, [](float x) { return x + 0.25f; });
#elif KALLPA_FAULT == KALLPA_FAULT_LEAK
  if (faulting()) {
    constexpr std::size_t kLeak = std::size_t{32} << 20;
    void* block = std::malloc(kLeak);
    if (block != nullptr) std::memset(block, 0x5a, kLeak);
    g_leaked.push_back(block);
  }
#endif
  return KALLPA_PLUGIN_OK;
}

}  // namespace

namespace {

#if KALLPA_FAULT == KALLPA_FAULT_OLD_MINOR
// The table exactly as ABI 1.0 defined it: kallpa must not read past its end.
struct TableV1_0 {
  std::size_t struct_size;
  std::uint32_t abi_major, abi_minor;
  const char* name;
  const char* version;
  std::int32_t device_kind, priority;
  void* state;
  std::int32_t (*supports)(void*, const kallpa_signature*, char*, std::size_t);
  std::size_t (*workspace_size)(void*, const kallpa_problem*);
  std::int32_t (*run)(void*, const kallpa_problem*, void*, std::size_t, char*, std::size_t);
  void (*destroy)(void*);
};
static_assert(sizeof(TableV1_0) == KALLPA_PLUGIN_TABLE_SIZE_1_0);
const TableV1_0 kTable = {
    sizeof(TableV1_0), 1,   0,      KALLPA_FAULT_NAME, "1.0.0", KALLPA_DEVICE_CPU, 1000, nullptr, supports,
    workspace,         run, nullptr};
#else
int g_destroyed = 0;
void destroy(void*) { ++g_destroyed; }
#if KALLPA_FAULT == KALLPA_FAULT_WRONG_MAJOR
constexpr auto kAbiMajor = KALLPA_PLUGIN_ABI_MAJOR + 1;
#else
constexpr auto kAbiMajor = KALLPA_PLUGIN_ABI_MAJOR;
#endif
const kallpa_plugin_table kTable = {sizeof(kallpa_plugin_table),
                                    kAbiMajor,
                                    KALLPA_PLUGIN_ABI_MINOR,
                                    KALLPA_FAULT_NAME,
                                    "1.0.0",
                                    KALLPA_DEVICE_CPU,
                                    1000,
                                    nullptr,
                                    supports,
                                    workspace,
                                    run,
                                    destroy,
                                    "fault-injection test plugin (tests/plugins/fault_plugin.cpp)"};
#endif

}  // namespace

extern "C" KALLPA_PLUGIN_EXPORT const kallpa_plugin_table* kallpa_attention_plugin_init(const kallpa_plugin_host* host,
                                                                                        char* error,
                                                                                        std::size_t capacity) {
  if (host->abi_major != KALLPA_PLUGIN_ABI_MAJOR) return nullptr;
  // Each load starts counting afresh (the library may stay mapped between loads).
  const char* after = std::getenv("KALLPA_FAULT_AFTER");
  g_fault_after = after != nullptr ? std::atol(after) : 0;
  g_calls = 0;
#if KALLPA_FAULT == KALLPA_FAULT_INIT_ERROR
  std::snprintf(error, capacity, "no accelerator found (injected initialisation failure)");
  return nullptr;
#else
  (void)error;
  (void)capacity;
  return reinterpret_cast<const kallpa_plugin_table*>(&kTable);
#endif
}
