// cpu-flash decode kernels (few query rows per KV head, long KV), compiled once per Highway target
// and dispatched at run time.
//
// Decode reads every K/V byte once for very little arithmetic, so the kernel is built around the
// memory stream: a task walks its chunk of keys in blocks of kDecodeBlock key rows, and for each
// block handles every KV head while the block's rows are in L1/L2 (a key row of a dense, packed or
// paged cache holds all heads side by side), prefetching the next block head by head. Per head it
// converts the block to f32 once (F16C / bf16 shifts) and serves all the query rows of the GQA
// group from it: dot products four keys at a time with a transposing reduction, an online softmax
// vectorised over keys, and a register-blocked P·V with lanes along the head dim. Rows of one
// query position go three at a time (GQA groups of 3, e.g. SmolLM2's 9/3 heads), else two.
//
// v5 (stream, the choice once K/V outgrow the caches) walks each block in memory order instead:
// four key rows across every head at a time, and K and V are each prefetched a fixed number of
// keys ahead into L2 as one forward stream per thread (see StreamBlock).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "backends/cpu-flash/flash_decode.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
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
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

std::int64_t HeadStrideOf(const TensorView& t) { return t.stride[static_cast<std::size_t>(t.rank - 2)]; }
std::int64_t DimStrideOf(const TensorView& t) { return t.stride[static_cast<std::size_t>(t.rank - 1)]; }

float ScalarAt(DType dt, const void* base, std::int64_t idx) {
  switch (dt) {
    case DType::f16: return f16_to_f32(static_cast<const std::uint16_t*>(base)[idx]);
    case DType::bf16: return bf16_to_f32(static_cast<const std::uint16_t*>(base)[idx]);
    case DType::f32: break;
  }
  return static_cast<const float*>(base)[idx];
}

void StoreAt(const TensorView& t, std::int64_t idx, float v) {
  switch (t.dtype) {
    case DType::f16: static_cast<std::uint16_t*>(t.data)[idx] = f32_to_f16(v); return;
    case DType::bf16: static_cast<std::uint16_t*>(t.data)[idx] = f32_to_bf16(v); return;
    case DType::f32: break;
  }
  static_cast<float*>(t.data)[idx] = v;
}

// dst[0, n) = f32(src[x * stride]), dst[n, npad) = 0. DT is the source dtype.
template <DType DT>
HWY_INLINE void ConvertRow(const void* HWY_RESTRICT base, std::int64_t off, std::int64_t stride, std::int64_t n,
                           float* HWY_RESTRICT dst, std::int64_t npad) {
  const DF d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  std::int64_t x = 0;
  if (stride == 1) {
    if constexpr (DT == DType::f32) {
      const float* src = static_cast<const float*>(base) + off;
      for (; x + N <= n; x += N) hn::Store(hn::LoadU(d, src + x), d, dst + x);
    } else if constexpr (DT == DType::f16) {
      const hn::Rebind<hwy::float16_t, DF> dh;
      const auto* src = static_cast<const hwy::float16_t*>(base) + off;
      for (; x + N <= n; x += N) hn::Store(hn::PromoteTo(d, hn::LoadU(dh, src + x)), d, dst + x);
    } else {
      const hn::Rebind<hwy::bfloat16_t, DF> db;
      const auto* src = static_cast<const hwy::bfloat16_t*>(base) + off;
      for (; x + N <= n; x += N) hn::Store(hn::PromoteTo(d, hn::LoadU(db, src + x)), d, dst + x);
    }
  }
  for (; x < n; ++x) dst[x] = ScalarAt(DT, base, off + x * stride);
  for (; x < npad; ++x) dst[x] = 0.0f;
}

void ConvertRowAny(const TensorView& t, std::int64_t off, std::int64_t stride, std::int64_t n, float* dst,
                   std::int64_t npad) {
  switch (t.dtype) {
    case DType::f16: return ConvertRow<DType::f16>(t.data, off, stride, n, dst, npad);
    case DType::bf16: return ConvertRow<DType::bf16>(t.data, off, stride, n, dst, npad);
    case DType::f32: break;
  }
  ConvertRow<DType::f32>(t.data, off, stride, n, dst, npad);
}

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

HWY_INLINE float SumLanes(DF d, VF v) { return hn::GetLane(hn::SumOfLanes(d, v)); }

