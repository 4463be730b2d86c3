// The cheap exp of cpu-flash's online softmax (prefill v3, decode v7). Highway per-target header.
#if defined(KALLPA_CPU_FLASH_FAST_EXP_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KALLPA_CPU_FLASH_FAST_EXP_INL_H_
#undef KALLPA_CPU_FLASH_FAST_EXP_INL_H_
#else
#define KALLPA_CPU_FLASH_FAST_EXP_INL_H_
#endif

#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace kallpa::cpu_flash {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// exp for the online softmax (arguments <= 0, -inf for masked keys, NaN kept): Cody-Waite
// reduction by ln 2 and a degree-6 Taylor polynomial on |r| <= ln(2)/2 (truncation error
// 0.347^7/7! ~ 1.2e-7 relative, about one ulp; checked against std::exp in
// CpuFlash.FastExpMatchesStdExp). About 17 operations against hn::Exp's 25 plus the NaN blend.
template <class D>
HWY_INLINE hn::Vec<D> FastExp(D d, hn::Vec<D> x) {
  using V = hn::Vec<D>;
  const hn::RebindToSigned<D> di;
  // Below e^-86 (~4e-38, a weight no softmax row can notice) the result is 0, which keeps the
  // exponent arithmetic clear of subnormals.
  const V lo = hn::Set(d, -86.0f);
  const V xc = hn::Min(hn::Max(x, lo), hn::Set(d, 88.0f));
  const V n = hn::Round(hn::Mul(xc, hn::Set(d, 1.44269504088896341f)));
  V r = hn::MulAdd(n, hn::Set(d, -0.693145751953125f), xc);
  r = hn::MulAdd(n, hn::Set(d, -1.428606765330187045e-6f), r);
  V y = hn::Set(d, 1.0f / 720.0f);
  y = hn::MulAdd(y, r, hn::Set(d, 1.0f / 120.0f));
  y = hn::MulAdd(y, r, hn::Set(d, 1.0f / 24.0f));
  y = hn::MulAdd(y, r, hn::Set(d, 1.0f / 6.0f));
  y = hn::MulAdd(y, r, hn::Set(d, 0.5f));
  y = hn::MulAdd(y, r, hn::Set(d, 1.0f));
  y = hn::MulAdd(y, r, hn::Set(d, 1.0f));
  const auto e = hn::ShiftLeft<23>(hn::ConvertTo(di, n));
  y = hn::BitCast(d, hn::Add(hn::BitCast(di, y), e));
  y = hn::IfThenZeroElse(hn::Lt(x, lo), y);
  return hn::IfThenElse(hn::IsNaN(x), x, y);
}

}  // namespace HWY_NAMESPACE
}  // namespace kallpa::cpu_flash
HWY_AFTER_NAMESPACE();

#endif  // KALLPA_CPU_FLASH_FAST_EXP_INL_H_
