// `kallpa conformance`: the conformance suite against one or more backends, at one of three tiers
// (default: every size bucket the backends switch at; --quick; --full). The last line of the
// output is always "N passed, M failed" (", K skipped" when any were), and the exit status is
// non-zero when any case failed.
#include <algorithm>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli.h"
#include "kallpa/conformance.h"
#include "output.h"

namespace kallpa::cli {
namespace {

struct ConformanceOptions {
  std::vector<std::string> backends;  // empty: every registered backend
  std::vector<std::string> filters;   // keep cases whose name contains any of these
  bool quick = false;
  bool full = false;
  bool json = false;
  bool verbose = false;
  bool list = false;
};

nlohmann::json to_json(const conformance::CaseResult& r) {
  return {{"backend", r.backend},
          {"case", r.case_name},
          {"max_error", r.max_abs_error},
          {"allowed", r.allowed_error},
          {"passed", r.passed},
          {"skipped", r.skipped},
          {"lost", r.lost},
          {"reason", r.skipped ? r.skip_reason : r.failure}};
}

void print_case(const conformance::CaseResult& r) {
  if (r.skipped) {
    fmt::print("skip  {} {}: {}\n", r.backend, r.case_name, r.skip_reason);
  } else if (r.passed) {
    fmt::print("pass  {} {}: max error {} (allowed {})\n", r.backend, r.case_name, format_error(r.max_abs_error),
               format_error(r.allowed_error));
  } else {
    fmt::print("FAIL  {} {}: {} (max error {}, allowed {})\n", r.backend, r.case_name, r.failure,
               format_error(r.max_abs_error), format_error(r.allowed_error));
  }
  std::fflush(stdout);
}

int run_conformance(const ConformanceOptions& options) {
  BackendRegistry& registry = BackendRegistry::global();
  std::vector<AttentionBackend*> targets;
  if (options.backends.empty()) {
    for (const BackendInfo& info : registry.list()) targets.push_back(info.backend);
  } else {
    for (const std::string& name : options.backends) {
      if (Status s = registry.require(name, "--backend"); !s) {
        print_error("", s);
        return kExitUsage;
      }
      AttentionBackend* b = registry.find(name);
      if (std::find(targets.begin(), targets.end(), b) == targets.end()) targets.push_back(b);
    }
  }
  if (targets.empty()) {
    print_error("", Status(ErrorCode::not_found, "--backend", "no backends are registered"));
    return kExitUsage;
  }

  const conformance::Tier tier =
      options.quick ? conformance::Tier::quick : (options.full ? conformance::Tier::full : conformance::Tier::normal);
  std::vector<conformance::Case> cases = conformance::generate_cases(tier);
  if (!options.filters.empty()) {
    std::erase_if(cases, [&](const conformance::Case& c) {
      return std::none_of(options.filters.begin(), options.filters.end(),
                          [&](const std::string& f) { return c.name.find(f) != std::string::npos; });
    });
  }
  if (options.list) {
    for (const auto& c : cases) fmt::print("{}\n", c.name);
    fmt::print(stderr, "{} case(s)\n", cases.size());
    return kExitOk;
  }

  // In --json mode stdout carries only the JSON document; everything for people goes to stderr.
  std::FILE* text = options.json ? stderr : stdout;
  // run_suites builds each case and its reference once and holds every backend to it.
  auto progress = [&](const conformance::CaseResult& r) {
    if (!options.json && (options.verbose || (!r.passed && !r.skipped))) print_case(r);
  };
  std::vector<conformance::Report> reports = conformance::run_suites(targets, cases, progress);
  nlohmann::json results = nlohmann::json::array();
  for (std::size_t i = 0; i < reports.size(); ++i) {
    if (reports[i].backend.empty()) reports[i].backend = targets[i]->name();
    if (options.json) {
      for (const auto& r : reports[i].results) results.push_back(to_json(r));
    }
  }

  if (options.json) fmt::print("{}\n", results.dump(2));

  std::size_t passed = 0, failed = 0, skipped = 0;
  Table table({{"backend"},
               {"cases", Table::Align::right},
               {"passed", Table::Align::right},
               {"failed", Table::Align::right},
               {"skipped", Table::Align::right},
               {"max error", Table::Align::right}});
  for (const conformance::Report& r : reports) {
    passed += r.passed();
    failed += r.failed();
    skipped += r.skipped();
    table.add_row({r.backend, std::to_string(r.results.size()), std::to_string(r.passed()), std::to_string(r.failed()),
                   std::to_string(r.skipped()), format_error(r.max_abs_error())});
  }
  fmt::print(text, "\n");
  table.print(text);
  std::size_t not_run = 0;
  for (const conformance::Report& r : reports) {
    if (r.not_run == 0) continue;
    not_run += r.not_run;
    fmt::print(text, "{}: lost on '{}'; its {} later case(s) were not run\n", r.backend, r.results.back().case_name,
               r.not_run);
  }
  std::string summary = fmt::format("{} passed, {} failed", passed, failed);
  if (skipped > 0) summary += fmt::format(", {} skipped", skipped);
  if (not_run > 0) summary += fmt::format(", {} not run", not_run);
  fmt::print(text, "{}\n", summary);
  return failed == 0 ? kExitOk : kExitFailure;
}

}  // namespace

Command add_conformance_command(CLI::App& app) {
  auto options = std::make_shared<ConformanceOptions>();
  CLI::App* sub =
      app.add_subcommand("conformance", "Run the conformance suite against backends (default: every registered one)");
  sub->add_option("--backend,-b", options->backends, "Backend to test (repeatable)")->type_name("NAME");
  CLI::Option* quick =
      sub->add_flag("--quick", options->quick,
                    "The quick tier: the pairwise matrix once, edge rules, degenerate shapes, window limits "
                    "(CI under sanitizers)");
  sub->add_flag("--full", options->full,
                "The full tier: the default tier plus 32k/128k-key decode and long prefill, judged on "
                "sampled rows (minutes per backend)")
      ->excludes(quick);
  sub->add_option("--filter", options->filters, "Only cases whose name contains TEXT (repeatable: any of them)")
      ->type_name("TEXT");
  sub->add_flag("--json", options->json, "Results as a JSON array on stdout (summary and table go to stderr)");
  sub->add_flag("--verbose,-v", options->verbose, "Print every case, not only failures");
  sub->add_flag("--list", options->list, "List the selected case names and exit");
  return {sub, [options](const GlobalOptions&) { return run_conformance(*options); }};
}

}  // namespace kallpa::cli
