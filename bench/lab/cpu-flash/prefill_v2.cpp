// cpu-flash kernel lab: prefill v2, the tiled path's first rows kernel.
//
// Two kernels share the tile loaders (any dtype, stride and KV layout -> contiguous f32 tiles):
//  * rows kernel (a task has at least one vector of query rows): vectorised across query rows.
//    q^T [D][Rp] is built once per task; per key tile S[j][r] = sum_d K[j][d] q^T[d][r] and
//    o^T[dv][r] += sum_j V[j][dv] P[j][r] are register-blocked outer products (broadcast K/V,
//    vectors of rows), and the online softmax runs vertically, one lane per row: no transposes of
//    K or V and no horizontal reductions.
//  * decode kernel (few rows, e.g. Sq = 1): vectorised along the head dim, dot products of a few
//    keys at once, per-row exact visible ranges.
// Production's prefill.cpp is v3: every tile gets a row stride of an odd number of cache lines
// (with v2's power-of-two strides, 512 bytes for 128 rows, a 128-row strip of q^T, S or V maps to
// an eighth of the L1 sets and is evicted before its reuse), the products of each row panel cover
// only the keys its rows see, the rescale of o rides on the P·V pass, a tile whose scores are used
// as they are needs only a max pass, and the exp is the cheaper FastExp.
//
// Checks itself against the reference, then times itself against production: build with
// -DKALLPA_BUILD_LAB=ON, run build/bench/lab/cpu-flash/cpu_flash_lab_prefill_v2.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "bench/lab/cpu-flash/prefill_v2.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

#include "hwy/cache_control.h"
#include "hwy/contrib/math/math-inl.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "backends/cpu-flash/flash_internal.h"
#include "bench/lab/cpu-flash/lab.h"
#include "kallpa/half.h"

