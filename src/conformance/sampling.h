// Which output rows a case is judged on. Small cases are judged whole; a case with
// CaseSpec::sampled_rows > 0 (the 32k/128k-key tiers) on a deterministic sample that always holds
// the rows where a wrong kernel is most likely to show: each sequence's first and last query, and
// the queries on either side of where the causal mask and each window bound start or stop cutting.
#pragma once

#include <vector>

#include "conformance/case_data.h"
#include "kallpa/backend.h"

namespace kallpa::conformance::detail {

// Every (sequence, query, head) row, in the logical order of ExactOutput.
std::vector<OutputRow> all_rows(const CaseData& data);

// The rows `data.spec` asks to be judged: all_rows() when sampled_rows is 0, else the boundary
// rows above (each at the first and last head) plus seeded random rows up to sampled_rows in all
// (more when the boundary rows alone exceed it), sorted in logical order, without duplicates.
std::vector<OutputRow> judged_rows(const CaseData& data);

// The logical row index (sum of Sq over earlier sequences + query) of `r`.
inline std::int64_t logical_row(const CaseData& data, const OutputRow& r) {
  return data.cu_q[static_cast<std::size_t>(r.sequence)] + r.query;
}

}  // namespace kallpa::conformance::detail
