// The oracle: plain loops over the contract's definition, double accumulation, every feature.
// Clarity over speed. The conformance suite compares every backend with compute_f64().
#pragma once

#include <span>
#include <vector>

#include "kallpa/attention.h"
#include "kallpa/backend.h"

namespace kallpa::reference {

// Results in logical order: row r = (sum of Sq over earlier sequences) + i.
using Output64 = ExactOutput;

Output64 compute_f64(const ValidatedProblem& vp);
// compute_f64's numbers for the chosen rows only, at their cost (AttentionOracle::compute_rows).
ExactRows compute_rows_f64(const ValidatedProblem& vp, std::span<const OutputRow> rows);

// Loads element `index` (in elements from data) of a tensor as double.
double load(const TensorView& t, std::int64_t index) noexcept;
// Stores `value` rounded to the tensor's dtype.
void store(const TensorView& t, std::int64_t index, double value) noexcept;

}  // namespace kallpa::reference
