// The tiers of the conformance suite (quick, normal, full) and the sampled-row judging the large
// cases rest on: what each tier contains, that a backend wrong only beyond 4096 keys fails the
// default tier, that sampling always holds the first, last and mask-boundary rows, and what it
// cannot see (one wrong row that the sample misses).
#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "conformance/buffers.h"
#include "conformance/case_data.h"
#include "conformance/sampling.h"
#include "kallpa/backend.h"
#include "kallpa/conformance.h"
#include "kallpa/half.h"
#include "kallpa/registry.h"

namespace kallpa::conformance {
namespace {

std::int32_t max_keys(const CaseSpec& s) {
  return s.seqlens_k.empty() ? 0 : *std::max_element(s.seqlens_k.begin(), s.seqlens_k.end());
}
std::int32_t max_queries(const CaseSpec& s) {
  return s.seqlens_q.empty() ? 0 : *std::max_element(s.seqlens_q.begin(), s.seqlens_q.end());
}

const std::vector<Case>& tier(Tier t) {
  static const std::vector<Case> quick = generate_cases(Tier::quick);
  static const std::vector<Case> normal = generate_cases(Tier::normal);
  static const std::vector<Case> full = generate_cases(Tier::full);
  return t == Tier::quick ? quick : t == Tier::normal ? normal : full;
}

const Case& case_named(const std::string& name) {
  for (const Case& c : tier(Tier::full)) {
    if (c.name == name) return c;
  }
  static const Case none{};
  return none;
}

// The reference, except for the output rows `wrong` names: there o[..., 0] is off by 0.25, far
// beyond any tolerance (or, with `unwritten`, still holds the suite's never-written poison). What
// a kernel wrong only at some sizes or rows looks like from outside.
class WrongRowsBackend final : public AttentionBackend {
 public:
  using Rule = std::function<bool(const ValidatedProblem&, std::int32_t b, std::int64_t i, std::int32_t h)>;
  explicit WrongRowsBackend(Rule wrong, bool unwritten = false) : wrong_(std::move(wrong)), unwritten_(unwritten) {}

  std::string_view name() const noexcept override { return "wrong-rows"; }
  std::string_view version() const noexcept override { return "0"; }
  DeviceKind device_kind() const noexcept override { return DeviceKind::cpu; }
  int priority() const noexcept override { return 0; }
  Support supports(const ProblemSignature& sig) const noexcept override { return reference()->supports(sig); }

  Status run(const ValidatedProblem& vp, Workspace ws) noexcept override {
    if (Status s = reference()->run(vp, ws); !s) return s;
    const TensorView& o = vp.problem().o;
    const std::int64_t o_hs = o.stride[static_cast<std::size_t>(o.rank - 2)];
    for (std::int32_t b = 0; b < vp.batch(); ++b) {
      for (std::int64_t i = 0; i < vp.seqlen_q(b); ++i) {
        for (std::int32_t h = 0; h < vp.hq(); ++h) {
          if (!wrong_(vp, b, i, h)) continue;
          const std::int64_t at = vp.o_row_offset(b, i) + h * o_hs;
          if (unwritten_) {
            detail::store_element_bits(o.data, o.dtype, at, detail::poison_bits(o.dtype));
          } else {
            store(o, at, load(o, at) + 0.25f);
          }
        }
      }
    }
    return {};
  }

 private:
  static AttentionBackend* reference() { return BackendRegistry::global().find("reference"); }
  static float load(const TensorView& t, std::int64_t n) {
    switch (t.dtype) {
      case DType::f32: return static_cast<const float*>(t.data)[n];
      case DType::f16: return f16_to_f32(static_cast<const std::uint16_t*>(t.data)[n]);
      case DType::bf16: return bf16_to_f32(static_cast<const std::uint16_t*>(t.data)[n]);
    }
    return 0.0f;
  }
  static void store(const TensorView& t, std::int64_t n, float x) {
    switch (t.dtype) {
      case DType::f32: static_cast<float*>(t.data)[n] = x; break;
      case DType::f16: static_cast<std::uint16_t*>(t.data)[n] = f32_to_f16(x); break;
      case DType::bf16: static_cast<std::uint16_t*>(t.data)[n] = f32_to_bf16(x); break;
    }
  }

