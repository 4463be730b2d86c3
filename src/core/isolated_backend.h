// An isolated plugin (plugin.h): the proxy AttentionBackend the parent registers, which runs the
// plugin's calls in a kallpa-plugin-host process over shared memory (plugin_wire.h).
#pragma once

#include <memory>
#include <string>

#include "kallpa/backend.h"
#include "kallpa/plugin.h"

namespace kallpa::detail {

// Starts a host for the library at `path`, which loads it and reports its table; the proxy takes
// the plugin's name, version, priority and description from there. A missing host executable, a
// host that cannot start or a plugin it cannot load is an error naming the path.
Result<std::unique_ptr<AttentionBackend>> start_isolated_plugin(const std::string& path, const PluginOptions& options);

}  // namespace kallpa::detail
