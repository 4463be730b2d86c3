// RoPE's cos and sin by position, computed once per position and kept: every layer, and Q and K,
// rotate by the same angles, so computing them in each rope call would repeat ~60 double-precision
// sin/cos pairs per position and frequency per forward pass (a few percent of a prompt's or a
// batched decode step's time). Entries are exactly what a direct computation gives, so results do
// not change.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

namespace kallpa::ops {

class RopeTable {
 public:
  // Positions at or beyond this are computed on each call (a table row costs n_rot floats).
  static constexpr std::int64_t kMaxPositions = 1 << 15;

  // The angle of frequency i at position pos, the way the table stores it: in double, because
  // positions reach tens of thousands, where f32 angles lose digits.
  static void cos_sin(double pos, const std::vector<float>& inv_freq, float* out) {
    for (std::size_t i = 0; i < inv_freq.size(); ++i) {
      const double angle = pos * double(inv_freq[i]);
      out[2 * i] = static_cast<float>(std::cos(angle));
      out[2 * i + 1] = static_cast<float>(std::sin(angle));
    }
  }

  // Makes rows [0, end) ready for (n_rot, theta, freq_scale, freq_factors) and returns the inverse
  // frequencies (pair i: freq_scale * theta^(-2i / n_rot) / freq_factors[i]). Not thread-safe: the
  // caller serialises prepare() and the reads of rows that follow it.
  const std::vector<float>& prepare(std::int64_t n_rot, float theta, std::int64_t end, float freq_scale = 1.0f,
                                    std::span<const float> freq_factors = {}) {
    if (!holds(n_rot, theta, freq_scale, freq_factors)) {
      n_rot_ = n_rot;
      theta_ = theta;
      freq_scale_ = freq_scale;
      factors_.assign(freq_factors.begin(), freq_factors.end());
      rows_ = 0;
      cs_.clear();
      inv_freq_.resize(static_cast<std::size_t>(n_rot / 2));
      for (std::size_t i = 0; i < inv_freq_.size(); ++i) {
        const double factor = i < factors_.size() ? double(factors_[i]) : 1.0;
        inv_freq_[i] =
            static_cast<float>(double(freq_scale) * std::pow(double(theta), -2.0 * double(i) / double(n_rot)) / factor);
      }
    }
    end = std::min(end, kMaxPositions);
    if (end > rows_) {
      const std::size_t width = 2 * inv_freq_.size();
      cs_.resize(static_cast<std::size_t>(end) * width);
      for (std::int64_t p = rows_; p < end; ++p)
        cos_sin(double(p), inv_freq_, cs_.data() + static_cast<std::size_t>(p) * width);
      rows_ = end;
    }
    return inv_freq_;
  }
  // [cos_0, sin_0, cos_1, sin_1, ...] of a position below the prepared end, else nullptr.
  const float* row(std::int64_t pos) const noexcept {
    return pos >= 0 && pos < rows_ ? cs_.data() + static_cast<std::size_t>(pos) * 2 * inv_freq_.size() : nullptr;
  }
  // Whether the table is prepared for these frequencies.
  bool holds(std::int64_t n_rot, float theta, float freq_scale, std::span<const float> freq_factors) const {
    return n_rot == n_rot_ && theta == theta_ && freq_scale == freq_scale_ &&
           std::equal(freq_factors.begin(), freq_factors.end(), factors_.begin(), factors_.end());
  }

 private:
  std::int64_t n_rot_ = -1;
  float theta_ = 0.0f;
  float freq_scale_ = 1.0f;
  std::vector<float> factors_;
  std::int64_t rows_ = 0;
  std::vector<float> inv_freq_;
  std::vector<float> cs_;  // rows_ x n_rot
};

}  // namespace kallpa::ops
