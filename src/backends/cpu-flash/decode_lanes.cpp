// cpu-flash decode in steps of one key per vector lane (DecodeKernel::lanes and lanes_half_dots):
// the decode kernel on 16-lane targets (AVX-512), in cache and streamed alike. Compiled once per
// Highway target and dispatched at run time.
//
// The grouped kernel's memory-order walk (StepWalk), block size and prefetch, with a step of one
// key per vector lane, so that on AVX-512 the overheads around the f16 conversions and FMAs shrink
// to a small share of each key:
//   - A step is N keys (N = lanes: 16 on AVX-512; 8 on AVX2). A pass of the dots holds RB rows x
//     KU keys = N accumulators (three rows pad to four) and one transposing tree reduces them to
//     one vector of N dots, stored to the score rows as pieces of KU lanes.
//   - The dots hold a slice of each query row in registers while the pass's keys go over it, so a
//     key's row pointer is read once per slice, unrolled so that GCC keeps the accumulators in
//     registers.
//   - P·V slices hold up to eight head-dim vectors for one or two rows (32 registers), and keys go
//     round-robin to two or four accumulator sets when the slice has fewer than eight FMA chains
//     (one D64 row on AVX-512 has four), so that the FMA latency stays hidden.
//   - No prefetch for a call whose K/V fits in cache: there the prefetches fetch nothing.
// With K/V in cache, the f16 conversions and FMAs bound it: MHA decode reads each K/V byte for one
// flop. lanes_half_dots is this file's second entry: the dots on 256-bit halves on AVX-512
// (DotsTag, kDotsSets, KeepInRegister), for cores that run 512-bit operations as two halves (AMD
// Zen 4); everything else is shared.
// On AVX-512 either kernel walks in steps of 8 keys instead of 16 where a 16-key step's rows would
// crowd the L1 sets they map to (decode_short_steps, DecodeTask::short_steps; DotsShape narrows a
// pass that would hold more keys than a step).
// Layouts that the kernels cannot read in place run by_head. docs/cpu-flash.md gives the design
// reasoning; bench/results/cpu-flash-decode-lanes.md the measurements behind it.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "backends/cpu-flash/decode_lanes.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

#include "backends/cpu-flash/decode_grouped-inl.h"

