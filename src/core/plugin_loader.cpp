// Finding, opening and checking plugin libraries (plugin.h, plugin_abi.h).
#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <mutex>
#include <system_error>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "core/isolated_backend.h"
#include "core/plugin_backend.h"
#include "kallpa/plugin.h"
#include "kallpa/plugin_abi.h"

#ifndef KALLPA_VERSION_STRING
#define KALLPA_VERSION_STRING "unknown"
#endif

namespace kallpa {
namespace {

bool valid_name(std::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_' ||
           c == '.';
  });
}

// Why the table cannot be used, or empty.
std::string check_table(const kallpa_plugin_table& t, std::size_t struct_size) {
  if (t.abi_major != KALLPA_PLUGIN_ABI_MAJOR) {
    return fmt::format(
        "built for plugin ABI {}.{}, but this kallpa speaks ABI {}.{} (the major version must match; "
        "rebuild the plugin against this kallpa)",
        t.abi_major, t.abi_minor, KALLPA_PLUGIN_ABI_MAJOR, KALLPA_PLUGIN_ABI_MINOR);
  }
  if (struct_size < KALLPA_PLUGIN_TABLE_SIZE_1_0) {
    return fmt::format("table struct_size {} is smaller than ABI 1.0's {} bytes", struct_size,
                       KALLPA_PLUGIN_TABLE_SIZE_1_0);
  }
  if (t.name == nullptr || !valid_name(std::string_view(t.name, strnlen(t.name, 65)))) {
    return "table.name is missing or not 1-64 characters of [A-Za-z0-9._-]";
  }
  if (t.supports == nullptr) return "table.supports is NULL";
  if (t.run == nullptr) return "table.run is NULL";
  if (t.device_kind < KALLPA_DEVICE_CPU || t.device_kind > KALLPA_DEVICE_PLUGIN) {
    return fmt::format("table.device_kind {} is not a KALLPA_DEVICE_* value", t.device_kind);
  }
  return {};
}

PluginLoadReport fail(const std::string& path, ErrorCode code, std::string message) {
  return {path, {}, Status(code, path, std::move(message))};
}

}  // namespace

namespace detail {

Result<std::unique_ptr<PluginBackend>> open_plugin(const std::string& path) {
  const auto refuse = [&](ErrorCode code, std::string message) { return Status(code, path, std::move(message)); };
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return refuse(ErrorCode::not_found, "no such file");
  auto library = std::make_shared<LibraryHandle>();
  library->handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library->handle == nullptr) {
    const char* why = dlerror();
    return refuse(ErrorCode::invalid_argument, fmt::format("cannot be loaded: {}", why ? why : "unknown dlopen error"));
  }
  void* symbol = dlsym(library->handle, KALLPA_PLUGIN_ENTRY_POINT);
  if (symbol == nullptr) {
    return refuse(ErrorCode::invalid_argument,
                  fmt::format("not a kallpa plugin: it does not export '{}'", KALLPA_PLUGIN_ENTRY_POINT));
  }
  kallpa_plugin_init_fn init = nullptr;
  static_assert(sizeof init == sizeof symbol);
  std::memcpy(&init, &symbol, sizeof init);

  const kallpa_plugin_host host{sizeof(kallpa_plugin_host), KALLPA_PLUGIN_ABI_MAJOR, KALLPA_PLUGIN_ABI_MINOR,
                                KALLPA_VERSION_STRING};
  char error[512] = {};
  const kallpa_plugin_table* table = nullptr;
  try {
    table = init(&host, error, sizeof error);
  } catch (const std::exception& e) {
    return refuse(ErrorCode::backend_failure, fmt::format("initialisation threw: {}", e.what()));
  } catch (...) {
    return refuse(ErrorCode::backend_failure, "initialisation threw");
  }
  if (table == nullptr) {
    const std::size_t n = strnlen(error, sizeof error);
    return refuse(
        ErrorCode::backend_failure,
        fmt::format("initialisation failed: {}", n ? std::string(error, n) : std::string("(no reason given)")));
  }

