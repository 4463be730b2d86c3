// The StableHLO text the pjrt backend generates, feature by feature: each contract feature shows up
// as the ops and arguments that implement it, and only when asked for. (That the programs compute
// the contract is the conformance suite's job, on the real plugins.)
#include <cstddef>
#include <string>
#include <string_view>

#include <gtest/gtest.h>

#include "backends/pjrt/attention_program.h"

namespace kallpa::pjrt {
namespace {

ProgramSpec base() {
  ProgramSpec s;
  s.batch = 2;
  s.seq_q = 4;
  s.hq = 8;
  s.hkv = 2;
  s.head_dim = 16;
  s.head_dim_v = 16;
  s.seq_k = 64;
  s.chunk = 16;
  return s;
}

std::size_t count(std::string_view text, std::string_view what) {
  std::size_t n = 0;
  for (std::size_t at = text.find(what); at != std::string_view::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

bool has(std::string_view text, std::string_view what) { return text.find(what) != std::string_view::npos; }

TEST(AttentionProgram, PlainProgramHasTheArgumentsAndOneResult) {
  const std::string t = attention_program(base());
  EXPECT_TRUE(has(t,
                  "func.func public @main(%arg0: tensor<2x4x8x16xf32>, %arg1: tensor<2x64x2x16xf32>, "
                  "%arg2: tensor<2x64x2x16xf32>, %arg3: tensor<2xi32>, %arg4: tensor<2xi32>, %arg5: tensor<f32>, "
                  "%arg6: tensor<f32>, %arg7: tensor<i32>, %arg8: tensor<i32>) -> (tensor<2x4x8x16xf32>)"))
      << t;
  EXPECT_FALSE(has(t, "%arg9"));
  // No feature that was not asked for.
  EXPECT_FALSE(has(t, "stablehlo.tanh"));
  EXPECT_FALSE(has(t, "stablehlo.abs"));
  EXPECT_FALSE(has(t, "stablehlo.gather"));
  EXPECT_FALSE(has(t, "stablehlo.log"));
  EXPECT_FALSE(has(t, "comparison_direction LE"));
  EXPECT_FALSE(has(t, "comparison_direction GE"));
}

TEST(AttentionProgram, KeysAreWalkedInChunksByAWhileLoop) {
  const std::string t = attention_program(base());
  EXPECT_EQ(count(t, "\"stablehlo.while\""), 1u);
  // 64 keys, 16 a step: the loop runs while the counter is below 4.
  EXPECT_TRUE(has(t, "value = dense<4> : tensor<i32>")) << t;
  EXPECT_TRUE(has(t, "slice_sizes = array<i64: 2, 16, 2, 16>")) << t;
  // Scores exist only chunk-wide: [B, Hkv, G*S, C] and [B, Hkv, G, S, C]; never [.., 64].
  EXPECT_TRUE(has(t, "tensor<2x2x16x16xf32>"));
  EXPECT_TRUE(has(t, "tensor<2x2x4x4x16xf32>"));
  EXPECT_FALSE(has(t, "x4x64xf32>"));
  // The running max, sum and accumulator are carried and merged: two exponentials per step.
  EXPECT_EQ(count(t, "stablehlo.exponential"), 2u);
  EXPECT_EQ(count(t, "stablehlo.dot_general"), 2u);
}

TEST(AttentionProgram, GqaGroupsQueryHeadsUnderTheirKvHead) {
  const std::string t = attention_program(base());
  // [B, S, Hq, D] -> [B, S, Hkv, G, D] -> [B, Hkv, G, S, D]: query head h reads KV head h / G.
  EXPECT_TRUE(has(t, "-> tensor<2x4x2x4x16xf32>")) << t;
  EXPECT_TRUE(has(t, "permutation = array<i64: 0, 2, 3, 1, 4>")) << t;
  EXPECT_TRUE(has(t, "lhs_batching_dimensions = [0, 1], rhs_batching_dimensions = [0, 2]")) << t;
  ProgramSpec mqa = base();
  mqa.hkv = 1;
  EXPECT_TRUE(has(attention_program(mqa), "-> tensor<2x4x1x8x16xf32>"));
}

TEST(AttentionProgram, HalfInputsAreWidenedAndTheSoftmaxIsF32) {
  for (DType t : {DType::f16, DType::bf16}) {
    ProgramSpec s = base();
    s.in_dtype = s.kv_dtype = s.out_dtype = t;
    s.lse = true;
    const std::string text = attention_program(s);
    const std::string e = t == DType::f16 ? "f16" : "bf16";
    EXPECT_TRUE(has(text, "%arg0: tensor<2x4x8x16x" + e + ">")) << text;
    EXPECT_TRUE(has(text, "(tensor<2x4x8x16x" + e + ">) -> tensor<2x4x8x16xf32>")) << text;    // q widened
    EXPECT_TRUE(has(text, "(tensor<2x16x2x16x" + e + ">) -> tensor<2x16x2x16xf32>")) << text;  // k, v chunks
    EXPECT_TRUE(has(text, "(tensor<2x4x8x16xf32>) -> tensor<2x4x8x16x" + e + ">")) << text;    // o narrowed last
    EXPECT_TRUE(has(text, "-> (tensor<2x4x8x16x" + e + ">, tensor<2x8x4xf32>)")) << text;      // lse stays f32
    EXPECT_FALSE(has(text, "x" + e + ">) -> tensor<2x2x16x16x")) << text;                      // no half scores
  }
}

TEST(AttentionProgram, KvMayHaveItsOwnDtype) {
  ProgramSpec s = base();
  s.kv_dtype = DType::f16;
  const std::string t = attention_program(s);
  EXPECT_TRUE(has(t, "%arg0: tensor<2x4x8x16xf32>, %arg1: tensor<2x64x2x16xf16>, %arg2: tensor<2x64x2x16xf16>")) << t;
  EXPECT_TRUE(has(t, "(tensor<2x16x2x16xf16>) -> tensor<2x16x2x16xf32>")) << t;
  EXPECT_EQ(s.key(), "f32/kv:f16>f32 b2 s4 h8/2 d16/16 n64 c16");
}

TEST(AttentionProgram, HeadDimOfValuesMayDiffer) {
  ProgramSpec s = base();
  s.head_dim_v = 24;
  const std::string t = attention_program(s);
  EXPECT_TRUE(has(t, "%arg2: tensor<2x64x2x24xf32>"));
  EXPECT_TRUE(has(t, "-> (tensor<2x4x8x24xf32>)"));
  EXPECT_TRUE(has(t, "lhs_contracting_dimensions = [3], rhs_contracting_dimensions = [1]"));
}

TEST(AttentionProgram, CausalMaskIsBottomRightAligned) {
  ProgramSpec s = base();
  s.causal = true;
  const std::string t = attention_program(s);
  // p = i + Skv - Sq from the length arguments, then key j <= p.
  EXPECT_TRUE(has(t, "\"stablehlo.subtract\"")) << t;
  EXPECT_EQ(count(t, "comparison_direction LE"), 1u) << t;
  EXPECT_FALSE(has(t, "comparison_direction GE"));
}

TEST(AttentionProgram, WindowBoundsComeFromTheArguments) {
  ProgramSpec s = base();
  s.window = true;
  const std::string t = attention_program(s);
  EXPECT_EQ(count(t, "comparison_direction GE"), 1u) << t;
  EXPECT_EQ(count(t, "comparison_direction LE"), 1u) << t;
}

TEST(AttentionProgram, SoftcapIsTanh) {
  ProgramSpec s = base();
  s.softcap = true;
  const std::string t = attention_program(s);
  EXPECT_EQ(count(t, "\"stablehlo.tanh\""), 1u);
  EXPECT_EQ(count(t, "\"stablehlo.divide\""), 2u);  // s / cap, and the final acc / sum
}

TEST(AttentionProgram, AlibiTakesSlopesPerQueryHead) {
  ProgramSpec s = base();
  s.alibi = true;
  const std::string t = attention_program(s);
  EXPECT_TRUE(has(t, "%arg9: tensor<8xf32>")) << t;
  EXPECT_TRUE(has(t, "\"stablehlo.abs\"")) << t;
  EXPECT_TRUE(has(t, "(tensor<8xf32>) -> tensor<2x4xf32>")) << t;  // slopes as [Hkv, G]
}

TEST(AttentionProgram, LseIsASecondResultAndMaskedRowsGetMinusInfinity) {
  ProgramSpec s = base();
  s.lse = true;
  const std::string t = attention_program(s);
  EXPECT_TRUE(has(t, "-> (tensor<2x4x8x16xf32>, tensor<2x8x4xf32>)")) << t;
  EXPECT_EQ(count(t, "\"stablehlo.log\""), 1u);
  EXPECT_TRUE(has(t, "\"func.return\"(%")) << t;
}

TEST(AttentionProgram, PagedKvIsGatheredOverTheBlockTableInsideTheLoop) {
  ProgramSpec s = base();
  s.paged = true;
  s.page_size = 8;
  s.num_blocks = 16;
  s.seq_k = 64;  // 8 blocks per row
  s.chunk = 16;  // 2 blocks a step
  ASSERT_TRUE(check_spec(s));
  const std::string t = attention_program(s);
  EXPECT_TRUE(has(t, "%arg1: tensor<16x8x2x16xf32>")) << t;
  EXPECT_TRUE(has(t, "%arg9: tensor<2x8xi32>")) << t;
  EXPECT_EQ(count(t, "\"stablehlo.gather\""), 2u);
  EXPECT_TRUE(has(t, "slice_sizes = array<i64: 2, 2>")) << t;  // this step's two table columns
  EXPECT_TRUE(has(t, "-> tensor<4x8x2x16xf32>")) << t;         // B * 2 gathered blocks
  // The gathers sit in the loop body, after the while's condition region.
  EXPECT_GT(t.find("\"stablehlo.gather\""), t.find("\"stablehlo.compare\""));
}

TEST(AttentionProgram, ValuesNoQueryCanSeeAreSelectedOutBeforeTheSecondProduct) {
  const std::string t = attention_program(base());
  // The keys any query row sees: an `or` over the query rows of the mask ...
  const std::size_t seen = t.find("\"stablehlo.or\"");
  ASSERT_NE(seen, std::string::npos) << t;
  // ... then a select on the V chunk, then the product with the probabilities.
  const std::size_t select = t.find("\"stablehlo.select\"", seen);
  const std::size_t second_dot = t.rfind("\"stablehlo.dot_general\"");
  ASSERT_NE(select, std::string::npos);
  EXPECT_LT(select, second_dot);
}

TEST(AttentionProgram, KeyNamesEveryFeatureAndShape) {
  ProgramSpec s = base();
  s.causal = s.window = s.softcap = s.alibi = s.lse = true;
  s.in_dtype = s.kv_dtype = s.out_dtype = DType::bf16;
  EXPECT_EQ(s.key(), "bf16>bf16 b2 s4 h8/2 d16/16 n64 c16 causal window softcap alibi lse");
  ProgramSpec p = base();
  p.paged = true;
  p.page_size = 8;
  p.num_blocks = 16;
  EXPECT_EQ(p.key(), "f32>f32 b2 s4 h8/2 d16/16 n64 paged16x8 c16");
  EXPECT_NE(base().key(), s.key());
}

TEST(AttentionProgram, CheckSpecNamesTheBadField) {
  ProgramSpec s = base();
  s.hq = 6;
  s.hkv = 4;
  EXPECT_EQ(check_spec(s).field(), "hq");
  s = base();
  s.chunk = 24;
  EXPECT_EQ(check_spec(s).field(), "chunk");
  s = base();
  s.head_dim = 0;
  EXPECT_EQ(check_spec(s).field(), "head_dim");
  s = base();
  s.paged = true;
  s.page_size = 8;
  s.num_blocks = 4;
  s.chunk = 12;
  s.seq_k = 48;
  EXPECT_EQ(check_spec(s).field(), "chunk");  // not a multiple of the page
  EXPECT_TRUE(check_spec(base()));
}

// The KV mirror's programs: the update scatters n pages into each pool, which it donates to its
// results; the zeros program takes nothing and makes both pools on the device.
TEST(PageUpdateProgram, ScattersPagesIntoDonatedPools) {
  PageUpdateSpec s;
  s.kv_dtype = DType::f16;
  s.num_blocks = 512;
  s.page_size = 16;
  s.hkv = 3;
  s.head_dim = 64;
  s.head_dim_v = 32;
  s.pages = 4;
  ASSERT_TRUE(check_spec(s));
  const std::string t = page_update_program(s);
  EXPECT_TRUE(has(t,
                  "@main(%arg0: tensor<512x16x3x64xf16> {tf.aliasing_output = 0 : i32}, %arg1: "
                  "tensor<512x16x3x32xf16> {tf.aliasing_output = 1 : i32}, %arg2: tensor<4x16x3x64xf16>, %arg3: "
                  "tensor<4x16x3x32xf16>, %arg4: tensor<4x1xi32>) -> (tensor<512x16x3x64xf16>, "
                  "tensor<512x16x3x32xf16>)"))
      << t;
  EXPECT_EQ(count(t, "\"stablehlo.scatter\""), 2u) << t;
  EXPECT_EQ(s.key(), "page-update f16 blocks512x16 h3 d64/32 n4");

  const std::string z = pool_zeros_program(s);
  EXPECT_TRUE(has(z, "@main() -> (tensor<512x16x3x64xf16>, tensor<512x16x3x32xf16>)")) << z;
  EXPECT_EQ(s.zeros_key(), "pool-zeros f16 blocks512x16 h3 d64/32");

  s.pages = 0;
  EXPECT_EQ(check_spec(s).field(), "pages");
}

}  // namespace
}  // namespace kallpa::pjrt
