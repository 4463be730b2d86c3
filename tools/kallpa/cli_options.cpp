// Global options: dispatch choice (--attention, --strict, KALLPA_ATTENTION*), logging, plugins and
// health checks.
#include <cstdlib>
#include <memory>
#include <string>

#include <fmt/format.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "backends/pjrt/pjrt_backend.h"
#include "cli.h"
#include "kallpa/health.h"
#include "kallpa/plugin.h"
#include "kallpa/process_group.h"

namespace kallpa::cli {

void add_global_options(CLI::App& app, GlobalOptions& options) {
  app.add_option("--attention", options.attention,
                 "Backends to use, first supported wins: NAME[,NAME...] "
                 "(overrides KALLPA_ATTENTION)")
      ->type_name("LIST");
  app.add_flag("--strict", options.strict,
               "An explicit --attention choice that cannot run a problem is an error, never a "
               "fallback (also KALLPA_ATTENTION_STRICT=1); so is a --device op that would run on the CPU");
  app.add_option("--log-level", options.log_level, "Log level (logs go to stderr)")
      ->envname("KALLPA_LOG_LEVEL")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "critical", "off"}))
      ->capture_default_str();
  app.add_option("--plugin", options.plugins,
                 "Load an attention backend plugin, isolated in its own host process (a shared "
                 "library; repeatable; also KALLPA_PLUGIN_PATH=LIB|DIR[:...])")
      ->type_name("PATH");
  app.add_option("--trusted-plugin", options.trusted_plugins,
                 "Load a plugin you trust into this process: no isolation, no copies (repeatable; also "
                 "KALLPA_TRUSTED_PLUGIN_PATH=LIB|DIR[:...])")
      ->type_name("PATH");
  app.add_option("--plugin-timeout", options.plugin_timeout_ms,
                 "Watchdog of isolated plugins: a call not answered within this many milliseconds kills "
                 "the plugin's host, falls back and quarantines it (default 30000; also "
                 "KALLPA_PLUGIN_TIMEOUT_MS)")
      ->type_name("MS")
      ->check(CLI::Range(1, 24 * 3600 * 1000));
  app.add_flag("--paranoid", options.paranoid,
               "Check every attention output for NaN/Inf the contract forbids, and fence isolated plugins' "
               "outputs with guard pages, so a write past them is caught at the write (also KALLPA_PARANOID=1)");
  app.add_flag("--no-health-check", options.no_health_check,
               "Select backends without running their canary health check first (faster start-up; "
               "also KALLPA_SKIP_HEALTH_CHECK=1)");
  app.add_option("--verify-rate", options.verify_rate,
                 "Shadow verification: the fraction of attention calls (0..1, or 1/N) whose answer is "
                 "checked on a few random rows against the reference; a mismatch quarantines the "
                 "backend and the call falls back (also KALLPA_VERIFY_RATE; default 1/1000, 0 turns it off)")
      ->type_name("RATE");
  app.add_flag("--no-first-use-check", options.no_first_use_check,
               "Trust a backend's first call in a new size bucket without checking sampled rows "
               "against the reference first (also KALLPA_FIRST_USE_CHECK=0)");
  app.add_option("--quarantine-journal", options.quarantine_journal,
                 "Where quarantines are journaled, so that a restart does not trust a quarantined "
                 "build without a fuller check; 'off' disables it (also KALLPA_QUARANTINE_JOURNAL; "
                 "default $XDG_STATE_HOME/kallpa/quarantine.jsonl or ~/.local/state/kallpa/quarantine.jsonl)")
      ->type_name("PATH");
  app.add_option("--ring-transport", options.ring_transport,
                 "How the ranks of an MPI job exchange the context-parallel engine's data: mpi (the default) "
                 "or nccl (through one CUDA device per rank; needs a build with NCCL)")
      ->envname("KALLPA_RING_TRANSPORT")
      ->type_name("NAME");
  app.add_option("--pjrt-plugin", options.pjrt_plugin,
                 "The PJRT plugin the pjrt backend drives (libtpu.so, XLA's CPU or GPU plugin; also "
                 "KALLPA_PJRT_PLUGIN)")
      ->type_name("PATH");
}

