// The `kallpa` command line program: parses the command line and runs one subcommand.
#include <exception>
#include <new>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "cli.h"
#include "kallpa/attention.h"
#include "kallpa/process_group.h"
#include "output.h"

#ifndef KALLPA_VERSION_STRING
#define KALLPA_VERSION_STRING "unknown"
#endif

int main(int argc, char** argv) {
  using namespace kallpa::cli;
  try {
    CLI::App app{"kallpa: Transformer inference with interchangeable attention backends", "kallpa"};
    app.set_version_flag("--version", fmt::format("kallpa {} (attention contract v{})", KALLPA_VERSION_STRING,
                                                  kallpa::kAttentionContractVersion));
    app.require_subcommand(1);
    app.fallthrough();  // global options may follow the subcommand: `kallpa demo --strict`

    GlobalOptions global;
    add_global_options(app, global);
    const std::vector<Command> commands = {
        add_demo_command(app),       add_backends_command(app), add_devices_command(app), add_conformance_command(app),
        add_bench_command(app),      add_generate_command(app), add_chat_command(app),    add_tokenize_command(app),
        add_detokenize_command(app), add_info_command(app),     add_serve_command(app),   add_pjrt_command(app),
        add_embed_command(app)};
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      if (app.get_subcommands().empty() && !app.remaining().empty()) {
        // `kallpa frobnicate`: say so, rather than CLI11's "a subcommand is required".
        fmt::print(
            stderr,
            "kallpa: unknown command '{}' (commands: generate, chat, tokenize, detokenize, embed, info, serve, demo, "
            "backends, "
            "conformance, bench, pjrt)\n"
            "Run with --help for more information.\n",
            app.remaining().front());
        return kExitUsage;
      }
      const int code = app.exit(e);  // prints help, the version, or the error with a hint
      return code == 0 ? kExitOk : kExitUsage;
    }

    configure_logging(global);
    if (kallpa::Status s = select_ring_transport(global); !s) {
      print_error("--ring-transport", s);
      return s.code() == kallpa::ErrorCode::not_found ? kExitUsage : kExitFailure;
    }
    // Under `mpirun` every rank must run the same command, since collective calls pair up by their
    // order: a rank started otherwise is named at once rather than left to hang or mix results. The
    // transport is compared on its own, as KALLPA_RING_TRANSPORT can choose it outside the command line.
    if (kallpa::ProcessGroup* group = kallpa::process_group(); group != nullptr && group->size() > 1) {
      std::string line;
      for (int i = 1; i < argc; ++i) line.append(argv[i]).push_back('\0');
      kallpa::Status s = group->agree("command line", line);
      if (s) s = group->agree("transport", group->transport());
      if (!s) {
        print_error("", s);
        return kExitUsage;
      }
    }
    setup_backends(global);
    for (const Command& command : commands) {
      if (command.app->parsed()) return command.run(global);
    }
    return kExitUsage;  // unreachable: require_subcommand(1)
  } catch (const std::bad_alloc&) {
    fmt::print(stderr, "kallpa: out of memory\n");
  } catch (const std::exception& e) {
    fmt::print(stderr, "kallpa: internal error: {}\n", e.what());
  }
  return kExitFailure;
}
