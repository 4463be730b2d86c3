// The dispatcher's "paranoid" check: non-finite outputs where the contract forbids them.
#pragma once

#include "kallpa/attention.h"
#include "kallpa/status.h"

namespace kallpa::detail {

// The contract allows NaN/Inf in o (and NaN/+Inf in lse) only where a visible input of that row
// (q, a visible k or v row, the ALiBi slope) is itself non-finite. Scans o and lse (O(output)),
// and reads the inputs only for rows that hold a non-finite value. Host memory only: a problem on
// another device passes unchecked.
Status check_outputs_finite(const ValidatedProblem& problem) noexcept;

}  // namespace kallpa::detail
