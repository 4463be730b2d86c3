// The cheap exp of cpu-flash's online softmax (prefill, the grouped and lanes decode kernels).
// Highway per-target header.
#if defined(KALLPA_BACKENDS_CPU_FLASH_FAST_EXP_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KALLPA_BACKENDS_CPU_FLASH_FAST_EXP_INL_H_
#undef KALLPA_BACKENDS_CPU_FLASH_FAST_EXP_INL_H_
#else
#define KALLPA_BACKENDS_CPU_FLASH_FAST_EXP_INL_H_
#endif

#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace kallpa::cpu_flash {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// The reduction of e^xc (xc finite, |xc| <= 88): n = round(xc / ln 2) and y = e^r on
// r = xc - n ln 2 (Cody-Waite, two parts of ln 2), so that e^xc = y 2^n.
template <class D>
HWY_INLINE void ExpReduce(D d, hn::Vec<D> xc, hn::Vec<D>& n, hn::Vec<D>& y) {
  n = hn::Round(hn::Mul(xc, hn::Set(d, 1.44269504088896341f)));
  hn::Vec<D> r = hn::MulAdd(n, hn::Set(d, -0.693145751953125f), xc);
  r = hn::MulAdd(n, hn::Set(d, -1.428606765330187045e-6f), r);
  y = hn::Set(d, 1.0f / 720.0f);
  y = hn::MulAdd(y, r, hn::Set(d, 1.0f / 120.0f));
  y = hn::MulAdd(y, r, hn::Set(d, 1.0f / 24.0f));
  y = hn::MulAdd(y, r, hn::Set(d, 1.0f / 6.0f));
  y = hn::MulAdd(y, r, hn::Set(d, 0.5f));
  y = hn::MulAdd(y, r, hn::Set(d, 1.0f));
  y = hn::MulAdd(y, r, hn::Set(d, 1.0f));
}

// exp for the online softmax (arguments <= 0, -inf for masked keys, NaN kept): Cody-Waite
// reduction by ln 2 and a degree-6 Taylor polynomial on |r| <= ln(2)/2 (truncation error
// 0.347^7/7! ~ 1.2e-7 relative, about one ulp; checked against std::exp in
// CpuFlash.FastExpMatchesStdExp). About 17 operations against hn::Exp's 25 plus the NaN blend.
// Below e^-86 (~4e-38, a weight no softmax row can notice) the result is 0, which keeps the
// exponent arithmetic clear of subnormals.
template <class D>
HWY_INLINE hn::Vec<D> FastExp(D d, hn::Vec<D> x) {
  using V = hn::Vec<D>;
  const V lo = hn::Set(d, -86.0f), hi = hn::Set(d, 88.0f);
  V n, y;
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  // AVX-512: vscalefps for the 2^n (it also gives the zero below -86, through its zero mask, and
  // keeps NaN: the mask is set for unordered lanes, and vminps returns its second operand, x,
  // when either is NaN, so no lower clamp is needed): 12 operations instead of 19, where the exp
  // is a tenth of AVX-512 decode's time with K/V in L1 (bench/results/cpu-flash-decode-lanes.md).
  if constexpr (hn::MaxLanes(D()) == 16) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x.raw, lo.raw, _CMP_NLT_UQ);
    ExpReduce(d, V{_mm512_min_ps(hi.raw, x.raw)}, n, y);
    return V{_mm512_maskz_scalef_ps(keep, y.raw, n.raw)};
  }
#endif
  const hn::RebindToSigned<D> di;
  ExpReduce(d, hn::Min(hn::Max(x, lo), hi), n, y);
  const auto e = hn::ShiftLeft<23>(hn::ConvertTo(di, n));
  y = hn::BitCast(d, hn::Add(hn::BitCast(di, y), e));
  y = hn::IfThenZeroElse(hn::Lt(x, lo), y);
  return hn::IfThenElse(hn::IsNaN(x), x, y);
}

}  // namespace HWY_NAMESPACE
}  // namespace kallpa::cpu_flash
HWY_AFTER_NAMESPACE();

#endif  // KALLPA_BACKENDS_CPU_FLASH_FAST_EXP_INL_H_
