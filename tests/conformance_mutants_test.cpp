// The suite must catch bugs, not just pass good backends. A plain-loop backend written over the
// contract (and ValidatedProblem's accessors) with one deliberate bug at a time: each bug must
// make the quick matrix fail, only on cases that exercise the feature it breaks, while the
// bug-free version passes every case.
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kallpa/backend.h"
#include "kallpa/conformance.h"
#include "kallpa/half.h"

namespace kallpa::conformance {
namespace {

enum class Bug {
  none,
  causal_off_by_one,   // sees one key into the future
  gqa_modulo,          // query head h reads KV head h % Hkv instead of h / group
  stray_write,         // writes one element past the last output row
  nan_on_masked_rows,  // 0/0 for rows with no visible key instead of the contract's zero row
  ignore_block_table,  // reads pages in pool order, as if the block table were the identity
  window_off_by_one,   // window_left one key too wide
  no_lse,              // forgets the logsumexp output
  ignore_softcap,
  ignore_alibi,
  top_left_causal,      // PyTorch's is_causal alignment instead of bottom-right
  reads_masked_keys,    // weights masked keys by 0 but still multiplies their values in
  bf16_accumulator,     // accumulates P.V in bf16
  nan_on_neg_inf_rows,  // all-(-inf) rows give exp(-inf - -inf) = NaN
  wrong_lse_base,       // log2 instead of the natural log
  write_before_output,  // writes the element before the first output row
  scales_q_in_place,    // "optimises" by scaling q in the caller's buffer
  workspace_overflow,   // asks for 64 bytes of workspace and uses 65
  refuses,              // declines every problem: must be skipped, not failed
  run_fails,            // supports everything, then returns an error from run()
  window_overflow,      // p_i +/- window in plain int64 arithmetic: wraps for windows near INT64_MAX
};

const std::map<Bug, std::string>& bug_names() {
  static const std::map<Bug, std::string> names = {
      {Bug::none, "none"},
      {Bug::causal_off_by_one, "causal_off_by_one"},
      {Bug::gqa_modulo, "gqa_modulo"},
      {Bug::stray_write, "stray_write"},
      {Bug::nan_on_masked_rows, "nan_on_masked_rows"},
      {Bug::ignore_block_table, "ignore_block_table"},
      {Bug::window_off_by_one, "window_off_by_one"},
      {Bug::no_lse, "no_lse"},
      {Bug::ignore_softcap, "ignore_softcap"},
      {Bug::ignore_alibi, "ignore_alibi"},
      {Bug::top_left_causal, "top_left_causal"},
      {Bug::reads_masked_keys, "reads_masked_keys"},
      {Bug::bf16_accumulator, "bf16_accumulator"},
      {Bug::nan_on_neg_inf_rows, "nan_on_neg_inf_rows"},
      {Bug::wrong_lse_base, "wrong_lse_base"},
      {Bug::write_before_output, "write_before_output"},
      {Bug::scales_q_in_place, "scales_q_in_place"},
      {Bug::workspace_overflow, "workspace_overflow"},
      {Bug::refuses, "refuses"},
      {Bug::run_fails, "run_fails"},
      {Bug::window_overflow, "window_overflow"},
  };
  return names;
}

float load(const TensorView& t, std::int64_t index) {
  switch (t.dtype) {
    case DType::f32: return static_cast<const float*>(t.data)[index];
    case DType::f16: return f16_to_f32(static_cast<const std::uint16_t*>(t.data)[index]);
    case DType::bf16: return bf16_to_f32(static_cast<const std::uint16_t*>(t.data)[index]);
  }
  return 0.0f;
}

void store(const TensorView& t, std::int64_t index, float value) {
  switch (t.dtype) {
    case DType::f32: static_cast<float*>(t.data)[index] = value; break;
    case DType::f16: static_cast<std::uint16_t*>(t.data)[index] = f32_to_f16(value); break;
    case DType::bf16: static_cast<std::uint16_t*>(t.data)[index] = f32_to_bf16(value); break;
  }
}

std::int64_t stride(const TensorView& t, int from_end) { return t.stride[static_cast<std::size_t>(t.rank - from_end)]; }

// A straightforward float implementation of the contract, two passes per row.
class MutantBackend final : public AttentionBackend {
 public:
  explicit MutantBackend(Bug bug) : bug_(bug), name_("mutant-" + bug_names().at(bug)) {}

