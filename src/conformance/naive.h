// Attention as a framework computes it in the case's own dtype: the yardstick for how much error
// the dtype itself forces on a case (anchors.md, "How we judge numerics"; FlashAttention's test
// rule). A backend may be worse than the double-precision reference by a small multiple of this.
#pragma once

#include <span>
#include <vector>

#include "conformance/case_data.h"
#include "kallpa/backend.h"

namespace kallpa::conformance::detail {

// Same layout as ExactRows (kallpa/backend.h): o [rows, dv], lse [rows].
struct NaiveOutput {
  std::vector<double> o;
  std::vector<double> lse;
};

// Works from the logical inputs and the suite's own mask, not from the backend-facing buffers or
// ValidatedProblem, so it is an independent second opinion on the reference as well. Computes the
// rows asked for only (sampling.h), at their cost.
NaiveOutput naive_attention(const CaseData& data, std::span<const OutputRow> rows);

}  // namespace kallpa::conformance::detail