#if HWY_TARGET != HWY_SCALAR
// Stores the sums over 128-bit blocks of u (4 lanes each) to out[0, 4).
template <class D>
HWY_INLINE void FoldStore4(D d, hn::Vec<D> u, float* out) {
  if constexpr (hn::MaxLanes(D()) > 4) {
    const hn::Half<D> dh;
    FoldStore4(dh, hn::Add(hn::LowerHalf(dh, u), hn::UpperHalf(dh, u)), out);
  } else {
    hn::StoreU(u, d, out);
  }
}
#endif

// out[0..4) = horizontal sums of a0..a3: a transposing reduction (about 2.5 ops per sum on AVX2
// instead of a full reduction per vector).
HWY_INLINE void Sum4(VF a0, VF a1, VF a2, VF a3, float* out) {
  const DF d;
#if HWY_TARGET == HWY_SCALAR
  out[0] = SumLanes(d, a0);
  out[1] = SumLanes(d, a1);
  out[2] = SumLanes(d, a2);
  out[3] = SumLanes(d, a3);
#else
  const hn::Repartition<std::uint64_t, DF> du;
  const VF t0 = hn::Add(hn::InterleaveLower(d, a0, a1), hn::InterleaveUpper(d, a0, a1));
  const VF t1 = hn::Add(hn::InterleaveLower(d, a2, a3), hn::InterleaveUpper(d, a2, a3));
  const auto u0 = hn::BitCast(du, t0), u1 = hn::BitCast(du, t1);
  const VF u = hn::Add(hn::BitCast(d, hn::InterleaveLower(du, u0, u1)), hn::BitCast(d, hn::InterleaveUpper(du, u0, u1)));
  FoldStore4(d, u, out);
#endif
}

