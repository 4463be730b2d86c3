// Small owning f32 problems for unit tests of the core (the conformance suite has its own,
// richer builder with guard regions).
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "kallpa/attention.h"

namespace kallpa::testing {

struct DenseF32Problem {
  std::vector<float> q, k, v, o, lse;
  AttentionProblem problem;

  DenseF32Problem(std::int64_t b, std::int64_t sq, std::int64_t skv, std::int64_t hq, std::int64_t hkv, std::int64_t d,
                  std::int64_t dv = 0, bool with_lse = false, unsigned seed = 1) {
    if (dv == 0) dv = d;
    std::mt19937 rng(seed);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    auto fill = [&](std::vector<float>& x, std::size_t n) {
      x.resize(n);
      for (float& e : x) e = dist(rng);
    };
    fill(q, static_cast<std::size_t>(b * sq * hq * d));
    fill(k, static_cast<std::size_t>(b * skv * hkv * d));
    fill(v, static_cast<std::size_t>(b * skv * hkv * dv));
    o.assign(static_cast<std::size_t>(b * sq * hq * dv), 0.0f);
    problem.q = make_contiguous_view(q.data(), DType::f32, {b, sq, hq, d});
    problem.k = make_contiguous_view(k.data(), DType::f32, {b, skv, hkv, d});
    problem.v = make_contiguous_view(v.data(), DType::f32, {b, skv, hkv, dv});
    problem.o = make_contiguous_view(o.data(), DType::f32, {b, sq, hq, dv});
    if (with_lse) {
      lse.assign(static_cast<std::size_t>(b * hq * sq), 0.0f);
      problem.lse = make_contiguous_view(lse.data(), DType::f32, {b, hq, sq});
    }
  }
  // Views point into the vectors: moving or copying would leave them dangling.
  DenseF32Problem(const DenseF32Problem&) = delete;
  DenseF32Problem& operator=(const DenseF32Problem&) = delete;
};

}  // namespace kallpa::testing