  std::string_view name() const noexcept override { return name_; }
  std::string_view version() const noexcept override { return "0"; }
  DeviceKind device_kind() const noexcept override { return DeviceKind::cpu; }
  int priority() const noexcept override { return 0; }
  Support supports(const ProblemSignature&) const noexcept override {
    if (bug_ == Bug::refuses) return Support::no("this mutant declines everything");
    return Support::yes();
  }

  std::size_t workspace_size(const ValidatedProblem&) const noexcept override {
    return bug_ == Bug::workspace_overflow ? 64 : 0;
  }

  Status run(const ValidatedProblem& vp, Workspace ws) noexcept override {
    if (bug_ == Bug::run_fails) return Status(ErrorCode::backend_failure, "mutant", "deliberate failure");
    if (bug_ == Bug::workspace_overflow) static_cast<unsigned char*>(ws.data)[ws.bytes] = 1;
    const AttentionProblem& p = vp.problem();
    const float neg_inf = -std::numeric_limits<float>::infinity();
    const std::int64_t hq = vp.hq(), d = vp.head_dim(), dv = vp.head_dim_v();
    const std::int64_t q_hs = stride(p.q, 2), q_ds = stride(p.q, 1), k_hs = stride(p.k, 2), k_ds = stride(p.k, 1);
    const std::int64_t v_hs = stride(p.v, 2), v_ds = stride(p.v, 1), o_hs = stride(p.o, 2), o_ds = stride(p.o, 1);
    std::vector<float> s, acc(static_cast<std::size_t>(dv)), qrow(static_cast<std::size_t>(d));
    std::int64_t last_o = -1;
    std::int64_t pool_base = 0;  // ignore_block_table: where this sequence's pages "would" start
    for (std::int32_t b = 0; b < vp.batch(); ++b) {
      const std::int64_t sq = vp.seqlen_q(b), skv = vp.seqlen_k(b);
      for (std::int64_t i = 0; i < sq; ++i) {
        const std::int64_t pos = bug_ == Bug::top_left_causal ? i : i + skv - sq;
        std::int64_t first = 0, last = skv - 1;
        if (p.causal) last = std::min(last, pos + (bug_ == Bug::causal_off_by_one ? 1 : 0));
        // The saturated bounds (attention.h); window_overflow takes the raw ones and wraps as
        // two's complement hardware does (written with unsigned arithmetic: no UB here).
        const bool raw = bug_ == Bug::window_overflow;
        const std::int64_t wl = raw ? p.window_left : vp.window_left();
        const std::int64_t wr = raw ? p.window_right : vp.window_right();
        const auto wrap = [](std::uint64_t x) { return static_cast<std::int64_t>(x); };
        if (wr >= 0) last = std::min(last, wrap(static_cast<std::uint64_t>(pos) + static_cast<std::uint64_t>(wr)));
        if (wl >= 0) {
          first = std::max(first, wrap(static_cast<std::uint64_t>(pos) - static_cast<std::uint64_t>(wl)) -
                                      (bug_ == Bug::window_off_by_one ? 1 : 0));
        }
        const std::int64_t lo = bug_ == Bug::reads_masked_keys ? 0 : first;
        const std::int64_t hi = bug_ == Bug::reads_masked_keys ? skv - 1 : last;
        for (std::int64_t h = 0; h < hq; ++h) {
          const std::int64_t kvh = bug_ == Bug::gqa_modulo ? h % vp.hkv() : h / vp.group_size();
          const std::int64_t qb = vp.q_row_offset(b, i) + h * q_hs;
          for (std::int64_t c = 0; c < d; ++c) qrow[static_cast<std::size_t>(c)] = load(p.q, qb + c * q_ds);
          s.clear();
          float m = neg_inf;
          for (std::int64_t j = lo; j <= hi; ++j) {
            const std::int64_t kb = k_row(vp, b, j, pool_base) + kvh * k_hs;
            float dot = 0.0f;
            for (std::int64_t c = 0; c < d; ++c) dot += qrow[static_cast<std::size_t>(c)] * load(p.k, kb + c * k_ds);
            float x = dot * vp.scale();
            if (p.softcap > 0.0f && bug_ != Bug::ignore_softcap) x = p.softcap * std::tanh(x / p.softcap);
            if (p.alibi_slopes && bug_ != Bug::ignore_alibi)
              x -= p.alibi_slopes[h] * static_cast<float>(std::llabs(pos - j));
            s.push_back(x);
            if (j >= first && j <= last && (x > m || std::isnan(x))) m = std::isnan(m) ? m : x;
          }
          const bool empty = first > last;
          const bool all_neg_inf = !empty && m == neg_inf;
          float sum = 0.0f;
          for (float& acc_c : acc) acc_c = 0.0f;
          const bool zero_row =
              (empty && bug_ != Bug::nan_on_masked_rows) || (all_neg_inf && bug_ != Bug::nan_on_neg_inf_rows);
          if (!zero_row) {
            for (std::int64_t j = lo; j <= hi; ++j) {
              const bool visible = j >= first && j <= last;
              const float e = visible ? std::exp(s[static_cast<std::size_t>(j - lo)] - m) : 0.0f;
              sum += e;
              const std::int64_t vb = v_row(vp, b, j, pool_base) + kvh * v_hs;
              for (std::int64_t c = 0; c < dv; ++c) {
                float& a = acc[static_cast<std::size_t>(c)];
                a += e * load(p.v, vb + c * v_ds);
                if (bug_ == Bug::bf16_accumulator) a = bf16_to_f32(f32_to_bf16(a));
              }
            }
            if (empty) sum = 0.0f;  // nan_on_masked_rows: 0/0 below
          }
          const std::int64_t ob = vp.o_row_offset(b, i) + h * o_hs;
          for (std::int64_t c = 0; c < dv; ++c) {
            last_o = ob + c * o_ds;
            store(p.o, last_o, zero_row ? 0.0f : acc[static_cast<std::size_t>(c)] / sum);
          }
          if (p.lse.present() && bug_ != Bug::no_lse) {
            float lse = zero_row ? neg_inf : m + std::log(sum);
            if (bug_ == Bug::wrong_lse_base && !zero_row) lse = m + std::log2(sum);
            static_cast<float*>(p.lse.data)[vp.lse_offset(b, static_cast<std::int32_t>(h), i)] = lse;
          }
        }
      }
      if (p.kv_layout == KvLayout::paged) pool_base += (skv + vp.signature().page_size - 1) / vp.signature().page_size;
    }
    if (bug_ == Bug::stray_write && last_o >= 0) store(p.o, last_o + o_ds, 0.0f);
    if (bug_ == Bug::write_before_output) store(p.o, -1, 0.0f);
    if (bug_ == Bug::scales_q_in_place) store(p.q, 0, load(p.q, 0) * vp.scale());
    return {};
  }

