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
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  // AVX-512: the same reduction and polynomial, with vscalefps for the 2^n (it also gives the
  // zero below -86, through its zero mask, and keeps NaN: the mask is set for unordered lanes, and
  // vminps returns its second operand, x, when either is NaN): 12 operations instead of 19. On the
  // 2-core Zen 4 (session 23) the exps took ~0.70 ms of decode v10's 7.35 with K/V in L1 (a
  // throwaway probe that exponentiated every score of a block in one flat loop, not kept); with
  // this the kernel runs in 7.0 (build/bench/cpu_flash_bench --benchmark_filter='decode_l1_gqa/
  // f16/d64/h32_8/sq1_skv65536/v10_half_dots_t1$').
  if constexpr (hn::MaxLanes(D()) == 16) {
    const __m512 xr = x.raw;
    const __mmask16 keep = _mm512_cmp_ps_mask(xr, _mm512_set1_ps(-86.0f), _CMP_NLT_UQ);
    const __m512 xc = _mm512_min_ps(_mm512_set1_ps(88.0f), xr);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693145751953125f), xc);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-1.428606765330187045e-6f), r);
    __m512 y = _mm512_set1_ps(1.0f / 720.0f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 120.0f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 24.0f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 6.0f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(0.5f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
    return V{_mm512_maskz_scalef_ps(keep, y, n)};
  }
#endif
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
