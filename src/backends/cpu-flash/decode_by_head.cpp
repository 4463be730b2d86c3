// cpu-flash decode, head by head (DecodeKernel::by_head): the kernel for calls whose K/V stay in
// cache on targets narrower than 16 lanes, and for every K/V layout that the other decode kernels
// cannot read in place. Compiled once per Highway target and dispatched at run time.
//
// A task walks its chunk of keys in blocks of kDecodeBlock key rows, and for each block handles
// every KV head while the block's rows are in L1/L2 (a key row of a dense, packed or paged cache
// holds all heads side by side), prefetching the next block head by head. K/V rows are read in
// place where the layout allows it (KvInPlace: F16C / bf16 promotion in registers); otherwise each
// head's block is first converted to f32 rows in scratch. All the query rows of the GQA group are
// served from each key: dot products four keys at a time with a transposing reduction, an online
// softmax vectorised over keys, and a register-blocked P·V with lanes along the head dim. Rows of
// one query position go three at a time (GQA groups of 3, e.g. SmolLM2's 9/3 heads), else two.
// Head by head needs the fewest instructions per key while the call's K/V are in cache; from
// beyond the caches the memory-order walks of decode_grouped.cpp and decode_lanes.cpp keep the
// memory busier (docs/cpu-flash.md).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "backends/cpu-flash/decode_by_head.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

#include "backends/cpu-flash/decode_common-inl.h"
#include "hwy/cache_control.h"
#include "hwy/contrib/math/math-inl.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>

#include "backends/cpu-flash/flash_internal.h"
#include "kallpa/half.h"

