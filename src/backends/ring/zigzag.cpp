#include "backends/ring/zigzag.h"

#include <algorithm>

namespace kallpa::ring {

Shard shard_of(const ValidatedProblem& vp, int rank, int ranks) {
  Shard shard;
  const std::int64_t chunks = 2 * static_cast<std::int64_t>(ranks);
  const std::int64_t mine[2] = {rank, chunks - 1 - rank};
  for (std::int32_t b = 0; b < vp.batch(); ++b) {
    const std::int64_t sq = vp.seqlen_q(b);
    const std::int64_t skv = vp.seqlen_k(b);
    const std::int64_t offset = skv - sq;  // p_i = i + offset
    for (const std::int64_t m : mine) {
      const std::int64_t lo = m * skv / chunks;
      const std::int64_t hi = (m + 1) * skv / chunks;
      if (hi > lo) shard.keys.push_back({b, lo, hi - lo});
      const std::int64_t row_lo = m == 0 ? 0 : std::clamp<std::int64_t>(lo - offset, 0, sq);
      const std::int64_t row_hi = std::clamp<std::int64_t>(hi - offset, 0, sq);
      if (row_hi > row_lo) {
        shard.rows.push_back({b, row_lo, row_hi - row_lo});
        shard.total_rows += row_hi - row_lo;
      }
    }
  }
  return shard;
}

}  // namespace kallpa::ring
