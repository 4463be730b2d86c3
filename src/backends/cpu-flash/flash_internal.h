// Internals of cpu-flash shared by the driver (cpu_flash.cpp) and the SIMD kernels
// (flash_kernels.cpp). Not a public header.
#pragma once

#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "backends/cpu-flash/cpu_flash.h"
#include "kallpa/attention.h"

namespace kallpa::cpu_flash {

inline constexpr std::int64_t kKeyTile = 128;   // keys per tile
inline constexpr std::int64_t kRowTarget = 128; // query rows (positions x heads) per task
inline constexpr std::int64_t kAlign = 16;      // floats; rows and head dims pad to this
inline constexpr std::int64_t kMaxFastHeadDim = 1024;

inline constexpr std::int64_t round_up(std::int64_t x, std::int64_t m) { return (x + m - 1) / m * m; }

// One unit of work: query heads [kvh*G + h0, +nh) x query positions [i0, i0+ni) of sequence b,
// against the keys [k_begin, k_end) (already the visible union of those rows, or a split of it).
struct Task {
  std::int32_t b = 0;
  std::int32_t kvh = 0;
  std::int32_t h0 = 0;
  std::int32_t nh = 0;
  std::int64_t i0 = 0;
  std::int64_t ni = 0;
  std::int64_t k_begin = 0;
  std::int64_t k_end = 0;
  std::int64_t partial = -1;  // -1: write o/lse; else the partial-result slot for a split
  double cost = 0.0;
};

// The splits of one query tile, merged after all its split tasks ran.
struct Combine {
  Task rows;  // b, kvh, h0, nh, i0, ni
  std::int64_t first_partial = 0;
  std::int32_t splits = 0;
};

struct Plan {
  std::vector<Task> tasks;  // heaviest first
  std::vector<Combine> combines;
  std::int64_t rows_max = 0;  // max rows (nh * ni) of any task
  std::int64_t n_partials = 0;
  std::size_t worker_bytes = 0;   // scratch per worker
  std::size_t partial_bytes = 0;  // one partial slot: m[rows_max], l[rows_max], o[rows_max * dv]

