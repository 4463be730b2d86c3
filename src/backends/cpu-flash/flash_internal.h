// Internals of cpu-flash shared by the driver (cpu_flash.cpp) and the SIMD kernels (prefill.cpp,
// decode_*.cpp). Not a public header. docs/cpu-flash.md describes the design.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "backends/cpu-flash/cpu_flash.h"
#include "kallpa/attention.h"

namespace kallpa::cpu_flash {

inline constexpr std::int64_t kKeyTile = 128;    // keys per tile
inline constexpr std::int64_t kRowTarget = 128;  // query rows (positions x heads) per task
inline constexpr std::int64_t kAlign = 16;       // floats; rows and head dims pad to this
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
    return static_cast<std::size_t>(threads) * worker_bytes + static_cast<std::size_t>(n_partials) * partial_bytes + 64;
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
// rs, ks, vs: the conflict-free row strides of q^T/S/o^T, the key tile and the value tile (the
// tiled path's decode kernel uses Rp, Dp, Dvp as strides, which fit in the same buffers).
struct ScratchLayout {
  std::int64_t rp = 0, dp = 0, dvp = 0;
  std::int64_t rs = 0, ks = 0, vs = 0;
  std::size_t q = 0;  // rows kernel: q^T [D][Rp]; decode kernel: q [R][Dp] (scaled)
  std::size_t s = 0;  // rows kernel: scores [Nk][Rp]; decode kernel: [R][Nk]
  std::size_t o = 0;  // rows kernel: o^T [Dv][Rp]; decode kernel: o [R][Dvp]
  std::size_t k = 0;  // key tile, f32 [Nk][Dp]
  std::size_t v = 0;  // value tile, f32 [Nk][Dvp]
  std::size_t m = 0, l = 0, slope = 0, posf = 0, alpha = 0;  // f32 [Rp]
  std::size_t lo = 0, hi = 0;                                // int32 [Rp]: visible keys per row
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

// The tiled plan of the sequences that are not decode-shaped (decode_shaped). Each sequence's
// tasks, splits included, follow from that sequence's shape alone (its query and key counts, the
// heads and head dims), never from the other sequences of the call or the thread count, so a
// sequence's results are the same bits alone, in any batch, and on any number of threads.
Plan make_plan(const ValidatedProblem& problem);

// Runs one task of the fast path. `scratch` is worker_bytes, 64-aligned; `partial` is the task's
// partial slot (null when the task writes o/lse directly).
void run_fast_task(const ValidatedProblem& problem, const Plan& plan, const Task& task, void* scratch, float* partial);

// ---------------------------------------------------------------------------------------------
// Decode path (few query rows per KV head, long KV): one task is a chunk of keys of one sequence
// against every query row of that sequence, all KV heads. The chunk streams K/V in memory order
// (every head of a key row is used while it is in cache) and each chunk of a split sequence writes
// a partial (m, l, o) that the last chunk to finish merges, so one parallel_for does everything.

inline constexpr std::int64_t kDecodeMaxRows = 16;    // query rows per KV head (Sq * group) at most
inline constexpr std::int64_t kDecodeBlock = 32;      // keys per block inside a chunk
inline constexpr std::int64_t kDecodeMinChunk = 256;  // keys
inline constexpr std::int64_t kDecodeMaxChunk = 8192;
inline constexpr std::int64_t kDecodeChunksTarget = 16;  // chunks per sequence, if it is long enough

// Whether sequence b runs the decode path: at most kDecodeMaxRows query rows per KV head. Judged
// per sequence, so a decode step batched with a prompt chunk runs the kernel it runs alone.
inline bool decode_shaped(const ValidatedProblem& problem, std::int32_t b) noexcept {
  return problem.seqlen_q(b) * problem.group_size() <= kDecodeMaxRows;
}

// The keys per chunk of a decode sequence whose queries see `span` keys: about span /
// kDecodeChunksTarget, in whole blocks, within [kDecodeMinChunk, kDecodeMaxChunk]. From the
// sequence's own span only, so its keys are summed in the same order alone or in any batch.
inline constexpr std::int64_t decode_chunk_keys(std::int64_t span) {
  return std::clamp(round_up((span + kDecodeChunksTarget - 1) / kDecodeChunksTarget, kDecodeBlock), kDecodeMinChunk,
                    kDecodeMaxChunk);
}

// The decode kernels and the rule that picks one (choose_decode_kernel; docs/cpu-flash.md gives
// the reasoning, bench/results/cpu-flash-decode-*.md the measurements).
//
// Up to this many bytes of a sequence's K/V, a target narrower than 16 lanes runs by_head, which
// needs the fewest instructions while K/V are in cache; beyond, the grouped kernel's memory-order
// walk keeps the memory busy. Whether K/V is resident depends on what ran before, not on its
// size: in a model each layer's cache is read once per token after every other layer's, so
// beyond one core's L2 it comes from L3 or DRAM. The bound is on the sequence's own bytes, never
// the batch's: the kernel fixes the order in which a sequence's keys are summed, and that order
// must not change when other sequences join the call.
inline constexpr double kDecodeInCacheMaxBytes = 1.0 * 1024 * 1024;
// The grouped kernels: keys per block (the softmax's per-row work is paid once a block) and the
// prefetch distance of their K and V streams in keys.
inline constexpr std::int64_t kDecodeGroupedBlock = 64;
inline constexpr std::int64_t kDecodeGroupedPrefetchKeys = 8;
// On AMD (Zen 4) eight keys ahead are too few to keep the memory busy; 24 are.
inline constexpr std::int64_t kDecodeGroupedPrefetchKeysAmd = 24;

// Whether this runs on an AMD CPU (read once), for the defaults chosen there.
inline bool cpu_is_amd() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool amd = __builtin_cpu_is("amd");
  return amd;
#else
  return false;
#endif
}

// The grouped and lanes kernels' prefetch distance in keys for the CPU this runs on.
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
  double kv_bytes = 0.0;        // K/V bytes the sequence reads (all its chunks): its kernel's choice
  // Keys below this may be prefetched past the chunk's end: the end of its run (DecodeRun), whose
  // next chunks the same task reads at once (at most k_end: none past it). Prefetches change no
  // result.
  std::int64_t prefetch_end = 0;
  // The lanes kernels on AVX-512: steps of 8 keys. Set by the caller for the sequence (its kernel
  // choice), never by the plan.
  bool short_steps = false;
};

