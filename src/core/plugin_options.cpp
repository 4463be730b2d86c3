// PluginOptions from the environment, and where the plugin host executable is (plugin.h).
#include <dlfcn.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "kallpa/plugin.h"

namespace kallpa {
namespace {

constexpr const char* kHostName = "kallpa-plugin-host";

// An integer variable in [low, high] into *out when it is set and not empty.
Status env_integer(const char* variable, long long low, long long high, long long* out) {
  const char* text = std::getenv(variable);
  if (text == nullptr || *text == '\0') return {};
  char* end = nullptr;
  errno = 0;
  const long long n = std::strtoll(text, &end, 10);
  if (*end != '\0' || errno != 0 || n < low || n > high) {
    return Status(ErrorCode::parse_error, variable, fmt::format("'{}' is not an integer in [{}, {}]", text, low, high));
  }
  *out = n;
  return {};
}

bool executable(const std::filesystem::path& path) {
  std::error_code ec;
  return std::filesystem::is_regular_file(path, ec) && access(path.c_str(), X_OK) == 0;
}

}  // namespace

Result<PluginOptions> PluginOptions::from_env() {
  PluginOptions options;
  long long timeout = options.timeout.count();
  if (Status s = env_integer("KALLPA_PLUGIN_TIMEOUT_MS", 1, 24LL * 3600 * 1000, &timeout); !s) return s;
  options.timeout = std::chrono::milliseconds(timeout);
  auto limit = static_cast<long long>(options.memory_limit_mib);
  if (Status s = env_integer("KALLPA_PLUGIN_MEMORY_LIMIT_MIB", 0, 1LL << 30, &limit); !s) return s;
  options.memory_limit_mib = static_cast<std::size_t>(limit);
  if (const char* text = std::getenv("KALLPA_PARANOID"); text != nullptr && *text != '\0') {
    const std::string_view v(text);
    if (v != "0" && v != "1" && v != "true" && v != "false") {
      return Status(ErrorCode::parse_error, "KALLPA_PARANOID", fmt::format("'{}' is not 0/1/true/false", v));
    }
    options.guard_pages = v == "1" || v == "true";
  }
  return options;
}

Result<std::string> find_plugin_host() {
  if (const char* env = std::getenv("KALLPA_PLUGIN_HOST"); env != nullptr && *env != '\0') {
    if (executable(env)) return std::string(env);
    return Status(ErrorCode::not_found, "KALLPA_PLUGIN_HOST", fmt::format("{} is not an executable file", env));
  }
  std::vector<std::filesystem::path> tried;
  // Beside this library (in the build tree and where the SDK installs it), then beside the program.
  Dl_info info{};
  if (dladdr(reinterpret_cast<const void*>(&find_plugin_host), &info) != 0 && info.dli_fname != nullptr) {
    const std::filesystem::path dir = std::filesystem::path(info.dli_fname).parent_path();
    tried.push_back(dir / kHostName);
  }
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) tried.push_back(self.parent_path() / kHostName);
  std::string places;
  for (const std::filesystem::path& p : tried) {
    if (executable(p)) return p.string();
    places += places.empty() ? p.string() : ", " + p.string();
  }
  return Status(ErrorCode::not_found, "plugin host",
                fmt::format("{} not found (looked at: {}); isolated plugins need it: install it there, set "
                            "KALLPA_PLUGIN_HOST, or trust the plugin to run in process",
                            kHostName, places.empty() ? std::string("nowhere") : places));
}

}  // namespace kallpa
