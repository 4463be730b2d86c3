#include <gtest/gtest.h>

#include "kallpa/problem_spec.h"

namespace kallpa {
namespace {

TEST(ProblemSpec, ParsesTheIssueExample) {
  auto r = parse_problem_spec("b=1,sq=4096,skv=4096,hq=32,hkv=8,d=128,causal,dtype=bf16");
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->batch, 1);
  EXPECT_EQ(r->seqlen_q, 4096);
  EXPECT_EQ(r->hq, 32);
  EXPECT_EQ(r->effective_hkv(), 8);
  EXPECT_EQ(r->head_dim, 128);
  EXPECT_TRUE(r->causal);
  EXPECT_EQ(r->dtype, DType::bf16);
  const ProblemSignature s = r->signature();
  EXPECT_EQ(s.hq, 32);
  EXPECT_EQ(s.hkv, 8);
  EXPECT_EQ(s.q_dtype, DType::bf16);
  EXPECT_EQ(s.kv_dtype, DType::bf16);
  EXPECT_TRUE(s.causal);
  EXPECT_FALSE(s.window);
}

TEST(ProblemSpec, RoundTripsEveryKey) {
  const char* text =
      "b=3,sq=1,skv=777,hq=12,hkv=4,d=80,dv=64,dtype=f16,kv_dtype=bf16,q=packed,kv=paged,page=7,"
      "causal,window=128:-1,softcap=30,alibi,lse,scale=0.5,device=cuda:1";
  auto r = parse_problem_spec(text);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  auto again = parse_problem_spec(r->to_string());
  ASSERT_TRUE(again.is_ok()) << again.status().to_string();
  EXPECT_EQ(again->to_string(), r->to_string());
  EXPECT_EQ(again->signature(), r->signature());
  EXPECT_EQ(r->window_left, 128);
  EXPECT_EQ(r->window_right, -1);
  EXPECT_EQ(r->device, (Device{DeviceKind::cuda, 1}));
  EXPECT_EQ(r->signature().page_size, 7);
}

struct BadSpec {
  const char* text;
  ErrorCode code;
  const char* field;
};

// gtest would otherwise print the struct's raw bytes, padding included (valgrind: uninitialised).
void PrintTo(const BadSpec& b, std::ostream* os) { *os << '"' << b.text << "\" -> " << b.field; }

class ProblemSpecErrors : public ::testing::TestWithParam<BadSpec> {};

TEST_P(ProblemSpecErrors, NameTheField) {
  auto r = parse_problem_spec(GetParam().text);
  ASSERT_FALSE(r.is_ok()) << GetParam().text;
  EXPECT_EQ(r.status().code(), GetParam().code) << r.status().to_string();
  EXPECT_EQ(r.status().field(), GetParam().field) << r.status().to_string();
}

INSTANTIATE_TEST_SUITE_P(Malformed, ProblemSpecErrors,
                         ::testing::Values(BadSpec{"", ErrorCode::parse_error, "spec"},
                                           BadSpec{"b=1,sq=abc", ErrorCode::parse_error, "sq"},
                                           BadSpec{"b=1,,sq=2", ErrorCode::parse_error, "spec"},
                                           BadSpec{"frobnicate=1", ErrorCode::parse_error, "frobnicate"},
                                           BadSpec{"hq=32,hkv=5", ErrorCode::invalid_argument, "hkv"},
                                           BadSpec{"d=0", ErrorCode::invalid_argument, "d"},
                                           BadSpec{"sq=-4", ErrorCode::invalid_argument, "sq"},
                                           BadSpec{"sq=99999999999999999999", ErrorCode::invalid_argument, "sq"},
                                           BadSpec{"dtype=f64", ErrorCode::parse_error, "dtype"},
                                           BadSpec{"kv=ring", ErrorCode::parse_error, "kv"},
                                           BadSpec{"window=5", ErrorCode::parse_error, "window"},
                                           BadSpec{"window=-2:0", ErrorCode::invalid_argument, "window"},
                                           BadSpec{"softcap=-1", ErrorCode::invalid_argument, "softcap"},
                                           BadSpec{"scale=inf", ErrorCode::invalid_argument, "scale"},
                                           BadSpec{"causal=maybe", ErrorCode::parse_error, "causal"},
                                           BadSpec{"d=64,d=128", ErrorCode::parse_error, "d"},
                                           BadSpec{"hq", ErrorCode::parse_error, "hq"},
                                           BadSpec{"device=tpu", ErrorCode::parse_error, "device"}));

}  // namespace
}  // namespace kallpa