// Consecutive chunks of one sequence that one task of the parallel_for runs in order, each from a
// fresh softmax state into its own partial as if alone (the last merges them). Grouping chunks
// into such runs changes the schedule only, never a result, so it may follow the whole call: a
// batch of many sequences runs each in a few long runs, as one sequence alone runs its chunks
// one per task.
struct DecodeRun {
  std::int32_t first = 0;  // index into DecodePlan::chunks
  std::int32_t count = 1;
};

// The decode plan of the decode-shaped sequences (decode_shaped). A sequence's chunks follow from
// its own key span alone (decode_chunk_keys), never from the other sequences of the call or the
// thread count; only their grouping into runs sees the call (decode_chunk_keys of all its keys).
struct DecodePlan {
  std::vector<DecodeTask> chunks;  // each sequence's chunks, in order
  std::vector<DecodeRun> runs;     // the parallel_for's tasks, longest first
  std::int64_t rows_max = 0;       // max over sequences of Sq_b * Hq
  std::int64_t n_slots = 0;
  std::int64_t n_counters = 0;
  std::size_t worker_bytes = 0;
  std::size_t slot_bytes = 0;     // m[rows_max], l[rows_max], o[rows_max][Dv]
  double kv_bytes = 0.0;          // K/V bytes the call reads: where prefetching pays (never the numerics)
  double seq_kv_bytes_max = 0.0;  // the most K/V bytes one sequence reads