  // Read only the bytes the plugin declared: an older-minor table ends before the newer fields,
  // which then stay zero (absent); a newer-minor table's extra fields are ignored.
  kallpa_plugin_table copy{};
  const std::size_t declared = table->struct_size;
  if (declared >= offsetof(kallpa_plugin_table, abi_minor) + sizeof(std::uint32_t)) {
    std::memcpy(&copy, table, std::min(declared, sizeof copy));
  } else {
    copy.abi_major = KALLPA_PLUGIN_ABI_MAJOR;  // let check_table name the size problem
  }
  if (std::string why = check_table(copy, declared); !why.empty()) {
    if (copy.abi_major == KALLPA_PLUGIN_ABI_MAJOR && declared >= KALLPA_PLUGIN_TABLE_SIZE_1_0 && copy.destroy) {
      copy.destroy(copy.state);
    }
    return refuse(ErrorCode::invalid_argument, std::move(why));
  }
  spdlog::debug("kallpa: opened plugin '{}' (ABI {}.{}) from {}", copy.name, copy.abi_major, copy.abi_minor, path);
  return std::make_unique<PluginBackend>(library, copy, path);
}

}  // namespace detail

PluginLoadReport load_plugin(const std::string& path, BackendRegistry& registry, const PluginOptions& options) {
  Result<std::unique_ptr<AttentionBackend>> backend = Status();
  if (options.isolation == PluginIsolation::in_process) {
    auto opened = detail::open_plugin(path);
    if (!opened) return {path, {}, opened.status()};
    backend = std::unique_ptr<AttentionBackend>(std::move(*opened));
  } else {
    backend = detail::start_isolated_plugin(path, options);
    if (!backend) return {path, {}, backend.status()};
  }
  const std::string name((*backend)->name());
  if (Status s = registry.add(std::move(*backend)); !s) {
    return fail(path, s.code(), fmt::format("backend '{}' not registered: {}", name, s.message()));
  }
  spdlog::debug("kallpa: loaded plugin backend '{}' from {} ({})", name, path,
                options.isolation == PluginIsolation::in_process ? "in process" : "isolated");
  return {path, name, {}};
}

std::vector<PluginLoadReport> load_plugins(std::string_view path_list, BackendRegistry& registry,
                                           const PluginOptions& options) {
  std::vector<PluginLoadReport> reports;
  std::size_t pos = 0;
  while (pos <= path_list.size()) {
    const std::size_t colon = std::min(path_list.find(':', pos), path_list.size());
    const std::string item(path_list.substr(pos, colon - pos));
    pos = colon + 1;
    if (item.empty()) continue;
    std::error_code ec;
    if (std::filesystem::is_directory(item, ec)) {
      std::vector<std::string> files;
      for (const auto& entry : std::filesystem::directory_iterator(item, ec)) {
        if (entry.is_regular_file(ec) && entry.path().extension() == ".so") files.push_back(entry.path().string());
      }
      if (ec) {
        reports.push_back(fail(item, ErrorCode::not_found, fmt::format("cannot list directory: {}", ec.message())));
        continue;
      }
      std::sort(files.begin(), files.end());
      for (const std::string& f : files) reports.push_back(load_plugin(f, registry, options));
    } else {
      reports.push_back(load_plugin(item, registry, options));
    }
  }
  for (const PluginLoadReport& r : reports) {
    if (!r.status) spdlog::warn("kallpa: plugin {} not loaded: {}", r.path, r.status.message());
  }
  return reports;
}

const std::vector<PluginLoadReport>& load_env_plugins() {
  static std::vector<PluginLoadReport> reports;
  static std::once_flag once;
  std::call_once(once, [] {
    const char* isolated = std::getenv("KALLPA_PLUGIN_PATH");
    const char* trusted = std::getenv("KALLPA_TRUSTED_PLUGIN_PATH");
    const bool any = (isolated != nullptr && *isolated != '\0') || (trusted != nullptr && *trusted != '\0');
    if (!any) return;
    Result<PluginOptions> options = PluginOptions::from_env();
    if (!options) {
      reports.push_back({"KALLPA_PLUGIN_PATH", {}, options.status()});
      spdlog::warn("kallpa: plugins not loaded: {}", options.status().to_string());
      return;
    }
    if (isolated != nullptr && *isolated != '\0') reports = load_plugins(isolated, BackendRegistry::global(), *options);
    if (trusted != nullptr && *trusted != '\0') {
      options->isolation = PluginIsolation::in_process;
      std::vector<PluginLoadReport> more = load_plugins(trusted, BackendRegistry::global(), *options);
      reports.insert(reports.end(), more.begin(), more.end());
    }
  });
  return reports;
}

}  // namespace kallpa