 private:
  std::int64_t k_row(const ValidatedProblem& vp, std::int32_t b, std::int64_t j, std::int64_t pool_base) const {
    if (bug_ == Bug::ignore_block_table && vp.problem().kv_layout == KvLayout::paged)
      return pool_row(vp.problem().k, vp, j, pool_base);
    return vp.k_row_offset(b, j);
  }
  std::int64_t v_row(const ValidatedProblem& vp, std::int32_t b, std::int64_t j, std::int64_t pool_base) const {
    if (bug_ == Bug::ignore_block_table && vp.problem().kv_layout == KvLayout::paged)
      return pool_row(vp.problem().v, vp, j, pool_base);
    return vp.v_row_offset(b, j);
  }
  // Blocks taken in pool order, sequence after sequence: right only for an identity table.
  static std::int64_t pool_row(const TensorView& t, const ValidatedProblem& vp, std::int64_t j,
                               std::int64_t pool_base) {
    const std::int64_t page = vp.signature().page_size;
    const std::int64_t block = (pool_base + j / page) % t.shape[0];
    return block * t.stride[0] + (j % page) * t.stride[1];
  }

  Bug bug_;
  std::string name_;
};

// What a failing case must have for the bug to matter there (no false alarms elsewhere).
using Relevant = std::function<bool(const CaseSpec&)>;

struct Expectation {
  Bug bug;
  Relevant relevant;
  std::string message;  // a failure of this bug must say this somewhere
};

// gtest prints parameters in test listings; the bug's name says it all.
void PrintTo(const Expectation& e, std::ostream* os) { *os << bug_names().at(e.bug); }

bool has_window(const CaseSpec& s) { return s.window_left >= 0 || s.window_right >= 0; }

const std::vector<Expectation>& expectations() {
  static const std::vector<Expectation> list = {
      {Bug::causal_off_by_one, [](const CaseSpec& s) { return s.causal; }, ""},
      {Bug::gqa_modulo, [](const CaseSpec& s) { return s.hkv > 1 && s.hq > s.hkv; }, ""},
      {Bug::stray_write, nullptr, "out-of-bounds write"},
      {Bug::nan_on_masked_rows, nullptr, "NaN where the reference is finite"},
      {Bug::ignore_block_table, [](const CaseSpec& s) { return s.kv_layout == KvLayout::paged; }, ""},
      {Bug::window_off_by_one, [](const CaseSpec& s) { return s.window_left >= 0; }, ""},
      {Bug::no_lse, [](const CaseSpec& s) { return s.lse; }, "never written"},
      {Bug::ignore_softcap, [](const CaseSpec& s) { return s.softcap > 0.0f; }, ""},
      {Bug::ignore_alibi, [](const CaseSpec& s) { return s.alibi; }, ""},
      {Bug::top_left_causal, [](const CaseSpec& s) { return s.causal || has_window(s) || s.alibi; }, ""},
      {Bug::reads_masked_keys, nullptr, ""},
      {Bug::bf16_accumulator, nullptr, ""},
      {Bug::nan_on_neg_inf_rows,
       [](const CaseSpec& s) { return s.edge == Edge::all_neg_inf_row || s.edge == Edge::neg_inf_keys; }, "NaN where"},
      {Bug::wrong_lse_base, [](const CaseSpec& s) { return s.lse; }, "lse["},
      {Bug::run_fails, nullptr, "run() failed"},
      {Bug::write_before_output, nullptr, "guard before the view"},
      {Bug::scales_q_in_place, nullptr, "modified its input q"},
      {Bug::workspace_overflow, nullptr, "past the end of the workspace"},
      {Bug::window_overflow,
       [](const CaseSpec& s) {
         constexpr std::int64_t near_limit = std::numeric_limits<std::int64_t>::max() - 64;
         return s.window_left >= near_limit || s.window_right >= near_limit;
       },
       ""},
  };
  return list;
}

const std::vector<Case>& quick_cases() {
  static const std::vector<Case> cases = generate_cases(Tier::quick);
  return cases;
}

// Whether this process runs a test that needs the mutant with `bug` (ctest runs one test per
// process; a plain run of the binary runs them all).
bool mutant_needed(Bug bug) {
  const testing::UnitTest& unit = *testing::UnitTest::GetInstance();
  const std::string& name = bug_names().at(bug);
  for (int s = 0; s < unit.total_test_suite_count(); ++s) {
    const testing::TestSuite& suite = *unit.GetTestSuite(s);
    for (int t = 0; t < suite.total_test_count(); ++t) {
      const testing::TestInfo& info = *suite.GetTestInfo(t);
      if (!info.should_run()) continue;
      const std::string test = info.name();
      if (test == "IsCaughtOnlyWhereItMatters/" + name) return true;
      if (bug == Bug::none && test == "BugFreeMutantPassesEveryCase") return true;
      if (bug == Bug::stray_write && test == "StrayWritesAreLocated") return true;
      if (bug == Bug::refuses && test == "DecliningBackendIsSkippedNotFailed") return true;
    }
  }
  return false;
}

// The needed mutants over the quick matrix in one pass, so each case's reference is computed once.
const std::map<Bug, Report>& mutant_reports() {
  static const std::map<Bug, Report> reports = [] {
    std::vector<std::unique_ptr<MutantBackend>> owned;
    std::vector<AttentionBackend*> backends;
    std::vector<Bug> order;
    for (const auto& [bug, name] : bug_names()) {
      if (!mutant_needed(bug)) continue;
      owned.push_back(std::make_unique<MutantBackend>(bug));
      backends.push_back(owned.back().get());
      order.push_back(bug);
    }
    std::vector<Report> list = run_suites(backends, quick_cases());
    std::map<Bug, Report> out;
    for (std::size_t n = 0; n < order.size(); ++n) out.emplace(order[n], std::move(list[n]));
    return out;
  }();
  return reports;
}

const Case& case_named(const std::string& name) {
  for (const Case& c : quick_cases()) {
    if (c.name == name) return c;
  }
  static const Case none{};
  return none;
}

TEST(ConformanceMutants, BugFreeMutantPassesEveryCase) {
  const Report& r = mutant_reports().at(Bug::none);
  for (const CaseResult& c : r.results) EXPECT_TRUE(c.passed) << c.case_name << ": " << c.failure;
  EXPECT_EQ(r.skipped(), 0u);
  EXPECT_EQ(r.passed(), quick_cases().size());
}

class ConformanceMutantBug : public testing::TestWithParam<Expectation> {};

TEST_P(ConformanceMutantBug, IsCaughtOnlyWhereItMatters) {
  const Expectation& e = GetParam();
  const Report& r = mutant_reports().at(e.bug);
  EXPECT_GT(r.failed(), 0u) << "the suite did not notice " << bug_names().at(e.bug);
  bool message_seen = e.message.empty();
  for (const CaseResult& c : r.results) {
    if (c.passed || c.skipped) continue;
    message_seen |= c.failure.find(e.message) != std::string::npos;
    if (e.relevant) {
      EXPECT_TRUE(e.relevant(case_named(c.case_name).spec))
          << bug_names().at(e.bug) << " failed a case that does not exercise it: " << c.case_name << ": " << c.failure;
    }
  }
  EXPECT_TRUE(message_seen) << "no failure of " << bug_names().at(e.bug) << " mentions \"" << e.message << "\"";
}

std::string expectation_name(const testing::TestParamInfo<Expectation>& info) { return bug_names().at(info.param.bug); }

INSTANTIATE_TEST_SUITE_P(Conformance, ConformanceMutantBug, testing::ValuesIn(expectations()), expectation_name);

// The guards say where a stray write landed: past a contiguous output, or in the padding between
// rows of a padded one.
TEST(ConformanceMutants, StrayWritesAreLocated) {
  bool after = false, gap = false;
  for (const CaseResult& c : mutant_reports().at(Bug::stray_write).results) {
    after |= c.failure.find("out-of-bounds write at o: guard after the view") != std::string::npos;
    gap |= c.failure.find("out-of-bounds write at o: stride gap") != std::string::npos;
  }
  EXPECT_TRUE(after);
  EXPECT_TRUE(gap);
}

TEST(ConformanceMutants, DecliningBackendIsSkippedNotFailed) {
  const Report& r = mutant_reports().at(Bug::refuses);
  EXPECT_EQ(r.skipped(), quick_cases().size());
  EXPECT_EQ(r.failed(), 0u);
  ASSERT_FALSE(r.results.empty());
  EXPECT_EQ(r.results.front().skip_reason, "this mutant declines everything");
}

// A backend spread over processes whose peer dies (the ring) answers every call after that with
// ErrorCode::backend_lost: the suite runs no later case on it, while the other backends go on.
class LosesItsPeer final : public AttentionBackend {
 public:
  explicit LosesItsPeer(int good_calls) : good_calls_(good_calls) {}
  std::string_view name() const noexcept override { return "loses-its-peer"; }
  std::string_view version() const noexcept override { return "0"; }
  DeviceKind device_kind() const noexcept override { return DeviceKind::cpu; }
  int priority() const noexcept override { return 0; }
  Support supports(const ProblemSignature& sig) const noexcept override { return inner_.supports(sig); }
  std::size_t workspace_size(const ValidatedProblem& vp) const noexcept override { return inner_.workspace_size(vp); }
  Status run(const ValidatedProblem& vp, Workspace ws) noexcept override {
    ++calls_;
    if (calls_ > good_calls_) return Status(ErrorCode::backend_lost, "peer", "rank 1 died or stalls");
    return inner_.run(vp, ws);
  }
  int calls() const { return calls_; }

