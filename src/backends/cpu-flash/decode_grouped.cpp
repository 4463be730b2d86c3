// cpu-flash decode in steps of eight keys across every KV head (DecodeKernel::grouped): the
// kernel for calls whose K/V outgrow the caches on targets narrower than 16 lanes (AVX2 and
// below). Compiled once per Highway target and dispatched at run time.
//
// A block of kDecodeGroupedBlock keys is walked in memory order (StepWalk): eight key rows across
// every KV head for the scores, the softmax of every row, then eight value rows across every head
// for P·V, K and V each prefetched a fixed number of keys ahead into L2 as one forward stream per
// thread, so that the memory stays busy. The query rows of a GQA group are served together from
// each K/V vector converted once:
//   - scores: on a step where a row group sees all eight keys, its RB x KU accumulators (RB * KU =
//     8: 1 x 8, 2 x 4, 4 x 2 keys, 3 x 2 with two idle) reduce in one tree to one vector of eight
//     sums, stored as KU-float pieces of the score rows;
//   - P·V: over a whole step the eight keys are a compile-time loop (no per-key control), the
//     accumulators of up to four rows x a slice of the head dim in registers;
//   - the row groups of a KV head are planned once per task, not per (step, head);
//   - the softmax of a row that sees every key of a block without softcap or ALiBi skips the
//     masking pass (GroupedSoftmax).
// Steps that a row sees only in part (causal and window edges, the last keys of a chunk) take
// per-key kernels. Layouts that the kernel cannot read in place run by_head.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "backends/cpu-flash/decode_grouped.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

#include "backends/cpu-flash/decode_grouped-inl.h"