// One vector of a K/V row as f32: straight from the cache (f16 through F16C, bf16 through a
// shift) or from a converted f32 block.
template <typename T>
HWY_INLINE VF LoadAsF32(const T* HWY_RESTRICT p) {
  const DF d;
  if constexpr (std::is_same_v<T, float>) {
    return hn::LoadU(d, p);
  } else {
    const hn::Rebind<T, DF> dh;
    return hn::PromoteTo(d, hn::LoadU(dh, p));
  }
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

struct Ctx {
  const ValidatedProblem* vp;
  const AttentionProblem* p;
  const DecodeTask* t;
  std::int64_t D, Dv, Dp, Dvp, G, sq, hkv, R;
  std::int64_t khs, kds, vhs, vds;
  float* q;
  float* acc;
  float* m;
  float* l;
  float* s;
  float* s_all;  // v5: [rows][kDecodeBlock], rows ordered (kvh, i, g)
  float* k;
  float* v;
  std::int64_t* koff;  // [2][kDecodeBlock]
  std::int64_t* voff;
  float softcap;
  const float* slopes;
  std::int64_t lo[kDecodeMaxRows], hi[kDecodeMaxRows];  // visible keys of query i within the chunk
  float posf[kDecodeMaxRows];
};

// Element offsets of key rows [j0, j0 + nb) at head 0. Consecutive keys are evenly spaced within a
// sequence (dense, packed) or a page (paged), so the table is consulted once per run.
void FillOffsets(const Ctx& c, std::int64_t j0, std::int64_t nb, std::int64_t* koff, std::int64_t* voff) {
  const AttentionProblem& p = *c.p;
  const bool paged = p.kv_layout == KvLayout::paged;
  const std::int64_t page = paged ? c.vp->signature().page_size : 0;
  const std::size_t row_axis = p.kv_layout == KvLayout::packed ? 0 : 1;
  const std::int64_t k_step = p.k.stride[row_axis], v_step = p.v.stride[row_axis];
  for (std::int64_t jj = 0; jj < nb; ++jj) {
    const std::int64_t j = j0 + jj;
    if (jj == 0 || (paged && j % page == 0)) {
      koff[jj] = c.vp->k_row_offset(c.t->b, j);
      voff[jj] = c.vp->v_row_offset(c.t->b, j);
    } else {
      koff[jj] = koff[jj - 1] + k_step;
      voff[jj] = voff[jj - 1] + v_step;
    }
  }
}

// The query rows of one KV head in groups of 3 (GQA groups of 3, e.g. SmolLM2), else 2, then 1;
// rows of one group share the query position, so their visible keys.
template <typename F>
HWY_INLINE void ForRowGroups(const Ctx& c, const std::int64_t* a_i, const std::int64_t* e_i, F&& f) {
  const std::int64_t G = c.G;
  const bool threes = G % 3 == 0 && G % 2 != 0;
  for (std::int64_t i = 0; i < c.sq; ++i) {
    if (a_i[i] > e_i[i]) continue;
    std::int64_t g = 0;
    if (threes) {
      for (; g + 3 <= G; g += 3) f(i, i * G + g, std::integral_constant<int, 3>());
    }
    for (; g + 2 <= G; g += 2) f(i, i * G + g, std::integral_constant<int, 2>());
    if (g < G) f(i, i * G + g, std::integral_constant<int, 1>());
  }
}

// Online softmax of the rows of KV head kvh over the block's keys [j0, j0 + nb), vectorised over the
// keys: s_rows [R][kDecodeBlock] holds the scores and receives the probabilities; m, l and the
// accumulators of the rows are updated.
void SoftmaxRows(Ctx& c, std::int64_t kvh, std::int64_t j0, std::int64_t nb, const std::int64_t* a_i,
                 const std::int64_t* e_i, float* s_rows) {
  const DF d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  const VF neg_inf = hn::Set(d, kNegInf);
  const std::int64_t G = c.G;
  const std::int64_t nbp = round_up(nb, N);
  for (std::int64_t r = 0; r < c.R; ++r) {
    const std::int64_t i = r / G;
    const std::int64_t a = a_i[i], e = e_i[i];
    if (a > e) continue;
    const std::int64_t row = kvh * c.R + r;
    float* s = s_rows + r * kDecodeBlock;
    const std::int32_t h = static_cast<std::int32_t>(kvh * G + r % G);
    const VF posv = hn::Set(d, c.posf[i]);
    const VF slope = hn::Set(d, c.slopes ? c.slopes[h] : 0.0f);
    const VF av = hn::Set(d, static_cast<float>(a)), ev = hn::Set(d, static_cast<float>(e));
    VF mt = neg_inf;
    auto nan = hn::Lt(mt, mt);  // all false
    for (std::int64_t x = 0; x < nbp; x += N) {
      VF sv = hn::Load(d, s + x);
      if (c.softcap > 0.0f) {
        const VF cap = hn::Set(d, c.softcap);
        const VF tv = hn::Mul(cap, hn::Tanh(d, hn::Div(sv, cap)));
        sv = hn::IfThenElse(hn::IsNaN(sv), sv, tv);
      }
      const VF jv = hn::Iota(d, static_cast<float>(x));
      if (c.slopes) sv = hn::NegMulAdd(slope, hn::Abs(hn::Sub(posv, hn::Add(jv, hn::Set(d, static_cast<float>(j0))))), sv);
      if (x < a || x + N > e + 1) sv = hn::IfThenElse(hn::And(hn::Ge(jv, av), hn::Le(jv, ev)), sv, neg_inf);
      nan = hn::Or(nan, hn::IsNaN(sv));
      hn::Store(sv, d, s + x);
      mt = hn::Max(mt, sv);
    }
    const float m_old = c.m[row];
    const float m_new = !hn::AllFalse(d, nan) ? std::numeric_limits<float>::quiet_NaN()
                                              : std::max(m_old, hn::GetLane(hn::MaxOfLanes(d, mt)));
    const float m_use = m_new == kNegInf ? 0.0f : m_new;
    const float alpha = std::exp(m_old - m_use);
    const VF mu = hn::Set(d, m_use);
    VF sum = hn::Zero(d);
    for (std::int64_t x = 0; x < nbp; x += N) {
      const VF sv = hn::Load(d, s + x);
      const VF pj = hn::IfThenElse(hn::IsNaN(sv), sv, hn::Exp(d, hn::Sub(sv, mu)));
      hn::Store(pj, d, s + x);
      sum = hn::Add(sum, pj);
    }
    c.l[row] = c.l[row] * alpha + SumLanes(d, sum);
    c.m[row] = m_new;
    if (!(alpha == 1.0f)) {
      float* o = c.acc + row * c.Dvp;
      const VF al = hn::Set(d, alpha);
      for (std::int64_t x = 0; x < c.Dvp; x += N) hn::Store(hn::Mul(hn::Load(d, o + x), al), d, o + x);
    }
  }
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

// ---------------------------------------------------------------------------------------------
// v5 stream: a block is walked in memory order. Scores go four keys at a time across every KV
// head (the four key rows, all heads, are a few KiB side by side), then the softmax of every row,
// then P·V four keys at a time across every head; so K and V are each read as one forward stream
// per thread, and a software prefetch runs a fixed number of keys ahead of each stream into L2.

// Prefetch distance in keys (each stream); KALLPA_CPU_FLASH_PREFETCH overrides it for tuning.
std::int64_t StreamPrefetchKeys() {
  static const std::int64_t keys = [] {
    if (const char* env = std::getenv("KALLPA_CPU_FLASH_PREFETCH")) {
      char* end = nullptr;
      const long v = std::strtol(env, &end, 10);
      if (end != env && *end == '\0' && v >= 0 && v <= 4096) return static_cast<std::int64_t>(v);
    }
    return kDecodeStreamPrefetchKeys;
  }();
  return keys;
}


// Walks the key rows of one tensor (K or V) of a task forward and prefetches each row (every head)
// into L2 once, up to a requested key.
struct StreamPrefetcher {
  const Ctx* c = nullptr;
  const TensorView* t = nullptr;
  std::int64_t next = 0, end = 0;  // next key to prefetch; end of the task's keys
  std::int64_t off = 0;            // element offset of key next - 1 (valid when next > first)
  std::int64_t first = 0;
  std::int64_t step = 0, page = 0, es = 0;
  std::int64_t span = 0;           // bytes of one key row over all heads, when contiguous enough
  std::int64_t head_stride = 0, head_bytes = 0, heads = 0;
  bool k = true;

  void init(const Ctx& ctx, const TensorView& tv, bool is_k, std::int64_t begin, std::int64_t stop) {
    c = &ctx;
    t = &tv;
    k = is_k;
    next = first = begin;
    end = stop;
    const AttentionProblem& p = *ctx.p;
    page = p.kv_layout == KvLayout::paged ? ctx.vp->signature().page_size : 0;
    step = tv.stride[p.kv_layout == KvLayout::packed ? 0 : 1];
    es = static_cast<std::int64_t>(dtype_size(tv.dtype));
    heads = ctx.hkv;
    head_stride = is_k ? ctx.khs : ctx.vhs;
    const std::int64_t dim = is_k ? ctx.D : ctx.Dv;
    const std::int64_t ds = is_k ? ctx.kds : ctx.vds;
    head_bytes = ((dim - 1) * ds + 1) * es;
    const std::int64_t all = (heads - 1) * head_stride * es + head_bytes;
    // Heads side by side (the usual cache layout): one span; else each head's row on its own.
    span = head_stride >= 0 && all <= 2 * heads * head_bytes + 4096 ? all : 0;
  }

  void until(std::int64_t key) {
    key = std::min(key, end);
    for (; next < key; ++next) {
      if (next == first || (page > 0 && next % page == 0)) {
        off = k ? c->vp->k_row_offset(c->t->b, next) : c->vp->v_row_offset(c->t->b, next);
      } else {
        off += step;
      }
      const char* row = static_cast<const char*>(t->data) + off * es;
      if (span > 0) {
        for (std::int64_t b = 0; b < span; b += 64) __builtin_prefetch(row + b, 0, 2);
        __builtin_prefetch(row + span - 1, 0, 2);
      } else {
        for (std::int64_t h = 0; h < heads; ++h) {
          const char* hr = row + h * head_stride * es;
          for (std::int64_t b = 0; b < head_bytes; b += 64) __builtin_prefetch(hr + b, 0, 2);
          __builtin_prefetch(hr + head_bytes - 1, 0, 2);
        }
      }
    }
  }
};

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
  const std::int64_t ahead = StreamPrefetchKeys();
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
  for (std::int64_t kvh = 0; kvh < c.hkv; ++kvh) SoftmaxRows(c, kvh, j0, nb, a_i, e_i, c.s_all + kvh * c.R * kDecodeBlock);
  StreamPvPass<T>(c, j0, nb, a_i, e_i, voff, vpf, ahead);
}

// ---------------------------------------------------------------------------------------------
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

// One block in memory order: kDecodeFusedStep key rows across every KV head at a time for the
// scores, the softmax of every row, then StreamPvPass (as v5); K and V each prefetched `ahead`
// keys in front of the walk, a slice of a step's rows per head.
template <typename T>
void FusedBlock(Ctx& c, std::int64_t j0, std::int64_t nb, const std::int64_t* a_i, const std::int64_t* e_i,
                const std::int64_t* koff, const std::int64_t* voff, StreamPrefetcher& kpf, StreamPrefetcher& vpf,
                std::int64_t ahead) {
  const T* kb = static_cast<const T*>(c.p->k.data);
  constexpr std::int64_t kStep = kDecodeFusedStep;
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
  for (std::int64_t kvh = 0; kvh < c.hkv; ++kvh) SoftmaxRows(c, kvh, j0, nb, a_i, e_i, c.s_all + kvh * c.R * kDecodeBlock);
  StreamPvPass<T>(c, j0, nb, a_i, e_i, voff, vpf, ahead);
}

// Writes o/lse for every row of the sequence from merged (m, l, o) values.
void WriteRow(const Ctx& c, std::int64_t row, float m, float l, const float* o) {
  const AttentionProblem& p = *c.p;
  const std::int64_t kvh = row / c.R, r = row % c.R;
  const std::int64_t i = r / c.G;
  const std::int32_t h = static_cast<std::int32_t>(kvh * c.G + r % c.G);
  const std::int64_t ooff = c.vp->o_row_offset(c.t->b, i) + h * HeadStrideOf(p.o);
  const std::int64_t ods = DimStrideOf(p.o);
  if (l == 0.0f) {  // no visible key, or every visible score -inf
    for (std::int64_t x = 0; x < c.Dv; ++x) StoreAt(p.o, ooff + x * ods, 0.0f);
    if (p.lse.present()) static_cast<float*>(p.lse.data)[c.vp->lse_offset(c.t->b, h, i)] = kNegInf;
    return;
  }
  const float inv = 1.0f / l;
  if (p.o.dtype == DType::f32 && ods == 1) {
    float* dst = static_cast<float*>(p.o.data) + ooff;
    for (std::int64_t x = 0; x < c.Dv; ++x) dst[x] = o[x] * inv;
  } else {
    for (std::int64_t x = 0; x < c.Dv; ++x) StoreAt(p.o, ooff + x * ods, o[x] * inv);
  }
  if (p.lse.present()) static_cast<float*>(p.lse.data)[c.vp->lse_offset(c.t->b, h, i)] = m + std::log(l);
}

// Merges the chunks of a split sequence (in chunk order, so the result does not depend on which
// thread finished last).
void Combine(const Ctx& c, const DecodePlan& plan, const std::byte* slots) {
  const std::int64_t rows = c.sq * c.hkv * c.G;
  const std::int64_t rm = plan.rows_max;
  float* acc = c.acc;  // the task's own accumulators are no longer needed
  for (std::int64_t row = 0; row < rows; ++row) {
    float mx = kNegInf;
    bool nan = false;
    for (std::int32_t ch = 0; ch < c.t->chunks; ++ch) {
      const auto* slot = reinterpret_cast<const float*>(slots + static_cast<std::size_t>(c.t->first_slot + ch) * plan.slot_bytes);
      const float ms = slot[row];
      if (std::isnan(ms)) nan = true;
      else mx = std::max(mx, ms);
    }
    const float muse = nan ? std::numeric_limits<float>::quiet_NaN() : (mx == kNegInf ? 0.0f : mx);
    float l = 0.0f;
    std::fill(acc, acc + c.Dv, 0.0f);
    for (std::int32_t ch = 0; ch < c.t->chunks; ++ch) {
      const auto* slot = reinterpret_cast<const float*>(slots + static_cast<std::size_t>(c.t->first_slot + ch) * plan.slot_bytes);
      const float w = std::exp(slot[row] - muse);
      l += w * slot[rm + row];
      const float* o = slot + 2 * rm + row * c.Dv;
      for (std::int64_t x = 0; x < c.Dv; ++x) acc[x] += w * o[x];
    }
    WriteRow(c, row, muse, l, acc);
  }
}

}  // namespace