  std::size_t workspace_bytes(int threads) const {
    return static_cast<std::size_t>(threads) * worker_bytes + static_cast<std::size_t>(n_slots) * slot_bytes +
           static_cast<std::size_t>(round_up(n_counters * 4, 64)) + 64;
  }
};

// Per-worker scratch of the decode path, byte offsets (each 64-aligned).
struct DecodeLayout {
  std::int64_t dp = 0, dvp = 0;
  std::size_t q = 0;               // f32 [rows][Dp], scaled; rows ordered (kvh, i, g)
  std::size_t acc = 0;             // f32 [rows][Dvp]
  std::size_t m = 0, l = 0;        // f32 [rows]
  std::size_t s = 0;               // f32 [kDecodeMaxRows][kDecodeBlock]
  std::size_t s_all = 0;           // f32 [rows][kDecodeGroupedBlock]: the scores of every head of a block
  std::size_t k = 0;               // f32 [kDecodeBlock][Dp]
  std::size_t v = 0;               // f32 [kDecodeBlock][Dvp]
  std::size_t koff = 0, voff = 0;  // int64 [2][kDecodeBlock]: row offsets of this and the next block
                                   // (grouped kernels: [kDecodeGroupedBlock] of this block)
  std::size_t total = 0;
};

static_assert(2 * kDecodeBlock >= kDecodeGroupedBlock, "a grouped block's row offsets fit in the offset tables");

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

DecodePlan make_decode_plan(const ValidatedProblem& problem);

// Both plans of one call: the tiled plan of its other sequences and the decode plan of its
// decode-shaped ones, run by one parallel_for (the tiled tasks first, as the heavier) that shares
// the per-worker scratch, then the tiled path's split-KV combines.
struct CallPlan {
  Plan tiled;
  DecodePlan decode;
  std::size_t worker_bytes = 0;  // the larger of the two plans' per-worker scratch

  std::size_t partials_bytes() const { return static_cast<std::size_t>(tiled.n_partials) * tiled.partial_bytes; }
  std::size_t slots_bytes() const { return static_cast<std::size_t>(decode.n_slots) * decode.slot_bytes; }
  std::size_t workspace_bytes(int threads) const {
    return static_cast<std::size_t>(threads) * worker_bytes + partials_bytes() + slots_bytes() +
           static_cast<std::size_t>(round_up(decode.n_counters * 4, 64)) + 64;
  }
};
CallPlan make_call_plan(const ValidatedProblem& problem);
// The decode kernels, one chunk each. `slots` and `counters` are the call's partial slots and
// completion counters (zeroed before the parallel_for); the last chunk of a split sequence merges
// and writes o/lse. Every kernel takes any layout: those that cannot read K/V in place run by_head.
// by_head (decode_by_head.cpp): each block head by head, K/V read in place, or converted to f32
// rows first where the layout cannot be read in place (KvInPlace).
void run_decode_by_head(const ValidatedProblem& problem, const DecodePlan& plan, const DecodeTask& task, void* scratch,
                        std::byte* slots, std::int32_t* counters);
// grouped (decode_grouped.cpp): blocks walked in memory order in steps of eight keys across every
// head, the rows of a GQA group served together, K/V streamed with a software prefetch.
void run_decode_grouped(const ValidatedProblem& problem, const DecodePlan& plan, const DecodeTask& task, void* scratch,
                        std::byte* slots, std::int32_t* counters);
// lanes / lanes_half_dots (decode_lanes.cpp): the grouped walk in steps of one key per vector lane,
// the second with its dots on 256-bit halves on AVX-512.
void run_decode_lanes(const ValidatedProblem& problem, const DecodePlan& plan, const DecodeTask& task, void* scratch,
                      std::byte* slots, std::int32_t* counters);
void run_decode_lanes_half_dots(const ValidatedProblem& problem, const DecodePlan& plan, const DecodeTask& task,
                                void* scratch, std::byte* slots, std::int32_t* counters);
// Float lanes of the SIMD target in use (16 on AVX-512): the lanes kernels' step.
int decode_lane_keys();

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

