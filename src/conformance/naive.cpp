#include "conformance/naive.h"

#include <cmath>
#include <cstdlib>
#include <limits>

namespace kallpa::conformance::detail {

// The rounding mirrors an eager framework in the input dtype (PyTorch's attention in fp16/bf16,
// as in FlashAttention's attention_ref): q * scale is a dtype tensor, the score matmul accumulates
// in f32 and rounds to the dtype, softcap is three dtype ops, the ALiBi bias is f32 (promotion),
// softmax runs in f32 and its probabilities are rounded to the dtype, and the second matmul
// accumulates in f32 and rounds once more.
NaiveOutput naive_attention(const CaseData& data, std::span<const OutputRow> rows) {
  const CaseSpec& s = data.spec;
  const DType dt = s.dtype;
  const std::int64_t hq = data.hq, hkv = data.hkv, d = data.d, dv = data.dv;
  const std::int64_t group = hq / hkv;
  const float neg_inf = -std::numeric_limits<float>::infinity();

  NaiveOutput out;
  out.o.assign(rows.size() * static_cast<std::size_t>(dv), 0.0);
  out.lse.assign(rows.size(), static_cast<double>(neg_inf));

  std::vector<float> qs(static_cast<std::size_t>(d));
  std::vector<float> scores;
  std::vector<float> acc(static_cast<std::size_t>(dv));
  for (std::size_t n_row = 0; n_row < rows.size(); ++n_row) {
    const std::int32_t b = rows[n_row].sequence;
    const std::int64_t i = rows[n_row].query, h = rows[n_row].head;
    const std::int64_t sq = data.seqlen_q(b), skv = data.seqlen_k(b);
    const std::int64_t row = data.cu_q[static_cast<std::size_t>(b)] + i;
    const std::int64_t pos = i + skv - sq;
    const KeyRange keys = contract_visible_keys(s, sq, skv, i);
    const std::int64_t kvh = h / group;
    const float* qrow = &data.q[static_cast<std::size_t>((row * hq + h) * d)];
    for (std::int64_t c = 0; c < d; ++c) qs[static_cast<std::size_t>(c)] = round_to(dt, qrow[c] * data.scale);
    scores.clear();
    float m = neg_inf;
    for (std::int64_t j = keys.first; j <= keys.last; ++j) {
      const float* krow = &data.k[static_cast<std::size_t>(((data.cu_k[b] + j) * hkv + kvh) * d)];
      float dot = 0.0f;
      for (std::int64_t c = 0; c < d; ++c) dot += qs[static_cast<std::size_t>(c)] * krow[c];
      float sc = round_to(dt, dot);
      if (s.softcap > 0.0f) {
        sc = round_to(dt, round_to(dt, std::tanh(round_to(dt, sc / s.softcap))) * s.softcap);
      }
      if (s.alibi) sc -= data.alibi[static_cast<std::size_t>(h)] * static_cast<float>(std::llabs(pos - j));
      scores.push_back(sc);
      if (std::isnan(sc) || sc > m) m = std::isnan(m) ? m : sc;
    }
    // The contract's zero row: nothing visible, or only -inf scores.
    if (scores.empty() || m == neg_inf) continue;
    float sum = 0.0f;
    for (float& e : scores) {
      e = std::exp(e - m);
      sum += e;
    }
    for (float& acc_c : acc) acc_c = 0.0f;
    for (std::size_t n = 0; n < scores.size(); ++n) {
      const std::int64_t j = keys.first + static_cast<std::int64_t>(n);
      const float p = round_to(dt, scores[n] / sum);
      const float* vrow = &data.v[static_cast<std::size_t>(((data.cu_k[b] + j) * hkv + kvh) * dv)];
      for (std::int64_t c = 0; c < dv; ++c) acc[static_cast<std::size_t>(c)] += p * vrow[c];
    }
    double* orow = &out.o[n_row * static_cast<std::size_t>(dv)];
    for (std::int64_t c = 0; c < dv; ++c) orow[c] = round_to(dt, acc[static_cast<std::size_t>(c)]);
    out.lse[n_row] = static_cast<double>(m + std::log(sum));
  }
  return out;
}

}  // namespace kallpa::conformance::detail