  std::size_t workspace_bytes(int threads) const {
    return static_cast<std::size_t>(threads) * worker_bytes +
           static_cast<std::size_t>(n_partials) * partial_bytes + 64;
  }
};

// A row stride (floats) of at least n whose length in 64-byte lines is odd: the rows of a tile then
// fall into every set of the L1 cache. With a power-of-two stride (128 floats = 512 bytes) a
// 128-row column strip maps to an eighth of the sets and is evicted before its reuse.
inline constexpr std::int64_t conflict_free_stride(std::int64_t n) {
  const std::int64_t s = round_up(n, 16);
  return (s / 16) % 2 == 0 ? s + 16 : s;
}

// Per-worker scratch, byte offsets (each 64-aligned). Rp, Dp, Dvp: rows, D, Dv padded to kAlign;
// rs, ks, vs: the conflict-free row strides of q^T/S/o^T, the key tile and the value tile (the v2
// rows kernel uses Rp, Dp, Dvp as strides, which fit in the same buffers).
struct ScratchLayout {
  std::int64_t rp = 0, dp = 0, dvp = 0;
  std::int64_t rs = 0, ks = 0, vs = 0;
  std::size_t q = 0;      // rows kernel: q^T [D][Rp]; decode kernel: q [R][Dp] (scaled)
  std::size_t s = 0;      // rows kernel: scores [Nk][Rp]; decode kernel: [R][Nk]
  std::size_t o = 0;      // rows kernel: o^T [Dv][Rp]; decode kernel: o [R][Dvp]
  std::size_t k = 0;      // key tile, f32 [Nk][Dp]
  std::size_t v = 0;      // value tile, f32 [Nk][Dvp]
  std::size_t m = 0, l = 0, slope = 0, posf = 0, alpha = 0;  // f32 [Rp]
  std::size_t lo = 0, hi = 0;                     // int32 [Rp]: visible keys per row
  std::size_t total = 0;
};

inline ScratchLayout scratch_layout(std::int64_t rows_max, std::int64_t d, std::int64_t dv) {
  ScratchLayout L;
  L.rp = round_up(rows_max < 1 ? 1 : rows_max, kAlign);
  L.dp = round_up(d, kAlign);
  L.dvp = round_up(dv, kAlign);
  L.rs = conflict_free_stride(L.rp);
  L.ks = conflict_free_stride(L.dp);
  L.vs = conflict_free_stride(L.dvp);
  std::size_t at = 0;
  auto take = [&](std::int64_t elems) {
    const std::size_t off = at;
    at += static_cast<std::size_t>(round_up(elems * 4, 64));
    return off;
  };
  L.q = take(L.rs * L.dp);
  L.s = take(kKeyTile * L.rs);
  L.o = take(L.rs * L.dvp);
  L.k = take(kKeyTile * L.ks);
  L.v = take(kKeyTile * L.vs);
  L.alpha = take(L.rp);
  L.m = take(L.rp);
  L.l = take(L.rp);
  L.slope = take(L.rp);
  L.posf = take(L.rp);
  L.lo = take(L.rp);
  L.hi = take(L.rp);
  L.total = at;
  return L;
}

// Shape-only (never thread-count dependent), so results do not depend on the number of threads.
Plan make_plan(const ValidatedProblem& problem);

// Runs one task of the fast path. `scratch` is worker_bytes, 64-aligned; `partial` is the task's
// partial slot (null when the task writes o/lse directly).
void run_fast_task(const ValidatedProblem& problem, const Plan& plan, const Task& task, void* scratch,
                   float* partial, PrefillKernel kernel);
// ---------------------------------------------------------------------------------------------
// Decode path (few query rows per KV head, long KV): one task is a chunk of keys of one sequence
// against every query row of that sequence, all KV heads. The chunk streams K/V in memory order
// (every head of a key row is used while it is in cache) and each chunk of a split sequence writes
// a partial (m, l, o) that the last chunk to finish merges, so one parallel_for does everything.

inline constexpr std::int64_t kDecodeMaxRows = 16;   // query rows per KV head (Sq * group) at most
inline constexpr std::int64_t kDecodeBlock = 32;     // keys per block inside a chunk
inline constexpr std::int64_t kDecodeMinChunk = 256; // keys
inline constexpr std::int64_t kDecodeMaxChunk = 8192;
inline constexpr std::int64_t kDecodeChunksTarget = 16;  // chunks for the whole call, if long enough
// While the call's K/V are cache resident, v4 (direct, head by head) needs the fewest instructions
// (v5 spends about 1.6x as many on its prefetches and four-key steps: callgrind, 32/8 and 9/3
// heads, D64, 512 keys); streamed from DRAM, v5's single forward stream per tensor and thread
// keeps the memory busy (1.3-1.8x v3/v4 side by side at 256 MiB; bench/cpu_flash_bench.cpp).
// Whether a call's K/V is resident depends on what ran before it, not on its size: in a model,
// each layer's cache is read once per token after every other layer's, so beyond one core's L2 it
// comes from L3 or DRAM. Hence v4 only up to 1 MiB: SmolLM2 at 2048 tokens (1.5 MiB per layer)
// decodes 1.2x faster end to end with v5 (kallpa bench model -d 2048, side by side), although a
// benchmark repeating one call on hot 4 MiB favours v4 (0.33 vs 0.43 ms, 32/8 D64).
inline constexpr double kDecodeDirectMaxBytes = 1.0 * 1024 * 1024;
inline constexpr DecodeKernel kDecodeAutoInCache = DecodeKernel::direct;
// Beyond that, v8. It needs 8-13% fewer instructions than v7 on every bench shape (callgrind,
// 512 keys: f16/bf16, 32/8, 8/8 and 9/3 heads, D64/D128), and from DRAM it was ahead or even in
// alternating runs (session 8, kallpa bench attention with KALLPA_CPU_FLASH_DECODE=v7|v8: median
// v8/v7 1.02-1.17 on SmolLM2's 9/3 paged shape, ahead in all six pairs; 0.92-1.59 elsewhere; the
// engine's tg64 @ d2048 1.02-1.20x). v7, which beat v5/v6 (0.54-1.00x v5's time on 25 of 26 cases
// of 4096 and 32768 keys; 0.81-1.06x v6's from DRAM), stays selectable, as do v5 and v6. Up to
// 1 MiB v4 stays: there v7/v4 is within the noise (0.66-1.18) and v4 needs fewer instructions for
// groups of 1 and 3 (callgrind, 512 keys: 324k vs 421k for 8/8 D128, 168k vs 204k for 9/3 D64).
inline constexpr DecodeKernel kDecodeAutoStreamed = DecodeKernel::grouped8;
// v5: keys each stream (K, V) is prefetched ahead of its reader, into L2.
inline constexpr std::int64_t kDecodeStreamPrefetchKeys = 16;
// v6: keys per step of the walk over a block (across every KV head); eight measured slower. Its
// prefetch distance is v5's.
inline constexpr std::int64_t kDecodeFusedStep = 4;
// v7: keys per block (the softmax's per-row work is paid once a block) and the prefetch distance
// of its K and V streams in keys. Eight against 16: 1.89-2.01x against 2.25-2.29x the time of a
// plain read of the same bytes (32/8 D64 from DRAM, alternating runs; no difference for 8/8 D128;
// no prefetch: 3.8x).
inline constexpr std::int64_t kDecodeGroupedBlock = 64;
inline constexpr std::int64_t kDecodeGroupedPrefetchKeys = 8;
// v7-v9 on AMD: eight keys are too few there. On a 2-core Zen 4 (EPYC, session 21, kallpa bench
// attention -b cpu-flash -t 2 --spec ..., KALLPA_CPU_FLASH_PREFETCH=N): 32/8 D64 f16 at 524288
// keys took 54 ms at 8 keys, 37-38 ms anywhere from 16 to 64 (78-85% of a plain read of the same
// bytes while the host's DRAM gave 33-35 GB/s, 45-48% while it gave 58-60); 8/8 D128 at 262144
// keys 38.6-43.9 ms at 8 against 34.4-35.5 at 24 (alternated), 52 at 64; SmolLM2's paged 9/3 shape
// 1.15-1.4x faster at 24 for 16384 and 1048576 keys. The Xeon's eight stays for every other CPU.
inline constexpr std::int64_t kDecodeGroupedPrefetchKeysAmd = 24;

// Whether this runs on an AMD CPU (read once), for the defaults measured there.
inline bool cpu_is_amd() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool amd = __builtin_cpu_is("amd");
  return amd;
#else
  return false;
#endif
}

