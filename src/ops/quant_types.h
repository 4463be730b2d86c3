// Block layouts of the quantised ggml types kallpa computes with (bit-compatible with ggml), and
// the activation block the quantised dot products use.
//
//   Q8_0: d (f16), 32 x int8 q          value = q * d
//   Q4_0: d (f16), 16 bytes of nibbles  value = (q - 8) * d
//   Q4_1: d (f16), m (f16), 16 bytes    value = q * d + m
// Nibble order (Q4_*): byte j holds element j in its low nibble and element j + 16 in its high one.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kallpa::ops {

inline constexpr int kQK = 32;  // elements per block of Q8_0 / Q4_0 / Q4_1

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
