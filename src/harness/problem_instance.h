// A problem built from a ProblemSpec with memory that it owns: seeded random inputs in the spec's
// dtypes, packed layouts with equal-length sequences, paged K/V with a permuted block table.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "harness/thp_allocator.h"
#include "kallpa/attention.h"
#include "kallpa/problem_spec.h"

namespace kallpa::harness {

class ProblemInstance {
 public:
  // Fails (out_of_memory / invalid_argument) rather than allocating more than max_bytes.
  static Result<std::unique_ptr<ProblemInstance>> create(const ProblemSpec& spec, std::uint64_t seed = 1,
                                                         std::size_t max_bytes = std::size_t{8} << 30);

  const ProblemSpec& spec() const noexcept { return spec_; }
  const AttentionProblem& problem() const noexcept { return problem_; }
  // Bytes of K and V a single pass reads (each visible row once), for bandwidth figures.
  double kv_bytes() const noexcept;
  // 4 * Sq * Skv * D * Hq * B, halved for causal when Sq == Skv (FlashAttention's benchmark convention).
  double flops() const noexcept;
  // The K and V buffers as allocated (paged: every block of the pool), host memory.
  std::vector<std::span<const std::byte>> kv_buffers() const {
    return {{k_.data(), k_.size()}, {v_.data(), v_.size()}};
  }

 private:
  ProblemInstance() = default;
  ProblemSpec spec_;
  std::vector<std::byte, ThpAllocator<std::byte>> q_, k_, v_, o_;  // K/V on huge pages, as in the engine
  std::vector<float> lse_, alibi_;
  std::vector<std::int32_t> cu_q_, cu_k_, block_table_, seqlens_k_;
  AttentionProblem problem_;
};

}  // namespace kallpa::harness