HWY_BEFORE_NAMESPACE();
namespace kallpa::cpu_flash {
namespace HWY_NAMESPACE {
namespace {

// Converts the rows offs[0, nb) (+ head offset) of t into dst [nb][npad].
// Prefetches the cache lines of [base + elem_off, + bytes) elements of elem_size bytes.
HWY_INLINE void PrefetchSpan(const void* base, std::int64_t elem_off, std::int64_t elem_size, std::int64_t bytes) {
  const auto first = reinterpret_cast<std::uintptr_t>(base) + static_cast<std::uintptr_t>(elem_off * elem_size);
  const std::uintptr_t last = first + static_cast<std::uintptr_t>(bytes - 1);
  for (std::uintptr_t line = first & ~std::uintptr_t{63}; line <= last; line += 64)
    hwy::Prefetch(reinterpret_cast<const char*>(line));
}

// Rows of the next block to prefetch while converting this one (one row per converted row, so the
// requests are spread over the work instead of flooding the miss queues).
struct PrefetchList {
  const std::int64_t* offs = nullptr;  // element offsets at head 0
  std::int64_t n = 0;                  // rows
  std::int64_t bytes = 0;              // bytes per row (this head)
};

// The next block's K and V rows of one head.
struct PrefetchPair {
  const void* kbase;
  const void* vbase;
  std::int64_t es;
  PrefetchList k, v;
  void rows(std::int64_t from, std::int64_t to) const {
    for (std::int64_t jj = from; jj < std::min(to, k.n); ++jj) {
      PrefetchSpan(kbase, k.offs[jj], es, k.bytes);
      PrefetchSpan(vbase, v.offs[jj], es, v.bytes);
    }
  }
};

template <DType DT>
void ConvertBlock(const void* base, const std::int64_t* offs, std::int64_t head_off, std::int64_t stride,
                  std::int64_t nb, std::int64_t n, float* HWY_RESTRICT dst, std::int64_t npad, const PrefetchList& pf) {
  const DF d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  constexpr std::int64_t es = DT == DType::f32 ? 4 : 2;
  for (std::int64_t jj = nb; jj < pf.n; ++jj) PrefetchSpan(base, pf.offs[jj] + head_off, es, pf.bytes);
  if (stride != 1 || n != npad || n % (2 * N) != 0 || DT == DType::f32) {
    for (std::int64_t jj = 0; jj < nb; ++jj) {
      if (jj < pf.n) PrefetchSpan(base, pf.offs[jj] + head_off, es, pf.bytes);
      ConvertRow<DT>(base, offs[jj] + head_off, stride, n, dst + jj * npad, npad);
    }
    return;
  }
  // The common case (unit stride, head dim a multiple of two vectors): a tight, unrolled loop.
  using T = std::conditional_t<DT == DType::f16, hwy::float16_t, hwy::bfloat16_t>;
  const hn::Rebind<T, DF> dh;
  const T* src = static_cast<const T*>(base) + head_off;
  for (std::int64_t jj = 0; jj < nb; ++jj) {
    if (jj < pf.n) PrefetchSpan(base, pf.offs[jj] + head_off, es, pf.bytes);
    const T* row = src + offs[jj];
    float* o = dst + jj * npad;
    for (std::int64_t x = 0; x < n; x += 2 * N) {
      const auto a = hn::LoadU(dh, row + x);
      const auto b = hn::LoadU(dh, row + x + N);
      hn::Store(hn::PromoteTo(d, a), d, o + x);
      hn::Store(hn::PromoteTo(d, b), d, o + x + N);
    }
  }
}

void ConvertBlockAny(const TensorView& t, const std::int64_t* offs, std::int64_t head_off, std::int64_t stride,
                     std::int64_t nb, std::int64_t n, float* dst, std::int64_t npad, const PrefetchList& pf) {
  switch (t.dtype) {
    case DType::f16: return ConvertBlock<DType::f16>(t.data, offs, head_off, stride, nb, n, dst, npad, pf);
    case DType::bf16: return ConvertBlock<DType::bf16>(t.data, offs, head_off, stride, nb, n, dst, npad, pf);
    case DType::f32: break;
  }
  ConvertBlock<DType::f32>(t.data, offs, head_off, stride, nb, n, dst, npad, pf);
}

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

// pf (optional): rows of the next block to prefetch, spread over the work (a burst of requests
// would only fill the miss queues and stall).
template <int RB, typename T>
HWY_INLINE void Scores(const float* const* q, const T* const* k, std::int64_t len, std::int64_t nb, float* const* s,
                       const PrefetchPair* pf) {
  std::int64_t j = 0;
  for (; j + 4 <= nb; j += 4) {
    if (pf != nullptr) pf->rows(j, j + 4);
    Dots4<RB>(q, k, len, j, s);
  }
  for (; j < nb; ++j) Dots1<RB>(q, k, len, j, s);
  if (pf != nullptr) pf->rows(j - (nb % 4), pf->k.n);
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

// One block of keys [j0, j0 + nb) for the query rows of KV head kvh (its K/V already in c.k, c.v).
// krows/vrows: the block's key/value rows of this head (klen/vlen elements, multiples of the vector).
template <typename T>
void ProcessBlock(Ctx& c, std::int64_t kvh, std::int64_t j0, std::int64_t nb, const std::int64_t* a_i,
                  const std::int64_t* e_i, const T* const* krows, std::int64_t klen, const T* const* vrows,
                  std::int64_t vlen, const PrefetchPair* pf) {
  // Scores, rows of one query position (so one visible range) three (GQA groups of 3) or two at a
  // time, so that each key vector loaded serves them all.
  ForRowGroups(c, a_i, e_i, [&](std::int64_t, std::int64_t r, auto rb) {
    constexpr int RB = decltype(rb)::value;
    const float* q[RB];
    float* s[RB];
    for (int u = 0; u < RB; ++u) {
      q[u] = c.q + (kvh * c.R + r + u) * c.Dp;
      s[u] = c.s + (r + u) * kDecodeBlock;
    }
    Scores<RB>(q, krows, klen, nb, s, pf);
    pf = nullptr;
  });

  SoftmaxRows(c, kvh, j0, nb, a_i, e_i, c.s);

  // o += P V over each row's visible keys only (a masked value may be NaN and must not be read).
  ForRowGroups(c, a_i, e_i, [&](std::int64_t i, std::int64_t r, auto rb) {
    constexpr int RB = decltype(rb)::value;
    const float* p[RB];
    float* o[RB];
    for (int u = 0; u < RB; ++u) {
      p[u] = c.s + (r + u) * kDecodeBlock;
      o[u] = c.acc + (kvh * c.R + r + u) * c.Dvp;
    }
    Pv<RB>(vrows, vlen, p, a_i[i], e_i[i], o);
  });
}

// One head of one block read in place: row pointers into the cache; the head's rows of the next
// block are prefetched during the dot products, so that they arrive while this block is computed.
template <typename T>
void DirectHead(Ctx& c, std::int64_t kvh, std::int64_t j0, std::int64_t nb, const std::int64_t* a_i,
                const std::int64_t* e_i, const std::int64_t* koff, const std::int64_t* voff, const PrefetchList& kpf,
                const PrefetchList& vpf) {
  const T* kb = static_cast<const T*>(c.p->k.data) + kvh * c.khs;
  const T* vb = static_cast<const T*>(c.p->v.data) + kvh * c.vhs;
  const PrefetchPair pf{kb, vb, static_cast<std::int64_t>(sizeof(T)), kpf, vpf};
  const T* kr[kDecodeBlock];
  const T* vr[kDecodeBlock];
  for (std::int64_t jj = 0; jj < nb; ++jj) {
    kr[jj] = kb + koff[jj];
    vr[jj] = vb + voff[jj];
  }
  ProcessBlock<T>(c, kvh, j0, nb, a_i, e_i, kr, c.D, vr, c.Dv, &pf);
}

}  // namespace

void RunDecodeTaskImpl(const ValidatedProblem& vp, const DecodePlan& plan, const DecodeTask& t, void* scratch,
                       std::byte* slots, std::int32_t* counters) {
  const AttentionProblem& p = vp.problem();
  Ctx c;
  InitTask(c, vp, plan, t, scratch);

  const auto kes = static_cast<std::int64_t>(dtype_size(p.k.dtype));
  const auto ves = static_cast<std::int64_t>(dtype_size(p.v.dtype));
  const std::int64_t k_bytes = ((c.D - 1) * c.kds + 1) * kes;  // one head of one key row
  const std::int64_t v_bytes = ((c.Dv - 1) * c.vds + 1) * ves;
  // Direct: the kernels read K/V rows where they lie; otherwise each block is first converted to
  // f32 rows in scratch.
  const bool direct = KvInPlace(vp);
  int cur = 0;
  if (t.k_begin < t.k_end) FillOffsets(c, t.k_begin, std::min(kDecodeBlock, t.k_end - t.k_begin), c.koff, c.voff);
  std::int64_t a_i[kDecodeMaxRows], e_i[kDecodeMaxRows];
  for (std::int64_t j0 = t.k_begin; j0 < t.k_end; j0 += kDecodeBlock) {
    const std::int64_t nb = std::min(kDecodeBlock, t.k_end - j0);
    const std::int64_t jn = j0 + nb;
    const std::int64_t nbn = jn < t.k_end ? std::min(kDecodeBlock, t.k_end - jn) : 0;
    const std::int64_t* koff = c.koff + cur * kDecodeBlock;
    const std::int64_t* voff = c.voff + cur * kDecodeBlock;
    std::int64_t* koffn = c.koff + (1 - cur) * kDecodeBlock;
    std::int64_t* voffn = c.voff + (1 - cur) * kDecodeBlock;
    if (nbn > 0) FillOffsets(c, jn, nbn, koffn, voffn);
    bool any = false;
    for (std::int64_t i = 0; i < c.sq; ++i) {
      a_i[i] = std::max(c.lo[i], j0) - j0;
      e_i[i] = std::min(c.hi[i], jn - 1) - j0;
      any |= a_i[i] <= e_i[i];
    }
    if (any) {
      for (std::int64_t kvh = 0; kvh < c.hkv; ++kvh) {
        const PrefetchList kpf{koffn, nbn, k_bytes}, vpf{voffn, nbn, v_bytes};
        switch (direct ? p.k.dtype : DType::f32) {
          case DType::f16: DirectHead<hwy::float16_t>(c, kvh, j0, nb, a_i, e_i, koff, voff, kpf, vpf); break;
          case DType::bf16: DirectHead<hwy::bfloat16_t>(c, kvh, j0, nb, a_i, e_i, koff, voff, kpf, vpf); break;
          case DType::f32:
            if (direct) {
              DirectHead<float>(c, kvh, j0, nb, a_i, e_i, koff, voff, kpf, vpf);
              break;
            }
            // Staged: this head's rows of the next block are fetched while this block is converted.
            ConvertBlockAny(p.k, koff, kvh * c.khs, c.kds, nb, c.D, c.k, c.Dp, kpf);
            ConvertBlockAny(p.v, voff, kvh * c.vhs, c.vds, nb, c.Dv, c.v, c.Dvp, vpf);
            const float* kr[kDecodeBlock];
            const float* vr[kDecodeBlock];
            for (std::int64_t jj = 0; jj < nb; ++jj) {
              kr[jj] = c.k + jj * c.Dp;
              vr[jj] = c.v + jj * c.Dvp;
            }
            ProcessBlock<float>(c, kvh, j0, nb, a_i, e_i, kr, c.Dp, vr, c.Dvp, nullptr);
            break;
        }
      }
    }
    cur = 1 - cur;
  }

  FinishTask(c, plan, slots, counters);
}

}  // namespace HWY_NAMESPACE
}  // namespace kallpa::cpu_flash
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kallpa::cpu_flash {

HWY_EXPORT(RunDecodeTaskImpl);

void run_decode_by_head(const ValidatedProblem& problem, const DecodePlan& plan, const DecodeTask& task, void* scratch,
                        std::byte* slots, std::int32_t* counters) {
  HWY_DYNAMIC_DISPATCH(RunDecodeTaskImpl)(problem, plan, task, scratch, slots, counters);
}

}  // namespace kallpa::cpu_flash
#endif  // HWY_ONCE