// The grouped kernels' prefetch distance in keys for the CPU this runs on (before
// KALLPA_CPU_FLASH_PREFETCH overrides it).
inline std::int64_t grouped_prefetch_keys() {
  return cpu_is_amd() ? kDecodeGroupedPrefetchKeysAmd : kDecodeGroupedPrefetchKeys;
}

struct DecodeTask {
  std::int32_t b = 0;
  std::int32_t chunk = 0;   // index within the sequence
  std::int32_t chunks = 1;  // chunks of the sequence; 1: the task writes o/lse itself
  std::int64_t k_begin = 0, k_end = 0;
  std::int64_t first_slot = 0;  // partial slot of chunk 0 of this sequence (chunks > 1)
  std::int32_t counter = -1;    // index of the sequence's completion counter (chunks > 1)
};

struct DecodePlan {
  std::vector<DecodeTask> tasks;  // longest first
  std::int64_t rows_max = 0;      // max over sequences of Sq_b * Hq
  std::int64_t n_slots = 0;
  std::int64_t n_counters = 0;
  std::size_t worker_bytes = 0;
  std::size_t slot_bytes = 0;     // m[rows_max], l[rows_max], o[rows_max][Dv]
  double kv_bytes = 0.0;          // K/V bytes the call reads
  bool short_steps = false;       // decode v9 / v10 on AVX-512: steps of 8 keys (set by the caller)

