// The ring backend's arithmetic without MPI: a backend that plays every rank of a ring of N in one
// process (each rank's keys over every rank's rows through the local backend, merged by lse, then
// written out) is held to the conformance suite, so that the zig-zag shards, the sub-problems of
// each (rows, keys) pair (shifted windows, ALiBi's lse correction, dummy rows) and the merge are
// right for every feature of the contract before any message is sent.
#if defined(KALLPA_HAVE_RING)

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "backends/ring/block_compute.h"
#include "backends/ring/zigzag.h"
#include "kallpa/conformance.h"
#include "kallpa/registry.h"

namespace kallpa {
namespace {

// With whole_rows, each rank's rows are computed over every key of their sequences at once (what
// refine_block does for rows with a large lse): rows that straddle keys, split under ALiBi.
class SimulatedRing final : public AttentionBackend {
 public:
  explicit SimulatedRing(int ranks, bool whole_rows = false)
      : ranks_(ranks), whole_rows_(whole_rows), name_("simulated-ring-" + std::to_string(ranks)) {}
  std::string_view name() const noexcept override { return name_; }
  std::string_view version() const noexcept override { return "test"; }
  DeviceKind device_kind() const noexcept override { return DeviceKind::cpu; }
  int priority() const noexcept override { return 0; }
  Support supports(const ProblemSignature&) const noexcept override { return Support::yes(); }
  Status run(const ValidatedProblem& vp, Workspace) noexcept override {
    AttentionBackend* local = BackendRegistry::global().find("cpu-flash");
    if (local == nullptr) return Status(ErrorCode::not_found, "cpu-flash", "not registered");
    std::vector<ring::Shard> shards;
    for (int t = 0; t < ranks_; ++t) shards.push_back(ring::shard_of(vp, t, ranks_));
    ring::BlockScratch scratch;
    for (int t = 0; t < ranks_; ++t) {
      const ring::Shard& rows = shards[static_cast<std::size_t>(t)];
      std::vector<float> acc(ring::block_floats(rows.total_rows, vp)), part(acc.size());
      ring::clear_block(acc.data(), rows.total_rows, vp);
      if (whole_rows_) {
        ring::Shard all;
        for (std::int32_t b = 0; b < vp.batch(); ++b) {
          if (vp.seqlen_k(b) > 0) all.keys.push_back({b, 0, vp.seqlen_k(b)});
        }
        if (Status st = ring::accumulate_block(*local, vp, rows, all, acc.data(), scratch); !st) return st;
        ring::write_block(vp, rows, acc.data());
        continue;
      }
      // In the ring's order: rank t - 1 first, rank t last.
      for (int s = 0; s < ranks_; ++s) {
        const int r = ((t + 1 + s) % ranks_ + ranks_) % ranks_;
        ring::clear_block(part.data(), rows.total_rows, vp);
        if (Status st =
                ring::accumulate_block(*local, vp, rows, shards[static_cast<std::size_t>(r)], part.data(), scratch);
            !st)
          return st;
        ring::merge_block(acc.data(), part.data(), rows.total_rows, vp);
      }
      if (Status st = ring::refine_block(*local, vp, rows, acc.data(), scratch); !st) return st;
      ring::write_block(vp, rows, acc.data());
    }
    return Status::ok();
  }

 private:
  int ranks_;
  bool whole_rows_;
  std::string name_;
};

TEST(RingBlocks, ZigZagShardsCoverEveryRowAndKeyOnce) {
  // Three sequences of different shapes: Sq = Skv, decode, Sq > Skv (rows at negative positions).
  const std::int32_t cu_q[] = {0, 37, 38, 48};
  const std::int32_t cu_k[] = {0, 37, 137, 141};
  AttentionProblem p;
  p.q_layout = QLayout::packed;
  p.kv_layout = KvLayout::packed;
  p.batch = 3;
  p.cu_seqlens_q = cu_q;
  p.cu_seqlens_k = cu_k;
  std::vector<float> qb(48 * 2), kb(141 * 2), vb(141 * 2), ob(48 * 2);
  p.q = make_contiguous_view(qb.data(), DType::f32, {48, 1, 2});
  p.k = make_contiguous_view(kb.data(), DType::f32, {141, 1, 2});
  p.v = make_contiguous_view(vb.data(), DType::f32, {141, 1, 2});
  p.o = make_contiguous_view(ob.data(), DType::f32, {48, 1, 2});
  Result<ValidatedProblem> vp = validate(p);
  ASSERT_TRUE(vp) << vp.status().to_string();
  for (const int ranks : {2, 3, 4, 7}) {
    std::vector<int> row_owner(48, -1), key_owner(141, -1);
    for (int r = 0; r < ranks; ++r) {
      const ring::Shard s = ring::shard_of(*vp, r, ranks);
      std::int64_t rows = 0;
      for (const ring::Span& span : s.rows) {
        for (std::int64_t i = span.first; i < span.first + span.count; ++i) {
          int& owner = row_owner[static_cast<std::size_t>(cu_q[span.seq] + i)];
          EXPECT_EQ(owner, -1) << "row " << i << " of sequence " << span.seq << " owned twice";
          owner = r;
        }
        rows += span.count;
      }
      EXPECT_EQ(rows, s.total_rows);
      for (const ring::Span& span : s.keys) {
        for (std::int64_t j = span.first; j < span.first + span.count; ++j) {
          int& owner = key_owner[static_cast<std::size_t>(cu_k[span.seq] + j)];
          EXPECT_EQ(owner, -1) << "key " << j << " of sequence " << span.seq << " owned twice";
          owner = r;
        }
      }
    }
    for (int x : row_owner) EXPECT_GE(x, 0) << ranks << " ranks leave a row unowned";
    for (int x : key_owner) EXPECT_GE(x, 0) << ranks << " ranks leave a key unowned";
    // Rank 0 owns the first and last chunk of sequence 0's 37 keys.
    EXPECT_EQ(key_owner[0], 0);
    EXPECT_EQ(key_owner[36], 0);
    // The decode row (sequence 1) belongs to the owner of its position, the last key: rank 0.
    EXPECT_EQ(row_owner[37], 0);
  }
}

class RingBlocksConformance : public testing::TestWithParam<int> {};

TEST_P(RingBlocksConformance, SimulatedRingPassesQuickTier) {
  SimulatedRing ring(GetParam());
  const conformance::Report report =
      conformance::run_suite(ring, conformance::generate_cases(conformance::Tier::quick));
  for (const auto& r : report.results) EXPECT_TRUE(r.passed) << r.case_name << ": " << r.failure;
  EXPECT_GT(report.passed(), 100u);
}

TEST(RingBlocks, RowsOverAllKeysPassQuickTier) {
  SimulatedRing rows(3, true);
  const conformance::Report report =
      conformance::run_suite(rows, conformance::generate_cases(conformance::Tier::quick));
  for (const auto& r : report.results) EXPECT_TRUE(r.passed) << r.case_name << ": " << r.failure;
  EXPECT_GT(report.passed(), 100u);
}

INSTANTIATE_TEST_SUITE_P(Ranks, RingBlocksConformance, testing::Values(2, 3, 4),
                         [](const testing::TestParamInfo<int>& p) { return std::to_string(p.param); });

}  // namespace
}  // namespace kallpa

#endif  // KALLPA_HAVE_RING