// Whether the lanes kernels on AVX-512 walk K/V in steps of 8 keys instead of 16: when a sequence
// reads more than kDecodeShortStepsMinBytes of K/V (kv_bytes) and one head's rows of a 16-key step
// put more than two lines into one L1 set (a quarter of its ways; four for MHA, whose short steps
// run narrower passes), as K/V rows 1 or 2 KiB apart do (8 KV heads of D64 or D128 f16). A step's
// rows are read head by head, so they must stay in L1 until every head is done; crowded sets
// evict them. Below 8 MiB the sequence's K/V stay in L2/L3 and the long step is as fast.
inline constexpr double kDecodeShortStepsMinBytes = 8.0 * 1024 * 1024;
inline constexpr std::int64_t kDecodeLongStepKeys = 16;  // the lanes kernels' step on AVX-512 (its lanes)
// Whether one head's rows of a 16-key step crowd an L1 set, as decode_short_steps judges it.
bool decode_steps_crowd_l1(const ValidatedProblem& problem);
bool decode_short_steps(const ValidatedProblem& problem, double kv_bytes);

// The facts the decode kernel choice of one sequence depends on; all of it, so that the rule is a
// pure function. Every fact is the sequence's own or the machine's, never the batch's: a sequence
// runs the same kernel, in the same steps, alone or batched.
struct DecodeFacts {
  int simd_lanes = 8;           // float lanes of the SIMD target in use (decode_lane_keys)
  bool amd = false;             // cpu_is_amd()
  bool kv_in_place = true;      // the kernels can read K/V where they lie (KvInPlace)
  double kv_bytes = 0.0;        // K/V bytes the sequence reads (DecodeTask::kv_bytes)
  bool steps_crowd_l1 = false;  // decode_steps_crowd_l1
};
struct DecodeChoice {
  DecodeKernel kernel = DecodeKernel::by_head;
  bool short_steps = false;  // DecodeTask::short_steps: the lanes kernels on AVX-512 in steps of 8
  friend bool operator==(const DecodeChoice&, const DecodeChoice&) = default;
};

// The rule:
//   - layouts that cannot be read in place: by_head (it converts each block to f32 first);
//   - 16-lane targets (AVX-512): lanes, or lanes_half_dots on AMD (Zen 4 runs 512-bit operations
//     as two halves, where the half-width reduction tree is cheaper), in cache and streamed alike;
//   - narrower targets (AVX2 and below): by_head up to kDecodeInCacheMaxBytes of K/V, grouped beyond.
// Steps of 8 keys for the lanes kernels on AVX-512 where more than kDecodeShortStepsMinBytes of K/V
// crowd the L1 sets (decode_short_steps).
constexpr DecodeChoice choose_decode_kernel(const DecodeFacts& f) {
  DecodeChoice c;
  c.short_steps = f.simd_lanes >= kDecodeLongStepKeys && f.kv_bytes > kDecodeShortStepsMinBytes && f.steps_crowd_l1;
  if (!f.kv_in_place) c.kernel = DecodeKernel::by_head;
  else if (f.simd_lanes >= 16) c.kernel = f.amd ? DecodeKernel::lanes_half_dots : DecodeKernel::lanes;
  else c.kernel = f.kv_bytes <= kDecodeInCacheMaxBytes ? DecodeKernel::by_head : DecodeKernel::grouped;
  if (c.kernel != DecodeKernel::lanes && c.kernel != DecodeKernel::lanes_half_dots) c.short_steps = false;
  return c;
}
// The facts of a sequence of this call that reads kv_bytes of K/V, on this machine.
DecodeFacts decode_facts(const ValidatedProblem& problem, double kv_bytes);

// The online softmax's exp (FastExp) on n values (for tests).
void fast_exp(const float* x, float* y, std::size_t n);

std::string fast_target_name();                   // the target the dispatcher uses now
std::vector<std::string> fast_target_names();     // compiled and supported by this CPU, best first
bool force_fast_target(const std::string& name);  // tests: pin one target ("" restores)

}  // namespace kallpa::cpu_flash
