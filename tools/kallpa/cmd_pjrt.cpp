// `kallpa pjrt`: the pjrt backend's own view. `info` says which PJRT plugin and device it drives
// (or why it cannot run) and prints its executable cache's counters; `compile` compiles the program
// for one or more problems ahead of time (warm-up) and prints the compile time and the compiler's
// memory statistics, with --keys to see how memory grows with the number of keys, and --target
// to compile for a device topology that is not here (a TPU generation, through libtpu).
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "backends/pjrt/pjrt_backend.h"
#include "cli.h"
#include "harness/problem_instance.h"
#include "kallpa/problem_spec.h"
#include "output.h"

namespace kallpa::cli {
namespace {

struct PjrtOptions {
  bool json = false;
  std::vector<std::string> specs;
  std::vector<std::int64_t> keys;  // compile: override skv (one compile per value)
  std::string target;              // compile: a device topology to compile for ahead of time
};

Result<pjrt::PjrtAttention*> find_pjrt() {
  AttentionBackend* backend = BackendRegistry::global().find("pjrt");
  auto* p = dynamic_cast<pjrt::PjrtAttention*>(backend);
  if (p == nullptr) {
    return Status(ErrorCode::not_found, "pjrt",
                  "this kallpa was built without the pjrt backend (its header was missing at configure time: run "
                  "scripts/fetch_pjrt.sh and configure again)");
  }
  return p;
}

nlohmann::json stats_json(const pjrt::CacheStats& s) {
  return {{"compiles", s.compiles},
          {"compile_failures", s.compile_failures},
          {"compile_ms", s.compile_milliseconds},
          {"cache_hits", s.cache_hits},
          {"executions", s.executions},
          {"cached_executables", s.cached_executables}};
}

int info(const PjrtOptions& options) {
  Result<pjrt::PjrtAttention*> backend = find_pjrt();
  if (!backend) {
    print_error("", backend.status());
    return kExitFailure;
  }
  Result<pjrt::PlatformInfo> platform = (*backend)->platform();
  const pjrt::CacheStats stats = (*backend)->cache_stats();
  if (options.json) {
    nlohmann::json out{{"available", platform.is_ok()}, {"cache", stats_json(stats)}};
    if (platform) {
      out["plugin"] = platform->plugin_path;
      out["api_version"] = platform->api_version;
      out["platform"] = platform->platform;
      out["device_kind"] = platform->device_kind;
      out["device"] = platform->device_index;
      out["devices"] = platform->device_count;
      out["chunk"] = platform->chunk;
    } else {
      out["why_not"] = platform.status().message();
    }
    fmt::print("{}\n", out.dump(2));
    return platform ? kExitOk : kExitFailure;
  }
  if (!platform) {
    fmt::print("pjrt: unavailable: {}\n", platform.status().message());
    return kExitFailure;
  }
  fmt::print("plugin:   {}\nPJRT API: {}\nplatform: {}\ndevice:   {} of {} ({})\nchunk:    {} keys per loop step\n",
             platform->plugin_path, platform->api_version, platform->platform, platform->device_index,
             platform->device_count, platform->device_kind, platform->chunk);
  fmt::print("cache:    {} compiled ({:.1f} ms), {} failed, {} hits, {} executions, {} executables\n", stats.compiles,
             stats.compile_milliseconds, stats.compile_failures, stats.cache_hits, stats.executions,
             stats.cached_executables);
  return kExitOk;
}

int compile(const PjrtOptions& options) {
  // libtpu on a machine that is not a TPU VM asks a cloud metadata server and waits minutes for
  // it unless told not to; an ahead-of-time compile needs nothing from it. Set before the plugin
  // is first loaded, and never over the user's own setting.
  if (!options.target.empty()) setenv("TPU_SKIP_MDS_QUERY", "1", 0);
  Result<pjrt::PjrtAttention*> backend = find_pjrt();
  if (!backend) {
    print_error("", backend.status());
    return kExitFailure;
  }
  std::vector<ProblemSpec> specs;
  for (const std::string& text : options.specs) {
    Result<ProblemSpec> spec = parse_problem_spec(text);
    if (!spec) {
      print_error("invalid problem spec", spec.status());
      return kExitUsage;
    }
    if (options.keys.empty()) {
      specs.push_back(*spec);
      continue;
    }
    for (std::int64_t k : options.keys) {
      ProblemSpec s = *spec;
      s.seqlen_k = k;
      specs.push_back(s);
    }
  }
  nlohmann::json out = nlohmann::json::array();
  Table table({{"problem"},
               {"compile ms", Table::Align::right},
               {"temp bytes", Table::Align::right},
               {"argument bytes", Table::Align::right},
               {"output bytes", Table::Align::right},
               {"program"}});
  int rc = kExitOk;
  for (const ProblemSpec& spec : specs) {
    Result<std::unique_ptr<harness::ProblemInstance>> instance = harness::ProblemInstance::create(spec);
    Result<ValidatedProblem> vp =
        instance ? validate((*instance)->problem()) : Result<ValidatedProblem>(instance.status());
    Result<pjrt::CompileReport> report = !vp                      ? Result<pjrt::CompileReport>(vp.status())
                                         : options.target.empty() ? (*backend)->compile(*vp)
                                                                  : (*backend)->compile_for_target(*vp, options.target);
    if (!report) {
      print_error(spec.to_string(), report.status());
      rc = kExitFailure;
      continue;
    }
    const auto bytes = [&](std::int64_t b) { return report->memory_known ? std::to_string(b) : std::string("-"); };
    if (options.json) {
      nlohmann::json r{{"problem", spec.to_string()},
                       {"program", report->program_key},
                       {"cached", report->cached},
                       {"compile_ms", report->compile_milliseconds},
                       {"program_bytes", report->program_bytes}};
      if (report->memory_known) {
        r["temp_bytes"] = report->temp_bytes;
        r["argument_bytes"] = report->argument_bytes;
        r["output_bytes"] = report->output_bytes;
        r["generated_code_bytes"] = report->generated_code_bytes;
      }
      out.push_back(std::move(r));
    } else {
      table.add_row({spec.to_string(),
                     report->cached ? std::string("cached") : fmt::format("{:.1f}", report->compile_milliseconds),
                     bytes(report->temp_bytes), bytes(report->argument_bytes), bytes(report->output_bytes),
                     report->program_key});
    }
  }
  if (options.json) {
    fmt::print("{}\n", out.dump(2));
  } else {
    table.print(stdout);
  }
  return rc;
}

}  // namespace

Command add_pjrt_command(CLI::App& app) {
  auto options = std::make_shared<PjrtOptions>();
  CLI::App* sub = app.add_subcommand("pjrt", "The pjrt backend: its plugin and device, compiling ahead of time");
  sub->require_subcommand(1);
  CLI::App* info_cmd =
      sub->add_subcommand("info", "Which PJRT plugin and device, or why not; executable cache counters");
  info_cmd->add_flag("--json", options->json, "Machine-readable output");
  CLI::App* compile_cmd =
      sub->add_subcommand("compile", "Compile the program for problems ahead of time; print compile time and memory");
  compile_cmd->alias("warmup");  // what a server does before taking traffic
  compile_cmd
      ->add_option("--spec", options->specs, "A problem spec (repeatable), e.g. b=1,sq=1,skv=4096,hq=32,hkv=8,d=128")
      ->type_name("SPEC")
      ->required();
  compile_cmd
      ->add_option("--keys", options->keys, "Compile each spec once per key count (its skv), e.g. 2048,8192,32768")
      ->delimiter(',')
      ->type_name("N[,N...]");
  compile_cmd
      ->add_option("--target", options->target,
                   "Compile ahead of time for a device topology of the plugin, with no device present "
                   "(libtpu: v5e:2x2, v6e:2x2, v4:2x2x1, v5p:2x2x1)")
      ->type_name("TOPOLOGY");
  compile_cmd->add_flag("--json", options->json, "Machine-readable output");
  return {sub, [options, info_cmd, compile_cmd](const GlobalOptions&) {
            if (info_cmd->parsed()) return info(*options);
            if (compile_cmd->parsed()) return compile(*options);
            return kExitUsage;
          }};
}

}  // namespace kallpa::cli
