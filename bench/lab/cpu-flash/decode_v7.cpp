// cpu-flash kernel lab: decode v7 ("grouped"), the first kernel to serve the query heads that
// share a KV head together from each K/V element loaded once.
//
// v5/v6 walk a block in memory order (four key rows across every head at a time), which streams
// from DRAM well, but their kernels take the rows of a GQA group two at a time, so each K/V vector
// is loaded and converted (F16C / bf16 shift) once per pair of rows, and their P·V loads and stores
// the accumulators every four keys. v7 keeps that walk and the stream prefetcher (every head of a
// key row fetched into L2 a fixed number of keys ahead), in steps of eight keys across every head,
// with blocks of 64 keys:
//   - scores: up to four rows of one query position against two keys at a time (one conversion of
//     each K vector feeds every row; RB x KU accumulators within 16 vector registers), only over
//     the keys each query can see, with pairwise transposing reductions;
//   - the online softmax of v5 with the prefill's cheaper exp, over the visible keys' vectors, every
//     row through the masking pass (GroupedSoftmaxMasked);
//   - P·V with the accumulators of up to four rows x a slice of the head dim in registers over
//     the step's eight keys (one conversion of each V vector per slice).
// Production's grouped kernel is v7 with fewer instructions per key (one reduction tree per step,
// whole steps of P·V unrolled, row groups planned once per task, the masking pass skipped for rows
// that see a whole block, lazy rescaling); its lanes kernels widen the step to the vector's lanes.
//
// Checks itself against the reference, then times itself against production (the automatic choice
// and the grouped kernel): build with -DKALLPA_BUILD_LAB=ON, run build/bench/lab/cpu-flash/
// cpu_flash_lab_decode_v7.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "bench/lab/cpu-flash/decode_v7.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

#include "backends/cpu-flash/decode_grouped-inl.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "bench/lab/cpu-flash/lab.h"

