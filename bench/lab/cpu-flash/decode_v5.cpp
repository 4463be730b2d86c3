// cpu-flash kernel lab: decode v5 ("stream"), the first memory-order decode kernel.
//
// Production's by_head walks a block head by head; v5 walks it in memory order instead: scores
// four key rows across every KV head at a time, then the softmax of every row, then P·V four value
// rows across every head, so that K and V are each read as one forward stream per thread, and a
// software prefetch runs kStreamPrefetchKeys keys ahead of each stream into L2. Rows of a GQA group
// go two or three at a time through the dot and P·V kernels of by_head (each K/V vector is loaded
// and converted once per pair of rows). Streamed from beyond the caches it kept the memory busier
// than by_head; the grouped kernels (v7 here, then production's grouped and lanes) replaced it by
// serving up to four rows from each vector converted once.
//
// Checks itself against the reference, then times itself against production (the automatic choice
// and the grouped kernel): build with -DKALLPA_BUILD_LAB=ON, run build/bench/lab/cpu-flash/
// cpu_flash_lab_decode_v5.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "bench/lab/cpu-flash/decode_v5.cpp"
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

// v5 stream: a block is walked in memory order. Scores go four keys at a time across every KV
// head (the four key rows, all heads, are a few KiB side by side), then the softmax of every row,
// then P·V four keys at a time across every head; so K and V are each read as one forward stream
// per thread, and a software prefetch runs a fixed number of keys ahead of each stream into L2.

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

template <typename T>
void StreamBlock(Ctx& c, std::int64_t j0, std::int64_t nb, const std::int64_t* a_i, const std::int64_t* e_i,
                 const std::int64_t* koff, const std::int64_t* voff, StreamPrefetcher& kpf, StreamPrefetcher& vpf) {
  const T* kb = static_cast<const T*>(c.p->k.data);
  const std::int64_t ahead = kStreamPrefetchKeys;
  for (std::int64_t u0 = 0; u0 < nb; u0 += 4) {
    const std::int64_t nk = std::min<std::int64_t>(4, nb - u0);
    kpf.until(j0 + u0 + nk + ahead);
    for (std::int64_t kvh = 0; kvh < c.hkv; ++kvh) {
      const T* k[4];
      for (std::int64_t u = 0; u < nk; ++u) k[u] = kb + koff[u0 + u] + kvh * c.khs;
      float* s_rows = c.s_all + kvh * c.R * kDecodeBlock;
      ForRowGroups(c, a_i, e_i, [&](std::int64_t, std::int64_t row, auto rb) {
        StreamDots<decltype(rb)::value>(c, kvh, row, k, nk, u0, s_rows);
      });
    }
  }
  for (std::int64_t kvh = 0; kvh < c.hkv; ++kvh)
    SoftmaxRows(c, kvh, j0, nb, a_i, e_i, c.s_all + kvh * c.R * kDecodeBlock);
  StreamPvPass<T>(c, j0, nb, a_i, e_i, voff, vpf, ahead);
}

// One task: the block walk of decode v5 over the task's keys; layouts it cannot read in place run the
// production by_head kernel (which converts them first), as they did.
void RunDecodeV5(const ValidatedProblem& vp, const DecodePlan& plan, const DecodeTask& t, void* scratch,
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
    ForKvType(p.k.dtype,
              [&](auto type) { StreamBlock<decltype(type)>(c, j0, nb, a_i, e_i, c.koff, c.voff, kstream, vstream); });
  }
  FinishTask(c, plan, slots, counters);
}

}  // namespace
}  // namespace HWY_NAMESPACE
}  // namespace kallpa::cpu_flash
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kallpa::cpu_flash {
HWY_EXPORT(RunDecodeV5);
namespace {

void run_lab_kernel(const ValidatedProblem& problem, const DecodePlan& plan, const DecodeTask& task, void* scratch,
                    std::byte* slots, std::int32_t* counters) {
  HWY_DYNAMIC_DISPATCH(RunDecodeV5)(problem, plan, task, scratch, slots, counters);
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
  std::printf("cpu-flash lab: decode v5 (stream) (SIMD target %s)\n", CpuFlashBackend::simd_target().c_str());
  if (!lab::check("decode v5", checks, kernel)) return 1;
  const std::vector<lab::Shape> timed = {
      {.b = 1, .sq = 1, .skv = 65536, .hq = 32, .hkv = 8, .d = 64, .dt = DType::f16},
      {.b = 1, .sq = 1, .skv = 2048, .hq = 9, .hkv = 3, .d = 64, .dt = DType::f16, .page = 16},
  };
  lab::bench("decode v5", kernel, "production", Options{}, timed, 20);
  lab::bench("decode v5", kernel, "grouped", Options{0, Path::fast, DecodeKernel::grouped}, timed, 20);
  return 0;
}
#endif  // HWY_ONCE
