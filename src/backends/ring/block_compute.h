// One rank's share of a ring step: the attention of some query rows over the keys this rank holds,
// computed by a local backend through the attention contract, as a partial result (o and lse) that
// merges with the other ranks' partials by log-sum-exp.
//
// A block of n rows is one float buffer: o [n, hq, dv] then lse [n, hq], both row-major. Rows with
// no visible key are o = 0, lse = -inf, which is also what merging adds nothing to.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "backends/ring/zigzag.h"
#include "kallpa/attention.h"
#include "kallpa/backend.h"
#include "kallpa/status.h"

namespace kallpa::ring {

inline std::size_t block_floats(std::int64_t rows, const ValidatedProblem& vp) {
  return static_cast<std::size_t>(rows) * static_cast<std::size_t>(vp.hq()) *
         (static_cast<std::size_t>(vp.head_dim_v()) + 1);
}

// Sets every row of a block to "no key seen": o = 0, lse = -inf.
void clear_block(float* block, std::int64_t rows, const ValidatedProblem& vp);

// Merges the partial `src` into `dst` (both blocks of `rows` rows) by log-sum-exp. NaN in either
// side's lse or o propagates to the row, as the contract's NaN rule asks.
void merge_block(float* dst, const float* src, std::int64_t rows, const ValidatedProblem& vp);

// Reusable memory of block computations, so that a ring step allocates only when it outgrows it.
struct BlockScratch {
  std::vector<float> part;          // one pair's partial
  std::vector<unsigned char> q;     // q rows with dummy rows after them (ALiBi over later keys)
  std::vector<unsigned char> k, v;  // a chunk of paged keys and values gathered contiguously
  std::vector<unsigned char> workspace;
};

// Adds to `block` (rows: the rows of `rows`, in order) the attention of those rows over the keys of
// `keys`. Each (row span, key span) pair of the same sequence is one or a few calls of `local` on a
// sub-problem whose masks, windows and ALiBi distances are those of the whole problem: the rows and
// keys keep their relative positions through the bottom-right alignment, shifted windows, and an
// lse correction where ALiBi's |p - j| is taken from another origin.
Status accumulate_block(AttentionBackend& local, const ValidatedProblem& problem, const Shard& rows, const Shard& keys,
                        float* block, BlockScratch& scratch);

// An lse beyond this magnitude carries too few bits in f32 for merged partials to meet the
// contract's f32 tolerance (a merge weighs partials by exp of lse differences): at 64 an ulp is
// 7.6e-6.
inline constexpr float kMergeLseLimit = 64.0f;

// When a merged block has a row whose |lse| exceeds kMergeLseLimit (scores in the hundreds, as with
// huge scales), recomputes the whole block over every key of its sequences, which a rank may do
// because every rank holds the whole problem; otherwise leaves it as it is.
Status refine_block(AttentionBackend& local, const ValidatedProblem& problem, const Shard& rows, float* block,
                    BlockScratch& scratch);

// Writes a finished block (the rows of `rows`, in order) into the problem's o (in its dtype) and lse.
void write_block(const ValidatedProblem& problem, const Shard& rows, const float* block);

}  // namespace kallpa::ring