void RunDecodeTaskImpl(const ValidatedProblem& vp, const DecodePlan& plan, const DecodeTask& t, void* scratch,
                       std::byte* slots, std::int32_t* counters, DecodeKernel kernel) {
  const DF d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  const AttentionProblem& p = vp.problem();
  const DecodeLayout L = decode_layout(plan.rows_max, vp.head_dim(), vp.head_dim_v());
  auto* base = static_cast<std::byte*>(scratch);
  Ctx c;
  c.vp = &vp;
  c.p = &p;
  c.t = &t;
  c.D = vp.head_dim();
  c.Dv = vp.head_dim_v();
  c.Dp = L.dp;
  c.Dvp = L.dvp;
  c.G = vp.group_size();
  c.sq = vp.seqlen_q(t.b);
  c.hkv = vp.hkv();
  c.R = c.sq * c.G;
  c.khs = HeadStrideOf(p.k);
  c.kds = DimStrideOf(p.k);
  c.vhs = HeadStrideOf(p.v);
  c.vds = DimStrideOf(p.v);
  c.q = reinterpret_cast<float*>(base + L.q);
  c.acc = reinterpret_cast<float*>(base + L.acc);
  c.m = reinterpret_cast<float*>(base + L.m);
  c.l = reinterpret_cast<float*>(base + L.l);
  c.s = reinterpret_cast<float*>(base + L.s);
  c.s_all = reinterpret_cast<float*>(base + L.s_all);
  c.k = reinterpret_cast<float*>(base + L.k);
  c.v = reinterpret_cast<float*>(base + L.v);
  c.koff = reinterpret_cast<std::int64_t*>(base + L.koff);
  c.voff = reinterpret_cast<std::int64_t*>(base + L.voff);
  c.softcap = p.softcap;
  c.slopes = p.alibi_slopes;
  const std::int64_t rows = c.R * c.hkv;
  const std::int64_t skv = vp.seqlen_k(t.b);

  // Scaled queries, rows ordered (kvh, i, g); state.
  const float scale = vp.scale();
  const VF sv = hn::Set(d, scale);
  const std::int64_t qhs = HeadStrideOf(p.q), qds = DimStrideOf(p.q);
  for (std::int64_t i = 0; i < c.sq; ++i) {
    auto range = vp.visible_keys(t.b, i);
    range.first = std::max(range.first, t.k_begin);
    range.last = std::min(range.last, t.k_end - 1);
    c.lo[i] = range.first;
    c.hi[i] = range.last;
    c.posf[i] = static_cast<float>(i + skv - c.sq);
    const std::int64_t qrow = vp.q_row_offset(t.b, i);
    for (std::int64_t kvh = 0; kvh < c.hkv; ++kvh)
      for (std::int64_t g = 0; g < c.G; ++g) {
        float* dst = c.q + (kvh * c.R + i * c.G + g) * c.Dp;
        ConvertRowAny(p.q, qrow + (kvh * c.G + g) * qhs, qds, c.D, dst, c.Dp);
        for (std::int64_t x = 0; x < c.Dp; x += N) hn::Store(hn::Mul(hn::Load(d, dst + x), sv), d, dst + x);
      }
  }
  std::memset(c.acc, 0, static_cast<std::size_t>(rows * c.Dvp) * sizeof(float));
  for (std::int64_t r = 0; r < rows; ++r) {
    c.m[r] = kNegInf;
    c.l[r] = 0.0f;
  }

  const auto kes = static_cast<std::int64_t>(dtype_size(p.k.dtype));
  const auto ves = static_cast<std::int64_t>(dtype_size(p.v.dtype));
  const std::int64_t k_bytes = ((c.D - 1) * c.kds + 1) * kes;  // one head of one key row
  const std::int64_t v_bytes = ((c.Dv - 1) * c.vds + 1) * ves;
  // Direct: the kernels read K/V rows where they lie (unit stride, head dims whole vectors, one
  // dtype); otherwise each block is first converted to f32 rows in scratch.
  const bool direct = kernel != DecodeKernel::staged && c.kds == 1 && c.vds == 1 && c.D % N == 0 && c.Dv % N == 0 &&
                      p.k.dtype == p.v.dtype;
  int cur = 0;
  if (t.k_begin < t.k_end)
    FillOffsets(c, t.k_begin, std::min(kDecodeBlock, t.k_end - t.k_begin), c.koff, c.voff);
  std::int64_t a_i[kDecodeMaxRows], e_i[kDecodeMaxRows];
  const bool stream = direct && kernel == DecodeKernel::stream;
  const bool fused = direct && kernel == DecodeKernel::fused;
  const std::int64_t fused_ahead = StreamPrefetchKeys();
  StreamPrefetcher kstream, vstream;
  if (stream || fused) {
    kstream.init(c, p.k, true, t.k_begin, t.k_end);
    vstream.init(c, p.v, false, t.k_begin, t.k_end);
  }
  for (std::int64_t j0 = t.k_begin; j0 < t.k_end; j0 += kDecodeBlock) {
    const std::int64_t nb = std::min(kDecodeBlock, t.k_end - j0);
    const std::int64_t jn = j0 + nb;
    const std::int64_t nbn = jn < t.k_end ? std::min(kDecodeBlock, t.k_end - jn) : 0;
    const std::int64_t* koff = c.koff + cur * kDecodeBlock;
    const std::int64_t* voff = c.voff + cur * kDecodeBlock;
    std::int64_t* koffn = c.koff + (1 - cur) * kDecodeBlock;
    std::int64_t* voffn = c.voff + (1 - cur) * kDecodeBlock;
    if (nbn > 0 && !stream && !fused) FillOffsets(c, jn, nbn, koffn, voffn);
    bool any = false;
    for (std::int64_t i = 0; i < c.sq; ++i) {
      a_i[i] = std::max(c.lo[i], j0) - j0;
      e_i[i] = std::min(c.hi[i], jn - 1) - j0;
      any |= a_i[i] <= e_i[i];
    }
    if (fused) {
      FillOffsets(c, j0, nb, c.koff, c.voff);
      if (any) {
        switch (p.k.dtype) {
          case DType::f16: FusedBlock<hwy::float16_t>(c, j0, nb, a_i, e_i, c.koff, c.voff, kstream, vstream, fused_ahead); break;
          case DType::bf16: FusedBlock<hwy::bfloat16_t>(c, j0, nb, a_i, e_i, c.koff, c.voff, kstream, vstream, fused_ahead); break;
          case DType::f32: FusedBlock<float>(c, j0, nb, a_i, e_i, c.koff, c.voff, kstream, vstream, fused_ahead); break;
        }
      }
    } else if (stream) {
      FillOffsets(c, j0, nb, c.koff, c.voff);
      if (any) {
        switch (p.k.dtype) {
          case DType::f16: StreamBlock<hwy::float16_t>(c, j0, nb, a_i, e_i, c.koff, c.voff, kstream, vstream); break;
          case DType::bf16: StreamBlock<hwy::bfloat16_t>(c, j0, nb, a_i, e_i, c.koff, c.voff, kstream, vstream); break;
          case DType::f32: StreamBlock<float>(c, j0, nb, a_i, e_i, c.koff, c.voff, kstream, vstream); break;
        }
      }
    } else if (any) {
      for (std::int64_t kvh = 0; kvh < c.hkv; ++kvh) {
        const PrefetchList kpf{koffn, nbn, k_bytes}, vpf{voffn, nbn, v_bytes};
        switch (direct ? p.k.dtype : DType::f32) {
          case DType::f16:
            DirectHead<hwy::float16_t>(c, kvh, j0, nb, a_i, e_i, koff, voff, kpf, vpf);
            break;
          case DType::bf16:
            DirectHead<hwy::bfloat16_t>(c, kvh, j0, nb, a_i, e_i, koff, voff, kpf, vpf);
            break;
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

  if (t.chunks == 1) {
    for (std::int64_t row = 0; row < rows; ++row) WriteRow(c, row, c.m[row], c.l[row], c.acc + row * c.Dvp);
    return;
  }
  const std::int64_t rm = plan.rows_max;
  auto* slot = reinterpret_cast<float*>(slots + static_cast<std::size_t>(t.first_slot + t.chunk) * plan.slot_bytes);
  for (std::int64_t row = 0; row < rows; ++row) {
    slot[row] = c.m[row];
    slot[rm + row] = c.l[row];
    std::memcpy(slot + 2 * rm + row * c.Dv, c.acc + row * c.Dvp, static_cast<std::size_t>(c.Dv) * sizeof(float));
  }
  std::atomic_ref<std::int32_t> done(counters[t.counter]);
  if (done.fetch_add(1, std::memory_order_acq_rel) == t.chunks - 1) Combine(c, plan, slots);
}

}  // namespace HWY_NAMESPACE
}  // namespace kallpa::cpu_flash
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kallpa::cpu_flash {

HWY_EXPORT(RunDecodeTaskImpl);

void run_decode_task(const ValidatedProblem& problem, const DecodePlan& plan, const DecodeTask& task, void* scratch,
                     std::byte* slots, std::int32_t* counters, DecodeKernel kernel) {
  HWY_DYNAMIC_DISPATCH(RunDecodeTaskImpl)(problem, plan, task, scratch, slots, counters, kernel);
}

}  // namespace kallpa::cpu_flash
#endif  // HWY_ONCE