 private:
  MutantBackend inner_{Bug::none};
  int good_calls_;
  int calls_ = 0;
};

TEST(ConformanceSuite, LostBackendRunsNoLaterCase) {
  const std::vector<Case> cases(quick_cases().begin(), quick_cases().begin() + 10);
  MutantBackend good(Bug::none);
  LosesItsPeer lossy(3);
  const std::vector<Report> reports = run_suites({&lossy, &good}, cases);
  EXPECT_EQ(lossy.calls(), 4);
  const Report& r = reports[0];
  ASSERT_EQ(r.results.size(), 4u);
  EXPECT_EQ(r.passed(), 3u);
  EXPECT_EQ(r.failed(), 1u);
  EXPECT_TRUE(r.results.back().lost);
  EXPECT_NE(r.results.back().failure.find("backend_lost"), std::string::npos) << r.results.back().failure;
  EXPECT_EQ(r.not_run, 6u);
  EXPECT_EQ(reports[1].passed(), 10u);
  EXPECT_EQ(reports[1].not_run, 0u);

  LosesItsPeer alone(0);
  const Report only = run_suite(alone, cases);
  EXPECT_EQ(alone.calls(), 1);
  EXPECT_EQ(only.results.size(), 1u);
  EXPECT_EQ(only.not_run, 9u);
}

}  // namespace
}  // namespace kallpa::conformance
