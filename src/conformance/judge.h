// Deciding whether a backend's outputs match the reference (anchors.md, "How we judge numerics"):
// element-wise |out - ref| <= atol_eff + rtol * |ref| with atol_eff = max(atol, naive_multiple *
// error of same-dtype naive attention), NaN exactly where the reference has NaN, infinities equal.
#pragma once

#include <span>
#include <string>

#include "conformance/case_data.h"
#include "conformance/naive.h"
#include "kallpa/backend.h"
#include "kallpa/conformance.h"

namespace kallpa::conformance::detail {

// What one case allows; computed once per case and shared by all backends.
struct Bounds {
  double atol_o = 0.0;
  double atol_lse = 0.0;
  double rtol = 0.0;
  double naive_error_o = 0.0;
  double naive_error_lse = 0.0;
  // Non-empty when the naive computation disagrees with the reference beyond what its dtype can
  // explain: a bug in the suite or in the reference, never a pass for anyone.
  std::string self_check_failure;
};

// `ref` and `naive` hold the rows `rows` (sampling.h), in that order.
Bounds bounds_for(const CaseData& data, std::span<const OutputRow> rows, const ExactRows& ref,
                  const NaiveOutput& naive);

struct Verdict {
  bool passed = true;
  double max_abs_error = 0.0;
  std::string failure;
};

// Reads the rows `rows` of o (and lse) from the case's output buffers and judges them against
// `ref` (same rows, same order). Also checks that no output element of any row, judged or not,
// was left unwritten and that packed rows beyond the last sequence were left alone.
Verdict judge_outputs(const CaseData& data, std::span<const OutputRow> rows, const ExactRows& ref,
                      const Bounds& bounds);

}  // namespace kallpa::conformance::detail
