// The CPU ops' RoPE, which takes its cos/sin from a table filled once per position, against the
// rotation computed directly (angle = position x inverse frequency in double, as the ops' contract
// and the NumPy reference define it): equal bit for bit, whether a position is in the table,
// beyond it, or comes after a change of theta or rotary width.
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "kallpa/ops/ops.h"
#include "ops/rope_table.h"

namespace kallpa::ops {
namespace {

std::vector<float> direct_rope(std::vector<float> x, const std::vector<std::int32_t>& positions, std::int64_t heads,
                               std::int64_t head_dim, std::int64_t n_rot, float theta) {
  for (std::size_t r = 0; r < positions.size(); ++r) {
    for (std::int64_t i = 0; i < n_rot / 2; ++i) {
      const auto inv_freq = static_cast<float>(std::pow(double(theta), -2.0 * double(i) / double(n_rot)));
      const double angle = double(positions[r]) * double(inv_freq);
      const auto c = static_cast<float>(std::cos(angle)), s = static_cast<float>(std::sin(angle));
      for (std::int64_t h = 0; h < heads; ++h) {
        float* p = x.data() + static_cast<std::int64_t>(r) * heads * head_dim + h * head_dim + 2 * i;
        const float x0 = p[0], x1 = p[1];
        p[0] = x0 * c - x1 * s;
        p[1] = x0 * s + x1 * c;
      }
    }
  }
  return x;
}

TEST(RopeTable, CpuRopeEqualsDirectRotationBitwise) {
  auto ops = make_ops("cpu");
  ASSERT_TRUE(ops) << ops.status().message();
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  struct Call {
    std::vector<std::int32_t> positions;
    std::int64_t heads, head_dim, n_rot;
    float theta;
  };
  const std::int32_t beyond = static_cast<std::int32_t>(RopeTable::kMaxPositions) + 12345;
  const Call calls[] = {
      {{7, 0, 3}, 4, 64, 64, 10000.0f},                 // fills the table to 8
      {{2000, 5, beyond, 1999}, 3, 64, 64, 10000.0f},   // grows it; one position beyond the table
      {{0, 1, 2, 3, 4, 5, 6, 7}, 2, 64, 64, 10000.0f},  // rows already in the table
      {{11, 4}, 2, 64, 64, 500000.0f},                  // another theta: rebuilt
      {{11, 4, 9000}, 2, 96, 32, 500000.0f},            // partial rotary width: rebuilt
      {{11, 4}, 4, 64, 64, 10000.0f},                   // back to the first
  };
  for (const Call& c : calls) {
    std::vector<float> x(c.positions.size() * static_cast<std::size_t>(c.heads * c.head_dim));
    for (float& v : x) v = normal(rng);
    const std::vector<float> want = direct_rope(x, c.positions, c.heads, c.head_dim, c.n_rot, c.theta);
    ASSERT_TRUE((*ops)->rope(x.data(), c.positions, c.heads, c.head_dim, c.n_rot, c.theta));
    for (std::size_t i = 0; i < x.size(); ++i) {
      ASSERT_EQ(x[i], want[i]) << "element " << i << ", theta " << c.theta << ", n_rot " << c.n_rot;
    }
  }
}

}  // namespace
}  // namespace kallpa::ops
