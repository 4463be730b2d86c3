// `kallpa backends`: what is registered, and (--explain SPEC) what each backend says about a problem.
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli.h"
#include "kallpa/problem_spec.h"
#include "output.h"

namespace kallpa::cli {
namespace {

struct BackendsOptions {
  bool json = false;
  std::string explain;  // a problem spec; empty: list backends
};

int list_backends(const BackendsOptions& options) {
  BackendRegistry& registry = BackendRegistry::global();
  // What a dispatcher would do before its first choice: the canary health check (health.h).
  registry.ensure_checked();
  const std::vector<BackendInfo> backends = registry.list();
  const HealthCounters counters = registry.health_counters();
  // The quarantine journal's records of each backend (this build and earlier ones), oldest first.
  std::vector<JournalRecord> history;
  if (const auto journal = registry.journal()) history = journal->read();
  auto history_of = [&](const AttentionBackend& b) {
    std::vector<const JournalRecord*> out;
    for (const JournalRecord& r : history) {
      if (r.backend == b.name()) out.push_back(&r);
    }
    return out;
  };
  if (options.json) {
    nlohmann::json out = nlohmann::json::array();
    for (const BackendInfo& info : backends) {
      const AttentionBackend& b = *info.backend;
      nlohmann::json published = nlohmann::json::object();
      for (const BackendCounter& c : b.counters()) published[c.name] = c.value;
      const VerificationCounters& v = info.verification;
      nlohmann::json journal = nlohmann::json::array();
      for (const JournalRecord* r : history_of(b)) {
        journal.push_back({{"event", r->event},
                           {"identity", r->identity},
                           {"scope", r->scope},
                           {"source", r->source},
                           {"reason", r->reason},
                           {"time", r->time}});
      }
      out.push_back({{"name", b.name()},
                     {"identity", b.identity()},
                     {"device", device_kind_name(b.device_kind())},
                     {"version", b.version()},
                     {"priority", b.priority()},
                     {"health", health_name(info.health)},
                     {"health_reason", info.health_reason},
                     {"run_failures", info.run_failures},
                     {"description", b.description()},
                     {"counters", published},
                     {"verification",
                      {{"first_use_checks", v.first_use_checks},
                       {"first_use_mismatches", v.first_use_mismatches},
                       {"first_use_seconds", v.first_use_seconds},
                       {"shadow_checks", v.shadow_checks},
                       {"shadow_mismatches", v.shadow_mismatches},
                       {"shadow_seconds", v.shadow_seconds},
                       {"unverifiable", v.unverifiable}}},
                     {"quarantined_buckets", info.quarantined_buckets},
                     {"journal", journal}});
    }
    fmt::print("{}\n", out.dump(2));
    return kExitOk;
  }
  Table table({{"name"}, {"device"}, {"version"}, {"priority", Table::Align::right}, {"health"}, {"description"}});
  for (const BackendInfo& info : backends) {
    const AttentionBackend& b = *info.backend;
    std::string health(health_name(info.health));
    if (!info.health_reason.empty()) health += " (" + info.health_reason + ")";
    table.add_row({std::string(b.name()), std::string(device_kind_name(b.device_kind())), std::string(b.version()),
                   std::to_string(b.priority()), health, std::string(b.description())});
  }
  table.print(stdout);
  // Each backend's own counters (the server's kallpa_backend_* metrics), one line per backend.
  for (const BackendInfo& info : backends) {
    std::string line;
    for (const BackendCounter& c : info.backend->counters()) line += fmt::format(" {}={}", c.name, c.value);
    if (!line.empty()) fmt::print("{} counters:{}\n", info.backend->name(), line);
  }
  // Sampled-row checks (first use in a size bucket, shadow) and the journal's history.
  for (const BackendInfo& info : backends) {
    const VerificationCounters& v = info.verification;
    if (v.first_use_checks + v.shadow_checks + v.unverifiable > 0) {
      fmt::print(
          "verification of {}: first-use {} checks, {} mismatches, {:.3f} s; shadow {} checks, {} mismatches, "
          "{:.3f} s; {} unverifiable\n",
          info.backend->name(), v.first_use_checks, v.first_use_mismatches, v.first_use_seconds, v.shadow_checks,
          v.shadow_mismatches, v.shadow_seconds, v.unverifiable);
    }
    for (const std::string& bucket : info.quarantined_buckets) {
      fmt::print("quarantined bucket of {}: {}\n", info.backend->name(), bucket);
    }
    for (const JournalRecord* r : history_of(*info.backend)) {
      fmt::print("journal of {}: {} {} {} ({}, {}): {}\n", info.backend->name(), r->time, r->event, r->identity,
                 r->source, r->scope, r->reason);
    }
  }
  if (const auto journal = registry.journal()) {
    fmt::print("quarantine journal: {} ({} record(s))\n", journal->path(), history.size());
  }
  fmt::print("{} backend(s); health check: {} checked, {} quarantined, {:.1f} ms\n", backends.size(), counters.checked,
             counters.quarantined_at_check, counters.check_milliseconds);
  return kExitOk;
}

// Exit 0 when some backend would run the problem, 1 when none would, 2 for a malformed spec.
int explain(const BackendsOptions& options, const GlobalOptions& global) {
  BackendRegistry& registry = BackendRegistry::global();
  Result<ProblemSpec> spec = parse_problem_spec(options.explain);
  if (!spec) {
    print_error("invalid problem spec", spec.status());
    return kExitUsage;
  }
  Result<DispatchOptions> dispatch = dispatch_options(global, registry);
  if (!dispatch) {
    print_error("", dispatch.status());
    return kExitUsage;
  }
  Dispatcher dispatcher(*dispatch, &registry);
  const ProblemSignature sig = spec->signature();
  const std::vector<Verdict> verdicts = dispatcher.explain(sig);
  Result<std::vector<AttentionBackend*>> order = dispatcher.candidates(sig);

  if (options.json) {
    nlohmann::json out = nlohmann::json::array();
    for (const Verdict& v : verdicts) {
      out.push_back({{"backend", v.backend},
                     {"health", health_name(v.health)},
                     {"supported", v.supported},
                     {"selected", v.selected},
                     {"rank", v.rank},
                     {"reason", v.reason}});
    }
    fmt::print("{}\n", out.dump(2));
    return order ? kExitOk : kExitFailure;
  }

  fmt::print("problem:   {}\nsignature: {}\n\n", spec->to_string(), sig.to_string());
  Table table({{"backend"}, {"health"}, {"verdict"}, {"rank", Table::Align::right}, {"reason"}});
  for (const Verdict& v : verdicts) {
    const std::string verdict = v.selected ? "selected" : v.supported ? "supported" : "unsupported";
    table.add_row(
        {v.backend, std::string(health_name(v.health)), verdict, v.rank >= 0 ? std::to_string(v.rank) : "-", v.reason});
  }
  table.print(stdout);
  if (!order) {
    fmt::print("\nselected: none ({})\n", order.status().to_string());
    return kExitFailure;
  }
  fmt::print("\nselected: {}\n", order->empty() ? "none" : std::string(order->front()->name()));
  return order->empty() ? kExitFailure : kExitOk;
}

}  // namespace

Command add_backends_command(CLI::App& app) {
  auto options = std::make_shared<BackendsOptions>();
  CLI::App* sub = app.add_subcommand("backends", "List attention backends, or explain the choice for a problem");
  sub->add_flag("--json", options->json, "Machine-readable output (a JSON array)");
  sub->add_option("--explain", options->explain,
                  "Each backend's verdict on a problem, e.g. "
                  "b=1,sq=4096,skv=4096,hq=32,hkv=8,d=128,causal,dtype=bf16")
      ->type_name("SPEC");
  return {sub, [options, sub](const GlobalOptions& global) {
            if (sub->count("--explain") > 0) return explain(*options, global);
            return list_backends(*options);
          }};
}

}  // namespace kallpa::cli
