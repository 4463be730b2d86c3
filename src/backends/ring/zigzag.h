// Which part of a problem each rank of a ring owns. Each sequence's keys are cut into 2 * ranks
// chunks and rank r owns chunks r and 2 * ranks - 1 - r ("zig-zag"): under a causal mask the early
// chunks are cheap and the late ones dear, so pairing them gives every rank the same number of
// query-key pairs. A query row belongs to the rank that owns the key at its position (p_i = i + Skv
// - Sq, attention.h); rows at negative positions (Sq > Skv) belong to the owner of chunk 0.
#pragma once

#include <cstdint>
#include <vector>

#include "kallpa/attention.h"

namespace kallpa::ring {

// Rows [first, first + count) of sequence `seq`: query rows or keys.
struct Span {
  std::int32_t seq = 0;
  std::int64_t first = 0;
  std::int64_t count = 0;
};

struct Shard {
  std::vector<Span> rows;  // query rows, by sequence then position; empty spans left out
  std::vector<Span> keys;  // keys, by sequence then position; empty spans left out
  std::int64_t total_rows = 0;
};

Shard shard_of(const ValidatedProblem& problem, int rank, int ranks);

}  // namespace kallpa::ring