  std::size_t workspace_bytes(int threads) const {
    return static_cast<std::size_t>(threads) * worker_bytes + static_cast<std::size_t>(n_slots) * slot_bytes +
           static_cast<std::size_t>(round_up(n_counters * 4, 64)) + 64;
  }
};

// Per-worker scratch of the decode path, byte offsets (each 64-aligned).
struct DecodeLayout {
  std::int64_t dp = 0, dvp = 0;
  std::size_t q = 0;     // f32 [rows][Dp], scaled; rows ordered (kvh, i, g)
  std::size_t acc = 0;   // f32 [rows][Dvp]
  std::size_t m = 0, l = 0;  // f32 [rows]
  std::size_t s = 0;     // f32 [kDecodeMaxRows][kDecodeBlock]
  std::size_t s_all = 0; // f32 [rows][kDecodeBlock] (v5, v6: the scores of every head of a block;
                         // v7: [rows][kDecodeGroupedBlock])
  std::size_t k = 0;     // f32 [kDecodeBlock][Dp]
  std::size_t v = 0;     // f32 [kDecodeBlock][Dvp]
  std::size_t koff = 0, voff = 0;  // int64 [2][kDecodeBlock]: row offsets of this and the next block
                                   // (v7: [kDecodeGroupedBlock] of this block)
  std::size_t total = 0;
};

static_assert(2 * kDecodeBlock >= kDecodeGroupedBlock, "v7's row offsets fit in the offset tables");

inline DecodeLayout decode_layout(std::int64_t rows_max, std::int64_t d, std::int64_t dv) {
  DecodeLayout L;
  L.dp = round_up(d, kAlign);
  L.dvp = round_up(dv, kAlign);
  std::size_t at = 0;
  auto take = [&](std::int64_t bytes) {
    const std::size_t off = at;
    at += static_cast<std::size_t>(round_up(bytes, 64));
    return off;
  };
  const std::int64_t rows = rows_max < 1 ? 1 : rows_max;
  L.q = take(rows * L.dp * 4);
  L.acc = take(rows * L.dvp * 4);
  L.m = take(rows * 4);
  L.l = take(rows * 4);
  L.s = take(kDecodeMaxRows * kDecodeBlock * 4);
  L.s_all = take(rows * std::max(kDecodeBlock, kDecodeGroupedBlock) * 4);
  L.k = take(kDecodeBlock * L.dp * 4);
  L.v = take(kDecodeBlock * L.dvp * 4);
  L.koff = take(2 * kDecodeBlock * 8);
  L.voff = take(2 * kDecodeBlock * 8);
  L.total = at;
  return L;
}

bool decode_applicable(const ValidatedProblem& problem) noexcept;
DecodePlan make_decode_plan(const ValidatedProblem& problem);
// Runs one chunk. `slots` and `counters` are the call's partial slots and completion counters
// (zeroed before the parallel_for); the last chunk of a split sequence merges and writes o/lse.
// kernel: staged, direct or stream (direct and stream read K/V in place when the layout allows,
// else they convert each block to f32 first, as staged does).
void run_decode_task(const ValidatedProblem& problem, const DecodePlan& plan, const DecodeTask& task,
                     void* scratch, std::byte* slots, std::int32_t* counters, DecodeKernel kernel);