HWY_BEFORE_NAMESPACE();
namespace kallpa::cpu_flash {
namespace HWY_NAMESPACE {
namespace {

constexpr std::int64_t kBlock = kDecodeGroupedBlock;
constexpr int kLanes = static_cast<int>(hn::MaxLanes(DF()));
// Keys per step where a step of kLanes keys would crowd the L1 sets its rows map to
// (decode_short_steps).
constexpr int kShortStep = 8;
static_assert(kLanes <= kShortStep || kLanes == kDecodeLongStepKeys, "decode_short_steps judges this step");

#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
constexpr int kVectorRegisters = 32;
#else
constexpr int kVectorRegisters = 16;
#endif

// Rows of a dot pass as the accumulators count them (three rows take the place of four).
template <int RB>
inline constexpr int kPaddedRows = RB == 3 ? 4 : RB;
// Keys per dot pass on vectors of L lanes: RB x KU = one accumulator per lane. Zero where a
// vector has fewer lanes than rows (the scalar target): the step then runs one key at a time.
// With S sets of L accumulators (half-width dots: two), RB x KU = S x L.
// (clang-format 14 reads `S * L` here as a pointer declaration.)
// clang-format off
template <int RB, int L, int S = 1>
inline constexpr int kPassKeys = L >= kPaddedRows<RB> ? S * L / kPaddedRows<RB> : 0;
// clang-format on

// The dots' vectors: full width (lanes), or 256-bit halves where vectors have 16 lanes
// (lanes_half_dots). On a core that runs 512-bit operations as two 256-bit halves (AMD Zen 4) the
// FMAs cost the same either way, and the two 8-way trees of a half-width pass cost far less than
// the 16-way tree of a full-width one.
template <bool kHalf>
using DotsTag = std::conditional_t<kHalf && kLanes >= 16, hn::CappedTag<float, 8>, DF>;
// Accumulator sets of a half-width pass: two trees of eight, so that a pass covers as many keys
// as a full-width one and each query vector loaded serves as many FMAs.
template <bool kHalf>
inline constexpr int kDotsSets = (kHalf && kLanes >= 16) ? 2 : 1;

// Pins a query vector in a register: without it GCC folds the load into every FMA that uses it
// (a memory operand per FMA, as objdump -d shows), and the pass is bound by loads.
template <class V>
HWY_INLINE void KeepInRegister(V& v) {
#if HWY_ARCH_X86 && (defined(__GNUC__) || defined(__clang__)) && HWY_TARGET != HWY_SCALAR
  asm("" : "+v"(v.raw));
#else
  (void)v;
#endif
}

// Head-dim vectors per P·V slice for RB rows: RB x C accumulators and C value vectors in the
// target's registers.
template <int RB>
inline constexpr int kSlice = kVectorRegisters == 32 ? (RB <= 2 ? 8 : 4)
                                                     : (RB == 1   ? 8
                                                        : RB == 2 ? 4
                                                        : RB == 3 ? 3
                                                                  : 2);

// Lane t of the result = the sum of the lanes of acc[t], for as many accumulators as lanes: one
// transposing tree (within 128-bit blocks, then across them).
template <class DD>
HWY_INLINE hn::Vec<DD> ReduceEachToLane(DD d, const hn::Vec<DD>* acc) {
#if HWY_TARGET == HWY_SCALAR
  (void)d;
  return acc[0];
#else
  using V = hn::Vec<DD>;
  constexpr int L = static_cast<int>(hn::MaxLanes(DD()));
  static_assert(L == 4 || L == 8 || L == 16, "4, 8 or 16 lanes");
  if constexpr (L == 4) {
    return Sum4Blocks(acc[0], acc[1], acc[2], acc[3]);
  } else if constexpr (L == 8) {
    const V u03 = Sum4Blocks(acc[0], acc[1], acc[2], acc[3]);
    const V u47 = Sum4Blocks(acc[4], acc[5], acc[6], acc[7]);
    return hn::Add(hn::ConcatLowerLower(d, u47, u03), hn::ConcatUpperUpper(d, u47, u03));
  } else {
    // w[j] lane 4b + t: block b's sum of acc[4j + t].
    V w[4];
    for (int j = 0; j < 4; ++j) w[j] = Sum4Blocks(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
    // Pairs of blocks: t01 = [w0 b0+b1, w1 b0+b1, w0 b2+b3, w1 b2+b3], t23 likewise.
    auto pair = [](V a, V b) {
      return hn::Add(hn::OddEvenBlocks(b, a), hn::OddEvenBlocks(hn::SwapAdjacentBlocks(b), hn::SwapAdjacentBlocks(a)));
    };
    const V t01 = pair(w[0], w[1]), t23 = pair(w[2], w[3]);
    return hn::Add(hn::ConcatLowerLower(d, t23, t01), hn::ConcatUpperUpper(d, t23, t01));
  }
#endif
}

// Head-dim vectors of the query rows held in registers while the keys of a dot pass go over them:
// RB x XC query vectors beside the kLanes accumulators, so that each key's row pointer is read
// once per slice, not once per vector.
template <int RB>
inline constexpr int kQuerySlice = kVectorRegisters == 32 ? (RB == 1   ? 8
                                                             : RB == 2 ? 4
                                                                       : 2)
                                                          : (RB == 1   ? 4
                                                             : RB == 2 ? 2
                                                                       : 1);

// acc[rb * KU + u] += <q[rb][x0, x0 + XC N), k[u][x0, x0 + XC N)> on vectors of N lanes (DD).
template <int RB, int KU, int XC, class DD, typename T>
HWY_INLINE void DotsSlice(DD d, const float* HWY_RESTRICT q, std::int64_t qs, const T* const* k, std::int64_t x0,
                          hn::Vec<DD>* acc) {
  constexpr int N = static_cast<int>(hn::MaxLanes(DD()));
  hn::Vec<DD> qv[RB][XC];
  for (int rb = 0; rb < RB; ++rb)
    for (int c = 0; c < XC; ++c) {
      qv[rb][c] = hn::Load(d, q + rb * qs + x0 + c * N);
      if constexpr (N < kLanes) KeepInRegister(qv[rb][c]);  // half-width dots only
    }
  // Fully unrolled, or GCC keeps the accumulators in memory (one store per key and slice).
  HWY_UNROLL(16)
  for (int u = 0; u < KU; ++u) {
    const T* kr = k[u] + x0;
    HWY_UNROLL(8)
    for (int c = 0; c < XC; ++c) {
      const hn::Vec<DD> kv = LoadAsF32(d, kr + c * N);
      for (int rb = 0; rb < RB; ++rb) acc[rb * KU + u] = hn::MulAdd(qv[rb][c], kv, acc[rb * KU + u]);
    }
  }
}

// Stores the pieces of KU lanes of v (lane rb * KU + u: row rb, key u) to the score rows: piece
// `first` + i to out + (first + i) * kBlock, for the rows below RB (a three-row pass pads to four).
// Halves of halves down to KU lanes: one store per row, where a scratch array and KU scalar copies
// per row cost GQA's four-row passes (KU = 4 on AVX-512) more than their reduction.
template <int RB, int KU, class D>
HWY_INLINE void StoreRowPieces(D d, hn::Vec<D> v, float* HWY_RESTRICT out, int first) {
  constexpr int L = static_cast<int>(hn::MaxLanes(D()));
  if constexpr (L == KU) {
    if (first < RB) hn::StoreU(v, d, out + first * kBlock);
  } else {
#if HWY_TARGET != HWY_SCALAR  // one lane: every pass is one key (kPassKeys is 0 there)
    const hn::Half<D> dh;
    StoreRowPieces<RB, KU>(dh, hn::LowerHalf(dh, v), out, first);
    StoreRowPieces<RB, KU>(dh, hn::UpperHalf(dh, v), out, first + L / KU / 2);
#endif
  }
}

// s[rb * kBlock + u] = <q[rb], k[u]> for the RB rows (q rows qs floats apart) and the kStep keys of
// a step, in passes of KU keys whose RB x KU dots (one per lane of S vectors of DD) reduce in S
// trees: set j holds the dots rb * KU + u in [j N, j N + N).
template <int RB, class DD, int S, int kStep, typename T>
HWY_INLINE void DotsStep(const float* HWY_RESTRICT q, std::int64_t qs, const T* const* k, std::int64_t len,
                         float* HWY_RESTRICT s) {
  constexpr int N = static_cast<int>(hn::MaxLanes(DD()));
  constexpr int KU = kPassKeys<RB, N, S>;
  if constexpr (KU == 0) {
    DotsPart<RB>(q, qs, k, kStep, len, s);
  } else {
    static_assert(KU <= kStep && kStep % KU == 0, "a step is whole passes");
    const DD d;
    constexpr int XC = kQuerySlice<RB>;
    for (int k0 = 0; k0 < kStep; k0 += KU) {
      hn::Vec<DD> acc[S * N];
      for (int t = 0; t < S * N; ++t) acc[t] = hn::Zero(d);
      std::int64_t x = 0;
      for (; x + XC * N <= len; x += XC * N) DotsSlice<RB, KU, XC>(d, q, qs, k + k0, x, acc);
      if constexpr (XC > 4) {
        for (; x + 4 * N <= len; x += 4 * N) DotsSlice<RB, KU, 4>(d, q, qs, k + k0, x, acc);
      }
      if constexpr (XC > 2) {
        for (; x + 2 * N <= len; x += 2 * N) DotsSlice<RB, KU, 2>(d, q, qs, k + k0, x, acc);
      }
      for (; x < len; x += N) DotsSlice<RB, KU, 1>(d, q, qs, k + k0, x, acc);
      for (int j = 0; j < S; ++j) {
        const hn::Vec<DD> dots = ReduceEachToLane(d, acc + j * N);
        if constexpr (KU >= N) {  // one row's keys [(j N) % KU, + N)
          hn::StoreU(dots, d, s + (j * N / KU) * kBlock + k0 + (j * N) % KU);
        } else {
          StoreRowPieces<RB, KU>(d, dots, s + k0, j * N / KU);
        }
      }
    }
  }
}

// Accumulator sets of a P·V slice: FMA chains in flight (RB x C x S) of at least eight, two FMA
// ports times four cycles of latency; with one set, one row of D64 on AVX-512 (four chains, each
// key's FMA waiting on the last) is latency-bound.
template <int RB, int C>
inline constexpr int kPvSets = (RB * C) >= 8 ? 1 : ((RB * C) >= 4 ? 2 : 4);

// o[rb][x0 + c N] += sum_u p[rb * kBlock + u] v[u][x0 + c N] over the keys u < n, the accumulators
// in registers (keys dealt round-robin to S sets, added at the end); KN > 0 fixes n at compile
// time (a whole step: no per-key loop control).
template <int RB, int C, int KN, typename T>
HWY_INLINE void PvSlice(const T* const* v, const float* HWY_RESTRICT p, std::int64_t n, float* HWY_RESTRICT o,
                        std::int64_t os, std::int64_t x0) {
  const DF d;
  constexpr int S = KN > 0 && KN % kPvSets<RB, C> == 0 ? kPvSets<RB, C> : 1;
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
        const VF pb = hn::Set(d, p[rb * kBlock + u]);
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
HWY_INLINE void PvStep(const T* const* v, const float* p, std::int64_t n, float* o, std::int64_t os, std::int64_t len) {
  constexpr int C = kSlice<RB>;
  std::int64_t x = 0;
  for (; x + C * kLanes <= len; x += C * kLanes) PvSlice<RB, C, KN>(v, p, n, o, os, x);
  if constexpr (C > 4) {
    for (; x + 4 * kLanes <= len; x += 4 * kLanes) PvSlice<RB, 4, KN>(v, p, n, o, os, x);
  }
  if constexpr (C > 2) {
    for (; x + 2 * kLanes <= len; x += 2 * kLanes) PvSlice<RB, 2, KN>(v, p, n, o, os, x);
  }
  for (; x < len; x += kLanes) PvSlice<RB, 1, KN>(v, p, n, o, os, x);
}

// The dots' vectors (Tag) and accumulator sets (S) of a pass of RB rows within steps of kStep
// keys: full width or halves (DotsTag, kDotsSets), narrowed while a pass would hold more keys
// than a step (one set, then 256-bit vectors: one row in steps of 8 on AVX-512).
template <bool kHalf, int RB, int kStep>
struct DotsShape {
  static constexpr int kWide = static_cast<int>(hn::MaxLanes(DotsTag<kHalf>()));
  static constexpr bool kOneSet = kPassKeys<RB, kWide, kDotsSets<kHalf>> > kStep;
  static constexpr int S = kOneSet ? 1 : kDotsSets<kHalf>;
  static constexpr bool kNarrow = kPassKeys<RB, kWide, S> > kStep;
  using Tag = std::conditional_t<kNarrow, hn::CappedTag<float, (kNarrow ? kWide / 2 : kWide)>, DotsTag<kHalf>>;
};

// lanes (kHalf false) or lanes_half_dots (kHalf true: the dots on 256-bit halves, DotsTag), in
// steps of kStep keys.
template <bool kHalf, int kStep>
HWY_INLINE void RunLanesSteps(const ValidatedProblem& vp, const DecodePlan& plan, const DecodeTask& t, void* scratch,
                              std::byte* slots, std::int32_t* counters, std::int64_t ahead) {
  RunStepWalkTask<kStep>(
      vp, plan, t, scratch, slots, counters, ahead,
      [](auto rb, auto... a) {
        using Shape = DotsShape<kHalf, decltype(rb)::value, kStep>;
        DotsStep<decltype(rb)::value, typename Shape::Tag, Shape::S, kStep>(a...);
      },
      [](auto rb, auto kn, auto... a) { PvStep<decltype(rb)::value, decltype(kn)::value>(a...); });
}

template <bool kHalf>
HWY_INLINE void RunLanesTask(const ValidatedProblem& vp, const DecodePlan& plan, const DecodeTask& t, void* scratch,
                             std::byte* slots, std::int32_t* counters) {
  // The grouped kernel's distance (grouped_prefetch_keys); none for a call whose K/V fits in
  // cache, where prefetches only cost instructions (they change no result).
  const std::int64_t ahead = plan.kv_bytes <= kDecodeInCacheMaxBytes ? -1 : grouped_prefetch_keys();
  if constexpr (kLanes > kShortStep) {
    if (t.short_steps) {
      RunLanesSteps<kHalf, kShortStep>(vp, plan, t, scratch, slots, counters, ahead);
      return;
    }
  }
  RunLanesSteps<kHalf, kLanes>(vp, plan, t, scratch, slots, counters, ahead);
}

}  // namespace

void RunDecodeLanesImpl(const ValidatedProblem& vp, const DecodePlan& plan, const DecodeTask& t, void* scratch,
                        std::byte* slots, std::int32_t* counters) {
  RunLanesTask<false>(vp, plan, t, scratch, slots, counters);
}

void RunDecodeLanesHalfDotsImpl(const ValidatedProblem& vp, const DecodePlan& plan, const DecodeTask& t, void* scratch,
                                std::byte* slots, std::int32_t* counters) {
  RunLanesTask<true>(vp, plan, t, scratch, slots, counters);
}

int DecodeLanesImpl() { return kLanes; }

}  // namespace HWY_NAMESPACE
}  // namespace kallpa::cpu_flash
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
KALLPA_CPU_FLASH_KERNEL_ENTRY(run_decode_lanes, RunDecodeLanesImpl)
KALLPA_CPU_FLASH_KERNEL_ENTRY(run_decode_lanes_half_dots, RunDecodeLanesHalfDotsImpl)
namespace kallpa::cpu_flash {
HWY_EXPORT(DecodeLanesImpl);
int decode_lane_keys() { return HWY_DYNAMIC_DISPATCH(DecodeLanesImpl)(); }
}  // namespace kallpa::cpu_flash
#endif  // HWY_ONCE
