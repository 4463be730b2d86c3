// cpu-flash decode v9 ("lanes"): v8's memory-order walk (StepWalk), block size and prefetch, with
// a step of one key per vector lane, written for AVX-512, where v8's eight-key steps left most of
// each core to overheads (perf annotate, 8/8 heads D64 f16, 512 keys in L2, one thread: ~30 cycles
// per key and head, against ~12 for the f16 conversions and FMAs themselves).
//   - A step is N keys (N = lanes: 16 on AVX-512; 8 on AVX2, where this is v8's walk). A pass of
//     the dots holds RB rows x KU keys = N accumulators (three rows pad to four) and one
//     transposing tree reduces them to one vector of N dots, stored to the score rows as pieces of
//     KU lanes (v8 on AVX-512: two 4-way reductions per eight keys, a scratch array, scalar copies).
//   - The dots hold a slice of each query row in registers while the pass's keys go over it, so a
//     key's row pointer is read once per slice (v8: once per vector), unrolled so that GCC keeps
//     the accumulators in registers.
//   - P·V slices hold up to eight head-dim vectors for one or two rows (32 registers), and keys go
//     round-robin to two or four accumulator sets when the slice has fewer than eight FMA chains:
//     one D64 row on AVX-512 (four chains) was FMA-latency-bound, a third of the time.
//   - No prefetch for a call whose K/V fits in cache (~8% of the time, fetching nothing).
// On this Xeon the conversions bound it: vcvtph2ps + FMA sustain 48-54 GB/s of f16 per core
// (build/bench/cpu_flash_bench --benchmark_filter=BM_F16ConvertFma1Core), and MHA decode reads
// each K/V byte for one flop.
// Layouts that the kernels cannot read in place run v6, as for v7 and v8.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "backends/cpu-flash/decode_v9.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "backends/cpu-flash/decode_grouped-inl.h"