Status select_ring_transport(const GlobalOptions& options) {
  if (options.ring_transport.empty()) return Status::ok();
  return use_process_group_transport(options.ring_transport);
}

void setup_backends(const GlobalOptions& options) {
  // The pjrt backend reads its plugin from the environment on first use, which comes later.
  if (!options.pjrt_plugin.empty()) setenv(pjrt::kPluginEnv, options.pjrt_plugin.c_str(), 1);
  BackendRegistry& registry = BackendRegistry::global();
  if (options.no_health_check) registry.set_health_check(skipped_health_check("--no-health-check"));
  const std::string journal =
      !options.quarantine_journal.empty() ? options.quarantine_journal : QuarantineJournal::default_path();
  if (!journal.empty() && journal != "off") registry.set_journal(std::make_shared<QuarantineJournal>(journal));
  if (options.plugin_timeout_ms > 0) {
    setenv("KALLPA_PLUGIN_TIMEOUT_MS", std::to_string(options.plugin_timeout_ms).c_str(), 1);
  }
  if (options.paranoid) setenv("KALLPA_PARANOID", "1", 1);
  std::vector<PluginLoadReport> reports = load_env_plugins();
  Result<PluginOptions> plugin_options = PluginOptions::from_env();
  if (!plugin_options) {
    reports.push_back({"--plugin", {}, plugin_options.status()});
  } else {
    for (const std::string& path : options.plugins) {
      std::vector<PluginLoadReport> more = load_plugins(path, registry, *plugin_options);
      reports.insert(reports.end(), more.begin(), more.end());
    }
    plugin_options->isolation = PluginIsolation::in_process;
    for (const std::string& path : options.trusted_plugins) {
      std::vector<PluginLoadReport> more = load_plugins(path, registry, *plugin_options);
      reports.insert(reports.end(), more.begin(), more.end());
    }
  }
  for (const PluginLoadReport& r : reports) {
    // load_plugins logs at warn; say it here too when logging is quieter, so it is never silent.
    if (!r.status && spdlog::get_level() > spdlog::level::warn) {
      fmt::print(stderr, "kallpa: plugin {} not loaded: {}\n", r.path, r.status.message());
    }
  }
}

void configure_logging(const GlobalOptions& options) {
  auto logger = std::make_shared<spdlog::logger>("", std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
  spdlog::set_default_logger(std::move(logger));
  spdlog::set_level(spdlog::level::from_str(options.log_level));
}

Result<DispatchOptions> dispatch_options(const GlobalOptions& options, const BackendRegistry& registry) {
  Result<DispatchOptions> from_env = DispatchOptions::from_env();
  if (!from_env) return from_env.status();  // names the malformed variable
  DispatchOptions result = std::move(from_env).value();
  std::string field = "KALLPA_ATTENTION";
  if (!options.attention.empty()) {
    Result<std::vector<std::string>> list = DispatchOptions::parse_backend_list(options.attention);
    if (!list) {
      Status s = list.status();
      return Status(s.code(), "--attention", s.message());
    }
    result.backends = std::move(list).value();
    field = "--attention";
  }
  if (options.strict) result.strict = true;
  if (options.no_first_use_check) result.first_use_check = false;
  if (!options.verify_rate.empty()) {
    Result<double> rate = DispatchOptions::parse_rate(options.verify_rate);
    if (!rate) return Status(ErrorCode::parse_error, "--verify-rate", rate.status().message());
    result.verify_rate = *rate;
  }
  if (options.paranoid) result.paranoid = true;
  for (const std::string& name : result.backends) {
    if (Status s = registry.require(name, field); !s) return s;
  }
  return result;
}

}  // namespace kallpa::cli