HWY_BEFORE_NAMESPACE();
namespace kallpa::cpu_flash {
namespace HWY_NAMESPACE {
namespace {

// Online softmax of the rows of KV head kvh over the block's keys [j0, j0 + nb), every row through
// the masking pass (production's GroupedSoftmax skips it for rows that see the whole block).
void GroupedSoftmaxMasked(Ctx& c, std::int64_t kvh, std::int64_t j0, std::int64_t nb, const std::int64_t* a_i,
                          const std::int64_t* e_i, float* s_rows) {
  const DF d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  (void)nb;
  ForSeeingRows(c, a_i, e_i, [&](std::int64_t r, std::int64_t i, std::int64_t a, std::int64_t e) {
    const std::int64_t row = kvh * c.R + r;
    float* s = s_rows + r * kDecodeGroupedBlock;
    const std::int64_t x0 = a / N * N;
    const float m_old = c.m[row];
    const std::int32_t h = static_cast<std::int32_t>(kvh * c.G + r % c.G);
    const float m_new = MaskScoresAndMax(c, s, x0, e + 1, h, i, j0, a, e, m_old);
    const float m_use = m_new == kNegInf ? 0.0f : m_new;
    const VF sum = ExpInPlaceAndSum(s, x0, e + 1, m_use);
    UpdateRow(c, row, m_new, std::exp(m_old - m_use), SumLanes(d, sum));
  });
}

constexpr std::int64_t kB7 = kDecodeGroupedBlock;
// Keys per step of the walk across every head: a multiple of every dot kernel's key count.
// Eight keys: the scores' walk then reads 8 KiB of rows in memory order for SmolLM2-sized rows and
// 8-16 KiB for 8 heads of 64-128; a walk head by head over 16 keys or more for P·V was 1.2-2x
// slower from beyond the caches (32/8 D64, 64 MiB, side by side), eight per step also keeps the
// accumulators' loads and stores to one per eight keys.
constexpr std::int64_t kGroupStep = 8;

// Keys per dot step for RB rows: RB x KU accumulators plus KU key vectors within 16 registers, and
// enough independent FMA chains (at least eight) to hide the FMA latency.
template <int RB>
inline constexpr int kGroupKeys = RB == 1   ? 8
                                  : RB == 2 ? 4
                                            : 2;

// s[rb * kB7 + j + u] = <q[rb], k[j + u]> for u < KU and RB rows (q rows qs floats apart),
// over len elements.
template <int RB, int KU, typename T>
HWY_INLINE void GroupDots(const float* HWY_RESTRICT q, std::int64_t qs, const T* const* k, std::int64_t j,
                          std::int64_t len, float* HWY_RESTRICT s) {
  const DF d;
  VF acc[RB][KU];
  for (int rb = 0; rb < RB; ++rb)
    for (int u = 0; u < KU; ++u) acc[rb][u] = hn::Zero(d);
  AccumulateDots<RB, KU>(q, qs, k + j, len, &acc[0][0]);
  if constexpr (KU % 4 == 0) {
    for (int rb = 0; rb < RB; ++rb)
      for (int u = 0; u < KU; u += 4)
        Sum4(acc[rb][u], acc[rb][u + 1], acc[rb][u + 2], acc[rb][u + 3], s + rb * kB7 + j + u);
  } else if constexpr (KU == 2) {
    // Rows in pairs: one transposing reduction gives both keys of both rows.
    float t[4];
    for (int rb = 0; rb < RB; rb += 2) {
      const int r1 = rb + 1 < RB ? rb + 1 : rb;
      Sum4(acc[rb][0], acc[rb][1], acc[r1][0], acc[r1][1], t);
      s[rb * kB7 + j] = t[0];
      s[rb * kB7 + j + 1] = t[1];
      if (r1 != rb) {
        s[r1 * kB7 + j] = t[2];
        s[r1 * kB7 + j + 1] = t[3];
      }
    }
  } else {
    for (int rb = 0; rb < RB; ++rb)
      for (int u = 0; u < KU; ++u) s[rb * kB7 + j + u] = SumLanes(d, acc[rb][u]);
  }
}

// Scores of RB rows (one query position) against the block's keys [a, e].
template <int RB, typename T>
HWY_INLINE void GroupScores(const float* q, std::int64_t qs, const T* const* k, std::int64_t a, std::int64_t e,
                            std::int64_t len, float* s) {
  constexpr int KU = kGroupKeys<RB>;
  std::int64_t j = a;
  for (; j + KU <= e + 1; j += KU) GroupDots<RB, KU>(q, qs, k, j, len, s);
  if constexpr (KU > 2) {
    for (; j + 2 <= e + 1; j += 2) GroupDots<RB, 2>(q, qs, k, j, len, s);
  }
  for (; j <= e; ++j) GroupDots<RB, 1>(q, qs, k, j, len, s);
}

// o[rb][x0 + c N] += sum_{jj in [a, e]} p[rb][jj] v[jj][x0 + c N] for C vectors: the accumulators
// stay in registers over the step's keys.
template <int RB, int C, typename T>
HWY_INLINE void GroupPvSlice(const T* const* v, const float* HWY_RESTRICT p, std::int64_t a, std::int64_t e,
                             float* HWY_RESTRICT o, std::int64_t os, std::int64_t x0) {
  const DF d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  VF acc[RB][C];
  for (int rb = 0; rb < RB; ++rb)
    for (int c = 0; c < C; ++c) acc[rb][c] = hn::Load(d, o + rb * os + x0 + c * N);
  for (std::int64_t jj = a; jj <= e; ++jj) {
    VF vv[C];
    const T* vr = v[jj] + x0;
    for (int c = 0; c < C; ++c) vv[c] = LoadAsF32(vr + c * N);
    for (int rb = 0; rb < RB; ++rb) {
      const VF pb = hn::Set(d, p[rb * kB7 + jj]);
      for (int c = 0; c < C; ++c) acc[rb][c] = hn::MulAdd(pb, vv[c], acc[rb][c]);
    }
  }
  for (int rb = 0; rb < RB; ++rb)
    for (int c = 0; c < C; ++c) hn::Store(acc[rb][c], d, o + rb * os + x0 + c * N);
}

// Head-dim vectors per P·V slice for RB rows: RB x C accumulators within 16 registers.
template <int RB>
inline constexpr int kGroupSlice = RB == 1   ? 8
                                   : RB == 2 ? 4
                                   : RB == 3 ? 3
                                             : 2;

template <int RB, typename T>
HWY_INLINE void GroupPv(const T* const* v, const float* p, std::int64_t a, std::int64_t e, float* o, std::int64_t os,
                        std::int64_t len) {
  const DF d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  constexpr int C = kGroupSlice<RB>;
  std::int64_t x = 0;
  for (; x + C * N <= len; x += C * N) GroupPvSlice<RB, C>(v, p, a, e, o, os, x);
  if constexpr (C > 2) {
    for (; x + 2 * N <= len; x += 2 * N) GroupPvSlice<RB, 2>(v, p, a, e, o, os, x);
  }
  for (; x < len; x += N) GroupPvSlice<RB, 1>(v, p, a, e, o, os, x);
}

// The rows of query i of one KV head in as few blocks of at most four as possible, of near-equal
// size (9 rows: 3 + 3 + 3; 6: 3 + 3; 5: 3 + 2).
template <typename F>
HWY_INLINE void ForGroupBlocks(std::int64_t G, std::int64_t i, F&& f) {
  const std::int64_t blocks = (G + 3) / 4;
  std::int64_t r = i * G;
  for (std::int64_t b = 0; b < blocks; ++b) {
    const std::int64_t n = G / blocks + (b < G % blocks ? 1 : 0);
    switch (n) {
      case 4: f(r, std::integral_constant<int, 4>()); break;
      case 3: f(r, std::integral_constant<int, 3>()); break;
      case 2: f(r, std::integral_constant<int, 2>()); break;
      default: f(r, std::integral_constant<int, 1>()); break;
    }
    r += n;
  }
}

// One block of keys [j0, j0 + nb), walked in memory order as v5/v6 do (streamed from beyond the
// caches, a walk head by head over a block is up to 2x slower: the hardware prefetchers follow
// only a forward stream): steps of kGroupStep key rows across every KV head for the scores, the
// softmax of every row, then steps across every head again for P·V. K and V each prefetched
// `ahead` keys in front of the walk, a slice of a step's rows per head (v6).
template <typename T>
void GroupedBlock(Ctx& c, std::int64_t j0, std::int64_t nb, const std::int64_t* a_i, const std::int64_t* e_i,
                  const std::int64_t* koff, const std::int64_t* voff, StreamPrefetcher& kpf, StreamPrefetcher& vpf,
                  std::int64_t ahead) {
  const T* kb = static_cast<const T*>(c.p->k.data);
  const T* vb = static_cast<const T*>(c.p->v.data);
  const T* rows[kB7];
  for (std::int64_t u0 = 0; u0 < nb; u0 += kGroupStep) {
    const std::int64_t nk = std::min(kGroupStep, nb - u0);
    for (std::int64_t kvh = 0; kvh < c.hkv; ++kvh) {
      kpf.until(j0 + u0 + ahead + (kvh + 1) * nk / c.hkv);
      for (std::int64_t u = u0; u < u0 + nk; ++u) rows[u] = kb + koff[u] + kvh * c.khs;
      float* s_rows = c.s_all + kvh * c.R * kB7;
      for (std::int64_t i = 0; i < c.sq; ++i) {
        const std::int64_t a = std::max(a_i[i], u0), e = std::min(e_i[i], u0 + nk - 1);
        if (a > e) continue;
        ForGroupBlocks(c.G, i, [&](std::int64_t r, auto rb) {
          GroupScores<decltype(rb)::value>(c.q + (kvh * c.R + r) * c.Dp, c.Dp, rows, a, e, c.D, s_rows + r * kB7);
        });
      }
    }
  }
  for (std::int64_t kvh = 0; kvh < c.hkv; ++kvh)
    GroupedSoftmaxMasked(c, kvh, j0, nb, a_i, e_i, c.s_all + kvh * c.R * kB7);
  for (std::int64_t u0 = 0; u0 < nb; u0 += kGroupStep) {
    const std::int64_t nk = std::min(kGroupStep, nb - u0);
    for (std::int64_t kvh = 0; kvh < c.hkv; ++kvh) {
      vpf.until(j0 + u0 + ahead + (kvh + 1) * nk / c.hkv);
      for (std::int64_t u = u0; u < u0 + nk; ++u) rows[u] = vb + voff[u] + kvh * c.vhs;
      const float* s_rows = c.s_all + kvh * c.R * kB7;
      for (std::int64_t i = 0; i < c.sq; ++i) {
        // Only the row's visible keys: a masked value may be NaN and must not be read.
        const std::int64_t a = std::max(a_i[i], u0), e = std::min(e_i[i], u0 + nk - 1);
        if (a > e) continue;
        ForGroupBlocks(c.G, i, [&](std::int64_t r, auto rb) {
          GroupPv<decltype(rb)::value>(rows, s_rows + r * kB7, a, e, c.acc + (kvh * c.R + r) * c.Dvp, c.Dvp, c.Dv);
        });
      }
    }
  }
}

void RunDecodeV7(const ValidatedProblem& vp, const DecodePlan& plan, const DecodeTask& t, void* scratch,
                 std::byte* slots, std::int32_t* counters) {
  const std::int64_t ahead = grouped_prefetch_keys();
  RunGroupedTask(vp, plan, t, scratch, slots, counters, kB7,
                 [&](auto type, Ctx& c, std::int64_t j0, std::int64_t nb, const std::int64_t* a_i,
                     const std::int64_t* e_i, StreamPrefetcher& kpf, StreamPrefetcher& vpf) {
                   GroupedBlock<decltype(type)>(c, j0, nb, a_i, e_i, c.koff, c.voff, kpf, vpf, ahead);
                 });
}

}  // namespace
}  // namespace HWY_NAMESPACE
}  // namespace kallpa::cpu_flash
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kallpa::cpu_flash {
HWY_EXPORT(RunDecodeV7);
namespace {

void run_lab_kernel(const ValidatedProblem& problem, const DecodePlan& plan, const DecodeTask& task, void* scratch,
                    std::byte* slots, std::int32_t* counters) {
  HWY_DYNAMIC_DISPATCH(RunDecodeV7)(problem, plan, task, scratch, slots, counters);
}

}  // namespace
}  // namespace kallpa::cpu_flash

