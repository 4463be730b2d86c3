// Shared by the memory-order decode kernels of cpu-flash (decode_grouped.cpp, decode_lanes.cpp),
// which serve the query rows of a KV head together from each K/V element loaded once: the task
// driver, the walk over a block in steps across every KV head, the dot products of a row group,
// the online softmax and the exported entry. Highway per-target header: included once per target
// by each translation unit that uses it.

// Defines kallpa::cpu_flash::entry (run_decode_grouped, run_decode_lanes..., declared in
// flash_internal.h) to run the best SIMD target's `impl`; in the HWY_ONCE part of the kernel's
// translation unit.
#ifndef KALLPA_CPU_FLASH_KERNEL_ENTRY
#define KALLPA_CPU_FLASH_KERNEL_ENTRY(entry, impl)                                                           \
  namespace kallpa::cpu_flash {                                                                              \
  HWY_EXPORT(impl);                                                                                          \
  void entry(const ValidatedProblem& problem, const DecodePlan& plan, const DecodeTask& task, void* scratch, \
             std::byte* slots, std::int32_t* counters) {                                                     \
    HWY_DYNAMIC_DISPATCH(impl)(problem, plan, task, scratch, slots, counters);                               \
  }                                                                                                          \
  }  // namespace kallpa::cpu_flash
#endif

