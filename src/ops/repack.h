// Load-time repacking of quantised weight matrices into the rows4 layout (WeightLayout::rows4,
// block_ptr in ops/quant_kernels.h): groups of 4 rows, block-interleaved, each block's 4 scales
// (and Q4_1's 4 mins) side by side. The bytes are the same as ggml's, only reordered, so results
// are bit-identical; the matmul kernels read a 4-row tile from one stream and convert its scales
// with one instruction instead of four.
#pragma once

#include <cstddef>
#include <functional>
#include <vector>

#include "kallpa/ops/quant.h"
#include "kallpa/status.h"
#include "ops/huge_buffer.h"

namespace kallpa::ops {

// Whether repack_rows4 applies: Q8_0/Q4_0/Q4_1 in the rows layout with rows % 4 == 0.
bool can_repack_rows4(const WeightMatrix& w) noexcept;

// Writes w in the rows4 layout into dst (w.rows * w.row_bytes bytes) and returns the matrix over
// dst. invalid_argument (field "w") when !can_repack_rows4(w).
Result<WeightMatrix> repack_rows4(const WeightMatrix& w, std::byte* dst);

// Owns repacked copies of matrices, all in one allocation so that a model's weights stay together.
// The allocation is 2 MiB-aligned and asks for transparent huge pages: decode streams every weight
// once per token, and with 4 KiB pages that is ~25k TLB misses per token for SmolLM2-135M.
class RepackedWeights {
 public:
  // Repacks each matrix that can_repack_rows4 accepts, in place in *matrices, and copies those of
  // the block types with rows-layout Q16 kernels (ops/q16_units.h: Q5_0, the K-quants, ..) as they
  // are, so that every quantised matrix is read from the huge pages (the others, float weights,
  // are left where they are), unless KALLPA_REPACK=0 is set in the environment. `copied` (may be empty) is
  // called with each part of an original (a range of its rows) right after its copy is written.
  Status repack(std::vector<WeightMatrix*> matrices, const std::function<void(const WeightMatrix&)>& copied = {});
  std::size_t bytes() const noexcept { return storage_.size(); }

 private:
  HugeBuffer storage_;
};

}  // namespace kallpa::ops
