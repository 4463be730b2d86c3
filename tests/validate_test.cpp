// validate() must refuse every malformed problem with a typed error naming the field.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>

#include "kallpa/attention.h"
#include "test_problem.h"

namespace kallpa {
namespace {

using testing::DenseF32Problem;

void expect_invalid(const AttentionProblem& p, const std::string& field, const std::string& fragment = {}) {
  auto r = validate(p);
  ASSERT_FALSE(r.is_ok()) << "expected an error on " << field;
  EXPECT_EQ(r.status().code(), ErrorCode::invalid_argument);
  EXPECT_EQ(r.status().field(), field) << r.status().to_string();
  if (!fragment.empty()) {
    EXPECT_NE(r.status().message().find(fragment), std::string::npos) << r.status().to_string();
  }
}

TEST(Validate, AcceptsDenseProblemAndDerivesGeometry) {
  DenseF32Problem t(2, 5, 9, 6, 2, 16, 8, true);
  auto r = validate(t.problem);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->batch(), 2);
  EXPECT_EQ(r->hq(), 6);
  EXPECT_EQ(r->hkv(), 2);
  EXPECT_EQ(r->group_size(), 3);
  EXPECT_EQ(r->head_dim(), 16);
  EXPECT_EQ(r->head_dim_v(), 8);
  EXPECT_EQ(r->total_q(), 10);
  EXPECT_FLOAT_EQ(r->scale(), 0.25f);
  EXPECT_DOUBLE_EQ(r->query_key_pairs(), 2.0 * 5 * 9);
  EXPECT_TRUE(r->signature().lse);
  EXPECT_EQ(r->q_row_offset(1, 2), (1 * 5 + 2) * 6 * 16);
  EXPECT_EQ(r->k_row_offset(1, 3), (1 * 9 + 3) * 2 * 16);
  EXPECT_EQ(r->lse_offset(1, 4, 2), (1 * 6 + 4) * 5 + 2);
}

TEST(Validate, CausalIsAlignedBottomRight) {
  DenseF32Problem t(1, 3, 8, 1, 1, 4);
  t.problem.causal = true;
  auto r = validate(t.problem);
  ASSERT_TRUE(r.is_ok());
  // Query 0 of 3 against 8 keys sits at key position 5.
  EXPECT_EQ(r->visible_keys(0, 0).first, 0);
  EXPECT_EQ(r->visible_keys(0, 0).last, 5);
  EXPECT_EQ(r->visible_keys(0, 2).last, 7);
}

TEST(Validate, CausalWithMoreQueriesThanKeysMasksLeadingRows) {
  DenseF32Problem t(1, 6, 4, 1, 1, 4);
  t.problem.causal = true;
  auto r = validate(t.problem);
  ASSERT_TRUE(r.is_ok());
  auto k0 = r->visible_keys(0, 0);  // position -2: nothing visible
  EXPECT_GT(k0.first, k0.last);
  auto k2 = r->visible_keys(0, 2);  // position 0
  EXPECT_EQ(k2.first, 0);
  EXPECT_EQ(k2.last, 0);
}

TEST(Validate, WindowBounds) {
  DenseF32Problem t(1, 10, 10, 1, 1, 4);
  t.problem.window_left = 2;
  t.problem.window_right = 1;
  auto r = validate(t.problem);
  ASSERT_TRUE(r.is_ok());
  EXPECT_EQ(r->visible_keys(0, 5).first, 3);
  EXPECT_EQ(r->visible_keys(0, 5).last, 6);
  EXPECT_EQ(r->visible_keys(0, 0).first, 0);
  EXPECT_EQ(r->visible_keys(0, 9).last, 9);
}

// Windows anywhere in [-1, INT64_MAX] are problems (attention.h); a bound past Sq + Skv hides no
// more than that and must not overflow p_i +/- window: the visible range is that of -1 (unbounded).
TEST(Validate, WindowsAtTheIntegerLimitsSaturate) {
  constexpr std::int64_t i64 = std::numeric_limits<std::int64_t>::max();
  constexpr std::int64_t i32 = std::numeric_limits<std::int32_t>::max();
  // Sq > Skv puts the first query positions below 0, Sq < Skv the last ones above 0.
  for (const auto& [sq, skv] : {std::pair{9, 4}, std::pair{4, 9}, std::pair{1, 7}}) {
    for (const bool causal : {false, true}) {
      DenseF32Problem unbounded(1, sq, skv, 1, 1, 4);
      unbounded.problem.causal = causal;
      auto want = validate(unbounded.problem);
      ASSERT_TRUE(want.is_ok());
      for (const std::int64_t w : {std::int64_t{sq + skv}, i32 - 1, i32, i32 + 1, i64 - 1, i64}) {
        for (const int side : {0, 1, 2}) {  // left, right, both
          DenseF32Problem t(1, sq, skv, 1, 1, 4);
          t.problem.causal = causal;
          if (side != 1) t.problem.window_left = w;
          if (side != 0) t.problem.window_right = w;
          auto r = validate(t.problem);
          ASSERT_TRUE(r.is_ok()) << r.status().to_string();
          EXPECT_LE(r->window_left(), sq + skv);
          EXPECT_LE(r->window_right(), sq + skv);
          EXPECT_EQ(r->window_left() >= 0, side != 1);
          for (std::int64_t i = 0; i < sq; ++i) {
            const auto got = r->visible_keys(0, i), expect = want->visible_keys(0, i);
            EXPECT_EQ(got.first, expect.first) << "sq " << sq << " skv " << skv << " w " << w << " i " << i;
            EXPECT_EQ(got.last, expect.last) << "sq " << sq << " skv " << skv << " w " << w << " i " << i;
          }
        }
      }
    }
  }
}

TEST(Validate, RejectsWindowsBelowMinusOne) {
  DenseF32Problem t(1, 2, 2, 1, 1, 4);
  for (const std::int64_t w : {std::numeric_limits<std::int64_t>::min(),
                               std::int64_t{std::numeric_limits<std::int32_t>::min()}, std::int64_t{-2}}) {
    AttentionProblem p = t.problem;
    p.window_left = w;
    expect_invalid(p, "window_left", ">= -1");
    p = t.problem;
    p.window_right = w;
    expect_invalid(p, "window_right", ">= -1");
  }
}

TEST(Validate, RejectsNullAndWrongRank) {
  DenseF32Problem t(1, 2, 2, 1, 1, 4);
  AttentionProblem p = t.problem;
  p.k.data = nullptr;
  expect_invalid(p, "k.data", "null");
  p = t.problem;
  p.q.rank = 3;
  expect_invalid(p, "q.rank", "expected 4");
}

TEST(Validate, RejectsShapeMismatches) {
  DenseF32Problem t(1, 2, 3, 4, 2, 8);
  AttentionProblem p = t.problem;
  p.k.shape[3] = 7;
  expect_invalid(p, "k.shape[3]", "head dim");
  p = t.problem;
  p.k.shape[2] = 3;
  p.v.shape[2] = 3;
  expect_invalid(p, "k.shape[2]", "multiple");
  p = t.problem;
  p.o.shape[1] = 3;
  expect_invalid(p, "o.shape[1]");
  p = t.problem;
  p.v.shape[1] = 2;
  expect_invalid(p, "v.shape[1]");
  p = t.problem;
  p.q.shape[3] = 0;
  expect_invalid(p, "q.shape[3]", "head dim");
}

TEST(Validate, RejectsBadStridesAndOverflow) {
  DenseF32Problem t(1, 2, 3, 1, 1, 8);
  AttentionProblem p = t.problem;
  p.q.stride[1] = -8;
  expect_invalid(p, "q.stride[1]", "negative");
  p = t.problem;
  p.q.shape[1] = std::numeric_limits<std::int64_t>::max() / 2;
  p.o.shape[1] = p.q.shape[1];
  expect_invalid(p, "q.stride[1]", "overflow");
  p = t.problem;
  p.o.stride[3] = 0;  // every dim writes the same element
  expect_invalid(p, "o.stride[3]", "overlap");
}

TEST(Validate, RejectsAliasingOutput) {
  DenseF32Problem t(1, 2, 2, 1, 1, 4);
  AttentionProblem p = t.problem;
  p.o.data = t.q.data();
  expect_invalid(p, "o.data", "overlaps input q");
}

TEST(Validate, RejectsDtypeAndDeviceMismatch) {
  DenseF32Problem t(1, 2, 2, 1, 1, 4);
  AttentionProblem p = t.problem;
  p.v.dtype = DType::f16;
  expect_invalid(p, "v.dtype", "share");
  p = t.problem;
  p.v.device = Device{DeviceKind::cuda, 0};
  expect_invalid(p, "v.device");
  p = t.problem;
  p.q.dtype = static_cast<DType>(9);
  expect_invalid(p, "q.dtype", "unknown");
}

TEST(Validate, RejectsBadParameters) {
  DenseF32Problem t(1, 2, 2, 2, 1, 4);
  AttentionProblem p = t.problem;
  p.scale = std::numeric_limits<float>::infinity();
  expect_invalid(p, "scale", "finite");
  p = t.problem;
  p.softcap = -1.0f;
  expect_invalid(p, "softcap");
  p = t.problem;
  p.window_left = -5;
  expect_invalid(p, "window_left");
  p = t.problem;
  const float slopes[2] = {0.5f, std::nanf("")};
  p.alibi_slopes = slopes;
  expect_invalid(p, "alibi_slopes[1]");
  p = t.problem;
  p.contract_version = 2;
  expect_invalid(p, "contract_version");
}

TEST(Validate, RejectsLseOfWrongShapeOrDtype) {
  DenseF32Problem t(1, 3, 2, 2, 1, 4, 0, true);
  AttentionProblem p = t.problem;
  p.lse.shape[2] = 4;
  expect_invalid(p, "lse.shape[2]");
  p = t.problem;
  p.lse.dtype = DType::f16;
  expect_invalid(p, "lse.dtype", "f32");
}

TEST(Validate, PackedOffsetsAreChecked) {
  std::vector<float> q(7 * 2 * 4), k(9 * 1 * 4), v(9 * 1 * 4), o(7 * 2 * 4);
  AttentionProblem p;
  p.q_layout = QLayout::packed;
  p.kv_layout = KvLayout::packed;
  p.q = make_contiguous_view(q.data(), DType::f32, {7, 2, 4});
  p.k = make_contiguous_view(k.data(), DType::f32, {9, 1, 4});
  p.v = make_contiguous_view(v.data(), DType::f32, {9, 1, 4});
  p.o = make_contiguous_view(o.data(), DType::f32, {7, 2, 4});
  p.batch = 3;
  std::int32_t cq[4] = {0, 3, 3, 7};
  std::int32_t ck[4] = {0, 4, 5, 9};
  p.cu_seqlens_q = cq;
  p.cu_seqlens_k = ck;
  auto r = validate(p);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->seqlen_q(1), 0);
  EXPECT_EQ(r->seqlen_k(2), 4);
  EXPECT_EQ(r->max_seqlen_q(), 4);
  EXPECT_EQ(r->q_row_offset(2, 1), 4 * 2 * 4);