int main() {
  using namespace kallpa;
  using namespace kallpa::cpu_flash;
  const lab::Runner kernel = [](const ValidatedProblem& vp) { lab::run_decode(vp, &run_lab_kernel); };
  const std::vector<lab::Shape> checks = {
      {.b = 1, .sq = 1, .skv = 700, .hq = 8, .hkv = 8, .d = 64, .dt = DType::f16},
      {.b = 2, .sq = 1, .skv = 5000, .hq = 32, .hkv = 8, .d = 128, .dt = DType::bf16},
      {.b = 1, .sq = 2, .skv = 900, .hq = 9, .hkv = 3, .d = 64, .dt = DType::f16, .page = 16, .causal = true},
      {.b = 1, .sq = 1, .skv = 300, .hq = 8, .hkv = 2, .d = 64, .dt = DType::f32},
  };
  std::printf("cpu-flash lab: decode v7 (grouped) (SIMD target %s)\n", CpuFlashBackend::simd_target().c_str());
  if (!lab::check("decode v7", checks, kernel)) return 1;
  const std::vector<lab::Shape> timed = {
      {.b = 1, .sq = 1, .skv = 65536, .hq = 32, .hkv = 8, .d = 64, .dt = DType::f16},
      {.b = 1, .sq = 1, .skv = 2048, .hq = 9, .hkv = 3, .d = 64, .dt = DType::f16, .page = 16},
  };
  lab::bench("decode v7", kernel, "production", Options{}, timed, 20);
  lab::bench("decode v7", kernel, "grouped", Options{0, Path::fast, DecodeKernel::grouped}, timed, 20);
  return 0;
}
#endif  // HWY_ONCE