// The same for decode v7 (decode_v7.cpp); layouts it cannot read in place run v6.
void run_decode_task_v7(const ValidatedProblem& problem, const DecodePlan& plan, const DecodeTask& task,
                        void* scratch, std::byte* slots, std::int32_t* counters);
// The same for decode v8 (decode_v8.cpp); layouts it cannot read in place run v6.
void run_decode_task_v8(const ValidatedProblem& problem, const DecodePlan& plan, const DecodeTask& task,
                        void* scratch, std::byte* slots, std::int32_t* counters);
// The same for decode v9 (decode_v9.cpp); layouts it cannot read in place run v6.
void run_decode_task_v9(const ValidatedProblem& problem, const DecodePlan& plan, const DecodeTask& task,
                        void* scratch, std::byte* slots, std::int32_t* counters);
// The same for decode v10 (decode_v9.cpp: v9 with its dots on 256-bit halves on AVX-512).
void run_decode_task_v10(const ValidatedProblem& problem, const DecodePlan& plan, const DecodeTask& task,
                         void* scratch, std::byte* slots, std::int32_t* counters);
// Keys per step of decode v9 on the SIMD target in use (its float lanes: 16 on AVX-512).
int decode_v9_step_keys();

// The L1 data cache that decode_short_steps assumes: 64 sets of 64-byte lines (32 KiB 8-way on
// Zen 4 and Skylake, 48 KiB 12-way on Golden Cove).
inline constexpr std::int64_t kL1Sets = 64;
inline constexpr std::int64_t kL1LineBytes = 64;
// Most distinct lines in one L1 set among `keys` rows of `bytes` bytes, `stride` bytes apart (rows
// that overlap, as with stride 0, share their lines).
inline int step_lines_per_set(std::int64_t stride, std::int64_t bytes, std::int64_t keys) {
  int count[kL1Sets] = {};
  int most = 0;
  stride = stride < 0 ? -stride : stride;
  std::int64_t seen = -1;  // the highest line counted: rows go up, so a shared line is never above it
  for (std::int64_t j = 0; j < keys; ++j) {
    const std::int64_t first = j * stride / kL1LineBytes, last = (j * stride + bytes - 1) / kL1LineBytes;
    for (std::int64_t line = std::max(first, seen + 1); line <= last; ++line)
      most = std::max(most, ++count[line % kL1Sets]);
    seen = std::max(seen, last);
  }
  return most;
}

// Whether decode v9 / v10 on AVX-512 walk K/V in steps of 8 keys instead of 16: when the call
// reads more than kDecodeShortStepsMinBytes of K/V (kv_bytes) and one head's rows of a 16-key step
// put more than two lines into one L1 set (a quarter of its ways; four for MHA, whose short steps
// run narrower passes), as K/V rows 1 or 2 KiB apart do (8 KV heads of D64 or D128 f16). A step's
// rows are read head by head, so they must stay in L1 until every head is done; crowded sets
// evict them. 2-core Zen 4 EPYC, session 23, kallpa bench attention -b cpu-flash -t 2 --spec
// b=1,sq=1,skv=N,hq=H,hkv=8,d=D,dtype=T with KALLPA_CPU_FLASH_STEP=16|8, alternated, ms:
//   from DRAM: 32/8 D128 bf16, 262144 keys (1 GiB) 47.2-52.4 vs 36.3-38.5; 32/8 D64 f16, 524288
//   keys 36.4-37.4 vs 34.3-36.0; 8/8 D128 f16, 262144 keys 30.3-32.4 vs 25.3 (42.5 vs 36.5 while
//   the host's DRAM was in its slow phase); 8/8 D64 f16, 524288 keys (4 lines a set) 22.1-23.8
//   vs 23.4-24.9, so MHA keeps 16 there; rows 384 bytes apart (SmolLM2's 3 KV heads of D64 f16,
//   paged page=16, 1048576 keys, one line a set) even, 34.1-38.5 vs 34.4-36.3.
//   in cache, 32/8 D64 f16: 1024 keys (2 MiB) 0.063 vs 0.066-0.067, 4096 (8 MiB) 0.249-0.293 vs
//   0.260-0.303, 8192 and 16384 mixed (0.504-0.540 vs 0.510-0.516; 1.05-1.17 vs 1.09-1.24),
//   32768 (64 MiB, a throwaway build) 2.25-2.31 vs 2.15-2.21; 32/8 D128 bf16, 4096 keys (16 MiB)
//   0.479-0.506 vs 0.471-0.473. Hence the 8 MiB floor.
// In throwaway builds (not kept), steps of 32 or 64 keys were 1.4x and 1.9x slower for 32/8 D64,
// 4 keys 1.1x for 32/8 D128. Options::decode_step (KALLPA_CPU_FLASH_STEP) overrides the choice.
inline constexpr double kDecodeShortStepsMinBytes = 8.0 * 1024 * 1024;
inline constexpr std::int64_t kDecodeLongStepKeys = 16;  // v9 / v10's step on AVX-512 (its lanes)
bool decode_short_steps(const ValidatedProblem& problem, double kv_bytes);