  Rule wrong_;
  bool unwritten_;
};

// ---- what the tiers hold ------------------------------------------------------------------

TEST(ConformanceTiers, EachTierContainsTheOneBelow) {
  std::set<std::string> quick, normal, full;
  for (const Case& c : tier(Tier::quick)) quick.insert(c.name);
  for (const Case& c : tier(Tier::normal)) normal.insert(c.name);
  for (const Case& c : tier(Tier::full)) full.insert(c.name);
  EXPECT_EQ(quick.size(), tier(Tier::quick).size()) << "duplicate names";
  EXPECT_EQ(normal.size(), tier(Tier::normal).size()) << "duplicate names";
  EXPECT_EQ(full.size(), tier(Tier::full).size()) << "duplicate names";
  EXPECT_LT(quick.size(), normal.size());
  EXPECT_LT(normal.size(), full.size());
  EXPECT_TRUE(std::includes(normal.begin(), normal.end(), quick.begin(), quick.end()));
  EXPECT_TRUE(std::includes(full.begin(), full.end(), normal.begin(), normal.end()));
  EXPECT_EQ(tier_name(Tier::quick), "quick");
  EXPECT_EQ(tier_name(Tier::normal), "normal");
  EXPECT_EQ(tier_name(Tier::full), "full");
}

TEST(ConformanceTiers, DefaultTierCrossesEverySizeBucket) {
  // Both sides of each power-of-two key bucket the dispatcher checks a backend at, and pjrt's
  // chunk and cpu-flash's split minimum (512), for decode (<= 16 rows per KV head, cpu-flash's
  // decode path) and prefill (more).
  for (std::int32_t keys : {512, 513, 1024, 1025, 2048, 2049, 4096, 4097, 8192, 8193}) {
    bool decode = false, prefill = false, past_decode_rows = false;
    for (const Case& c : tier(Tier::normal)) {
      const CaseSpec& s = c.spec;
      if (max_keys(s) != keys) continue;
      const std::int32_t rows = max_queries(s) * (s.hq / s.hkv);
      decode |= rows <= 16;
      past_decode_rows |= rows == 17;
      prefill |= max_queries(s) > 16;
    }
    EXPECT_TRUE(decode) << keys << " keys: no decode case";
    EXPECT_TRUE(prefill) << keys << " keys: no prefill case";
    EXPECT_TRUE(past_decode_rows) << keys << " keys: no case one row past cpu-flash's decode limit";
  }
  // The quick tier stays small: nothing past 4096 keys.
  for (const Case& c : tier(Tier::quick)) EXPECT_LE(max_keys(c.spec), 4096) << c.name;
}

TEST(ConformanceTiers, FullTierReachesTheSizesThatServe) {
  bool decode_128k = false, paged_decode_128k = false, gqa_window_128k = false, decode_32k = false;
  bool long_prefill = false;
  for (const Case& c : tier(Tier::full)) {
    const CaseSpec& s = c.spec;
    const std::int32_t keys = max_keys(s), queries = max_queries(s);
    const bool window = s.window_left >= 0 || s.window_right >= 0;
    if (keys >= 32768 && queries <= 4) decode_32k = true;
    if (keys >= 131071 && queries <= 4) {
      decode_128k = true;
      paged_decode_128k |= s.kv_layout == KvLayout::paged;
      gqa_window_128k |= s.hq > s.hkv && s.hkv > 1 && window;
    }
    if (queries >= 4096 && keys >= 32768) long_prefill = true;
    // Anything beyond a few million query-key pairs is judged on sampled rows.
    double pairs = 0.0;
    for (std::size_t b = 0; b < s.seqlens_q.size(); ++b) pairs += double(s.seqlens_q[b]) * s.seqlens_k[b] * s.hq;
    if (pairs > 5e7) {
      EXPECT_GT(s.sampled_rows, 0) << c.name << " is judged whole";
    }
  }
  EXPECT_TRUE(decode_32k);
  EXPECT_TRUE(decode_128k);
  EXPECT_TRUE(paged_decode_128k);
  EXPECT_TRUE(gqa_window_128k);
  EXPECT_TRUE(long_prefill);
}

TEST(ConformanceTiers, EdgeCasesAreGeneratedFromTheFieldRanges) {
  // Every window value at the limits, on both sides, with each layout and causal on and off.
  constexpr std::int64_t i64 = std::numeric_limits<std::int64_t>::max();
  constexpr std::int64_t i32 = std::numeric_limits<std::int32_t>::max();
  for (const Tier t : {Tier::quick, Tier::normal}) {
    std::set<std::tuple<std::int64_t, std::int64_t>> pairs;
    std::set<std::tuple<int, int, bool>> layouts_at_limit;  // q layout, kv layout, causal
    bool empty_batch = false, zero_blocks = false, zero_q = false, zero_kv = false;
    for (const Case& c : tier(t)) {
      const CaseSpec& s = c.spec;
      pairs.emplace(s.window_left, s.window_right);
      if (s.window_left == i64 || s.window_right == i64)
        layouts_at_limit.emplace(int(s.q_layout), int(s.kv_layout), s.causal);
      empty_batch |= s.seqlens_q.empty();
      zero_blocks |= s.kv_layout == KvLayout::paged && s.spare_blocks == 0 && max_keys(s) == 0;
      zero_q |= !s.seqlens_q.empty() && std::count(s.seqlens_q.begin(), s.seqlens_q.end(), 0) > 0;
      zero_kv |= !s.seqlens_k.empty() && std::count(s.seqlens_k.begin(), s.seqlens_k.end(), 0) > 0;
    }
    for (std::int64_t a : {std::int64_t{-1}, std::int64_t{0}, i32, i64}) {
      for (std::int64_t b : {std::int64_t{-1}, std::int64_t{0}, i32, i64}) {
        EXPECT_TRUE(pairs.count({a, b})) << tier_name(t) << ": no case with window " << a << ":" << b;
      }
    }
    EXPECT_EQ(layouts_at_limit.size(), 6u) << tier_name(t) << ": INT64_MAX windows not on every layout x causal";
    EXPECT_TRUE(empty_batch && zero_blocks && zero_q && zero_kv) << tier_name(t);
  }
}

// ---- a backend wrong only at sizes the small cases never reach ----------------------------

TEST(ConformanceTiers, BackendWrongBeyond4096KeysFailsTheDefaultTier) {
  WrongRowsBackend wrong(
      [](const ValidatedProblem& vp, std::int32_t b, std::int64_t, std::int32_t) { return vp.seqlen_k(b) > 4096; });
  // The default tier's cases from 2k keys up (the rest cannot involve it): it must fail exactly
  // those with a sequence past 4096 keys.
  std::vector<Case> cases;
  for (const Case& c : tier(Tier::normal)) {
    if (max_keys(c.spec) >= 2048) cases.push_back(c);
  }
  const Report r = run_suite(wrong, cases);
  std::size_t beyond = 0;
  for (const CaseResult& c : r.results) {
    const bool past = max_keys(case_named(c.case_name).spec) > 4096;
    beyond += past;
    EXPECT_FALSE(c.skipped) << c.case_name;
    EXPECT_EQ(c.passed, !past) << c.case_name << ": " << c.failure;
  }
  EXPECT_GE(beyond, 8u);
  EXPECT_EQ(r.failed(), beyond);
}

TEST(ConformanceTiers, BackendWrongBeyond4096KeysFailsTheFullTiersLongDecode) {
  WrongRowsBackend wrong(
      [](const ValidatedProblem& vp, std::int32_t b, std::int64_t, std::int32_t) { return vp.seqlen_k(b) > 4096; });
  // The full tier's 128k-key decode case with the fewest keys in all, judged on sampled rows.
  const Case* big = nullptr;
  auto total_keys = [](const CaseSpec& s) {
    std::int64_t n = 0;
    for (std::int32_t k : s.seqlens_k) n += k;
    return n;
  };
  for (const Case& c : tier(Tier::full)) {
    if (max_keys(c.spec) < 131071 || max_queries(c.spec) != 1) continue;
    if (big == nullptr || total_keys(c.spec) < total_keys(big->spec)) big = &c;
  }
  ASSERT_NE(big, nullptr);
  ASSERT_GT(big->spec.sampled_rows, 0);
  const CaseResult bad = run_case(wrong, *big);
  EXPECT_FALSE(bad.passed);
  // Caught on its numbers, not by a failure to build or self-check the case.
  EXPECT_NE(bad.failure.find(": got "), std::string::npos) << bad.failure;
  EXPECT_EQ(bad.failure.find("self-check"), std::string::npos) << bad.failure;
}

// ---- the sampling machinery ---------------------------------------------------------------

CaseSpec sampled_spec() {
  CaseSpec s;
  s.dtype = DType::f32;
  s.q_layout = QLayout::packed;
  s.kv_layout = KvLayout::packed;
  s.seqlens_q = {300, 40};
  s.seqlens_k = {200, 500};
  s.hq = 4;
  s.hkv = 2;
  s.head_dim = s.head_dim_v = 16;
  s.causal = true;
  s.window_left = 50;
  s.sampled_rows = 48;
  s.lse = true;
  s.seed = 77;
  return s;
}

bool holds(const std::vector<OutputRow>& rows, std::int32_t b, std::int64_t i, std::int32_t h) {
  return std::any_of(rows.begin(), rows.end(),
                     [&](const OutputRow& r) { return r.sequence == b && r.query == i && r.head == h; });
}

TEST(ConformanceSampling, JudgedRowsHoldEdgesAndMaskBoundaries) {
  const Case c{"sampled", sampled_spec()};
  const auto data = detail::build_case_data(c);
  const std::vector<OutputRow> rows = detail::judged_rows(*data);
  // Deterministic, sorted, unique, inside the problem, and a sample rather than everything.
  EXPECT_EQ(rows.size(), detail::judged_rows(*detail::build_case_data(c)).size());
  EXPECT_LT(rows.size(), static_cast<std::size_t>(340 * 4));
  EXPECT_GE(rows.size(), 40u);
  for (std::size_t n = 0; n < rows.size(); ++n) {
    EXPECT_LT(rows[n].query, data->seqlen_q(rows[n].sequence));
    EXPECT_LT(rows[n].head, 4);
    if (n > 0) {
      const OutputRow& a = rows[n - 1];
      const OutputRow& b = rows[n];
      EXPECT_TRUE(std::tie(a.sequence, a.query, a.head) < std::tie(b.sequence, b.query, b.head));
    }
  }
  // Sequence 0 (Sq 300 > Skv 200: p_i = i - 100): the causal mask starts at i = 100, the window
  // starts cutting at i = 150. Sequence 1 (p_i = i + 460): the window cuts from the first row.
  for (std::int32_t h : {0, 3}) {
    for (std::int64_t i : {0, 99, 100, 101, 149, 150, 151, 299}) EXPECT_TRUE(holds(rows, 0, i, h)) << i << "," << h;
    for (std::int64_t i : {0, 39}) EXPECT_TRUE(holds(rows, 1, i, h)) << i << "," << h;
  }
  // Unsampled: every row.
  Case whole = c;
  whole.spec.sampled_rows = 0;
  EXPECT_EQ(detail::judged_rows(*detail::build_case_data(whole)).size(), static_cast<std::size_t>(340 * 4));
}

TEST(ConformanceSampling, CatchesWrongBoundaryRowsButNotEveryRow) {
  const Case c{"sampled", sampled_spec()};
  const std::vector<OutputRow> rows = detail::judged_rows(*detail::build_case_data(c));
  // A row the sample misses: the honest limit of sampling. A kernel wrong in that one row of
  // this case passes it; only the unsampled (smaller) cases and other seeds can catch it.
  OutputRow missed{-1, 0, 0};
  for (std::int64_t i = 0; i < 300 && missed.sequence < 0; ++i) {
    if (!holds(rows, 0, i, 1)) missed = {0, i, 1};
  }
  ASSERT_GE(missed.sequence, 0);
  WrongRowsBackend one_row([&](const ValidatedProblem&, std::int32_t b, std::int64_t i, std::int32_t h) {
    return b == missed.sequence && i == missed.query && h == missed.head;
  });
  EXPECT_TRUE(run_case(one_row, c).passed) << "expected the sampling limit: one unsampled row goes unseen";
  Case whole = c;
  whole.spec.sampled_rows = 0;
  EXPECT_FALSE(run_case(one_row, whole).passed);
  // A row at the causal boundary is always in the sample.
  WrongRowsBackend boundary([](const ValidatedProblem&, std::int32_t b, std::int64_t i, std::int32_t h) {
    return b == 0 && i == 100 && h == 3;
  });
  const CaseResult r = run_case(boundary, c);
  EXPECT_FALSE(r.passed);
  EXPECT_NE(r.failure.find("o[b=0,i=100,h=3,d=0]"), std::string::npos) << r.failure;
  // A row left unwritten is caught even when it is not sampled.
  WrongRowsBackend unwritten(
      [&](const ValidatedProblem&, std::int32_t b, std::int64_t i, std::int32_t h) {
        return b == missed.sequence && i == missed.query && h == missed.head;
      },
      true);
  const CaseResult u = run_case(unwritten, c);
  EXPECT_FALSE(u.passed);
  EXPECT_NE(u.failure.find("never written"), std::string::npos) << u.failure;
  AttentionBackend* reference = BackendRegistry::global().find("reference");
  ASSERT_NE(reference, nullptr);
  EXPECT_TRUE(run_case(*reference, c).passed);
}

}  // namespace
}  // namespace kallpa::conformance
