// Checks a finished call on sampled output rows against the oracle (the dispatcher's first-use
// and shadow verification, dispatcher.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kallpa/backend.h"

namespace kallpa::detail {

struct RowCheck {
  enum class Verdict : std::uint8_t { passed, mismatch, unverifiable };
  Verdict verdict = Verdict::passed;
  std::vector<OutputRow> rows;  // the rows compared
  double max_error = 0.0;       // over the compared elements (finite ones)
  std::string detail;           // mismatch: the first bad element; unverifiable: why
};

// Picks `count` rows of the problem (all of them when it has no more): with `longest`, the first is
// the last query of the sequence with the most keys (the row a size-dependent bug reaches first),
// the rest uniformly at random from `seed`.
std::vector<OutputRow> sample_rows(const ValidatedProblem& problem, std::size_t count, bool longest,
                                   std::uint64_t seed);

// Recomputes `rows` with the oracle and compares the problem's o (and lse) with them. The rule is
// the conformance judge's (src/conformance/judge.h): |got - want| <= atol_eff + rtol * |want| with
// the dtype's tolerance_for, NaN exactly where the reference has NaN, infinities equal. A live call
// has no same-dtype naive run to measure what its dtype forces, so atol_eff is the judge's
// naive_multiple * atol scaled by the row's largest |v| (live values are not the suite's [-1, 1])
// and by sqrt(keys / 4096) beyond the suite's largest case (f32 accumulation error grows with the
// key count). Unverifiable when o is not in host memory, or without an oracle.
RowCheck check_rows(const ValidatedProblem& problem, const AttentionOracle* oracle, std::vector<OutputRow> rows);

}  // namespace kallpa::detail
