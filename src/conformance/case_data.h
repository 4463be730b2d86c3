// One case made concrete: its input values (kept in logical order as the exact values of the
// dtype, for the naive computation), the guarded buffers and index arrays handed to a backend, and
// the AttentionProblem over them. Offsets into the buffers are computed here from the suite's own
// layout description, independently of ValidatedProblem's accessors, so that the suite also checks
// the core's layout arithmetic instead of sharing its mistakes.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "conformance/buffers.h"
#include "kallpa/attention.h"
#include "kallpa/conformance.h"

namespace kallpa::conformance::detail {

// The contract's visible key range [first, last] for query i of a sequence (empty when
// first > last), written out again from attention.h rather than borrowed from the core.
struct KeyRange {
  std::int64_t first;
  std::int64_t last;
};
KeyRange contract_visible_keys(const CaseSpec& spec, std::int64_t sq, std::int64_t skv, std::int64_t i) noexcept;

struct CaseData {
  CaseSpec spec;
  std::int32_t batch = 0;
  std::int32_t hq = 0, hkv = 0, d = 0, dv = 0;
  float scale = 1.0f;
  std::vector<std::int32_t> cu_q, cu_k;  // logical offsets of each sequence (any layout)
  std::int64_t total_q = 0, total_k = 0;

  // Logical inputs: q [total_q, hq, d], k [total_k, hkv, d], v [total_k, hkv, dv].
  std::vector<float> q, k, v;
  std::vector<float> alibi;  // [hq] when spec.alibi

  // What the backend sees.
  std::unique_ptr<GuardedBuffer> qb, kb, vb, ob, lseb;
  std::vector<std::int32_t> cu_q_arg, cu_k_arg, block_table, seqlens_k;
  std::int32_t page = 0, max_blocks = 0;
  std::int64_t table_stride = 0;  // effective row stride of block_table
  AttentionProblem problem;

  // The inputs as they were before a backend ran, to prove it did not write them.
  std::vector<std::byte> q_before, k_before, v_before;
  std::vector<std::int32_t> cu_q_before, cu_k_before, table_before, seqlens_before;
  std::vector<float> alibi_before;

  // Element offsets into the output buffers for logical (b, i, h, c).
  std::int64_t o_offset(std::int32_t b, std::int64_t i, std::int64_t h, std::int64_t c) const noexcept;
  std::int64_t lse_offset(std::int32_t b, std::int64_t h, std::int64_t i) const noexcept;
  // Output rows that belong to no sequence (packed q tail): element offsets of o/lse there.
  std::vector<std::int64_t> tail_o_offsets() const;
  std::vector<std::int64_t> tail_lse_offsets() const;

  std::int64_t seqlen_q(std::int32_t b) const noexcept { return cu_q[b + 1] - cu_q[b]; }
  std::int64_t seqlen_k(std::int32_t b) const noexcept { return cu_k[b + 1] - cu_k[b]; }

  // Describes a logical output element for failure messages: "o[b=1,i=3,h=2,d=17]".
  std::string describe_o(std::int64_t row, std::int64_t h, std::int64_t c) const;
  std::string describe_lse(std::int64_t row, std::int64_t h) const;
};

// Builds everything for `c`. Throws std::invalid_argument for a spec that cannot be built (a suite
// bug, reported as a failed case by the caller).
std::unique_ptr<CaseData> build_case_data(const Case& c);

// Names the first input (q, k, v, an index array, the ALiBi slopes) that differs from its
// snapshot, or nothing.
std::optional<std::string> find_input_change(const CaseData& data);
// Puts every input back as it was, so that the next backend on this case sees the same problem.
void restore_inputs(CaseData& data);

}  // namespace kallpa::conformance::detail
