// Block layouts of the quantised ggml types kallpa computes with (bit-compatible with ggml), and
// the activation block the quantised dot products use.
//
//   Q8_0: d (f16), 32 x int8 q          value = q * d
//   Q4_0: d (f16), 16 bytes of nibbles  value = (q - 8) * d
//   Q4_1: d (f16), m (f16), 16 bytes    value = q * d + m
// Nibble order (Q4_*): byte j holds element j in its low nibble and element j + 16 in its high one.
//
// The block types computed by dequantising (quant_kernels.h's is_block_dequant), byte offsets in
// a block; `nibble j` is Q4's order, hbit j is bit j of the 32-bit qh:
//   Q5_0   (22 B, 32): d@0, qh@2 (u32), qs@6        value = (nibble j | hbit j << 4) - 16) * d
//   Q5_1   (24 B, 32): d@0, m@2, qh@4, qs@8         value = (nibble j | hbit j << 4) * d + m
//   IQ4_NL (18 B, 32): d@0, qs@2                    value = kIq4NlValues[nibble j] * d
// K-quants: super-blocks of 256 elements in sub-blocks of 16 or 32 with 4..8-bit scales.
//   Q2_K (84 B):  scales@0 (16: low 4 bits scale, high 4 min), qs@16 (64), d@80, dmin@82
//                 element e: q = qs[32 (e/128) + e%32] >> 2 ((e%128)/32) & 3,
//                 value = d * (sc & 15) * q - dmin * (sc >> 4), sc = scales[e/16]
//   Q3_K (110 B): hmask@0 (32), qs@32 (64), scales@96 (12: 16 six-bit scales), d@108
//                 q = (2-bit as Q2_K) - 4 unless bit e/32 of hmask[e%32] is set,
//                 value = d * (scale[e/16] - 32) * q
//   Q4_K (144 B): d@0, dmin@2, scales@4 (12: 8 six-bit scales and mins, kquant_scale_min), qs@16
//                 sub-block c of 32: q = qs[32 (c/2) + i] >> 4 (c%2) & 15,
//                 value = d * sc[c] * q - dmin * min[c]
//   Q5_K (176 B): d@0, dmin@2, scales@4, qh@16 (32), qs@48: Q4_K's q | (bit c of qh[i]) << 4
//   Q6_K (210 B): ql@0 (128), qh@128 (64), scales@192 (16 x int8), d@208
//                 e = 128 h + r: q = (ql[64 h + r%64] >> 4 (r/64) & 15 | (qh[32 h + r%32] >> 2 (r/32)
//                 & 3) << 4) - 32, value = d * scales[e/16] * q
//   Q8_K (292 B): d@0 (f32), qs@4 (256 x int8), bsums@260 (16 x int16)   value = q * d
#pragma once

#include <cstddef>
#include <cstdint>

namespace kallpa::ops {

inline constexpr int kQK = 32;     // elements per block of Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / IQ4_NL
inline constexpr int kQK_K = 256;  // elements per K-quant super-block

inline constexpr std::size_t kQ5_0Bytes = 22;
inline constexpr std::size_t kQ5_1Bytes = 24;
inline constexpr std::size_t kIq4NlBytes = 18;
inline constexpr std::size_t kQ2KBytes = 84;
inline constexpr std::size_t kQ3KBytes = 110;
inline constexpr std::size_t kQ4KBytes = 144;
inline constexpr std::size_t kQ5KBytes = 176;
inline constexpr std::size_t kQ6KBytes = 210;
inline constexpr std::size_t kQ8KBytes = 292;

// IQ4_NL's 16 non-linear levels.
inline constexpr std::int8_t kIq4NlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                 1,    13,   25,  38,  53,  69,  89,  113};

// Q4_K/Q5_K: sub-block c's (0..7) 6-bit scale and min from the 12 packed bytes s: for c < 4 the
// low 6 bits of s[c] and s[c + 4]; for c >= 4 a nibble of s[c + 4] with the top 2 bits of s[c - 4]
// (scale) or s[c] (min) above it.
struct KScaleMin {
  int scale, min;
};
constexpr KScaleMin kquant_scale_min(const std::uint8_t* s, int c) noexcept {
  if (c < 4) return {s[c] & 63, s[c + 4] & 63};
  return {(s[c + 4] & 0x0f) | ((s[c - 4] >> 6) << 4), (s[c + 4] >> 4) | ((s[c] >> 6) << 4)};
}

struct BlockQ8_0 {
  std::uint16_t d;
  std::int8_t qs[kQK];
};
struct BlockQ4_0 {
  std::uint16_t d;
  std::uint8_t qs[kQK / 2];
};
struct BlockQ4_1 {
  std::uint16_t d;
  std::uint16_t m;
  std::uint8_t qs[kQK / 2];
};
static_assert(sizeof(BlockQ8_0) == 34 && alignof(BlockQ8_0) == 2);
static_assert(sizeof(BlockQ4_0) == 18);
static_assert(sizeof(BlockQ4_1) == 20);

// An activation block: x[i] ~= q[i] * d, with s = d * sum(q) (for the constant term of Q4_0/Q4_1).
// d = max|x| / 127 and q = round-to-nearest-even(x / d), so |q| <= 127.
struct alignas(8) BlockQ8x {
  float d;
  float s;
  std::int8_t qs[kQK];
};
static_assert(sizeof(BlockQ8x) == 40);

// A 16-bit activation block (decode rows, MatmulOptions::Activations::q16): x[i] ~= q[i] * d with
// d = max|x| / 32767 and q = round-to-nearest-even(x / d), so each element is off by at most
// max|x_block| / 65534 (256x finer than BlockQ8x); s = d * sum(q) for the constant term.
struct alignas(8) BlockQ16x {
  float d;
  float s;
  std::int16_t qs[kQK];
};
static_assert(sizeof(BlockQ16x) == 72);

}  // namespace kallpa::ops
