// The paged KV cache's prefix cache: publishing full blocks, attaching them to a new sequence,
// keeping released ones cached (counted free) until the pool needs them, and copy-on-truncate of
// a shared block so that one sequence's writes never reach another's.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <span>

#include "kallpa/half.h"
#include "kallpa/ops/kv_cache.h"

namespace kallpa::ops {
namespace {

constexpr std::int32_t kLayers = 2, kHeads = 1, kDim = 4, kPage = 4;

std::unique_ptr<KvCache> make_cache(std::int64_t tokens) {
  auto c = KvCache::create(kLayers, kHeads, kDim, {.page_size = kPage, .max_tokens = tokens, .dtype = DType::f32});
  EXPECT_TRUE(c.is_ok()) << c.status().to_string();
  return std::move(*c);
}

std::vector<std::int32_t> tokens_of(int n, int salt = 0) {
  std::vector<std::int32_t> t(static_cast<std::size_t>(n));
  std::iota(t.begin(), t.end(), 100 + salt);
  return t;
}

// Writes positions [from, to) of every layer with a value that names (seq tag, layer, position).
void fill(KvCache& c, SeqId seq, std::int64_t from, std::int64_t to, float tag) {
  const auto blocks = c.blocks(seq);
  for (std::int32_t l = 0; l < kLayers; ++l) {
    for (std::int64_t p = from; p < to; ++p) {
      std::vector<float> row(kHeads * kDim, tag * 1000 + static_cast<float>(l * 100 + p));
      ASSERT_TRUE(c.write(l, blocks, p, row.data(), row.data(), 1));
    }
  }
}

// K of position p, layer l, as the sequence's block table finds it.
// Element offset of position p's row in a view of the pool (blocks are strided: the pool is
// block-major over the layers).
std::int64_t row_at(const TensorView& view, std::span<const std::int32_t> blocks, std::int64_t page, std::int64_t p) {
  return std::int64_t{blocks[static_cast<std::size_t>(p / page)]} * view.stride[0] + p % page * view.stride[1];
}

float k_at(const KvCache& c, SeqId seq, std::int32_t l, std::int64_t p) {
  const auto blocks = c.blocks(seq);
  const TensorView k = c.k_view(l);
  return static_cast<const float*>(k.data)[row_at(k, blocks, kPage, p)];
}

// A sequence holding positions [0, n) written (tag 1) and published as tokens_of(n).
SeqId published(KvCache& c, std::int64_t n) {
  const SeqId s = c.add_sequence();
  EXPECT_TRUE(c.reserve(s, n).is_ok());
  fill(c, s, 0, n, 1);
  c.publish(s, tokens_of(static_cast<int>(n)));
  return s;
}

TEST(KvCachePrefix, AttachesThePublishedFullBlocksOfAMatchingPrefix) {
  auto c = make_cache(64);
  const auto t = tokens_of(10);
  const SeqId a = c->add_sequence();
  ASSERT_TRUE(c->reserve(a, 10).is_ok());
  fill(*c, a, 0, 10, 1);
  c->publish(a, t);  // two full blocks; positions 8, 9 stay private

  const SeqId b = c->add_sequence();
  auto longer = tokens_of(20);
  EXPECT_EQ(c->attach_prefix(b, longer), 8);
  ASSERT_EQ(c->blocks(b).size(), 2u);
  EXPECT_EQ(c->blocks(b)[0], c->blocks(a)[0]);
  EXPECT_EQ(c->blocks(b)[1], c->blocks(a)[1]);
  EXPECT_EQ(k_at(*c, b, 1, 7), k_at(*c, a, 1, 7));

  // A difference in the second block stops the match after the first.
  auto diverging = tokens_of(20);
  diverging[6] = 7;
  const SeqId d = c->add_sequence();
  EXPECT_EQ(c->attach_prefix(d, diverging), 4);
  // The last token is always left to compute: 8 tokens match, but only one block is attached.
  const SeqId e = c->add_sequence();
  EXPECT_EQ(c->attach_prefix(e, std::span(t).first(8)), 4);
  // A sequence that holds blocks already attaches nothing.
  EXPECT_EQ(c->attach_prefix(a, longer), 0);
  // Nothing is published from a different start.
  const SeqId f = c->add_sequence();
  EXPECT_EQ(c->attach_prefix(f, tokens_of(20, 1)), 0);
}

// A scheduler that prefills in chunks at fixed positions attaches whole chunks only: the match is
// cut to a multiple of lcm(granule, page), and the blocks past the cut stay published for others.
TEST(KvCachePrefix, AttachesWholeGranulesOnly) {
  auto c = make_cache(64);            // 4-token blocks
  const SeqId a = published(*c, 13);  // three full blocks published: positions 0..11
  const auto longer = tokens_of(20);
  const SeqId b = c->add_sequence();
  EXPECT_EQ(c->attach_prefix(b, longer, 8), 8);
  ASSERT_EQ(c->blocks(b).size(), 2u);
  EXPECT_EQ(c->blocks(b)[1], c->blocks(a)[1]);
  const SeqId d = c->add_sequence();
  EXPECT_EQ(c->attach_prefix(d, longer, 6), 12);  // lcm(6, 4) = 12
  const SeqId e = c->add_sequence();
  EXPECT_EQ(c->attach_prefix(e, longer, 16), 0);
  EXPECT_TRUE(c->blocks(e).empty());
  c->remove(a);
  c->remove(d);
  // The third block, held by no sequence now, is still published: a whole-block attach finds it.
  const SeqId f = c->add_sequence();
  EXPECT_EQ(c->attach_prefix(f, longer), 12);
}

TEST(KvCachePrefix, ReleasedBlocksStayCachedAsFreeUntilThePoolNeedsThem) {
  auto c = make_cache(32);  // 8 blocks
  const auto t = tokens_of(12);
  const SeqId a = c->add_sequence();
  ASSERT_TRUE(c->reserve(a, 12).is_ok());
  fill(*c, a, 0, 12, 1);
  c->publish(a, t);
  c->remove(a);
  EXPECT_EQ(c->free_blocks(), 8);
  EXPECT_EQ(c->used_blocks(), 0);
  EXPECT_EQ(c->cached_blocks(), 3);

  const SeqId b = c->add_sequence();
  EXPECT_EQ(c->attach_prefix(b, tokens_of(13)), 12);
  EXPECT_EQ(c->cached_blocks(), 0);
  EXPECT_EQ(c->used_blocks(), 3);
  EXPECT_EQ(k_at(*c, b, 0, 11), 1000.0f + 11);
  c->remove(b);

  // Every block taken: the cached ones are reused (forgotten), never refused.
  const SeqId big = c->add_sequence();
  ASSERT_TRUE(c->reserve(big, 32).is_ok());
  EXPECT_EQ(c->cached_blocks(), 0);
  EXPECT_FALSE(c->reserve(big, 33).is_ok());
  c->remove(big);
  const SeqId again = c->add_sequence();
  EXPECT_EQ(c->attach_prefix(again, tokens_of(13)), 0);
}

TEST(KvCachePrefix, TruncatingIntoASharedBlockCopiesIt) {
  auto c = make_cache(64);
  const auto t = tokens_of(8);
  const SeqId a = c->add_sequence();
  ASSERT_TRUE(c->reserve(a, 8).is_ok());
  fill(*c, a, 0, 8, 1);
  c->publish(a, t);
  const SeqId b = c->add_sequence();
  ASSERT_EQ(c->attach_prefix(b, tokens_of(9)), 8);

  EXPECT_EQ(c->truncate(b, 6), 6);  // b goes on inside the second block: it gets its own copy
  EXPECT_EQ(c->blocks(b)[0], c->blocks(a)[0]);
  EXPECT_NE(c->blocks(b)[1], c->blocks(a)[1]);
  EXPECT_EQ(k_at(*c, b, 1, 5), k_at(*c, a, 1, 5));  // copied content
  fill(*c, b, 6, 8, 2);
  EXPECT_EQ(k_at(*c, a, 1, 6), 1000.0f + 106);  // a's block untouched
  EXPECT_EQ(k_at(*c, b, 1, 6), 2000.0f + 106);

  // The truncated chain is no longer published under its old tokens from b's side, but a's
  // blocks still are.
  const SeqId d = c->add_sequence();
  EXPECT_EQ(c->attach_prefix(d, tokens_of(9)), 8);
}

TEST(KvCacheFork, SharesFullBlocksAndCopiesThePartialOne) {
  auto c = make_cache(64);
  const SeqId a = c->add_sequence();
  ASSERT_TRUE(c->reserve(a, 10).is_ok());
  fill(*c, a, 0, 10, 1);
  const std::int64_t used = c->used_blocks();
  auto b = c->fork(a, 10);
  ASSERT_TRUE(b.is_ok()) << b.status().to_string();
  ASSERT_EQ(c->blocks(*b).size(), 3u);
  EXPECT_EQ(c->blocks(*b)[0], c->blocks(a)[0]);  // full blocks: shared, not copied
  EXPECT_EQ(c->blocks(*b)[1], c->blocks(a)[1]);
  EXPECT_NE(c->blocks(*b)[2], c->blocks(a)[2]);  // the partial one: a private copy
  EXPECT_EQ(c->used_blocks(), used + 1);
  for (std::int64_t p = 0; p < 10; ++p) EXPECT_EQ(k_at(*c, *b, 1, p), k_at(*c, a, 1, p)) << p;
  // Both go on past the fork in their own block.
  fill(*c, a, 10, 12, 1);
  fill(*c, *b, 10, 12, 2);
  EXPECT_EQ(k_at(*c, a, 0, 11), 1000.0f + 11);
  EXPECT_EQ(k_at(*c, *b, 0, 11), 2000.0f + 11);
  EXPECT_EQ(k_at(*c, *b, 0, 9), 1000.0f + 9);
  // The shared blocks go back to the pool only when both have let go.
  c->remove(a);
  EXPECT_EQ(c->used_blocks(), 3);
  EXPECT_EQ(k_at(*c, *b, 1, 3), 1000.0f + 103);
  c->remove(*b);
  EXPECT_EQ(c->used_blocks(), 0);
}

TEST(KvCacheFork, AtABlockBoundaryNothingIsCopiedAndErrorsAreTyped) {
  auto c = make_cache(12);  // three blocks
  const SeqId a = c->add_sequence();
  ASSERT_TRUE(c->reserve(a, 8).is_ok());
  auto b = c->fork(a, 8);
  ASSERT_TRUE(b.is_ok());
  EXPECT_EQ(c->blocks(*b), c->blocks(a));
  EXPECT_EQ(c->used_blocks(), 2);
  EXPECT_EQ(c->fork(12345, 4).status().code(), ErrorCode::not_found);
  // A partial last block needs a free block for its copy.
  ASSERT_TRUE(c->reserve(a, 12).is_ok());
  EXPECT_EQ(c->fork(a, 10).status().code(), ErrorCode::out_of_memory);
}

TEST(KvCachePrefix, TruncatingAnUnsharedPublishedBlockUnpublishesIt) {
  auto c = make_cache(64);
  const SeqId a = c->add_sequence();
  ASSERT_TRUE(c->reserve(a, 8).is_ok());
  fill(*c, a, 0, 8, 1);
  c->publish(a, tokens_of(8));
  const std::int32_t second = c->blocks(a)[1];
  EXPECT_EQ(c->truncate(a, 5), 5);
  EXPECT_EQ(c->blocks(a)[1], second);  // kept in place, now private
  const SeqId b = c->add_sequence();
  EXPECT_EQ(c->attach_prefix(b, tokens_of(9)), 4);
}

TEST(KvCachePrefix, DuplicateContentStaysPrivateAndFreesNormally) {
  auto c = make_cache(64);
  const SeqId a = c->add_sequence(), b = c->add_sequence();
  for (SeqId s : {a, b}) {
    ASSERT_TRUE(c->reserve(s, 8).is_ok());
    fill(*c, s, 0, 8, 1);
  }
  c->publish(a, tokens_of(8));
  c->publish(b, tokens_of(8));  // same tokens: b's blocks are not published a second time
  c->remove(a);
  c->remove(b);
  EXPECT_EQ(c->cached_blocks(), 2);
  EXPECT_EQ(c->free_blocks(), 16);
}

TEST(KvCachePrefix, ACopyIntoAFullPoolGivesUpThePartialBlockAndSaysSo) {
  auto c = make_cache(8);  // 2 blocks
  const SeqId a = published(*c, 8);
  const SeqId b = c->add_sequence();
  ASSERT_EQ(c->attach_prefix(b, tokens_of(9)), 8);
  EXPECT_EQ(c->truncate(b, 6), 4);
  EXPECT_EQ(c->blocks(b).size(), 1u);
  EXPECT_EQ(c->blocks(a).size(), 2u);
}

// Found by tests/fuzz/kv_cache_fuzz.cpp: a length past the sequence's blocks read the last block
// of an empty block list (a crash), or unpublished / copied a block that holds no position to forget.
TEST(KvCachePrefix, TruncatingPastTheBlocksHeldForgetsNothing) {
  auto c = make_cache(64);
  const SeqId empty = c->add_sequence();
  EXPECT_EQ(c->truncate(empty, 3), 0);
  EXPECT_EQ(c->capacity(empty), 0);

  const SeqId a = published(*c, 8);
  const SeqId b = c->add_sequence();
  ASSERT_EQ(c->attach_prefix(b, tokens_of(9)), 8);
  const auto shared = c->blocks(b);
  EXPECT_EQ(c->truncate(b, 10), 8);
  EXPECT_EQ(c->blocks(b), shared);  // still the published blocks, not a needless copy
  EXPECT_EQ(c->truncate(a, 9), 8);
  const SeqId d = c->add_sequence();
  EXPECT_EQ(c->attach_prefix(d, tokens_of(9)), 8);  // and still published
  EXPECT_EQ(k_at(*c, d, 1, 7), 1000 + 100 + 7);
}

// f16 and bf16 caches store each written value as f32_to_f16 / f32_to_bf16 give it, bit for bit,
// whatever path converts the row (8 at a time where the CPU has F16C, then a scalar tail): ties
// to even, overflow to infinity, subnormals, signed zeros, infinities and NaNs with payloads
// (stored as the scalar functions' quiet NaN), in rows of 3 x 13 elements (not a whole number of
// vectors) written one and several at a time.
TEST(KvCacheWrite, HalfRowsHoldTheScalarConversionsBitForBit) {
  constexpr std::int32_t kH = 3, kD = 13, kRow = kH * kD;
  const float specials[] = {0.0f,
                            -0.0f,
                            1.0f,
                            -2.5f,
                            65504.0f,
                            65519.0f,
                            65520.0f,
                            -1e6f,
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(),
                            -std::numeric_limits<float>::quiet_NaN(),
                            std::bit_cast<float>(0x7f800001u),
                            std::bit_cast<float>(0xffc12345u),
                            std::bit_cast<float>(0x7fa00000u),
                            5.96e-8f,
                            2.98e-8f,
                            2.99e-8f,
                            6.1e-5f,
                            1e-40f,
                            -1e-45f,
                            std::bit_cast<float>(0x3f801000u),
                            std::bit_cast<float>(0x3f803000u),
                            std::bit_cast<float>(0x3f808000u),
                            std::bit_cast<float>(0x3f818000u),
                            std::bit_cast<float>(0x00018000u),
                            3.3895314e38f};
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  for (DType dt : {DType::f16, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    auto made = KvCache::create(1, kH, kD, {.page_size = 4, .max_tokens = 16, .dtype = dt});
    ASSERT_TRUE(made.is_ok()) << made.status().to_string();
    KvCache& c = **made;
    const SeqId seq = c.add_sequence();
    ASSERT_TRUE(c.reserve(seq, 7).is_ok());
    std::vector<float> k(7 * kRow), v(7 * kRow);
    for (std::size_t e = 0; e < k.size(); ++e) {
      k[e] = e < std::size(specials) ? specials[e] : dist(rng);
      v[e] = e + 5 < std::size(specials) ? -specials[e + 5] : dist(rng) * 1e-3f;
    }
    const auto blocks = c.blocks(seq);
    ASSERT_TRUE(c.write(0, blocks, 0, k.data(), v.data(), 1));                // one row
    ASSERT_TRUE(c.write(0, blocks, 1, k.data() + kRow, v.data() + kRow, 6));  // a batch
    const TensorView kview = c.k_view(0), vview = c.v_view(0);
    const auto* kb = static_cast<const std::uint16_t*>(kview.data);
    const auto* vb = static_cast<const std::uint16_t*>(vview.data);
    int differ = 0;
    for (std::int64_t p = 0; p < 7; ++p) {
      const std::int64_t krow = row_at(kview, blocks, 4, p), vrow = row_at(vview, blocks, 4, p);
      for (std::int64_t e = 0; e < kRow; ++e) {
        const float kf = k[static_cast<std::size_t>(p * kRow + e)], vf = v[static_cast<std::size_t>(p * kRow + e)];
        const std::uint16_t kw = dt == DType::f16 ? f32_to_f16(kf) : f32_to_bf16(kf);
        const std::uint16_t vw = dt == DType::f16 ? f32_to_f16(vf) : f32_to_bf16(vf);
        const std::uint16_t kg = kb[krow + e], vg = vb[vrow + e];
        if (kg != kw || vg != vw) {
          ++differ;
          ADD_FAILURE() << "position " << p << " element " << e << ": k " << kf << " -> " << kg << " want " << kw
                        << ", v " << vf << " -> " << vg << " want " << vw;
        }
      }
    }
    EXPECT_EQ(differ, 0);
  }
}

// Page versions (the attention contract's page_versions): every change to a block's bytes in a
// layer gives it a version never seen before; nothing else moves it.
std::uint64_t version(const KvCache& c, std::int32_t layer, std::int32_t block) {
  return c.page_versions(layer)[block];
}

TEST(KvCacheVersions, PoolsHaveDistinctIdsAndUntouchedBlocksAreUnknown) {
  auto a = make_cache(16), b = make_cache(16);
  EXPECT_NE(a->pool_id(), 0u);
  EXPECT_NE(a->pool_id(), b->pool_id());
  for (std::int32_t l = 0; l < kLayers; ++l) {
    for (std::int32_t blk = 0; blk < a->total_blocks(); ++blk) EXPECT_EQ(version(*a, l, blk), 0u);
  }
}

TEST(KvCacheVersions, AWriteMovesOnlyItsBlockInItsLayer) {
  auto c = make_cache(32);
  const SeqId s = c->add_sequence();
  ASSERT_TRUE(c->reserve(s, 8).is_ok());
  const auto blocks = c->blocks(s);
  const std::uint64_t taken0 = version(*c, 0, blocks[0]), taken1 = version(*c, 1, blocks[0]);
  EXPECT_NE(taken0, 0u);  // handed out: its bytes are whatever the pool held, so a new version
  EXPECT_NE(taken1, 0u);
  const std::uint64_t other = version(*c, 0, blocks[1]);

  std::vector<float> row(kHeads * kDim, 1.0f);
  ASSERT_TRUE(c->write(0, blocks, 2, row.data(), row.data(), 1));
  const std::uint64_t written = version(*c, 0, blocks[0]);
  EXPECT_GT(written, taken0);
  EXPECT_EQ(version(*c, 1, blocks[0]), taken1);  // the other layer did not change
  EXPECT_EQ(version(*c, 0, blocks[1]), other);   // nor did the other block

  const std::vector<std::int64_t> slots = {c->slot(blocks, 5)};
  ASSERT_TRUE(c->write_rows(1, slots, row.data(), row.data()));
  EXPECT_GT(version(*c, 1, blocks[1]), written);
  EXPECT_EQ(version(*c, 0, blocks[0]), written);
}

TEST(KvCacheVersions, ABlockHandedOutAgainOrCopiedIntoGetsANewVersion) {
  auto c = make_cache(64);
  const SeqId a = c->add_sequence();
  ASSERT_TRUE(c->reserve(a, 8).is_ok());
  fill(*c, a, 0, 8, 1);
  c->publish(a, tokens_of(8));
  const SeqId b = c->add_sequence();
  ASSERT_EQ(c->attach_prefix(b, tokens_of(9)), 8);
  const std::int32_t shared = c->blocks(a)[1];
  const std::uint64_t before = version(*c, 1, shared);

  ASSERT_EQ(c->truncate(b, 6), 6);  // copy-on-truncate: b's second block is a fresh copy
  const std::int32_t copy = c->blocks(b)[1];
  ASSERT_NE(copy, shared);
  EXPECT_EQ(version(*c, 1, shared), before);  // the source did not change
  EXPECT_GT(version(*c, 1, copy), before);

  // Freed and taken again: whatever it held, a version seen before never describes it.
  const SeqId d = c->add_sequence();
  c->remove(b);
  const std::uint64_t freed = version(*c, 0, copy);
  ASSERT_TRUE(c->reserve(d, 64 - 8).is_ok());  // every block but a's two
  const auto mine = c->blocks(d);
  ASSERT_NE(std::find(mine.begin(), mine.end(), copy), mine.end());
  EXPECT_GT(version(*c, 0, copy), freed);
}

}  // namespace
}  // namespace kallpa::ops