// The automatic decode kernel for a call that reads kv_bytes of K/V: on 16-lane targets v9, in
// cache and streamed alike; elsewhere v4 up to kDecodeDirectMaxBytes, v8 beyond. On the AVX-512
// Xeon (session 15, build/bench/cpu_flash_bench --benchmark_filter='^decode(_gqa|_gqa3)?/.*skv512/
// (v4_direct|v8_grouped8|v9_lanes)' --benchmark_repetitions=6
// --benchmark_enable_random_interleaving=true, medians): one thread,
// 512 keys (in L2), v9 against v4 / v8: 8/8 heads D64 f16 23.6 vs 20.3 / 19.8 GFLOP/s, 9/3 heads
// 38.5 vs 34.1 / 26.6; all threads, 32/8 heads 60-71 vs 46-66 on f16/bf16 D64/D128; 4096 keys
// (in L3) and 256 MiB from DRAM it is even with v8 within the noise (8/8 D128 11.1 vs 11.3 GB/s,
// 32/8 D64 7.4 vs 6.9). AVX2 keeps its measured choices: v9 there is v8's walk, unmeasured.
// On AMD, v10 instead of v9 (its dots on 256-bit halves: Zen 4 runs 512-bit operations as two
// halves, where the full-width tree competes with the FMAs). 2-core Zen 4 EPYC, session 22,
// KALLPA_CPU_FLASH_DECODE=v9|v10 kallpa bench attention -b cpu-flash -t 2 --spec
// b=1,sq=1,skv=32768,hq=32,hkv=8,d=64,dtype=f16 (and the heads, d, dtype, skv and kv=paged,page=16
// below), alternated, ms:
// 32/8 D64 f16 32768 keys 2.29-2.63 vs 2.58-2.67; 8/8 D128 f16 5.45-6.28 vs 5.97-6.59; paged 9/3
// D64 0.70-0.72 vs 0.74; 32/8 D128 bf16 6.78-7.68 vs 7.12-7.35; 8/8 D64 2048 keys 0.059 vs 0.062.
inline DecodeKernel automatic_decode_kernel(double kv_bytes) {
  if (decode_v9_step_keys() >= 16) return cpu_is_amd() ? DecodeKernel::half_dots : DecodeKernel::lanes;
  return kv_bytes <= kDecodeDirectMaxBytes ? kDecodeAutoInCache : kDecodeAutoStreamed;
}

// The prefill v3 softmax exp on n values (for tests).
void fast_exp(const float* x, float* y, std::size_t n);

std::string fast_target_name();              // the target the dispatcher uses now
std::vector<std::string> fast_target_names();  // compiled and supported by this CPU, best first
bool force_fast_target(const std::string& name);  // tests: pin one target ("" restores)

}  // namespace kallpa::cpu_flash
