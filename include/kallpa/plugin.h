// Loading out-of-tree attention backends (plugin_abi.h) into a registry. A library that cannot be
// opened, lacks the entry point, has another ABI major, fails to initialise or hands over a
// malformed table is reported by path and reason, and nothing else is affected.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "kallpa/registry.h"
#include "kallpa/status.h"

namespace kallpa {

struct PluginLoadReport {
  std::string path;
  std::string backend;  // the registered name, when loaded
  Status status;        // ok, or why the library was not loaded (field = the path)
};

// Opens one shared library, checks its table and registers the backend it describes.
PluginLoadReport load_plugin(const std::string& path, BackendRegistry& registry);

// Each item of a colon-separated list is a library, or a directory whose *.so files are loaded
// in name order. Empty items are ignored. One report per library (or per unreadable item).
std::vector<PluginLoadReport> load_plugins(std::string_view path_list, BackendRegistry& registry);

// KALLPA_PLUGIN_PATH into the global registry, once per process (thread-safe; later calls return
// the first call's reports). Dispatchers over the global registry call it when they are made.
const std::vector<PluginLoadReport>& load_env_plugins();

}  // namespace kallpa
