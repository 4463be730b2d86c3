// Shared by the decode kernels of cpu-flash (decode_by_head.cpp, decode_grouped.cpp,
// decode_lanes.cpp): the task context, query setup, the online softmax over a block's scores, the
// software prefetcher of the memory-order kernels and the final write / split-KV merge.
// Highway per-target header: included once per target by each translation unit that uses it.
#if defined(KALLPA_BACKENDS_CPU_FLASH_DECODE_COMMON_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KALLPA_BACKENDS_CPU_FLASH_DECODE_COMMON_INL_H_
#undef KALLPA_BACKENDS_CPU_FLASH_DECODE_COMMON_INL_H_
#else
#define KALLPA_BACKENDS_CPU_FLASH_DECODE_COMMON_INL_H_
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string_view>
#include <type_traits>

#include "backends/cpu-flash/flash_internal.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"
#include "kallpa/half.h"

HWY_BEFORE_NAMESPACE();
namespace kallpa::cpu_flash {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline std::int64_t HeadStrideOf(const TensorView& t) { return t.stride[static_cast<std::size_t>(t.rank - 2)]; }
inline std::int64_t DimStrideOf(const TensorView& t) { return t.stride[static_cast<std::size_t>(t.rank - 1)]; }

inline float ScalarAt(DType dt, const void* base, std::int64_t idx) {
  switch (dt) {
    case DType::f16: return f16_to_f32(static_cast<const std::uint16_t*>(base)[idx]);
    case DType::bf16: return bf16_to_f32(static_cast<const std::uint16_t*>(base)[idx]);
    case DType::f32: break;
  }
  return static_cast<const float*>(base)[idx];
}

inline void StoreAt(const TensorView& t, std::int64_t idx, float v) {
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

inline void ConvertRowAny(const TensorView& t, std::int64_t off, std::int64_t stride, std::int64_t n, float* dst,
                          std::int64_t npad) {
  switch (t.dtype) {
    case DType::f16: return ConvertRow<DType::f16>(t.data, off, stride, n, dst, npad);
    case DType::bf16: return ConvertRow<DType::bf16>(t.data, off, stride, n, dst, npad);
    case DType::f32: break;
  }
  ConvertRow<DType::f32>(t.data, off, stride, n, dst, npad);
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

#if HWY_TARGET != HWY_SCALAR
// Lanes 4b..4b+3 = the sums of a0..a3 over 128-bit block b: the transposing half of Sum4, which
// the grouped and lanes kernels fold across blocks themselves. Any width of 128-bit blocks (the
// half-width dots of DecodeKernel::lanes_half_dots reduce 256-bit vectors on AVX-512).
template <class V>
HWY_INLINE V Sum4Blocks(V a0, V a1, V a2, V a3) {
  const hn::DFromV<V> d;
  const hn::Repartition<std::uint64_t, decltype(d)> du;
  const V t0 = hn::Add(hn::InterleaveLower(d, a0, a1), hn::InterleaveUpper(d, a0, a1));
  const V t1 = hn::Add(hn::InterleaveLower(d, a2, a3), hn::InterleaveUpper(d, a2, a3));
  const auto u0 = hn::BitCast(du, t0), u1 = hn::BitCast(du, t1);
  return hn::Add(hn::BitCast(d, hn::InterleaveLower(du, u0, u1)), hn::BitCast(d, hn::InterleaveUpper(du, u0, u1)));
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
  FoldStore4(d, Sum4Blocks(a0, a1, a2, a3), out);
#endif
}

// One vector of a K/V row as f32: straight from the cache (f16 through F16C, bf16 through a
// shift) or from a converted f32 block.
// Any vector width d (the half-width dots load 256-bit vectors on AVX-512).
template <class D, typename T>
HWY_INLINE hn::Vec<D> LoadAsF32(D d, const T* HWY_RESTRICT p) {
  if constexpr (std::is_same_v<T, float>) {
    return hn::LoadU(d, p);
  } else {
    const hn::Rebind<T, D> dh;
    return hn::PromoteTo(d, hn::LoadU(dh, p));
  }
}
template <typename T>
HWY_INLINE VF LoadAsF32(const T* HWY_RESTRICT p) {
  return LoadAsF32(DF(), p);
}

// Whether the in-place decode kernels can read the problem's K/V where they lie: unit element
// strides, head dims of whole vectors, one dtype.
inline bool KvInPlace(const ValidatedProblem& vp) {
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(DF()));
  const AttentionProblem& p = vp.problem();
  return DimStrideOf(p.k) == 1 && DimStrideOf(p.v) == 1 && vp.head_dim() % N == 0 && vp.head_dim_v() % N == 0 &&
         p.k.dtype == p.v.dtype;
}

// Calls f(T()) with T the element type of K/V dtype dt (hwy::float16_t, hwy::bfloat16_t, float):
// a kernel's block template, instantiated per dtype, chosen once per block.
template <typename F>
HWY_INLINE void ForKvType(DType dt, F&& f) {
  switch (dt) {
    case DType::f16: f(hwy::float16_t()); return;
    case DType::bf16: f(hwy::bfloat16_t()); return;
    case DType::f32: f(0.0f); return;
  }
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
  float* s_all;  // [rows][kDecodeGroupedBlock]: every head's scores of a block, rows ordered (kvh, i, g)
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
inline void FillOffsets(const Ctx& c, std::int64_t j0, std::int64_t nb, std::int64_t* koff, std::int64_t* voff) {
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

// One row's scores s[x_begin, x_end) (whole vectors) of a block starting at key j0: softcap and
// ALiBi applied, keys outside the row's visible range [a, e] set to -inf, in place. Returns the
// row's new running max from m_old (NaN when a visible score is NaN, so the row turns NaN).
inline float MaskScoresAndMax(const Ctx& c, float* s, std::int64_t x_begin, std::int64_t x_end, std::int32_t h,
                              std::int64_t i, std::int64_t j0, std::int64_t a, std::int64_t e, float m_old) {
  const DF d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  const VF neg_inf = hn::Set(d, kNegInf);
  const VF posv = hn::Set(d, c.posf[i]);
  const VF slope = hn::Set(d, c.slopes ? c.slopes[h] : 0.0f);
  const VF av = hn::Set(d, static_cast<float>(a)), ev = hn::Set(d, static_cast<float>(e));
  VF mt = neg_inf;
  auto nan = hn::Lt(mt, mt);  // all false
  for (std::int64_t x = x_begin; x < x_end; x += N) {
    VF sv = hn::Load(d, s + x);
    if (c.softcap > 0.0f) {
      const VF cap = hn::Set(d, c.softcap);
      const VF tv = hn::Mul(cap, hn::Tanh(d, hn::Div(sv, cap)));
      sv = hn::IfThenElse(hn::IsNaN(sv), sv, tv);
    }
    const VF jv = hn::Iota(d, static_cast<float>(x));
    if (c.slopes)
      sv = hn::NegMulAdd(slope, hn::Abs(hn::Sub(posv, hn::Add(jv, hn::Set(d, static_cast<float>(j0))))), sv);
    if (x < a || x + N > e + 1) sv = hn::IfThenElse(hn::And(hn::Ge(jv, av), hn::Le(jv, ev)), sv, neg_inf);
    nan = hn::Or(nan, hn::IsNaN(sv));
    hn::Store(sv, d, s + x);
    mt = hn::Max(mt, sv);
  }
  return !hn::AllFalse(d, nan) ? std::numeric_limits<float>::quiet_NaN()
                               : std::max(m_old, hn::GetLane(hn::MaxOfLanes(d, mt)));
}

// A row's state after a block: l = l * alpha + the block's probability sum, m = m_new, and the
// output accumulator rescaled by alpha (skipped when alpha is exactly 1).
inline void UpdateRow(Ctx& c, std::int64_t row, float m_new, float alpha, float block_sum) {
  const DF d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  c.l[row] = c.l[row] * alpha + block_sum;
  c.m[row] = m_new;
  if (!(alpha == 1.0f)) {
    float* o = c.acc + row * c.Dvp;
    const VF al = hn::Set(d, alpha);
    for (std::int64_t x = 0; x < c.Dvp; x += N) hn::Store(hn::Mul(hn::Load(d, o + x), al), d, o + x);
  }
}

// Calls f(r, i, a, e) for each query row r of one KV head (rows ordered (i, g)) whose query i sees
// keys [a, e] of the block.
template <typename F>
HWY_INLINE void ForSeeingRows(const Ctx& c, const std::int64_t* a_i, const std::int64_t* e_i, F&& f) {
  const std::int64_t G = c.G;
  for (std::int64_t r = 0; r < c.R; ++r) {
    const std::int64_t i = r / G;
    const std::int64_t a = a_i[i], e = e_i[i];
    if (a > e) continue;
    f(r, i, a, e);
  }
}

// Online softmax of the rows of KV head kvh over the block's keys [j0, j0 + nb), vectorised over the
// keys: s_rows [R][kDecodeBlock] holds the scores and receives the probabilities; m, l and the
// accumulators of the rows are updated.
inline void SoftmaxRows(Ctx& c, std::int64_t kvh, std::int64_t j0, std::int64_t nb, const std::int64_t* a_i,
                        const std::int64_t* e_i, float* s_rows) {
  const DF d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  const std::int64_t G = c.G;
  const std::int64_t nbp = round_up(nb, N);
  ForSeeingRows(c, a_i, e_i, [&](std::int64_t r, std::int64_t i, std::int64_t a, std::int64_t e) {
    const std::int64_t row = kvh * c.R + r;
    float* s = s_rows + r * kDecodeBlock;
    const std::int32_t h = static_cast<std::int32_t>(kvh * G + r % G);
    const float m_new = MaskScoresAndMax(c, s, 0, nbp, h, i, j0, a, e, c.m[row]);
    const float m_old = c.m[row];
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
    UpdateRow(c, row, m_new, alpha, SumLanes(d, sum));
  });
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
  std::int64_t span = 0;  // bytes of one key row over all heads, when contiguous enough
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
        // Four lines per iteration, so that the loop control stays a small share of the grouped
        // kernels' instructions.
        std::int64_t b = 0;
        for (; b + 256 <= span; b += 256) {
          __builtin_prefetch(row + b, 0, 2);
          __builtin_prefetch(row + b + 64, 0, 2);
          __builtin_prefetch(row + b + 128, 0, 2);
          __builtin_prefetch(row + b + 192, 0, 2);
        }
        for (; b < span; b += 64) __builtin_prefetch(row + b, 0, 2);
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

// Writes o/lse for every row of the sequence from merged (m, l, o) values.
inline void WriteRow(const Ctx& c, std::int64_t row, float m, float l, const float* o) {
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
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)
  } else if (p.o.dtype == DType::f16 && ods == 1) {
    // Whole vectors through F16C (round to nearest even, inf past the range, NaN kept, as
    // f32_to_f16): a scalar conversion of each element would be most of a short call's time (8/8
    // heads, D64, 16 keys). Not on targets without F16C, where Highway's DemoteTo truncates and
    // saturates.
    const DF d;
    const hn::Rebind<hwy::float16_t, DF> dh;
    const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
    auto* dst = static_cast<hwy::float16_t*>(p.o.data) + ooff;
    const VF iv = hn::Set(d, inv);
    std::int64_t x = 0;
    for (; x + N <= c.Dv; x += N) hn::StoreU(hn::DemoteTo(dh, hn::Mul(hn::LoadU(d, o + x), iv)), dh, dst + x);
    for (; x < c.Dv; ++x) StoreAt(p.o, ooff + x, o[x] * inv);
#endif
  } else {
    for (std::int64_t x = 0; x < c.Dv; ++x) StoreAt(p.o, ooff + x * ods, o[x] * inv);
  }
  if (p.lse.present()) static_cast<float*>(p.lse.data)[c.vp->lse_offset(c.t->b, h, i)] = m + std::log(l);
}

// Merges the chunks of a split sequence (in chunk order, so the result does not depend on which
// thread finished last).
inline void Combine(const Ctx& c, const DecodePlan& plan, const std::byte* slots) {
  const std::int64_t rows = c.sq * c.hkv * c.G;
  const std::int64_t rm = plan.rows_max;
  float* acc = c.acc;  // the task's own accumulators are no longer needed
  for (std::int64_t row = 0; row < rows; ++row) {
    float mx = kNegInf;
    bool nan = false;
    for (std::int32_t ch = 0; ch < c.t->chunks; ++ch) {
      const auto* slot =
          reinterpret_cast<const float*>(slots + static_cast<std::size_t>(c.t->first_slot + ch) * plan.slot_bytes);
      const float ms = slot[row];
      if (std::isnan(ms)) nan = true;
      else mx = std::max(mx, ms);
    }
    const float muse = nan ? std::numeric_limits<float>::quiet_NaN() : (mx == kNegInf ? 0.0f : mx);
    float l = 0.0f;
    std::fill(acc, acc + c.Dv, 0.0f);
    for (std::int32_t ch = 0; ch < c.t->chunks; ++ch) {
      const auto* slot =
          reinterpret_cast<const float*>(slots + static_cast<std::size_t>(c.t->first_slot + ch) * plan.slot_bytes);
      const float w = std::exp(slot[row] - muse);
      l += w * slot[rm + row];
      const float* o = slot + 2 * rm + row * c.Dv;
      for (std::int64_t x = 0; x < c.Dv; ++x) acc[x] += w * o[x];
    }
    WriteRow(c, row, muse, l, acc);
  }
}

// Binds the task's scratch, converts and scales its queries (rows ordered (kvh, i, g)), sets each
// query's visible keys within the chunk and resets the online-softmax state.
inline void InitTask(Ctx& c, const ValidatedProblem& vp, const DecodePlan& plan, const DecodeTask& t, void* scratch) {
  const DF d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  const AttentionProblem& p = vp.problem();
  const DecodeLayout L = decode_layout(plan.rows_max, vp.head_dim(), vp.head_dim_v());
  auto* base = static_cast<std::byte*>(scratch);
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
}

// Writes o/lse (a task that is its sequence's only chunk) or the chunk's partial; the last chunk
// of a split sequence to finish merges them.
inline void FinishTask(Ctx& c, const DecodePlan& plan, std::byte* slots, std::int32_t* counters) {
  const DecodeTask& t = *c.t;
  const std::int64_t rows = c.R * c.hkv;
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

#endif  // KALLPA_BACKENDS_CPU_FLASH_DECODE_COMMON_INL_H_
