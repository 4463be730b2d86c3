// Loading out-of-tree attention backends (plugin_abi.h) into a registry. A library that cannot be
// opened, lacks the entry point, has another ABI major, fails to initialise or hands over a
// malformed table is reported by path and reason, and nothing else is affected.
//
// Isolation. By default a plugin runs in its own host process (kallpa-plugin-host, installed
// beside libkallpa_attention): its calls reach it through shared memory, with a watchdog, so a
// crash, an abort, a hang, an out-of-bounds write caught by a guard page or a memory leak past a
// limit costs one call a fallback (ErrorCode::backend_lost, which quarantines it at once), never
// the process that loaded it. Only the operator can trust a plugin to run in process (--trusted-
// plugin, KALLPA_TRUSTED_PLUGIN_PATH, PluginIsolation::in_process); nothing in a plugin's table
// can ask for it. Isolated plugins work on host memory only (device_kind cpu).
#pragma once

#include <chrono>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "kallpa/registry.h"
#include "kallpa/status.h"

namespace kallpa {

enum class PluginIsolation {
  process,     // a separate host process per plugin (the default)
  in_process,  // dlopen into this process: fastest, and a crash in the plugin is a crash here
};

struct PluginOptions {
  PluginIsolation isolation = PluginIsolation::process;
  // Isolated only. A call (or a supports() question, or start-up) that the host does not answer
  // within this time kills the host; the call fails with backend_lost.
  std::chrono::milliseconds timeout{30000};
  // Isolated only. After each call the host reports its anonymous resident memory (its own heap,
  // not the shared tensors); past this many MiB it is killed and the call fails with
  // backend_lost. 0: no limit.
  std::size_t memory_limit_mib = 4096;
  // Isolated only. o and lse end exactly at a PROT_NONE page (and begin after one) in the host's
  // view of shared memory, so a write past them faults at the write and is reported as "backend X
  // wrote N bytes past o". The plugin's workspace is always guarded this way. Costs a few
  // mprotect calls per run.
  bool guard_pages = false;
  // The host executable; empty: KALLPA_PLUGIN_HOST, else kallpa-plugin-host beside
  // libkallpa_attention, else beside the running executable (find_plugin_host()).
  std::string host_path;

  // Defaults, then KALLPA_PLUGIN_TIMEOUT_MS (integer > 0), KALLPA_PLUGIN_MEMORY_LIMIT_MIB (integer
  // >= 0) and KALLPA_PARANOID (1/true: guard pages); a malformed value is an error naming the
  // variable. `isolation` stays process.
  static Result<PluginOptions> from_env();
};

struct PluginLoadReport {
  std::string path;
  std::string backend;  // the registered name, when loaded
  Status status;        // ok, or why the library was not loaded (field = the path)
};

// The plugin host executable, searched as PluginOptions::host_path says; not_found naming every
// place looked at when there is none.
Result<std::string> find_plugin_host();

// Opens one shared library (in this process or in a host process, per `options`), checks its table
// and registers the backend it describes.
PluginLoadReport load_plugin(const std::string& path, BackendRegistry& registry, const PluginOptions& options = {});

// Each item of a colon-separated list is a library, or a directory whose *.so files are loaded
// in name order. Empty items are ignored. One report per library (or per unreadable item).
std::vector<PluginLoadReport> load_plugins(std::string_view path_list, BackendRegistry& registry,
                                           const PluginOptions& options = {});

// KALLPA_PLUGIN_PATH (isolated) and KALLPA_TRUSTED_PLUGIN_PATH (in process) into the global
// registry with PluginOptions::from_env(), once per process (thread-safe; later calls return the
// first call's reports). Dispatchers over the global registry call it when they are made.
const std::vector<PluginLoadReport>& load_env_plugins();

}  // namespace kallpa