#if defined(KALLPA_BACKENDS_CPU_FLASH_DECODE_GROUPED_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KALLPA_BACKENDS_CPU_FLASH_DECODE_GROUPED_INL_H_
#undef KALLPA_BACKENDS_CPU_FLASH_DECODE_GROUPED_INL_H_
#else
#define KALLPA_BACKENDS_CPU_FLASH_DECODE_GROUPED_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "backends/cpu-flash/decode_common-inl.h"
#include "backends/cpu-flash/fast_exp-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace kallpa::cpu_flash {
namespace HWY_NAMESPACE {

// acc[rb * KU + u] += <q[rb], k[u]> over len elements for RB rows (q rows qs floats apart) and KU
// keys: each K vector is loaded and converted once for every row.
template <int RB, int KU, typename T>
HWY_INLINE void AccumulateDots(const float* HWY_RESTRICT q, std::int64_t qs, const T* const* k, std::int64_t len,
                               VF* acc) {
  const DF d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  const T* kr[KU];
  for (int u = 0; u < KU; ++u) kr[u] = k[u];
  for (std::int64_t x = 0; x < len; x += N) {
    VF kv[KU];
    for (int u = 0; u < KU; ++u) kv[u] = LoadAsF32(kr[u] + x);
    for (int rb = 0; rb < RB; ++rb) {
      const VF qv = hn::Load(d, q + rb * qs + x);
      for (int u = 0; u < KU; ++u) acc[rb * KU + u] = hn::MulAdd(qv, kv[u], acc[rb * KU + u]);
    }
  }
}

// Internal linkage, as each kernel's own softmax had: called directly, not through the PLT.
namespace {

// How far (in natural-log units) a block's scores may rise above a row's running max before the
// row rescales: ln 256, so probabilities stay below 256.
constexpr float kRescaleSlack = 5.545177444479562f;

// s[x] = exp(s[x] - m) over the vectors [x0, end); returns their lane-wise sum.
HWY_INLINE VF ExpInPlaceAndSum(float* HWY_RESTRICT s, std::int64_t x0, std::int64_t end, float m) {
  const DF d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  const VF mu = hn::Set(d, m);
  VF sum = hn::Zero(d);
  for (std::int64_t x = x0; x < end; x += N) {
    const VF pj = FastExp(d, hn::Sub(hn::Load(d, s + x), mu));
    hn::Store(pj, d, s + x);
    sum = hn::Add(sum, pj);
  }
  return sum;
}

// Lazy rescaling (as FlashAttention-4 does on GPUs) for a row that sees all nb keys of a block
// (nb a multiple of the vector length) and has a finite running max m: when no score exceeds
// m + kRescaleSlack (and none is NaN), the block is exponentiated against m itself and only its sum
// joins l. The exact path's horizontal max, exp(m_old - m_new) and rescale of the row's
// accumulator, a chain of dependent steps per row and block that left GQA decode's softmax at 7-11
// cycles per key and KV head (four rows), are skipped. Softmax is invariant to the shift, so the
// result is the same up to rounding; probabilities up to 256 are harmless in f32 (l and o scale
// alike). Returns false, having written nothing, when the block must take the exact path, which
// then raises m.
HWY_INLINE bool SoftmaxBelowRunningMax(float* HWY_RESTRICT s, std::int64_t nb, float m, float& l) {
  const DF d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  const VF lim = hn::Set(d, m + kRescaleSlack);
  auto over = hn::Lt(lim, lim);  // all false
  // Not (s <= lim): true above the limit and for NaN.
  for (std::int64_t x = 0; x < nb; x += N) over = hn::Or(over, hn::Not(hn::Le(hn::Load(d, s + x), lim)));
  if (!hn::AllFalse(d, over)) return false;
  l += SumLanes(d, ExpInPlaceAndSum(s, 0, nb, m));
  return true;
}

// Online softmax of the rows of KV head kvh over the block's keys [j0, j0 + nb): s_rows
// [R][kDecodeGroupedBlock] holds the scores of each row's visible keys [a, e] and receives their
// probabilities; m, l and the rows' accumulators are updated. SoftmaxRows with the prefill's
// cheaper exp, over the vectors that hold visible keys only; a row that sees every key of a block
// without softcap or ALiBi skips the masking pass (the max and the NaN check ride on one read of
// the scores), and first tries SoftmaxBelowRunningMax.
inline void GroupedSoftmax(Ctx& c, std::int64_t kvh, std::int64_t j0, std::int64_t nb, const std::int64_t* a_i,
                           const std::int64_t* e_i, float* s_rows) {
  const DF d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  const std::int64_t G = c.G;
  const bool plain = !(c.softcap > 0.0f) && c.slopes == nullptr && nb % N == 0;
  ForSeeingRows(c, a_i, e_i, [&](std::int64_t r, std::int64_t i, std::int64_t a, std::int64_t e) {
    const std::int64_t row = kvh * c.R + r;
    float* s = s_rows + r * kDecodeGroupedBlock;
    const std::int64_t x0 = a / N * N;
    const float m_old = c.m[row];
    const bool whole = plain && a == 0 && e == nb - 1;
    if (whole && m_old > kNegInf && SoftmaxBelowRunningMax(s, nb, m_old, c.l[row])) return;
    float m_new;
    if (whole) {
      VF mt = hn::Set(d, kNegInf);
      auto nan = hn::Lt(mt, mt);  // all false
      for (std::int64_t x = 0; x < nb; x += N) {
        const VF sv = hn::Load(d, s + x);
        nan = hn::Or(nan, hn::IsNaN(sv));
        mt = hn::Max(mt, sv);
      }
      m_new = !hn::AllFalse(d, nan) ? std::numeric_limits<float>::quiet_NaN()
                                    : std::max(m_old, hn::GetLane(hn::MaxOfLanes(d, mt)));
    } else {
      const std::int32_t h = static_cast<std::int32_t>(kvh * G + r % G);
      m_new = MaskScoresAndMax(c, s, x0, e + 1, h, i, j0, a, e, m_old);
    }
    const float m_use = m_new == kNegInf ? 0.0f : m_new;
    const VF sum = ExpInPlaceAndSum(s, x0, e + 1, m_use);
    UpdateRow(c, row, m_new, std::exp(m_old - m_use), SumLanes(d, sum));
  });
}

// A group of up to four query rows of one query position, which share each K/V vector.
struct RowGroup {
  std::int64_t i;  // query position
  std::int64_t r;  // first row within the KV head
  int rb;          // rows
};

// The rows of every query position in as few groups of at most four as possible, of near-equal
// size (9 rows: 3 + 3 + 3; 6: 3 + 3; 5: 3 + 2). Returns the number of groups.
inline int PlanRowGroups(std::int64_t sq, std::int64_t G, RowGroup* out) {
  const std::int64_t blocks = (G + 3) / 4;
  int n = 0;
  for (std::int64_t i = 0; i < sq; ++i) {
    std::int64_t r = i * G;
    for (std::int64_t b = 0; b < blocks; ++b) {
      const std::int64_t rows = G / blocks + (b < G % blocks ? 1 : 0);
      out[n++] = RowGroup{i, r, static_cast<int>(rows)};
      r += rows;
    }
  }
  return n;
}

// s[rb * kDecodeGroupedBlock + u] = <q[rb], k[u]> for the RB rows (q rows qs floats apart) and the n
// keys of a step that the rows see only in part: one key at a time.
template <int RB, typename T>
HWY_INLINE void DotsPart(const float* HWY_RESTRICT q, std::int64_t qs, const T* const* k, std::int64_t n,
                         std::int64_t len, float* HWY_RESTRICT s) {
  const DF d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  for (std::int64_t u = 0; u < n; ++u) {
    VF acc[RB];
    for (int rb = 0; rb < RB; ++rb) acc[rb] = hn::Zero(d);
    for (std::int64_t x = 0; x < len; x += N) {
      const VF kv = LoadAsF32(k[u] + x);
      for (int rb = 0; rb < RB; ++rb) acc[rb] = hn::MulAdd(hn::Load(d, q + rb * qs + x), kv, acc[rb]);
    }
    for (int rb = 0; rb < RB; ++rb) s[rb * kDecodeGroupedBlock + u] = SumLanes(d, acc[rb]);
  }
}

// Calls f(integral_constant<int, rb>) for a group's row count.
template <typename F>
HWY_INLINE void WithRows(int rb, F&& f) {
  switch (rb) {
    case 4: f(std::integral_constant<int, 4>()); break;
    case 3: f(std::integral_constant<int, 3>()); break;
    case 2: f(std::integral_constant<int, 2>()); break;
    default: f(std::integral_constant<int, 1>()); break;
  }
}

// One block of keys [j0, j0 + nb) of the grouped and lanes kernels, in memory order: steps of
// kStep key rows across every KV head for the scores, the softmax of every row, then steps across every head
// again for P·V, K and V each prefetched `ahead` keys in front of the walk (ahead < 0: none). The
// kernel's two steps come as callables taking the row count RB (and for P·V the compile-time key
// count KN) as std::integral_constant, then its arguments: on a step that a row group sees whole,
// dots(rb, q, Dp, rows, D, s) writes its scores and pv(rb, kn = kStep, rows, p, kStep, o, Dvp, Dv)
// adds its values; on the steps it sees in part (causal and window edges, the end of a chunk),
// DotsPart and pv(rb, kn = 0, rows, p, n, o, Dvp, Dv) take the visible keys only.
template <int kStep, typename T, typename Dots, typename Pv>
HWY_INLINE void StepWalk(Ctx& c, const RowGroup* groups, int n_groups, std::int64_t j0, std::int64_t nb,
                         const std::int64_t* a_i, const std::int64_t* e_i, StreamPrefetcher& kpf, StreamPrefetcher& vpf,
                         std::int64_t ahead, Dots&& dots, Pv&& pv) {
  constexpr std::int64_t kB = kDecodeGroupedBlock;
  static_assert(kB % kStep == 0, "a block is whole steps");
  const T* kb = static_cast<const T*>(c.p->k.data);
  const T* vb = static_cast<const T*>(c.p->v.data);
  const std::int64_t D = c.D, Dp = c.Dp, Dvp = c.Dvp, R = c.R;
  const bool prefetch = ahead >= 0;
  const T* rows[kStep];
  for (std::int64_t u0 = 0; u0 < nb; u0 += kStep) {
    const std::int64_t nk = std::min<std::int64_t>(kStep, nb - u0);
    for (std::int64_t u = 0; u < nk; ++u) rows[u] = kb + c.koff[u0 + u];
    for (std::int64_t kvh = 0; kvh < c.hkv; ++kvh) {
      if (prefetch) kpf.until(j0 + u0 + ahead + (kvh + 1) * nk / c.hkv);
      const float* qh = c.q + kvh * R * Dp;
      float* sh = c.s_all + kvh * R * kB;
      for (int g = 0; g < n_groups; ++g) {
        const RowGroup& rg = groups[g];
        const std::int64_t a = std::max(a_i[rg.i], u0), e = std::min(e_i[rg.i], u0 + nk - 1);
        if (a > e) continue;
        const float* q = qh + rg.r * Dp;
        float* s = sh + rg.r * kB;
        WithRows(rg.rb, [&](auto rbc) {
          if (e - a + 1 == kStep) dots(rbc, q, Dp, rows, D, s + u0);
          else DotsPart<decltype(rbc)::value>(q, Dp, rows + (a - u0), e - a + 1, D, s + a);
        });
      }
      for (std::int64_t u = 0; u < nk; ++u) rows[u] += c.khs;
    }
  }
  for (std::int64_t kvh = 0; kvh < c.hkv; ++kvh) GroupedSoftmax(c, kvh, j0, nb, a_i, e_i, c.s_all + kvh * R * kB);
  for (std::int64_t u0 = 0; u0 < nb; u0 += kStep) {
    const std::int64_t nk = std::min<std::int64_t>(kStep, nb - u0);
    for (std::int64_t u = 0; u < nk; ++u) rows[u] = vb + c.voff[u0 + u];
    for (std::int64_t kvh = 0; kvh < c.hkv; ++kvh) {
      if (prefetch) vpf.until(j0 + u0 + ahead + (kvh + 1) * nk / c.hkv);
      const float* sh = c.s_all + kvh * R * kB;
      float* oh = c.acc + kvh * R * Dvp;
      for (int g = 0; g < n_groups; ++g) {
        const RowGroup& rg = groups[g];
        // Only the rows' visible keys: a masked value may be NaN and must not be read.
        const std::int64_t a = std::max(a_i[rg.i], u0), e = std::min(e_i[rg.i], u0 + nk - 1);
        if (a > e) continue;
        const float* p = sh + rg.r * kB + a;
        float* o = oh + rg.r * Dvp;
        WithRows(rg.rb, [&](auto rbc) {
          using Whole = std::integral_constant<int, kStep>;
          using Part = std::integral_constant<int, 0>;
          if (e - a + 1 == kStep) pv(rbc, Whole(), rows, p, kStep, o, Dvp, c.Dv);
          else pv(rbc, Part(), rows + (a - u0), p, e - a + 1, o, Dvp, c.Dv);
        });
      }
      for (std::int64_t u = 0; u < nk; ++u) rows[u] += c.vhs;
    }
  }
}

}  // namespace

// One task of a memory-order kernel. Layouts it cannot read in place (KvInPlace) run by_head,
// which converts them first (choose_decode_kernel never picks these kernels for them). Else: the
// task's context and K / V stream prefetchers, then for each block [j0, j0 + nb) of at most
// block_keys keys that a query sees, block(T(), c, j0, nb, a_i, e_i, kpf, vpf) with T the K/V
// element type, a_i[i] / e_i[i] the first / last key of the block that query i sees (none when
// a_i[i] > e_i[i]) and the block's row offsets in c.koff / c.voff; last the task's output.
template <typename Block>
HWY_INLINE void RunGroupedTask(const ValidatedProblem& vp, const DecodePlan& plan, const DecodeTask& t, void* scratch,
                               std::byte* slots, std::int32_t* counters, std::int64_t block_keys, Block&& block) {
  if (!KvInPlace(vp)) {
    run_decode_by_head(vp, plan, t, scratch, slots, counters);
    return;
  }
  const AttentionProblem& p = vp.problem();
  Ctx c;
  InitTask(c, vp, plan, t, scratch);
  StreamPrefetcher kpf, vpf;
  kpf.init(c, p.k, true, t.k_begin, std::max(t.k_end, t.prefetch_end));
  vpf.init(c, p.v, false, t.k_begin, std::max(t.k_end, t.prefetch_end));
  std::int64_t a_i[kDecodeMaxRows], e_i[kDecodeMaxRows];
  for (std::int64_t j0 = t.k_begin; j0 < t.k_end; j0 += block_keys) {
    const std::int64_t nb = std::min(block_keys, t.k_end - j0);
    bool any = false;
    for (std::int64_t i = 0; i < c.sq; ++i) {
      a_i[i] = std::max(c.lo[i], j0) - j0;
      e_i[i] = std::min(c.hi[i], j0 + nb - 1) - j0;
      any |= a_i[i] <= e_i[i];
    }
    if (!any) continue;
    FillOffsets(c, j0, nb, c.koff, c.voff);
    ForKvType(p.k.dtype, [&](auto type) { block(type, c, j0, nb, a_i, e_i, kpf, vpf); });
  }
  FinishTask(c, plan, slots, counters);
}

// One task of the grouped or lanes kernel: the row groups planned once, then StepWalk<kStep> over each block
// with the kernel's full-step dots and P·V (see StepWalk), K/V prefetched `ahead` keys ahead.
// Each kernel passes its own step functions as
//   [](auto rb, auto... a) { DotsStep<decltype(rb)::value>(a...); }
//   [](auto rb, auto kn, auto... a) { PvStep<decltype(rb)::value, decltype(kn)::value>(a...); }
template <int kStep, typename Dots, typename Pv>
HWY_INLINE void RunStepWalkTask(const ValidatedProblem& vp, const DecodePlan& plan, const DecodeTask& t, void* scratch,
                                std::byte* slots, std::int32_t* counters, std::int64_t ahead, Dots&& dots, Pv&& pv) {
  RowGroup groups[kDecodeMaxRows];
  const int n_groups = PlanRowGroups(vp.seqlen_q(t.b), vp.group_size(), groups);
  RunGroupedTask(vp, plan, t, scratch, slots, counters, kDecodeGroupedBlock,
                 [&](auto type, Ctx& c, std::int64_t j0, std::int64_t nb, const std::int64_t* a_i,
                     const std::int64_t* e_i, StreamPrefetcher& kpf, StreamPrefetcher& vpf) {
                   StepWalk<kStep, decltype(type)>(c, groups, n_groups, j0, nb, a_i, e_i, kpf, vpf, ahead, dots, pv);
                 });
}

}  // namespace HWY_NAMESPACE
}  // namespace kallpa::cpu_flash
HWY_AFTER_NAMESPACE();

#endif  // KALLPA_BACKENDS_CPU_FLASH_DECODE_GROUPED_INL_H_