  cq[2] = 2;  // decreasing
  expect_invalid(p, "cu_seqlens_q[2]", "less than");
  cq[2] = 3;
  ck[3] = 10;  // beyond the rows
  expect_invalid(p, "cu_seqlens_k[3]", "beyond");
  ck[3] = 9;
  ck[0] = 1;
  expect_invalid(p, "cu_seqlens_k[0]");
  ck[0] = 0;
  p.cu_seqlens_q = nullptr;
  expect_invalid(p, "cu_seqlens_q", "null");
}

TEST(Validate, PagedBlockTableIsChecked) {
  // 4 blocks of 3 keys; two sequences of 5 and 2 keys.
  std::vector<float> q(2 * 1 * 1 * 4), k(4 * 3 * 1 * 4), v(4 * 3 * 1 * 4), o(2 * 1 * 1 * 4);
  AttentionProblem p;
  p.kv_layout = KvLayout::paged;
  p.q = make_contiguous_view(q.data(), DType::f32, {2, 1, 1, 4});
  p.k = make_contiguous_view(k.data(), DType::f32, {4, 3, 1, 4});
  p.v = make_contiguous_view(v.data(), DType::f32, {4, 3, 1, 4});
  p.o = make_contiguous_view(o.data(), DType::f32, {2, 1, 1, 4});
  std::int32_t table[2 * 3] = {3, 1, -7, 2, -1, -1};  // unused entries are never read
  std::int32_t lens[2] = {5, 2};
  p.block_table = table;
  p.max_blocks_per_seq = 2;
  p.block_table_stride = 3;
  p.seqlens_k = lens;
  auto r = validate(p);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->signature().page_size, 3);
  EXPECT_EQ(r->k_row_offset(0, 4), (1 * 3 + 1) * 4);  // key 4 -> block 1, slot 1
  EXPECT_EQ(r->k_row_offset(1, 1), (2 * 3 + 1) * 4);

  table[1] = 4;
  expect_invalid(p, "block_table[0][1]", "outside");
  table[1] = 1;
  lens[1] = 7;  // more than 2 blocks x 3
  expect_invalid(p, "seqlens_k[1]", "more than");
  lens[1] = 2;
  p.block_table_stride = 1;
  expect_invalid(p, "block_table_stride");
  p.block_table_stride = 3;

  // Page versions come with a pool id, and only with paged K/V.
  const std::uint64_t versions[4] = {1, 2, 3, 0};
  p.page_versions = versions;
  expect_invalid(p, "kv_pool_id", "together");
  p.kv_pool_id = 7;
  ASSERT_TRUE(validate(p).is_ok());
  p.page_versions = nullptr;
  expect_invalid(p, "page_versions", "together");
}

TEST(Validate, PageVersionsOutsidePagedLayoutAreRefused) {
  DenseF32Problem t(1, 2, 2, 1, 1, 4);
  const std::uint64_t versions[1] = {1};
  t.problem.page_versions = versions;
  t.problem.kv_pool_id = 1;
  expect_invalid(t.problem, "page_versions", "not paged");
}

TEST(Validate, IndexArraysForTheWrongLayoutAreRefused) {
  DenseF32Problem t(1, 2, 2, 1, 1, 4);
  std::int32_t cu[2] = {0, 2};
  AttentionProblem p = t.problem;
  p.cu_seqlens_q = cu;
  expect_invalid(p, "cu_seqlens_q", "dense");
  p = t.problem;
  p.batch = 3;
  expect_invalid(p, "batch");
}

TEST(Validate, EmptyBatchIsValid) {
  DenseF32Problem t(0, 4, 4, 1, 1, 4);
  auto r = validate(t.problem);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->total_q(), 0);
}

}  // namespace
}  // namespace kallpa
