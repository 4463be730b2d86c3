// cpu-flash kernel lab: decode v6 ("fused"), v5 with its prefetches spread out.
//
// v5's walk in memory order, with one change: the prefetches of each step are spread over its
// heads instead of issued as one burst per step (a burst of a step's rows fills the miss queues and
// stalls the loads behind it). Four rows of a GQA group per dot pass take two keys at a time
// (DotsRK), three or fewer four. Everything else is v5's. It was the automatic path's kernel for
// layouts the grouped kernels cannot read in place only in name: those run the converting by_head
// path (as here), so production keeps by_head for them.
//
// Checks itself against the reference, then times itself against production (the automatic choice
// and the grouped kernel): build with -DKALLPA_BUILD_LAB=ON, run build/bench/lab/cpu-flash/
// cpu_flash_lab_decode_v6.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "bench/lab/cpu-flash/decode_v6.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

#include "backends/cpu-flash/decode_common-inl.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "bench/lab/cpu-flash/lab.h"

HWY_BEFORE_NAMESPACE();
namespace kallpa::cpu_flash {
namespace HWY_NAMESPACE {
namespace {

// Keys each stream (K, V) is prefetched ahead of its reader, into L2.
constexpr std::int64_t kStreamPrefetchKeys = 16;
// Keys per step of the walk over a block (across every KV head).
constexpr std::int64_t kFusedStep = 4;

// s[rb][jj] = <q[rb], k[jj]> for jj in [j, j + 4) and RB rows, over len elements.
template <int RB, typename T>
HWY_INLINE void Dots4(const float* const* q, const T* const* k, std::int64_t len, std::int64_t j, float* const* s) {
  const DF d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  VF acc[RB][4];
  for (int rb = 0; rb < RB; ++rb)
    for (int kk = 0; kk < 4; ++kk) acc[rb][kk] = hn::Zero(d);
  const T* k0 = k[j];
  const T* k1 = k[j + 1];
  const T* k2 = k[j + 2];
  const T* k3 = k[j + 3];
  for (std::int64_t x = 0; x < len; x += N) {
    const VF kv0 = LoadAsF32(k0 + x);
    const VF kv1 = LoadAsF32(k1 + x);
    const VF kv2 = LoadAsF32(k2 + x);
    const VF kv3 = LoadAsF32(k3 + x);
    for (int rb = 0; rb < RB; ++rb) {
      const VF qv = hn::Load(d, q[rb] + x);
      acc[rb][0] = hn::MulAdd(qv, kv0, acc[rb][0]);
      acc[rb][1] = hn::MulAdd(qv, kv1, acc[rb][1]);
      acc[rb][2] = hn::MulAdd(qv, kv2, acc[rb][2]);
      acc[rb][3] = hn::MulAdd(qv, kv3, acc[rb][3]);
    }
  }
  for (int rb = 0; rb < RB; ++rb) Sum4(acc[rb][0], acc[rb][1], acc[rb][2], acc[rb][3], s[rb] + j);
}

template <int RB, typename T>
HWY_INLINE void Dots1(const float* const* q, const T* const* k, std::int64_t len, std::int64_t j, float* const* s) {
  const DF d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  VF acc[RB];
  for (int rb = 0; rb < RB; ++rb) acc[rb] = hn::Zero(d);
  const T* k0 = k[j];
  for (std::int64_t x = 0; x < len; x += N) {
    const VF kv = LoadAsF32(k0 + x);
    for (int rb = 0; rb < RB; ++rb) acc[rb] = hn::MulAdd(hn::Load(d, q[rb] + x), kv, acc[rb]);
  }
  for (int rb = 0; rb < RB; ++rb) s[rb][j] = SumLanes(d, acc[rb]);
}

// o[rb][x] += sum_{jj in [a, e]} p[rb][jj] v[jj][x] for x in C vectors from x0.
template <int RB, int C, typename T>
HWY_INLINE void PvBlock(const T* const* v, const float* const* p, std::int64_t a, std::int64_t e, float* const* o,
                        std::int64_t x0) {
  const DF d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  VF acc[RB][C];
  for (int rb = 0; rb < RB; ++rb)
    for (int c = 0; c < C; ++c) acc[rb][c] = hn::Load(d, o[rb] + x0 + c * N);
  for (std::int64_t jj = a; jj <= e; ++jj) {
    VF vv[C];
    const T* vr = v[jj] + x0;
    for (int c = 0; c < C; ++c) vv[c] = LoadAsF32(vr + c * N);
    for (int rb = 0; rb < RB; ++rb) {
      const VF pb = hn::Set(d, p[rb][jj]);
      for (int c = 0; c < C; ++c) acc[rb][c] = hn::MulAdd(pb, vv[c], acc[rb][c]);
    }
  }
  for (int rb = 0; rb < RB; ++rb)
    for (int c = 0; c < C; ++c) hn::Store(acc[rb][c], d, o[rb] + x0 + c * N);
}

template <int RB, typename T>
HWY_INLINE void Pv(const T* const* v, std::int64_t len, const float* const* p, std::int64_t a, std::int64_t e,
                   float* const* o) {
  const DF d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  constexpr int C = RB >= 3 ? 2 : 4;  // accumulators + value vectors within 16 registers
  std::int64_t x = 0;
  for (; x + C * N <= len; x += C * N) PvBlock<RB, C>(v, p, a, e, o, x);
  for (; x < len; x += N) PvBlock<RB, 1>(v, p, a, e, o, x);
}

// s[rb][j + u] = <q[rb], k[u]> for u < 4 (RB rows of one KV head against four key rows).
template <int RB, typename T>
HWY_INLINE void StreamDots(Ctx& c, std::int64_t kvh, std::int64_t first_row, const T* const* k, std::int64_t nk,
                           std::int64_t j, float* s_rows) {
  const float* q[RB];
  float* s[RB];
  for (int rb = 0; rb < RB; ++rb) {
    q[rb] = c.q + (kvh * c.R + first_row + rb) * c.Dp;
    s[rb] = s_rows + (first_row + rb) * kDecodeBlock + j;
  }
  if (nk == 4) {
    Dots4<RB>(q, k, c.D, 0, s);
  } else {
    for (std::int64_t u = 0; u < nk; ++u) {
      float* su[RB];
      for (int rb = 0; rb < RB; ++rb) su[rb] = s[rb] + u;
      Dots1<RB>(q, k + u, c.D, 0, su);
    }
  }
}

template <int RB, typename T>
HWY_INLINE void StreamPv(Ctx& c, std::int64_t kvh, std::int64_t first_row, const T* const* v, std::int64_t a,
                         std::int64_t e, const float* s_rows) {
  const float* p[RB];
  float* o[RB];
  for (int rb = 0; rb < RB; ++rb) {
    p[rb] = s_rows + (first_row + rb) * kDecodeBlock;
    o[rb] = c.acc + (kvh * c.R + first_row + rb) * c.Dvp;
  }
  Pv<RB>(v, c.Dv, p, a, e, o);
}

// The P.V half of a streamed block (v5 and v6): 4 value rows across every KV head at a time, in
// memory order, V prefetched `ahead` keys in front, a slice of a step's rows per head.
template <typename T>
void StreamPvPass(Ctx& c, std::int64_t j0, std::int64_t nb, const std::int64_t* a_i, const std::int64_t* e_i,
                  const std::int64_t* voff, StreamPrefetcher& vpf, std::int64_t ahead) {
  const T* vb = static_cast<const T*>(c.p->v.data);
  for (std::int64_t u0 = 0; u0 < nb; u0 += 4) {
    const std::int64_t nk = std::min<std::int64_t>(4, nb - u0);
    for (std::int64_t kvh = 0; kvh < c.hkv; ++kvh) {
      vpf.until(j0 + u0 + ahead + (kvh + 1) * nk / c.hkv);
      const T* v[kDecodeBlock];
      for (std::int64_t u = u0; u < u0 + nk; ++u) v[u] = vb + voff[u] + kvh * c.vhs;
      const float* s_rows = c.s_all + kvh * c.R * kDecodeBlock;
      ForRowGroups(c, a_i, e_i, [&](std::int64_t i, std::int64_t row, auto rb) {
        // Only the row's visible keys: a masked value may be NaN and must not be read.
        const std::int64_t a = std::max(a_i[i], u0), e = std::min(e_i[i], u0 + nk - 1);
        if (a <= e) StreamPv<decltype(rb)::value>(c, kvh, row, v, a, e, s_rows);
      });
    }
  }
}

// v6 fused: v5's walk in memory order (from L3 or DRAM it beats v4's head-by-head order 1.5-1.9x,
// one thread, side by side), with one change: the prefetches of each step are spread over its
// heads instead of issued as one burst per step (a burst of a step's rows fills the miss queues and
// stalls the loads behind it: perf shows v6's first, burst-per-step version waiting in the
// prefetch loop). Everything else is v5's.
// Tried and dropped (bench/cpu_flash_bench.cpp, side by side): four rows per pass for GQA groups
// of 4 (each f16 vector converted once; 18% fewer instructions than v5 in callgrind, yet 5-15%
// slower than v5 when streaming), steps of eight keys (slower), the head-by-head order (slower),
// three rows by two keys (within 16 registers where v5's 3 x 4 needs 17, but 7% more instructions
// in callgrind and no gain side by side).

// s[rb][u] = <q[rb], k[u]> for u < KU keys and RB rows, over len elements; each key vector is
// loaded (and converted) once for all RB rows.
template <int RB, int KU, typename T>
HWY_INLINE void DotsRK(const float* const* q, const T* const* k, std::int64_t len, float* const* s) {
  const DF d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  VF acc[RB][KU];
  for (int rb = 0; rb < RB; ++rb)
    for (int u = 0; u < KU; ++u) acc[rb][u] = hn::Zero(d);
  for (std::int64_t x = 0; x < len; x += N) {
    VF kv[KU];
    for (int u = 0; u < KU; ++u) kv[u] = LoadAsF32(k[u] + x);
    for (int rb = 0; rb < RB; ++rb) {
      const VF qv = hn::Load(d, q[rb] + x);
      for (int u = 0; u < KU; ++u) acc[rb][u] = hn::MulAdd(qv, kv[u], acc[rb][u]);
    }
  }
  if constexpr (KU == 4) {
    for (int rb = 0; rb < RB; ++rb) Sum4(acc[rb][0], acc[rb][1], acc[rb][2], acc[rb][3], s[rb]);
  } else {
    for (int rb = 0; rb < RB; ++rb)
      for (int u = 0; u < KU; ++u) s[rb][u] = SumLanes(d, acc[rb][u]);
  }
}

// Keys per dot step for RB rows (v5's four; four rows would take two).
template <int RB>
inline constexpr int kFusedKeys = RB >= 4 ? 2 : 4;

template <int RB, typename T>
HWY_INLINE void FusedScores(const float* const* q, const T* const* k, std::int64_t len, std::int64_t nb,
                            float* const* s) {
  constexpr int KU = kFusedKeys<RB>;
  float* sj[RB];
  std::int64_t j = 0;
  for (; j + KU <= nb; j += KU) {
    for (int rb = 0; rb < RB; ++rb) sj[rb] = s[rb] + j;
    DotsRK<RB, KU>(q, k + j, len, sj);
  }
  for (; j < nb; ++j) {
    for (int rb = 0; rb < RB; ++rb) sj[rb] = s[rb] + j;
    DotsRK<RB, 1>(q, k + j, len, sj);
  }
}

// One block in memory order: kFusedStep key rows across every KV head at a time for the
// scores, the softmax of every row, then StreamPvPass (as v5); K and V each prefetched `ahead`
// keys in front of the walk, a slice of a step's rows per head.
template <typename T>
void FusedBlock(Ctx& c, std::int64_t j0, std::int64_t nb, const std::int64_t* a_i, const std::int64_t* e_i,
                const std::int64_t* koff, const std::int64_t* voff, StreamPrefetcher& kpf, StreamPrefetcher& vpf,
                std::int64_t ahead) {
  const T* kb = static_cast<const T*>(c.p->k.data);
  constexpr std::int64_t kStep = kFusedStep;
  for (std::int64_t u0 = 0; u0 < nb; u0 += kStep) {
    const std::int64_t nk = std::min(kStep, nb - u0);
    for (std::int64_t kvh = 0; kvh < c.hkv; ++kvh) {
      kpf.until(j0 + u0 + ahead + (kvh + 1) * nk / c.hkv);
      const T* k[kStep];
      for (std::int64_t u = 0; u < nk; ++u) k[u] = kb + koff[u0 + u] + kvh * c.khs;
      float* s_rows = c.s_all + kvh * c.R * kDecodeBlock;
      ForRowGroups(c, a_i, e_i, [&](std::int64_t, std::int64_t r, auto rb) {
        constexpr int RB = decltype(rb)::value;
        const float* q[RB];
        float* s[RB];
        for (int u = 0; u < RB; ++u) {
          q[u] = c.q + (kvh * c.R + r + u) * c.Dp;
          s[u] = s_rows + (r + u) * kDecodeBlock + u0;
        }
        FusedScores<RB>(q, k, c.D, nk, s);
      });
    }
  }
  for (std::int64_t kvh = 0; kvh < c.hkv; ++kvh)
    SoftmaxRows(c, kvh, j0, nb, a_i, e_i, c.s_all + kvh * c.R * kDecodeBlock);
  StreamPvPass<T>(c, j0, nb, a_i, e_i, voff, vpf, ahead);
}

// One task: the block walk of decode v6 over the task's keys; layouts it cannot read in place run the
// production by_head kernel (which converts them first), as they did.
void RunDecodeV6(const ValidatedProblem& vp, const DecodePlan& plan, const DecodeTask& t, void* scratch,
                 std::byte* slots, std::int32_t* counters) {
  if (!KvInPlace(vp)) {
    run_decode_by_head(vp, plan, t, scratch, slots, counters);
    return;
  }
  const AttentionProblem& p = vp.problem();
  Ctx c;
  InitTask(c, vp, plan, t, scratch);
  StreamPrefetcher kstream, vstream;
  kstream.init(c, p.k, true, t.k_begin, t.k_end);
  vstream.init(c, p.v, false, t.k_begin, t.k_end);
  std::int64_t a_i[kDecodeMaxRows], e_i[kDecodeMaxRows];
  for (std::int64_t j0 = t.k_begin; j0 < t.k_end; j0 += kDecodeBlock) {
    const std::int64_t nb = std::min(kDecodeBlock, t.k_end - j0);
    bool any = false;
    for (std::int64_t i = 0; i < c.sq; ++i) {
      a_i[i] = std::max(c.lo[i], j0) - j0;
      e_i[i] = std::min(c.hi[i], j0 + nb - 1) - j0;
      any |= a_i[i] <= e_i[i];
    }
    FillOffsets(c, j0, nb, c.koff, c.voff);
    if (!any) continue;
    ForKvType(p.k.dtype, [&](auto type) {
      FusedBlock<decltype(type)>(c, j0, nb, a_i, e_i, c.koff, c.voff, kstream, vstream, kStreamPrefetchKeys);
    });
  }
  FinishTask(c, plan, slots, counters);
}

}  // namespace
}  // namespace HWY_NAMESPACE
}  // namespace kallpa::cpu_flash
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kallpa::cpu_flash {
HWY_EXPORT(RunDecodeV6);
namespace {

void run_lab_kernel(const ValidatedProblem& problem, const DecodePlan& plan, const DecodeTask& task, void* scratch,
                    std::byte* slots, std::int32_t* counters) {
  HWY_DYNAMIC_DISPATCH(RunDecodeV6)(problem, plan, task, scratch, slots, counters);
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
  std::printf("cpu-flash lab: decode v6 (fused) (SIMD target %s)\n", CpuFlashBackend::simd_target().c_str());
  if (!lab::check("decode v6", checks, kernel)) return 1;
  const std::vector<lab::Shape> timed = {
      {.b = 1, .sq = 1, .skv = 65536, .hq = 32, .hkv = 8, .d = 64, .dt = DType::f16},
      {.b = 1, .sq = 1, .skv = 2048, .hq = 9, .hkv = 3, .d = 64, .dt = DType::f16, .page = 16},
  };
  lab::bench("decode v6", kernel, "production", Options{}, timed, 20);
  lab::bench("decode v6", kernel, "grouped", Options{0, Path::fast, DecodeKernel::grouped}, timed, 20);
  return 0;
}
#endif  // HWY_ONCE