HWY_BEFORE_NAMESPACE();
namespace kallpa::cpu_flash {
namespace HWY_NAMESPACE {
namespace {

constexpr std::int64_t kBlock = kDecodeGroupedBlock;
constexpr int kStep = 8;  // keys per step of the walk across every head

// Keys per pass of the full-step dot kernel for RB rows: RB x KU = 8 accumulators, one reduction.
template <int RB>
inline constexpr int kPassKeys = RB == 1   ? 8
                                 : RB == 2 ? 4
                                           : 2;

// Head-dim vectors per P·V slice for RB rows: RB x C accumulators within 16 registers.
template <int RB>
inline constexpr int kSlice = RB == 1   ? 8
                              : RB == 2 ? 4
                              : RB == 3 ? 3
                                        : 2;

// s[rb * kBlock + u] = <q[rb], k[u]> for the RB rows (q rows qs floats apart) and eight keys.
template <int RB, typename T>
HWY_INLINE void DotsStep(const float* HWY_RESTRICT q, std::int64_t qs, const T* const* k, std::int64_t len,
                         float* HWY_RESTRICT s) {
  constexpr int KU = kPassKeys<RB>;
  const DF d;
  for (int k0 = 0; k0 < kStep; k0 += KU) {
    VF acc[8];
    for (int t = 0; t < 8; ++t) acc[t] = hn::Zero(d);
    AccumulateDots<RB, KU>(q, qs, k + k0, len, acc);
#if HWY_TARGET != HWY_SCALAR
    if constexpr (hn::MaxLanes(DF()) == 8) {
      // One tree for the eight dots: lane rb * KU + u = row rb, key k0 + u.
      const VF u03 = Sum4Blocks(acc[0], acc[1], acc[2], acc[3]);
      const VF u47 = Sum4Blocks(acc[4], acc[5], acc[6], acc[7]);
      const VF sums = hn::Add(hn::ConcatLowerLower(d, u47, u03), hn::ConcatUpperUpper(d, u47, u03));
      if constexpr (KU == 8) {
        hn::StoreU(sums, d, s + k0);
      } else {
        const hn::Half<DF> d4;
        const auto lo = hn::LowerHalf(d4, sums), hi = hn::UpperHalf(d4, sums);
        if constexpr (KU == 4) {
          hn::StoreU(lo, d4, s + k0);
          hn::StoreU(hi, d4, s + kBlock + k0);
        } else {
          const hn::Half<hn::Half<DF>> d2;
          hn::StoreU(hn::LowerHalf(d2, lo), d2, s + k0);
          hn::StoreU(hn::UpperHalf(d2, lo), d2, s + kBlock + k0);
          hn::StoreU(hn::LowerHalf(d2, hi), d2, s + 2 * kBlock + k0);
          if constexpr (RB == 4) hn::StoreU(hn::UpperHalf(d2, hi), d2, s + 3 * kBlock + k0);
        }
      }
      continue;
    }
#endif
    // Other widths: two transposing reductions of four (one lane per dot on the scalar target).
    float t[8];
    Sum4(acc[0], acc[1], acc[2], acc[3], t);
    Sum4(acc[4], acc[5], acc[6], acc[7], t + 4);
    for (int rb = 0; rb < RB; ++rb)
      for (int u = 0; u < KU; ++u) s[rb * kBlock + k0 + u] = t[rb * KU + u];
  }
}

// o[rb][x0 + c N] += sum_u p[rb * kBlock + u] v[u][x0 + c N] over the keys u < n, the accumulators
// in registers; KN > 0 fixes n at compile time (a whole step: no per-key loop control).
template <int RB, int C, int KN, typename T>
HWY_INLINE void PvSlice(const T* const* v, const float* HWY_RESTRICT p, std::int64_t n, float* HWY_RESTRICT o,
                        std::int64_t os, std::int64_t x0) {
  const DF d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  VF acc[RB][C];
  for (int rb = 0; rb < RB; ++rb)
    for (int c = 0; c < C; ++c) acc[rb][c] = hn::Load(d, o + rb * os + x0 + c * N);
  const std::int64_t keys = KN > 0 ? KN : n;
  for (std::int64_t u = 0; u < keys; ++u) {
    VF vv[C];
    for (int c = 0; c < C; ++c) vv[c] = LoadAsF32(v[u] + x0 + c * N);
    for (int rb = 0; rb < RB; ++rb) {
      const VF pb = hn::Set(d, p[rb * kBlock + u]);
      for (int c = 0; c < C; ++c) acc[rb][c] = hn::MulAdd(pb, vv[c], acc[rb][c]);
    }
  }
  for (int rb = 0; rb < RB; ++rb)
    for (int c = 0; c < C; ++c) hn::Store(acc[rb][c], d, o + rb * os + x0 + c * N);
}

template <int RB, int KN, typename T>
HWY_INLINE void PvStep(const T* const* v, const float* p, std::int64_t n, float* o, std::int64_t os, std::int64_t len) {
  const DF d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  constexpr int C = kSlice<RB>;
  std::int64_t x = 0;
  for (; x + C * N <= len; x += C * N) PvSlice<RB, C, KN>(v, p, n, o, os, x);
  if constexpr (C > 2) {
    for (; x + 2 * N <= len; x += 2 * N) PvSlice<RB, 2, KN>(v, p, n, o, os, x);
  }
  for (; x < len; x += N) PvSlice<RB, 1, KN>(v, p, n, o, os, x);
}

}  // namespace

void RunDecodeGroupedImpl(const ValidatedProblem& vp, const DecodePlan& plan, const DecodeTask& t, void* scratch,
                          std::byte* slots, std::int32_t* counters) {
  const std::int64_t ahead = grouped_prefetch_keys();
  RunStepWalkTask<kStep>(
      vp, plan, t, scratch, slots, counters, ahead, [](auto rb, auto... a) { DotsStep<decltype(rb)::value>(a...); },
      [](auto rb, auto kn, auto... a) { PvStep<decltype(rb)::value, decltype(kn)::value>(a...); });
}

}  // namespace HWY_NAMESPACE
}  // namespace kallpa::cpu_flash
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
KALLPA_CPU_FLASH_KERNEL_ENTRY(run_decode_grouped, RunDecodeGroupedImpl)
#endif  // HWY_ONCE