HWY_BEFORE_NAMESPACE();
namespace kallpa::cpu_flash {
namespace HWY_NAMESPACE {
namespace {

constexpr std::int64_t kB9 = kDecodeGroupedBlock;
constexpr int kLanes = static_cast<int>(hn::MaxLanes(DF()));

#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
constexpr int kVectorRegisters = 32;
#else
constexpr int kVectorRegisters = 16;
#endif

// Rows of a dot pass as the accumulators count them (three rows take the place of four).
template <int RB>
inline constexpr int kPaddedRows = RB == 3 ? 4 : RB;
// Keys per dot pass: RB x KU = one accumulator per lane. Zero where a vector has fewer lanes
// than rows (the scalar target): the step then runs one key at a time.
template <int RB>
inline constexpr int kPassKeys9 = kLanes >= kPaddedRows<RB> ? kLanes / kPaddedRows<RB> : 0;

// Head-dim vectors per P·V slice for RB rows: RB x C accumulators and C value vectors in the
// target's registers.
template <int RB>
inline constexpr int kSlice9 = kVectorRegisters == 32 ? (RB <= 2 ? 8 : 4) : (RB == 1 ? 8 : RB == 2 ? 4 : RB == 3 ? 3 : 2);

// Lane t of the result = the sum of the lanes of acc[t], for kLanes accumulators: one
// transposing tree (within 128-bit blocks, then across them).
HWY_INLINE VF ReduceEachToLane(const VF* acc) {
#if HWY_TARGET == HWY_SCALAR
  return acc[0];
#else
  static_assert(kLanes == 4 || kLanes == 8 || kLanes == 16, "4, 8 or 16 lanes");
  const DF d;
  if constexpr (kLanes == 4) {
    return Sum4Blocks(acc[0], acc[1], acc[2], acc[3]);
  } else if constexpr (kLanes == 8) {
    const VF u03 = Sum4Blocks(acc[0], acc[1], acc[2], acc[3]);
    const VF u47 = Sum4Blocks(acc[4], acc[5], acc[6], acc[7]);
    return hn::Add(hn::ConcatLowerLower(d, u47, u03), hn::ConcatUpperUpper(d, u47, u03));
  } else {
    // w[j] lane 4b + t: block b's sum of acc[4j + t].
    VF w[4];
    for (int j = 0; j < 4; ++j) w[j] = Sum4Blocks(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
    // Pairs of blocks: t01 = [w0 b0+b1, w1 b0+b1, w0 b2+b3, w1 b2+b3], t23 likewise.
    auto pair = [](VF a, VF b) {
      return hn::Add(hn::OddEvenBlocks(b, a), hn::OddEvenBlocks(hn::SwapAdjacentBlocks(b), hn::SwapAdjacentBlocks(a)));
    };
    const VF t01 = pair(w[0], w[1]), t23 = pair(w[2], w[3]);
    return hn::Add(hn::ConcatLowerLower(d, t23, t01), hn::ConcatUpperUpper(d, t23, t01));
  }
#endif
}

// Head-dim vectors of the query rows held in registers while the keys of a dot pass go over them:
// RB x XC query vectors beside the kLanes accumulators, so that each key's row pointer is read
// once per slice (not once per vector: v8 kept the keys outermost only within a vector).
template <int RB>
inline constexpr int kQuerySlice9 = kVectorRegisters == 32 ? (RB == 1 ? 8 : RB == 2 ? 4 : 2)
                                                           : (RB == 1 ? 4 : RB == 2 ? 2 : 1);

// acc[rb * KU + u] += <q[rb][x0, x0 + XC N), k[u][x0, x0 + XC N)>.
template <int RB, int KU, int XC, typename T>
HWY_INLINE void DotsSlice(const float* HWY_RESTRICT q, std::int64_t qs, const T* const* k, std::int64_t x0,
                          VF* acc) {
  const DF d;
  VF qv[RB][XC];
  for (int rb = 0; rb < RB; ++rb)
    for (int c = 0; c < XC; ++c) qv[rb][c] = hn::Load(d, q + rb * qs + x0 + c * kLanes);
  // Fully unrolled, or GCC keeps the accumulators in memory (one store per key and slice).
  HWY_UNROLL(16)
  for (int u = 0; u < KU; ++u) {
    const T* kr = k[u] + x0;
    HWY_UNROLL(8)
    for (int c = 0; c < XC; ++c) {
      const VF kv = LoadAsF32(kr + c * kLanes);
      for (int rb = 0; rb < RB; ++rb) acc[rb * KU + u] = hn::MulAdd(qv[rb][c], kv, acc[rb * KU + u]);
    }
  }
}

// Stores the pieces of KU lanes of v (lane rb * KU + u: row rb, key u) to the score rows: piece
// `first` + i to out + (first + i) * kB9, for the rows below RB (a three-row pass pads to four).
// Halves of halves down to KU lanes: one store per row, where a scratch array and KU scalar copies
// per row cost GQA's four-row passes (KU = 4 on AVX-512) more than their reduction.
template <int RB, int KU, class D>
HWY_INLINE void StoreRowPieces(D d, hn::Vec<D> v, float* HWY_RESTRICT out, int first) {
  constexpr int L = static_cast<int>(hn::MaxLanes(D()));
  if constexpr (L == KU) {
    if (first < RB) hn::StoreU(v, d, out + first * kB9);
  } else {
#if HWY_TARGET != HWY_SCALAR  // one lane: every pass is one key (kPassKeys9 is 0 there)
    const hn::Half<D> dh;
    StoreRowPieces<RB, KU>(dh, hn::LowerHalf(dh, v), out, first);
    StoreRowPieces<RB, KU>(dh, hn::UpperHalf(dh, v), out, first + L / KU / 2);
#endif
  }
}

// s[rb * kB9 + u] = <q[rb], k[u]> for the RB rows (q rows qs floats apart) and the kLanes keys of
// a step, in passes of KU keys whose RB x KU dots reduce in one tree.
template <int RB, typename T>
HWY_INLINE void DotsStep(const float* HWY_RESTRICT q, std::int64_t qs, const T* const* k, std::int64_t len,
                         float* HWY_RESTRICT s) {
  constexpr int KU = kPassKeys9<RB>;
  if constexpr (KU == 0) {
    DotsPart<RB>(q, qs, k, kLanes, len, s);
  } else {
    const DF d;
    constexpr int XC = kQuerySlice9<RB>;
    for (int k0 = 0; k0 < kLanes; k0 += KU) {
      VF acc[kLanes];
      for (int t = 0; t < kLanes; ++t) acc[t] = hn::Zero(d);
      std::int64_t x = 0;
      for (; x + XC * kLanes <= len; x += XC * kLanes) DotsSlice<RB, KU, XC>(q, qs, k + k0, x, acc);
      if constexpr (XC > 4) {
        for (; x + 4 * kLanes <= len; x += 4 * kLanes) DotsSlice<RB, KU, 4>(q, qs, k + k0, x, acc);
      }
      if constexpr (XC > 2) {
        for (; x + 2 * kLanes <= len; x += 2 * kLanes) DotsSlice<RB, KU, 2>(q, qs, k + k0, x, acc);
      }
      for (; x < len; x += kLanes) DotsSlice<RB, KU, 1>(q, qs, k + k0, x, acc);
      StoreRowPieces<RB, KU>(d, ReduceEachToLane(acc), s + k0, 0);
    }
  }
}

// Accumulator sets of a P·V slice: FMA chains in flight (RB x C x S) of at least eight, two FMA
// ports times four cycles of latency; with one set, one row of D64 on AVX-512 (four chains, each
// key's FMA waiting on the last) was latency-bound, a third of v9's first version's time.
template <int RB, int C>
inline constexpr int kPvSets9 = RB * C >= 8 ? 1 : RB * C >= 4 ? 2 : 4;

// o[rb][x0 + c N] += sum_u p[rb * kB9 + u] v[u][x0 + c N] over the keys u < n, the accumulators
// in registers (keys dealt round-robin to S sets, added at the end); KN > 0 fixes n at compile
// time (a whole step: no per-key loop control).
template <int RB, int C, int KN, typename T>
HWY_INLINE void PvSlice9(const T* const* v, const float* HWY_RESTRICT p, std::int64_t n, float* HWY_RESTRICT o,
                         std::int64_t os, std::int64_t x0) {
  const DF d;
  constexpr int S = KN > 0 && KN % kPvSets9<RB, C> == 0 ? kPvSets9<RB, C> : 1;
  VF acc[S][RB][C];
  for (int rb = 0; rb < RB; ++rb)
    for (int c = 0; c < C; ++c) {
      acc[0][rb][c] = hn::Load(d, o + rb * os + x0 + c * kLanes);
      for (int st = 1; st < S; ++st) acc[st][rb][c] = hn::Zero(d);
    }
  const std::int64_t keys = KN > 0 ? KN : n;
  HWY_UNROLL(16)
  for (std::int64_t u0 = 0; u0 < keys; u0 += S) {
    for (int st = 0; st < S; ++st) {
      const std::int64_t u = u0 + st;
      VF vv[C];
      for (int c = 0; c < C; ++c) vv[c] = LoadAsF32(v[u] + x0 + c * kLanes);
      for (int rb = 0; rb < RB; ++rb) {
        const VF pb = hn::Set(d, p[rb * kB9 + u]);
        for (int c = 0; c < C; ++c) acc[st][rb][c] = hn::MulAdd(pb, vv[c], acc[st][rb][c]);
      }
    }
  }
  for (int rb = 0; rb < RB; ++rb)
    for (int c = 0; c < C; ++c) {
      VF sum = acc[0][rb][c];
      for (int st = 1; st < S; ++st) sum = hn::Add(sum, acc[st][rb][c]);
      hn::Store(sum, d, o + rb * os + x0 + c * kLanes);
    }
}

template <int RB, int KN, typename T>
HWY_INLINE void PvStep(const T* const* v, const float* p, std::int64_t n, float* o, std::int64_t os,
                       std::int64_t len) {
  constexpr int C = kSlice9<RB>;
  std::int64_t x = 0;
  for (; x + C * kLanes <= len; x += C * kLanes) PvSlice9<RB, C, KN>(v, p, n, o, os, x);
  if constexpr (C > 4) {
    for (; x + 4 * kLanes <= len; x += 4 * kLanes) PvSlice9<RB, 4, KN>(v, p, n, o, os, x);
  }
  if constexpr (C > 2) {
    for (; x + 2 * kLanes <= len; x += 2 * kLanes) PvSlice9<RB, 2, KN>(v, p, n, o, os, x);
  }
  for (; x < len; x += kLanes) PvSlice9<RB, 1, KN>(v, p, n, o, os, x);
}

}  // namespace

void RunDecodeTaskV9Impl(const ValidatedProblem& vp, const DecodePlan& plan, const DecodeTask& t, void* scratch,
                         std::byte* slots, std::int32_t* counters) {
  // The grouped kernels' distance (grouped_prefetch_keys); none for a call whose K/V fits in
  // cache, where the prefetches were ~8% of the time and fetched nothing (8/8 heads D64 f16, 512
  // keys, one thread).
  const std::int64_t ahead =
      plan.kv_bytes <= kDecodeDirectMaxBytes ? -1 : PrefetchKeys(grouped_prefetch_keys());
  RunStepWalkTask<kLanes>(
      vp, plan, t, scratch, slots, counters, ahead,
      [](auto rb, auto... a) { DotsStep<decltype(rb)::value>(a...); },
      [](auto rb, auto kn, auto... a) { PvStep<decltype(rb)::value, decltype(kn)::value>(a...); });
}

int DecodeV9LanesImpl() { return kLanes; }

}  // namespace HWY_NAMESPACE
}  // namespace kallpa::cpu_flash
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
KALLPA_CPU_FLASH_DECODE_ENTRY(run_decode_task_v9, RunDecodeTaskV9Impl)
namespace kallpa::cpu_flash {
HWY_EXPORT(DecodeV9LanesImpl);
int decode_v9_step_keys() { return HWY_DYNAMIC_DISPATCH(DecodeV9LanesImpl)(); }
}  // namespace kallpa::cpu_flash
#endif  // HWY_ONCE
