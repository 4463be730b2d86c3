// The conformance suite run against every registered backend, plus the properties the generator
// promises (size, unique names, coverage of every contract feature).
#include <cctype>
#include <chrono>
#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kallpa/conformance.h"
#include "kallpa/device.h"
#include "kallpa/registry.h"

namespace kallpa::conformance {
namespace {

const std::vector<Case>& full_cases() {
  static const std::vector<Case> cases = generate_cases(Tier::normal);
  return cases;
}

const std::vector<Case>& quick_cases() {
  static const std::vector<Case> cases = generate_cases(Tier::quick);
  return cases;
}

// The full matrix over the registered backends whose test this process runs, run once: every
// case's reference is computed once and shared by those backends. (ctest runs each test in its own
// process, so there it is one backend per process; a plain run of the binary shares one oracle.)
struct SuiteRun {
  std::map<std::string, Report> reports;
  double seconds = 0.0;
};

std::string param_name(const std::string& backend) {
  std::string s = backend;
  for (char& c : s) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return s;
}

bool backend_test_runs(const std::string& backend) {
  const testing::UnitTest& unit = *testing::UnitTest::GetInstance();
  const std::string wanted = "PassesFullMatrix/" + param_name(backend);
  for (int s = 0; s < unit.total_test_suite_count(); ++s) {
    const testing::TestSuite& suite = *unit.GetTestSuite(s);
    for (int t = 0; t < suite.total_test_count(); ++t) {
      const testing::TestInfo& info = *suite.GetTestInfo(t);
      if (info.should_run() && info.name() == wanted) return true;
    }
  }
  return false;
}

const SuiteRun& registered_run() {
  static const SuiteRun run = [] {
    std::vector<AttentionBackend*> backends;
    for (const BackendInfo& info : BackendRegistry::global().list()) {
      if (backend_test_runs(std::string(info.backend->name()))) backends.push_back(info.backend);
    }
    const auto start = std::chrono::steady_clock::now();
    std::vector<Report> reports = run_suites(backends, full_cases());
    SuiteRun r;
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    for (Report& report : reports) r.reports.emplace(report.backend, std::move(report));
    return r;
  }();
  return run;
}

std::vector<std::string> registered_names() {
  std::vector<std::string> names;
  for (const BackendInfo& info : BackendRegistry::global().list()) names.emplace_back(info.backend->name());
  return names;
}

class ConformanceBackend : public testing::TestWithParam<std::string> {};

TEST_P(ConformanceBackend, PassesFullMatrix) {
  // A device backend is run on its device (the suite stages each case there); without a device
  // it is not tested, and says so instead of passing.
  const AttentionBackend* backend = BackendRegistry::global().find(GetParam());
  ASSERT_NE(backend, nullptr);
  if (backend->device_kind() != DeviceKind::cpu && backend->device_memory() == nullptr) {
    ProblemSignature on_device;
    on_device.device = Device{backend->device_kind(), 0};
    GTEST_SKIP() << GetParam() << " has no device here: " << backend->supports(on_device).why_not;
  }
  const SuiteRun& run = registered_run();
  const auto it = run.reports.find(GetParam());
  ASSERT_NE(it, run.reports.end());
  const Report& report = it->second;
  ASSERT_EQ(report.results.size(), full_cases().size());
  constexpr int kShown = 40;  // enough to see a pattern, not a wall of text
  int shown = 0;
  for (const CaseResult& r : report.results) {
    if (r.skipped || r.passed) continue;
    if (shown++ < kShown) ADD_FAILURE() << r.case_name << ": " << r.failure;
  }
  EXPECT_EQ(report.failed(), 0u) << report.failed() << " of " << report.results.size() << " cases failed";
  // The oracle must accept the whole matrix: a case it declines is judged by nobody.
  if (GetParam() == "reference") {
    EXPECT_EQ(report.skipped(), 0u);
  }
  // A backend that declines most of the matrix is not tested by it, which deserves a loud line
  // even though it is allowed.
  if (report.skipped() > 0) {
    std::map<std::string, int> reasons;
    for (const CaseResult& r : report.results) {
      if (r.skipped) ++reasons[r.skip_reason];
    }
    for (const auto& [why, n] : reasons)
      std::printf("  %s skipped %d case(s): %s\n", GetParam().c_str(), n, why.c_str());
  }
  std::printf("  %s: %zu passed, %zu failed, %zu skipped, max error %.3g (suite over all backends %.1f s)\n",
              GetParam().c_str(), report.passed(), report.failed(), report.skipped(), report.max_abs_error(),
              run.seconds);
}

std::string param_label(const testing::TestParamInfo<std::string>& info) { return param_name(info.param); }

INSTANTIATE_TEST_SUITE_P(Conformance, ConformanceBackend, testing::ValuesIn(registered_names()), param_label);

// ---- the generator ------------------------------------------------------------------------

TEST(ConformanceCases, FullMatrixIsLargeWithUniqueNames) {
  EXPECT_GT(full_cases().size(), 500u);
  std::set<std::string> names;
  for (const Case& c : full_cases()) EXPECT_TRUE(names.insert(c.name).second) << "duplicate " << c.name;
  EXPECT_GE(quick_cases().size(), 150u);
  EXPECT_LT(quick_cases().size(), full_cases().size() / 2);
  std::set<std::string> quick;
  for (const Case& c : quick_cases()) EXPECT_TRUE(quick.insert(c.name).second) << "duplicate " << c.name;
}

TEST(ConformanceCases, AreDeterministic) {
  const std::vector<Case> again = generate_cases(Tier::normal);
  ASSERT_EQ(again.size(), full_cases().size());
  for (std::size_t n = 0; n < again.size(); ++n) {
    EXPECT_EQ(again[n].name, full_cases()[n].name);
    EXPECT_EQ(again[n].spec.seed, full_cases()[n].spec.seed);
  }
}

// What both matrices must contain, as facts read off the generated specs.
struct Coverage {
  std::set<DType> dtypes;
  std::set<Edge> edges;
  std::set<std::pair<QLayout, KvLayout>> layouts;
  std::set<std::int32_t> head_dims, page_sizes, lengths, gqa_ratios;
  bool dv_differs = false, mqa = false, softcap = false, alibi = false, lse_on = false, lse_off = false;
  bool padded = false, empty_q = false, empty_kv = false, sq_gt_skv_causal = false, ragged_sq_ne_skv = false;
  bool long_kv = false, decode_long = false, chunked_prefill = false, table_stride_pad = false;
  bool window_left_only = false, window_right_only = false, window_both = false, causal_window = false;
  bool custom_scale = false, q_tail = false, kv_tail = false;
};

Coverage coverage_of(const std::vector<Case>& cases) {
  Coverage c;
  for (const Case& k : cases) {
    const CaseSpec& s = k.spec;
    c.dtypes.insert(s.dtype);
    c.edges.insert(s.edge);
    c.layouts.insert({s.q_layout, s.kv_layout});
    c.head_dims.insert(s.head_dim);
    if (s.kv_layout == KvLayout::paged) c.page_sizes.insert(s.page_size);
    c.gqa_ratios.insert(s.hq / s.hkv);
    c.dv_differs |= s.head_dim != s.head_dim_v;
    c.mqa |= s.hkv == 1 && s.hq > 1;
    c.softcap |= s.softcap > 0.0f;
    c.alibi |= s.alibi;
    c.lse_on |= s.lse;
    c.lse_off |= !s.lse;
    c.padded |= s.padded_strides;
    c.custom_scale |= s.scale.has_value();
    c.q_tail |= s.q_tail_rows > 0;
    c.kv_tail |= s.kv_tail_rows > 0;
    c.table_stride_pad |= s.table_stride_pad > 0;
    const bool wl = s.window_left >= 0, wr = s.window_right >= 0;
    c.window_left_only |= wl && !wr && !s.causal;
    c.window_right_only |= wr && !wl && !s.causal;
    c.window_both |= wl && wr;
    c.causal_window |= s.causal && wl;
    for (std::size_t b = 0; b < s.seqlens_q.size(); ++b) {
      const std::int32_t sq = s.seqlens_q[b], skv = s.seqlens_k[b];
      c.lengths.insert(sq);
      c.lengths.insert(skv);
      c.empty_q |= sq == 0;
      c.empty_kv |= skv == 0;
      c.sq_gt_skv_causal |= s.causal && sq > skv;
      c.ragged_sq_ne_skv |= s.q_layout == QLayout::packed && s.seqlens_q.size() > 1 && sq != skv && sq > 0;
      c.long_kv |= skv >= 1000;
      c.decode_long |= sq == 1 && skv >= 1000;
      c.chunked_prefill |= sq > 1 && sq < skv;
    }
  }
  return c;
}

void expect_covers_contract(const std::vector<Case>& cases) {
  const Coverage c = coverage_of(cases);
  EXPECT_EQ(c.dtypes, (std::set<DType>{DType::f32, DType::f16, DType::bf16}));
  EXPECT_EQ(c.edges, (std::set<Edge>{Edge::none, Edge::all_masked, Edge::huge_logits, Edge::neg_inf_keys,
                                     Edge::all_neg_inf_row, Edge::nan_in_q, Edge::nan_in_masked_kv}));
  for (QLayout q : {QLayout::dense, QLayout::packed}) {
    EXPECT_TRUE(c.layouts.count({q, KvLayout::packed}) && c.layouts.count({q, KvLayout::paged}))
        << "q layout " << q_layout_name(q);
  }
  EXPECT_TRUE(c.layouts.count({QLayout::dense, KvLayout::dense}));
  for (std::int32_t d : {8, 40, 64, 80, 96, 112, 128, 160, 256}) EXPECT_TRUE(c.head_dims.count(d)) << "head dim " << d;
  for (std::int32_t p : {1, 7, 16, 256}) EXPECT_TRUE(c.page_sizes.count(p)) << "page size " << p;
  for (std::int32_t l : {1, 2, 7, 63, 64, 65, 127, 129}) EXPECT_TRUE(c.lengths.count(l)) << "length " << l;
  for (std::int32_t r : {1, 3, 8}) EXPECT_TRUE(c.gqa_ratios.count(r)) << "GQA ratio " << r;
  EXPECT_TRUE(c.dv_differs);
  EXPECT_TRUE(c.mqa);
  EXPECT_TRUE(c.softcap);
  EXPECT_TRUE(c.alibi);
  EXPECT_TRUE(c.lse_on && c.lse_off);
  EXPECT_TRUE(c.padded);
  EXPECT_TRUE(c.custom_scale);
  EXPECT_TRUE(c.empty_q && c.empty_kv);
  EXPECT_TRUE(c.sq_gt_skv_causal);
  EXPECT_TRUE(c.ragged_sq_ne_skv);
  EXPECT_TRUE(c.long_kv && c.decode_long && c.chunked_prefill);
  EXPECT_TRUE(c.table_stride_pad);
  EXPECT_TRUE(c.window_left_only && c.window_right_only && c.window_both && c.causal_window);
  EXPECT_TRUE(c.q_tail && c.kv_tail);
}

TEST(ConformanceCases, FullMatrixCoversTheContract) { expect_covers_contract(full_cases()); }
TEST(ConformanceCases, QuickMatrixCoversTheContract) { expect_covers_contract(quick_cases()); }

// Every paged case hands out its blocks out of order, or the page-lookup bug would go unseen.
TEST(ConformanceCases, PagedBlockTablesArePermuted) {
  for (const Case& c : full_cases()) {
    if (c.spec.kv_layout == KvLayout::paged) {
      EXPECT_TRUE(c.spec.permute_blocks) << c.name;
    }
  }
}

// The single-case API gives the same verdict as the shared-reference path.
TEST(ConformanceSuite, RunCaseMatchesRunSuite) {
  AttentionBackend* ref = BackendRegistry::global().find("reference");
  ASSERT_NE(ref, nullptr);
  const std::vector<Case> some(quick_cases().begin(), quick_cases().begin() + 5);
  const Report report = run_suite(*ref, some);
  ASSERT_EQ(report.results.size(), some.size());
  for (std::size_t n = 0; n < some.size(); ++n) {
    const CaseResult r = run_case(*ref, some[n]);
    EXPECT_EQ(r.case_name, some[n].name);
    EXPECT_EQ(r.passed, report.results[n].passed) << r.failure;
    EXPECT_EQ(r.max_abs_error, report.results[n].max_abs_error);
  }
}

}  // namespace
}  // namespace kallpa::conformance
