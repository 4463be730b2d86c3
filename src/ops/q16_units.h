// The block types that take Q16 activations in integer products beside Q8_0/Q4_0/Q4_1: Q5_0, Q5_1,
// IQ4_NL, Q4_K, Q5_K and Q6_K (the types of the Q4_K_M / Q5_K_M files people share).
//
// Each is read in units (one block of 32 for Q5_0/Q5_1/IQ4_NL, one super-block of 256 for the
// K-quants), each unit as blocks of 32 elements that line up with the activation blocks
// (BlockQ16x). Block c of a unit is 32 integer weights wq[j], a scale d_c and, for the types with a
// minimum, a constant m_c, so that its dequantised values are wq[j] * d_c + m_c:
//   Q5_0   wq = 5-bit q - 16                     d_c = d                  (no m)
//   Q5_1   wq = 5-bit q                          d_c = d, m_c = m
//   IQ4_NL wq = kIq4NlValues[nibble]             d_c = d                  (no m)
//   Q4_K   wq = 4-bit q of sub-block c            d_c = d * sc[c], m_c = -(dmin * min[c])
//   Q5_K   wq = 5-bit q of sub-block c            as Q4_K
//   Q6_K   wq = scales[2c + j/16] * (6-bit q - 32) d_c = d                  (no m)
// d * sc and dmin * min are exact in f32 (an 11-bit mantissa times a 6-bit integer), and Q6_K's
// folded |wq| <= 128 * 32 = 4096 fits int16, so every integer half of quant_kernels.h's Q16 sum
// stays exact in int32 (16 * 4096 * 32767 < 2^31). The products then follow gemm_q16's order
// block by block: acc_e/acc_o take fma(float(E|O), d_c * d_x), macc = fma(m_c, s_x, macc) for the
// types with a minimum, y = (acc_e + acc_o) + macc.
//
// The scale decoding below is plain scalar code shared by the scalar and SIMD kernels, so both
// compute the same d_c and m_c.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kallpa/half.h"
#include "kallpa/ops/ggml_type.h"
#include "ops/quant_types.h"

namespace kallpa::ops::kernels {

inline constexpr int kMaxUnitBlocks = kQK_K / kQK;  // 8

struct Q16Unit {
  int blocks;         // blocks of 32 per unit
  std::size_t bytes;  // bytes per unit
  bool has_m;         // blocks carry a constant m_c
};

constexpr bool has_q16_unit_kernel(GgmlType t) noexcept {
  switch (t) {
    case GgmlType::q5_0:
    case GgmlType::q5_1:
    case GgmlType::iq4_nl:
    case GgmlType::q4_k:
    case GgmlType::q5_k:
    case GgmlType::q6_k: return true;
    default: return false;
  }
}

constexpr Q16Unit q16_unit(GgmlType t) noexcept {
  switch (t) {
    case GgmlType::q5_0: return {1, kQ5_0Bytes, false};
    case GgmlType::q5_1: return {1, kQ5_1Bytes, true};
    case GgmlType::iq4_nl: return {1, kIq4NlBytes, false};
    case GgmlType::q4_k: return {8, kQ4KBytes, true};
    case GgmlType::q5_k: return {8, kQ5KBytes, true};
    case GgmlType::q6_k: return {8, kQ6KBytes, false};
    default: return {0, 0, false};
  }
}

inline float unit_half(const std::byte* p) noexcept {
  std::uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

// d_c and m_c (m only where the type has a minimum) of every block of the unit at u.
inline void q16_unit_scales(GgmlType t, const std::byte* u, float* d, float* m) noexcept {
  switch (t) {
    case GgmlType::q5_0:
    case GgmlType::iq4_nl: d[0] = unit_half(u); return;
    case GgmlType::q5_1:
      d[0] = unit_half(u);
      m[0] = unit_half(u + 2);
      return;
    case GgmlType::q4_k:
    case GgmlType::q5_k: {
      const float dd = unit_half(u);
      const float dmin = unit_half(u + 2);
      const auto* s = reinterpret_cast<const std::uint8_t*>(u + 4);
      for (int c = 0; c < 8; ++c) {
        const KScaleMin sm = kquant_scale_min(s, c);
        d[c] = dd * static_cast<float>(sm.scale);
        m[c] = -(dmin * static_cast<float>(sm.min));
      }
      return;
    }
    case GgmlType::q6_k: {
      const float dd = unit_half(u + 208);
      for (int c = 0; c < 8; ++c) d[c] = dd;
      return;
    }
    default: return;
  }
}

// wq[0..31] of block c of the unit at u (the scalar reference's reading; the SIMD kernels widen the
// same integers in registers).
void q16_unit_quants_scalar(GgmlType t, const std::byte* u, int c, std::int32_t* wq) noexcept;

}  // namespace kallpa::ops::kernels
