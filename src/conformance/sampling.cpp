#include "conformance/sampling.h"

#include <algorithm>
#include <tuple>

#include "conformance/rng.h"

namespace kallpa::conformance::detail {
namespace {

using detail::Rng;

// Queries of one sequence where a bound of the mask changes what a row sees, with a neighbour on
// each side: the row before sees one key fewer (or more) than the row after. Positions follow the
// contract's bottom-right alignment p_i = i + Skv - Sq.
std::vector<std::int64_t> boundary_queries(const CaseSpec& s, std::int64_t sq, std::int64_t skv) {
  std::vector<std::int64_t> at = {0, sq - 1};
  const std::int64_t shift = skv - sq;  // p_i = i + shift
  // Causal: the first row with a visible key (p_i = 0) and where p_i reaches the last key.
  if (s.causal) at.push_back(-shift);
  // window_left starts cutting where p_i - window_left = 0 ... and it applies at every row after.
  if (s.window_left >= 0 && s.window_left < skv) at.push_back(s.window_left - shift);
  // window_right stops cutting where p_i + window_right = Skv - 1.
  if (s.window_right >= 0 && s.window_right < skv) at.push_back(skv - 1 - s.window_right - shift);
  std::vector<std::int64_t> out;
  for (std::int64_t q : at) {
    for (std::int64_t d = -1; d <= 1; ++d) {
      const std::int64_t i = q + d;
      if (i >= 0 && i < sq) out.push_back(i);
    }
  }
  return out;
}

}  // namespace

std::vector<OutputRow> all_rows(const CaseData& data) {
  std::vector<OutputRow> rows;
  rows.reserve(static_cast<std::size_t>(data.total_q * data.hq));
  for (std::int32_t b = 0; b < data.batch; ++b) {
    for (std::int64_t i = 0; i < data.seqlen_q(b); ++i) {
      for (std::int32_t h = 0; h < data.hq; ++h) rows.push_back({b, i, h});
    }
  }
  return rows;
}

std::vector<OutputRow> judged_rows(const CaseData& data) {
  const CaseSpec& s = data.spec;
  if (s.sampled_rows <= 0 || data.total_q * data.hq <= s.sampled_rows) return all_rows(data);
  std::vector<OutputRow> rows;
  for (std::int32_t b = 0; b < data.batch; ++b) {
    for (std::int64_t i : boundary_queries(s, data.seqlen_q(b), data.seqlen_k(b))) {
      rows.push_back({b, i, 0});
      rows.push_back({b, i, data.hq - 1});
    }
  }
  // The rest uniformly over all rows (a row is one draw from sequence-weighted positions).
  Rng rng(Rng::mix(s.seed, 0x5a3d));
  const auto total = static_cast<std::uint64_t>(data.total_q);
  for (std::size_t tries = 0; rows.size() < static_cast<std::size_t>(s.sampled_rows) && tries < 8 * total; ++tries) {
    const auto r = static_cast<std::int32_t>(rng.below(total));
    const auto b =
        static_cast<std::int32_t>(std::upper_bound(data.cu_q.begin(), data.cu_q.end(), r) - data.cu_q.begin() - 1);
    const auto h = static_cast<std::int32_t>(rng.below(static_cast<std::uint64_t>(data.hq)));
    rows.push_back({b, r - data.cu_q[static_cast<std::size_t>(b)], h});
  }
  const auto key = [](const OutputRow& r) { return std::tuple(r.sequence, r.query, r.head); };
  std::sort(rows.begin(), rows.end(), [&](const OutputRow& a, const OutputRow& b) { return key(a) < key(b); });
  rows.erase(
      std::unique(rows.begin(), rows.end(), [&](const OutputRow& a, const OutputRow& b) { return key(a) == key(b); }),
      rows.end());
  return rows;
}

}  // namespace kallpa::conformance::detail