HWY_BEFORE_NAMESPACE();
namespace kallpa::cpu_flash {
namespace HWY_NAMESPACE {
namespace {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;
using DI = hn::RebindToSigned<DF>;

// Register blocking of the outer-product kernels: kKB broadcast operands x kC row vectors.
#if HWY_TARGET <= HWY_AVX3
constexpr int kKB = 6;  // 32 vector registers: 6 x 4 accumulators + 4 row vectors + 1 broadcast
constexpr int kC = 4;
#else
// 16 vector registers: 6 x 2 accumulators + 2 row vectors + 1 broadcast. The 4 x 3 block it
// replaced left a one-vector panel of a 128-row task (16 vectors = 5 x 3 + 1) with 4 accumulators,
// too few to cover the FMA latency, and ran D128 prefill ~20% slower on Zen 3 (one thread, best of
// repeated runs, 512 and 2048 keys, causal or not); D64 was even.
constexpr int kKB = 6;
constexpr int kC = 2;
#endif

inline std::int64_t HeadStride(const TensorView& t) { return t.stride[static_cast<std::size_t>(t.rank - 2)]; }
inline std::int64_t DimStride(const TensorView& t) { return t.stride[static_cast<std::size_t>(t.rank - 1)]; }

inline float LoadScalar(const TensorView& t, std::int64_t idx) {
  switch (t.dtype) {
    case DType::f16: return f16_to_f32(static_cast<const std::uint16_t*>(t.data)[idx]);
    case DType::bf16: return bf16_to_f32(static_cast<const std::uint16_t*>(t.data)[idx]);
    case DType::f32: break;
  }
  return static_cast<const float*>(t.data)[idx];
}

inline void StoreScalar(const TensorView& t, std::int64_t idx, float v) {
  switch (t.dtype) {
    case DType::f16: static_cast<std::uint16_t*>(t.data)[idx] = f32_to_f16(v); return;
    case DType::bf16: static_cast<std::uint16_t*>(t.data)[idx] = f32_to_bf16(v); return;
    case DType::f32: break;
  }
  static_cast<float*>(t.data)[idx] = v;
}

// t.data[off + x * stride] = src[x] for x < n, converted to t's dtype (f16 by F16C where the row is
// contiguous: a scalar conversion per element was a tenth of a prefill task's instructions).
void StoreRow(const TensorView& t, std::int64_t off, std::int64_t stride, std::int64_t n,
              const float* HWY_RESTRICT src) {
  std::int64_t x = 0;
  if (stride == 1 && t.dtype == DType::f32) {
    std::memcpy(static_cast<float*>(t.data) + off, src, static_cast<std::size_t>(n) * sizeof(float));
    return;
  }
#if HWY_TARGET != HWY_SCALAR
  if (stride == 1 && t.dtype == DType::f16) {
    const DF d;
    const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
    const hn::Rebind<hwy::float16_t, DF> dh;
    auto* dst = static_cast<hwy::float16_t*>(t.data) + off;
    for (; x + N <= n; x += N) hn::StoreU(hn::DemoteTo(dh, hn::LoadU(d, src + x)), dh, dst + x);
  }
#endif
  for (; x < n; ++x) StoreScalar(t, off + x * stride, src[x]);
}

// exp that keeps NaN (hn::Exp maps NaN to 0) and gives 0 for -inf.
HWY_INLINE VF ExpKeepNaN(DF d, VF x) { return hn::IfThenElse(hn::IsNaN(x), x, hn::Exp(d, x)); }

// Converts n elements (element stride `stride`) starting at t.data + off to f32 dst[0, n), zero
// fills dst[n, npad).
void LoadRow(const TensorView& t, std::int64_t off, std::int64_t stride, std::int64_t n, float* HWY_RESTRICT dst,
             std::int64_t npad) {
  const DF d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  std::int64_t x = 0;
  if (stride == 1) {
    switch (t.dtype) {
      case DType::f32: {
        const float* src = static_cast<const float*>(t.data) + off;
        for (; x + N <= n; x += N) hn::StoreU(hn::LoadU(d, src + x), d, dst + x);
        break;
      }
      case DType::f16: {
        const hn::Rebind<hwy::float16_t, DF> dh;
        const auto* src = static_cast<const hwy::float16_t*>(t.data) + off;
        for (; x + N <= n; x += N) hn::StoreU(hn::PromoteTo(d, hn::LoadU(dh, src + x)), d, dst + x);
        break;
      }
      case DType::bf16: {
        const hn::Rebind<hwy::bfloat16_t, DF> db;
        const auto* src = static_cast<const hwy::bfloat16_t*>(t.data) + off;
        for (; x + N <= n; x += N) hn::StoreU(hn::PromoteTo(d, hn::LoadU(db, src + x)), d, dst + x);
        break;
      }
    }
  }
  for (; x < n; ++x) dst[x] = LoadScalar(t, off + x * stride);
  for (; x < npad; ++x) dst[x] = 0.0f;
}

// out[kk * out_kk + r] (+)= sum_{l < L} a[kk * a_kk + l * a_l] * b[l * b_l + r]
// for kk < KB and r in C vectors.
// colscale (optional, accumulate only): the output is first multiplied by colscale[r] (the online
// softmax's rescale of o, folded into the pass that loads o anyway).
template <int KB, int C>
HWY_INLINE void Block(const float* HWY_RESTRICT a, std::size_t a_kk, std::size_t a_l, const float* HWY_RESTRICT b,
                      std::size_t b_l, std::size_t L, float* HWY_RESTRICT out, std::size_t out_kk, bool accumulate,
                      const float* HWY_RESTRICT colscale) {
  const DF d;
  const std::size_t N = hn::Lanes(d);
  VF acc[KB][C];
  for (int kk = 0; kk < KB; ++kk)
    for (int c = 0; c < C; ++c)
      acc[kk][c] = accumulate
                       ? hn::Load(d, out + static_cast<std::size_t>(kk) * out_kk + static_cast<std::size_t>(c) * N)
                       : hn::Zero(d);
  if (colscale != nullptr) {
    for (int c = 0; c < C; ++c) {
      const VF sc = hn::Load(d, colscale + static_cast<std::size_t>(c) * N);
      for (int kk = 0; kk < KB; ++kk) acc[kk][c] = hn::Mul(acc[kk][c], sc);
    }
  }
  for (std::size_t l = 0; l < L; ++l) {
    VF bv[C];
    for (int c = 0; c < C; ++c) bv[c] = hn::Load(d, b + l * b_l + static_cast<std::size_t>(c) * N);
    const float* al = a + l * a_l;
    for (int kk = 0; kk < KB; ++kk) {
      const VF av = hn::Set(d, al[static_cast<std::size_t>(kk) * a_kk]);
      for (int c = 0; c < C; ++c) acc[kk][c] = hn::MulAdd(av, bv[c], acc[kk][c]);
    }
  }
  for (int kk = 0; kk < KB; ++kk)
    for (int c = 0; c < C; ++c)
      hn::Store(acc[kk][c], d, out + static_cast<std::size_t>(kk) * out_kk + static_cast<std::size_t>(c) * N);
}

template <int C>
HWY_INLINE void GemmCols(const float* a, std::size_t a_kk, std::size_t a_l, const float* b, std::size_t b_l,
                         std::size_t L, float* out, std::size_t out_kk, std::size_t K, bool accumulate,
                         const float* colscale) {
  std::size_t kk = 0;
  for (; kk + kKB <= K; kk += kKB)
    Block<kKB, C>(a + kk * a_kk, a_kk, a_l, b, b_l, L, out + kk * out_kk, out_kk, accumulate, colscale);
  for (; kk + 2 <= K; kk += 2)
    Block<2, C>(a + kk * a_kk, a_kk, a_l, b, b_l, L, out + kk * out_kk, out_kk, accumulate, colscale);
  for (; kk < K; ++kk)
    Block<1, C>(a + kk * a_kk, a_kk, a_l, b, b_l, L, out + kk * out_kk, out_kk, accumulate, colscale);
}

HWY_INLINE void GemmColsAny(std::size_t vecs, const float* a, std::size_t a_kk, std::size_t a_l, const float* b,
                            std::size_t b_l, std::size_t L, float* out, std::size_t out_kk, std::size_t K,
                            bool accumulate, const float* colscale) {
  if (vecs == kC) return GemmCols<kC>(a, a_kk, a_l, b, b_l, L, out, out_kk, K, accumulate, colscale);
  if (vecs == 2) return GemmCols<2>(a, a_kk, a_l, b, b_l, L, out, out_kk, K, accumulate, colscale);
  GemmCols<1>(a, a_kk, a_l, b, b_l, L, out, out_kk, K, accumulate, colscale);
}

// out[kk][r] (+)= sum_l A(kk, l) B[l][r] for kk < K, r < rvecs * N (out, b row strides in floats);
// with colscale, out[kk][r] = colscale[r] * out[kk][r] + sum_l ...
void Gemm(const float* a, std::size_t a_kk, std::size_t a_l, const float* b, std::size_t b_l, std::size_t L, float* out,
          std::size_t out_kk, std::size_t K, std::size_t rvecs, bool accumulate, const float* colscale = nullptr) {
  const DF d;
  const std::size_t N = hn::Lanes(d);
  auto cs = [&](std::size_t rv) { return colscale == nullptr ? nullptr : colscale + rv * N; };
  std::size_t rv = 0;
  for (; rv + kC <= rvecs; rv += kC)
    GemmCols<kC>(a, a_kk, a_l, b + rv * N, b_l, L, out + rv * N, out_kk, K, accumulate, cs(rv));
  for (; rv + 2 <= rvecs; rv += 2)
    GemmCols<2>(a, a_kk, a_l, b + rv * N, b_l, L, out + rv * N, out_kk, K, accumulate, cs(rv));
  for (; rv < rvecs; ++rv) GemmCols<1>(a, a_kk, a_l, b + rv * N, b_l, L, out + rv * N, out_kk, K, accumulate, cs(rv));
}

struct TaskCtx {
  const ValidatedProblem* vp;
  const AttentionProblem* p;
  const Task* task;
  ScratchLayout L;
  std::int64_t R, Rp, D, Dv, Dp, Dvp;
  std::int64_t Rs, Ks, Vs;  // row strides of q^T/S/o^T, the key tile and the value tile (floats)
  float* alpha;
  float* q;
  float* s;
  float* o;
  float* k;
  float* v;
  float* m;
  float* l;
  float* slope;
  float* posf;
  std::int32_t* lo;
  std::int32_t* hi;
  float softcap;
  bool alibi;
};

constexpr std::int64_t kPrefetchRows = 6;

// Prefetches the cache lines of `elems` elements starting at element `off` of t.
HWY_INLINE void PrefetchRow(const TensorView& t, std::int64_t off, std::int64_t elems) {
  const auto* base = static_cast<const char*>(t.data) + off * static_cast<std::int64_t>(dtype_size(t.dtype));
  const std::int64_t bytes = elems * static_cast<std::int64_t>(dtype_size(t.dtype));
  for (std::int64_t b = 0; b < bytes; b += 64) hwy::Prefetch(base + b);
}

// Loads the key tile [j0, j0 + nk) into ctx.k ([nk][Dp]) and the value tile into ctx.v
// ([nk][Dvp]); returns true when the value tile holds a non-finite number.
bool LoadKvTile(const TaskCtx& c, std::int64_t j0, std::int64_t nk, bool check_v) {
  const AttentionProblem& p = *c.p;
  const Task& t = *c.task;
  const std::int64_t khs = HeadStride(p.k), kds = DimStride(p.k);
  const std::int64_t vhs = HeadStride(p.v), vds = DimStride(p.v);
  // Consecutive keys are evenly spaced within a sequence (dense, packed) or a page (paged), so the
  // row offset is looked up once per run of keys and then stepped.
  const bool paged = p.kv_layout == KvLayout::paged;
  const std::int64_t page = paged ? c.vp->signature().page_size : 0;
  const std::size_t row_axis = p.kv_layout == KvLayout::packed ? 0 : 1;
  const std::int64_t k_step = p.k.stride[row_axis], v_step = p.v.stride[row_axis];
  std::int64_t koff = 0, voff = 0;
  for (std::int64_t jj = 0; jj < nk; ++jj) {
    const std::int64_t j = j0 + jj;
    if (jj == 0 || (paged && j % page == 0)) {
      koff = c.vp->k_row_offset(t.b, j) + t.kvh * khs;
      voff = c.vp->v_row_offset(t.b, j) + t.kvh * vhs;
    } else {
      koff += k_step;
      voff += v_step;
    }
    if (jj + kPrefetchRows < nk && (!paged || (j % page) + kPrefetchRows < page)) {
      // The rows a few keys ahead (same sequence or page): hide DRAM latency on long KV.
      PrefetchRow(p.k, koff + kPrefetchRows * k_step, c.D * kds);
      PrefetchRow(p.v, voff + kPrefetchRows * v_step, c.Dv * vds);
    }
    LoadRow(p.k, koff, kds, c.D, c.k + jj * c.Ks, c.Dp);
    LoadRow(p.v, voff, vds, c.Dv, c.v + jj * c.Vs, c.Dvp);
  }
  if (!check_v) return false;
  const DF d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  VF z = hn::Zero(d);
  const VF zero = hn::Zero(d);
  for (std::int64_t jj = 0; jj < nk; ++jj)
    for (std::int64_t x = 0; x < c.Dvp; x += N) z = hn::Add(z, hn::Mul(hn::Load(d, c.v + jj * c.Vs + x), zero));
  return !hn::AllFalse(d, hn::IsNaN(z));  // x * 0 is NaN exactly when x is not finite
}

// Softcap and ALiBi on a vector of scores for rows [r0, r0 + N) at key j.
HWY_INLINE VF Transform(const TaskCtx& c, DF d, VF s, std::int64_t r0, float jf) {
  if (c.softcap > 0.0f) {
    const VF cap = hn::Set(d, c.softcap);
    const VF t = hn::Mul(cap, hn::Tanh(d, hn::Div(s, cap)));
    s = hn::IfThenElse(hn::IsNaN(s), s, t);
  }
  if (c.alibi) {
    const VF dist = hn::Abs(hn::Sub(hn::Load(d, c.posf + r0), hn::Set(d, jf)));
    s = hn::NegMulAdd(hn::Load(d, c.slope + r0), dist, s);
  }
  return s;
}

// ---------------------------------------------------------------------------------------------
// Rows kernel: lanes are query rows.

void RowsKernel(TaskCtx& c) {
  const DF d;
  const DI di;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  const Task& t = *c.task;
  const std::int64_t Rp = c.Rp, Rs = c.Rs;
  const std::size_t rvecs = static_cast<std::size_t>(Rp / N);
  const VF neg_inf = hn::Set(d, -std::numeric_limits<float>::infinity());

  for (std::int64_t x = 0; x < c.Dv; ++x) std::memset(c.o + x * Rs, 0, static_cast<std::size_t>(Rp) * sizeof(float));
  for (std::int64_t r = 0; r < Rp; r += N) {
    hn::Store(neg_inf, d, c.m + r);
    hn::Store(hn::Zero(d), d, c.l + r);
  }

  for (std::int64_t j0 = t.k_begin; j0 < t.k_end; j0 += kKeyTile) {
    const std::int64_t nk = std::min(kKeyTile, t.k_end - j0);
    const std::int64_t j1 = j0 + nk - 1;
    bool any = false, full = true;
    for (std::int64_t r = 0; r < c.R; ++r) {
      if (c.lo[r] <= j1 && c.hi[r] >= j0) any = true;
      if (c.lo[r] > j0 || c.hi[r] < j1) full = false;
    }
    if (!any) continue;
    const bool v_bad = LoadKvTile(c, j0, nk, !full);

    // S[jj][r] = sum_d K[jj][d] q^T[d][r] over the whole tile; the rest of S is masked below.
    Gemm(c.k, static_cast<std::size_t>(c.Ks), 1, c.q, static_cast<std::size_t>(Rs), static_cast<std::size_t>(c.D), c.s,
         static_cast<std::size_t>(Rs), static_cast<std::size_t>(nk), rvecs, false);

    // Online softmax, one lane per row.
    const bool fold = false;   // the rescale of o is a pass of its own
    const bool plain = false;  // every tile's scores take the transform and mask pass
    for (std::int64_t r0 = 0; r0 < Rp; r0 += N) {
      VF mt = neg_inf;
      if (plain) {
        VF mt1 = neg_inf;
        std::int64_t jj = 0;
        for (; jj + 2 <= nk; jj += 2) {
          mt = hn::Max(mt, hn::Load(d, c.s + jj * Rs + r0));
          mt1 = hn::Max(mt1, hn::Load(d, c.s + (jj + 1) * Rs + r0));
        }
        if (jj < nk) mt = hn::Max(mt, hn::Load(d, c.s + jj * Rs + r0));
        // (Max may drop a NaN score; its exp below is NaN all the same, and so are l and o.)
        mt = hn::Max(mt, mt1);
      } else {
        const auto lo = hn::Load(di, c.lo + r0);
        const auto hi = hn::Load(di, c.hi + r0);
        for (std::int64_t jj = 0; jj < nk; ++jj) {
          float* sp = c.s + jj * Rs + r0;
          VF s = Transform(c, d, hn::Load(d, sp), r0, static_cast<float>(j0 + jj));
          if (!full) {
            const auto j = hn::Set(di, static_cast<std::int32_t>(j0 + jj));
            const auto vis = hn::RebindMask(d, hn::And(hn::Not(hn::Lt(j, lo)), hn::Not(hn::Gt(j, hi))));
            s = hn::IfThenElse(vis, s, neg_inf);
          }
          hn::Store(s, d, sp);
          mt = hn::Max(mt, s);
        }
      }
      const VF m_old = hn::Load(d, c.m + r0);
      const VF m_new = hn::Max(m_old, mt);
      const VF m_use = hn::IfThenZeroElse(hn::Eq(m_new, neg_inf), m_new);
      const VF alpha = ExpKeepNaN(d, hn::Sub(m_old, m_use));
      VF sum = hn::Zero(d);
      for (std::int64_t jj = 0; jj < nk; ++jj) {
        float* sp = c.s + jj * Rs + r0;
        const VF pj = ExpKeepNaN(d, hn::Sub(hn::Load(d, sp), m_use));
        hn::Store(pj, d, sp);
        sum = hn::Add(sum, pj);
      }
      hn::Store(hn::MulAdd(hn::Load(d, c.l + r0), alpha, sum), d, c.l + r0);
      hn::Store(m_new, d, c.m + r0);
      if (fold) {
        hn::Store(alpha, d, c.alpha + r0);
      } else {
        for (std::int64_t x = 0; x < c.Dv; ++x) {
          float* op = c.o + x * Rs + r0;
          hn::Store(hn::Mul(hn::Load(d, op), alpha), d, op);
        }
      }
    }

    if (!v_bad) {
      // o^T[dv][r] += sum_jj V[jj][dv] P[jj][r] over the whole tile.
      Gemm(c.v, 1, static_cast<std::size_t>(c.Vs), c.s, static_cast<std::size_t>(Rs), static_cast<std::size_t>(nk), c.o,
           static_cast<std::size_t>(Rs), static_cast<std::size_t>(c.Dv), rvecs, true);
    } else {
      // Non-finite values in a partly masked tile: never touch a value a row cannot see.
      for (std::int64_t r = 0; r < c.R; ++r) {
        const std::int64_t a = std::max<std::int64_t>(c.lo[r], j0), e = std::min<std::int64_t>(c.hi[r], j1);
        for (std::int64_t j = a; j <= e; ++j) {
          const float pj = c.s[(j - j0) * Rs + r];
          const float* vr = c.v + (j - j0) * c.Vs;
          for (std::int64_t x = 0; x < c.Dv; ++x) c.o[x * Rs + r] += pj * vr[x];
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Decode kernel: lanes run along the head dim; each row has its exact visible range.

template <int C>
HWY_INLINE void PvRow(const float* HWY_RESTRICT v, std::int64_t dvp, const float* HWY_RESTRICT p, std::int64_t a,
                      std::int64_t e, float* HWY_RESTRICT o) {
  const DF d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  VF acc[C];
  for (int cc = 0; cc < C; ++cc) acc[cc] = hn::Load(d, o + cc * N);
  for (std::int64_t jj = a; jj <= e; ++jj) {
    const VF pj = hn::Set(d, p[jj]);
    const float* vr = v + jj * dvp;
    for (int cc = 0; cc < C; ++cc) acc[cc] = hn::MulAdd(pj, hn::Load(d, vr + cc * N), acc[cc]);
  }
  for (int cc = 0; cc < C; ++cc) hn::Store(acc[cc], d, o + cc * N);
}

void DecodeKernel(TaskCtx& c) {
  const DF d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  const Task& t = *c.task;
  const float ninf = -std::numeric_limits<float>::infinity();
  const VF neg_inf = hn::Set(d, ninf);
  std::memset(c.o, 0, static_cast<std::size_t>(c.R * c.Dvp) * sizeof(float));
  for (std::int64_t r = 0; r < c.R; ++r) {
    c.m[r] = ninf;
    c.l[r] = 0.0f;
  }
  const std::int64_t nkp = round_up(kKeyTile, N);
  for (std::int64_t j0 = t.k_begin; j0 < t.k_end; j0 += kKeyTile) {
    const std::int64_t nk = std::min(kKeyTile, t.k_end - j0);
    const std::int64_t j1 = j0 + nk - 1;
    bool any = false;
    for (std::int64_t r = 0; r < c.R; ++r)
      if (c.lo[r] <= j1 && c.hi[r] >= j0) any = true;
    if (!any) continue;
    LoadKvTile(c, j0, nk, false);
    for (std::int64_t r = 0; r < c.R; ++r) {
      const std::int64_t a = std::max<std::int64_t>(c.lo[r], j0) - j0;
      const std::int64_t e = std::min<std::int64_t>(c.hi[r], j1) - j0;
      if (a > e) continue;
      float* s = c.s + r * nkp;
      const float* qr = c.q + r * c.Dp;
      for (std::int64_t jj = 0; jj < a; ++jj) s[jj] = ninf;
      std::int64_t jj = a;
      for (; jj + 4 <= e + 1; jj += 4) {
        const float* k0 = c.k + jj * c.Dp;
        VF a0 = hn::Zero(d), a1 = hn::Zero(d), a2 = hn::Zero(d), a3 = hn::Zero(d);
        for (std::int64_t x = 0; x < c.Dp; x += N) {
          const VF qv = hn::Load(d, qr + x);
          a0 = hn::MulAdd(qv, hn::Load(d, k0 + x), a0);
          a1 = hn::MulAdd(qv, hn::Load(d, k0 + c.Dp + x), a1);
          a2 = hn::MulAdd(qv, hn::Load(d, k0 + 2 * c.Dp + x), a2);
          a3 = hn::MulAdd(qv, hn::Load(d, k0 + 3 * c.Dp + x), a3);
        }
        s[jj] = hn::GetLane(hn::SumOfLanes(d, a0));
        s[jj + 1] = hn::GetLane(hn::SumOfLanes(d, a1));
        s[jj + 2] = hn::GetLane(hn::SumOfLanes(d, a2));
        s[jj + 3] = hn::GetLane(hn::SumOfLanes(d, a3));
      }
      for (; jj <= e; ++jj) {
        const float* k0 = c.k + jj * c.Dp;
        VF a0 = hn::Zero(d);
        for (std::int64_t x = 0; x < c.Dp; x += N) a0 = hn::MulAdd(hn::Load(d, qr + x), hn::Load(d, k0 + x), a0);
        s[jj] = hn::GetLane(hn::SumOfLanes(d, a0));
      }
      for (jj = e + 1; jj < nkp; ++jj) s[jj] = ninf;
      // Transform (softcap, ALiBi) and the tile max, vectorised over keys.
      const VF rowv = hn::Set(d, c.posf[r]);
      const VF slope = hn::Set(d, c.slope[r]);
      const auto iota = hn::Iota(d, static_cast<float>(j0));
      VF mt = neg_inf;
      for (std::int64_t x = 0; x < nkp; x += N) {
        VF sv = hn::Load(d, s + x);
        if (c.softcap > 0.0f) {
          const VF cap = hn::Set(d, c.softcap);
          const VF tv = hn::Mul(cap, hn::Tanh(d, hn::Div(sv, cap)));
          sv = hn::IfThenElse(hn::IsNaN(sv), sv, tv);
        }
        if (c.alibi) {
          const VF jv = hn::Add(iota, hn::Set(d, static_cast<float>(x)));
          sv = hn::NegMulAdd(slope, hn::Abs(hn::Sub(rowv, jv)), sv);
        }
        if (x < a || x + N > e + 1) {  // keep masked keys at -inf after ALiBi
          const auto jv = hn::Iota(d, static_cast<float>(x));
          const auto vis =
              hn::And(hn::Ge(jv, hn::Set(d, static_cast<float>(a))), hn::Le(jv, hn::Set(d, static_cast<float>(e))));
          sv = hn::IfThenElse(vis, sv, neg_inf);
        }
        hn::Store(sv, d, s + x);
        mt = hn::Max(mt, sv);
      }
      const float mtile = hn::GetLane(hn::MaxOfLanes(d, mt));
      bool nan = false;
      for (std::int64_t x = a; x <= e; ++x) nan |= std::isnan(s[x]);
      const float m_old = c.m[r];
      const float m_new = nan ? std::numeric_limits<float>::quiet_NaN() : std::max(m_old, mtile);
      const float m_use = m_new == ninf ? 0.0f : m_new;
      const float alpha = std::exp(m_old - m_use);
      const VF mu = hn::Set(d, m_use);
      VF sum = hn::Zero(d);
      for (std::int64_t x = 0; x < nkp; x += N) {
        const VF pj = ExpKeepNaN(d, hn::Sub(hn::Load(d, s + x), mu));
        hn::Store(pj, d, s + x);
        sum = hn::Add(sum, pj);
      }
      c.l[r] = c.l[r] * alpha + hn::GetLane(hn::SumOfLanes(d, sum));
      c.m[r] = m_new;
      float* orow = c.o + r * c.Dvp;
      const VF av = hn::Set(d, alpha);
      for (std::int64_t x = 0; x < c.Dvp; x += N) hn::Store(hn::Mul(hn::Load(d, orow + x), av), d, orow + x);
      std::int64_t x = 0;
      for (; x + 4 * N <= c.Dvp; x += 4 * N) PvRow<4>(c.v + x, c.Dvp, s, a, e, orow + x);
      for (; x < c.Dvp; x += N) PvRow<1>(c.v + x, c.Dvp, s, a, e, orow + x);
    }
  }
}

// ---------------------------------------------------------------------------------------------

void RunPrefillV2(const ValidatedProblem& vp, const Plan& plan, const Task& t, void* scratch, float* partial) {
  const DF d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  const AttentionProblem& p = vp.problem();
  TaskCtx c;
  c.vp = &vp;
  c.p = &p;
  c.task = &t;
  c.L = scratch_layout(plan.rows_max, vp.head_dim(), vp.head_dim_v());
  auto* base = static_cast<std::byte*>(scratch);
  c.q = reinterpret_cast<float*>(base + c.L.q);
  c.s = reinterpret_cast<float*>(base + c.L.s);
  c.o = reinterpret_cast<float*>(base + c.L.o);
  c.k = reinterpret_cast<float*>(base + c.L.k);
  c.v = reinterpret_cast<float*>(base + c.L.v);
  c.m = reinterpret_cast<float*>(base + c.L.m);
  c.l = reinterpret_cast<float*>(base + c.L.l);
  c.slope = reinterpret_cast<float*>(base + c.L.slope);
  c.posf = reinterpret_cast<float*>(base + c.L.posf);
  c.lo = reinterpret_cast<std::int32_t*>(base + c.L.lo);
  c.hi = reinterpret_cast<std::int32_t*>(base + c.L.hi);
  c.D = vp.head_dim();
  c.Dv = vp.head_dim_v();
  c.Dp = c.L.dp;
  c.Dvp = c.L.dvp;
  c.R = t.ni * t.nh;
  c.softcap = p.softcap;
  c.alibi = p.alibi_slopes != nullptr;
  const bool rows_kernel = c.R >= N;
  c.Rp = rows_kernel ? round_up(c.R, N) : c.R;
  c.Rs = c.Rp;  // the rows' padded count: power-of-two strides for 128-row tasks
  c.Ks = c.Dp;
  c.Vs = c.Dvp;
  c.alpha = reinterpret_cast<float*>(base + c.L.alpha);

  const std::int32_t group = vp.group_size();
  const std::int64_t sq = vp.seqlen_q(t.b), skv = vp.seqlen_k(t.b);
  const float scale = vp.scale();
  const std::int64_t qhs = HeadStride(p.q), qds = DimStride(p.q);
  for (std::int64_t r = 0; r < c.Rp; ++r) {
    if (r >= c.R) {
      c.lo[r] = 1;
      c.hi[r] = 0;
      c.slope[r] = 0.0f;
      c.posf[r] = 0.0f;
      continue;
    }
    const std::int64_t i = t.i0 + r / t.nh;
    const std::int32_t h = t.kvh * group + t.h0 + static_cast<std::int32_t>(r % t.nh);
    auto range = vp.visible_keys(t.b, i);
    range.first = std::max(range.first, t.k_begin);
    range.last = std::min(range.last, t.k_end - 1);
    if (range.first > range.last) range = {1, 0};
    c.lo[r] = static_cast<std::int32_t>(range.first);
    c.hi[r] = static_cast<std::int32_t>(range.last);
    c.slope[r] = c.alibi ? p.alibi_slopes[h] : 0.0f;
    c.posf[r] = static_cast<float>(i + skv - sq);
    // q row, scaled, into the key tile buffer as a staging row.
    float* row = rows_kernel ? c.k : c.q + r * c.Dp;
    LoadRow(p.q, vp.q_row_offset(t.b, i) + h * qhs, qds, c.D, row, c.Dp);
    const VF sv = hn::Set(d, scale);
    for (std::int64_t x = 0; x < c.Dp; x += N) hn::Store(hn::Mul(hn::Load(d, row + x), sv), d, row + x);
    if (rows_kernel)
      for (std::int64_t x = 0; x < c.D; ++x) c.q[x * c.Rs + r] = row[x];
  }
  if (rows_kernel) {
    for (std::int64_t x = 0; x < c.D; ++x)
      for (std::int64_t r = c.R; r < c.Rp; ++r) c.q[x * c.Rs + r] = 0.0f;
    RowsKernel(c);
  } else {
    DecodeKernel(c);
  }

  // Results: o^T [Dv][Rp] (rows kernel) or o [R][Dvp] (decode kernel), unnormalised.
  const std::int64_t o_r = rows_kernel ? 1 : c.Dvp;
  const std::int64_t o_x = rows_kernel ? c.Rs : 1;
  if (partial != nullptr) {
    const std::int64_t rows_max = plan.rows_max;
    for (std::int64_t r = 0; r < c.R; ++r) {
      partial[r] = c.m[r];
      partial[rows_max + r] = c.l[r];
      float* po = partial + 2 * rows_max + r * c.Dv;
      for (std::int64_t x = 0; x < c.Dv; ++x) po[x] = c.o[r * o_r + x * o_x];
    }
    return;
  }
  const std::int64_t ohs = HeadStride(p.o), ods = DimStride(p.o);
  for (std::int64_t r = 0; r < c.R; ++r) {
    const std::int64_t i = t.i0 + r / t.nh;
    const std::int32_t h = t.kvh * group + t.h0 + static_cast<std::int32_t>(r % t.nh);
    const std::int64_t ooff = vp.o_row_offset(t.b, i) + h * ohs;
    const float l = c.l[r];
    if (l == 0.0f) {
      for (std::int64_t x = 0; x < c.Dv; ++x) StoreScalar(p.o, ooff + x * ods, 0.0f);
      if (p.lse.present())
        static_cast<float*>(p.lse.data)[vp.lse_offset(t.b, h, i)] = -std::numeric_limits<float>::infinity();
      continue;
    }
    const float inv = 1.0f / l;
    float* row = c.k;  // the key tile is free now
    for (std::int64_t x = 0; x < c.Dv; ++x) row[x] = c.o[r * o_r + x * o_x] * inv;
    StoreRow(p.o, ooff, ods, c.Dv, row);
    if (p.lse.present()) static_cast<float*>(p.lse.data)[vp.lse_offset(t.b, h, i)] = c.m[r] + std::log(l);
  }
}

}  // namespace
}  // namespace HWY_NAMESPACE
}  // namespace kallpa::cpu_flash
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kallpa::cpu_flash {
HWY_EXPORT(RunPrefillV2);
namespace {

void run_lab_kernel(const ValidatedProblem& problem, const Plan& plan, const Task& task, void* scratch,
                    float* partial) {
  HWY_DYNAMIC_DISPATCH(RunPrefillV2)(problem, plan, task, scratch, partial);
}

}  // namespace
}  // namespace kallpa::cpu_flash

int main() {
  using namespace kallpa;
  using namespace kallpa::cpu_flash;
  const lab::Runner kernel = [](const ValidatedProblem& vp) { lab::run_prefill(vp, &run_lab_kernel); };
  const std::vector<lab::Shape> checks = {
      {.b = 1, .sq = 300, .skv = 300, .hq = 4, .hkv = 4, .d = 64, .dt = DType::f16, .causal = true},
      {.b = 2, .sq = 129, .skv = 700, .hq = 8, .hkv = 2, .d = 128, .dt = DType::bf16},
      {.b = 1, .sq = 64, .skv = 2000, .hq = 2, .hkv = 1, .d = 64, .dt = DType::f32, .page = 16, .causal = true},
      {.b = 1, .sq = 2, .skv = 300, .hq = 64, .hkv = 2, .d = 64, .dt = DType::f16},
  };
  std::printf("cpu-flash lab: prefill v2 (SIMD target %s)\n", CpuFlashBackend::simd_target().c_str());
  if (!lab::check("prefill v2", checks, kernel)) return 1;
  const std::vector<lab::Shape> timed = {
      {.b = 1, .sq = 512, .skv = 4096, .hq = 8, .hkv = 8, .d = 128, .dt = DType::f16, .causal = true},
      {.b = 1, .sq = 512, .skv = 512, .hq = 8, .hkv = 8, .d = 64, .dt = DType::f16, .causal = true},
  };
  lab::bench("prefill v2", kernel, "production", Options{}, timed, 10);
  return 0;
}
#endif  // HWY_ONCE
