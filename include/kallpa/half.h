// Scalar conversions between f32 and the 16-bit float formats, round-to-nearest-even, with
// NaN/Inf/subnormals preserved. Used by plain-loop code (reference, tests); fast kernels convert
// in SIMD registers instead.
#pragma once

#include <bit>
#include <cstdint>
#include <limits>

#include "kallpa/tensor.h"

namespace kallpa {

inline float bf16_to_f32(std::uint16_t bits) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

inline std::uint16_t f32_to_bf16(float value) noexcept {
  std::uint32_t u = std::bit_cast<std::uint32_t>(value);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

inline float f16_to_f32(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  std::uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      bits = sign | (static_cast<std::uint32_t>(127 - 15 - e) << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  return std::bit_cast<float>(bits);
}

inline std::uint16_t f32_to_f16(float value) noexcept {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(value);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u);   // NaN
  if (abs >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (abs < 0x38800000u) {                                                    // subnormal or zero in f16
    if (abs < 0x33000000u) return static_cast<std::uint16_t>(sign);           // rounds to zero
    const std::uint32_t exp = abs >> 23;
    const std::uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126u - exp;  // value / 2^-24, the f16 subnormal unit
    const std::uint32_t half_units = mant >> shift;
    const std::uint32_t rem = mant & ((1u << shift) - 1u);
    const std::uint32_t halfway = 1u << (shift - 1u);
    std::uint32_t r = half_units;
    if (rem > halfway || (rem == halfway && (r & 1u))) ++r;
    return static_cast<std::uint16_t>(sign | r);
  }
  std::uint32_t bits = abs - ((127u - 15u) << 23);
  const std::uint32_t rem = bits & 0x1fffu;
  bits >>= 13;
  if (rem > 0x1000u || (rem == 0x1000u && (bits & 1u))) ++bits;
  return static_cast<std::uint16_t>(sign | bits);
}

// Element `index` (in elements from data) of a buffer of `dtype`, widened to f32, and the reverse
// with round-to-nearest-even: the plain-loop access every non-SIMD path shares.
inline float load_f32(DType dtype, const void* data, std::int64_t index) noexcept {
  switch (dtype) {
    case DType::f32: return static_cast<const float*>(data)[index];
    case DType::f16: return f16_to_f32(static_cast<const std::uint16_t*>(data)[index]);
    case DType::bf16: return bf16_to_f32(static_cast<const std::uint16_t*>(data)[index]);
  }
  return std::numeric_limits<float>::quiet_NaN();
}

inline void store_f32(DType dtype, void* data, std::int64_t index, float value) noexcept {
  switch (dtype) {
    case DType::f32: static_cast<float*>(data)[index] = value; break;
    case DType::f16: static_cast<std::uint16_t*>(data)[index] = f32_to_f16(value); break;
    case DType::bf16: static_cast<std::uint16_t*>(data)[index] = f32_to_bf16(value); break;
  }
}

}  // namespace kallpa
