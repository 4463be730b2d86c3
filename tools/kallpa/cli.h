// Shared pieces of the `kallpa` command line program: exit codes, global options, and the
// signature every subcommand follows (add itself to the app, run when it was the one parsed).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "kallpa/dispatcher.h"
#include "kallpa/registry.h"
#include "kallpa/status.h"

namespace kallpa::cli {

// Exit codes: 0 success; 1 the job ran and found a problem (a failed case, a failed run);
// 2 the input was wrong (bad flag, malformed spec, unknown backend name).
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

// Options that every subcommand accepts (declared on the top-level app, which falls through).
struct GlobalOptions {
  std::string attention;  // --attention LIST; empty when not given
  bool strict = false;    // --strict
  std::string log_level = "warn";
  std::vector<std::string> plugins;          // --plugin PATH (repeatable), on top of KALLPA_PLUGIN_PATH
  std::vector<std::string> trusted_plugins;  // --trusted-plugin PATH (in process)
  long long plugin_timeout_ms = 0;           // --plugin-timeout MS; 0: KALLPA_PLUGIN_TIMEOUT_MS or default
  bool paranoid = false;                     // --paranoid (also KALLPA_PARANOID=1)
  bool no_health_check = false;              // --no-health-check (also KALLPA_SKIP_HEALTH_CHECK=1)
  std::string pjrt_plugin;                   // --pjrt-plugin PATH (sets KALLPA_PJRT_PLUGIN)
  std::string verify_rate;                   // --verify-rate RATE; empty: KALLPA_VERIFY_RATE or the default
  bool no_first_use_check = false;           // --no-first-use-check (also KALLPA_FIRST_USE_CHECK=0)
  std::string quarantine_journal;            // --quarantine-journal PATH|off; empty: the default path
  std::string ring_transport;                // --ring-transport NAME; empty: the ring's default (mpi)
};

void add_global_options(CLI::App& app, GlobalOptions& options);

// Applies --log-level and sends log output to stderr, so that --json output on stdout stays valid.
void configure_logging(const GlobalOptions& options);

// Loads KALLPA_PLUGIN_PATH and --plugin libraries (isolated), KALLPA_TRUSTED_PLUGIN_PATH and
// --trusted-plugin libraries (in process) into the global registry (a library that fails
// is reported on stderr by path and reason, and the program carries on) and applies
// --no-health-check, --pjrt-plugin and the quarantine journal (--quarantine-journal,
// KALLPA_QUARANTINE_JOURNAL, or the default path). Call once, after configure_logging.
void setup_backends(const GlobalOptions& options);

// Installs the process group of --ring-transport (KALLPA_RING_TRANSPORT) when one is named: ok, or
// why not (not_found: no such transport; unsupported: not built, no device). Call before the ranks'
// first collective call.
Status select_ring_transport(const GlobalOptions& options);

// DispatchOptions::from_env(), then --attention / --strict on top. Every named backend must be
// registered (not_found otherwise).
Result<DispatchOptions> dispatch_options(const GlobalOptions& options, const BackendRegistry& registry);

// A subcommand: its CLI11 app and what to run when it was given.
struct Command {
  CLI::App* app = nullptr;
  std::function<int(const GlobalOptions&)> run;
};

Command add_demo_command(CLI::App& app);
Command add_backends_command(CLI::App& app);
Command add_devices_command(CLI::App& app);
Command add_conformance_command(CLI::App& app);
Command add_bench_command(CLI::App& app);
Command add_generate_command(CLI::App& app);
Command add_chat_command(CLI::App& app);
Command add_tokenize_command(CLI::App& app);
Command add_detokenize_command(CLI::App& app);
Command add_embed_command(CLI::App& app);
Command add_info_command(CLI::App& app);
Command add_serve_command(CLI::App& app);
Command add_pjrt_command(CLI::App& app);

}  // namespace kallpa::cli
