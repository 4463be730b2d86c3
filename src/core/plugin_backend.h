// An AttentionBackend over a plugin's C table (plugin_abi.h): converts signatures and problems to
// the C structs, turns C error codes into Status, and catches C++ exceptions at the boundary.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "kallpa/backend.h"
#include "kallpa/plugin_abi.h"

namespace kallpa::detail {

// Owns the dlopen handle: the plugin's destroy runs, then the library is closed.
struct LibraryHandle {
  void* handle = nullptr;
  ~LibraryHandle();
};

class PluginBackend final : public AttentionBackend {
 public:
  // `table` is the plugin's table copied into a full-size struct (fields past the plugin's
  // struct_size zeroed); strings are copied, so the plugin's memory is not read for them again.
  PluginBackend(std::shared_ptr<LibraryHandle> library, const kallpa_plugin_table& table, std::string path);
  ~PluginBackend() override;
  PluginBackend(const PluginBackend&) = delete;
  PluginBackend& operator=(const PluginBackend&) = delete;

  std::string_view name() const noexcept override { return name_; }
  std::string_view version() const noexcept override { return version_; }
  DeviceKind device_kind() const noexcept override { return device_; }
  int priority() const noexcept override { return table_.priority; }
  std::string_view description() const noexcept override { return description_; }
  // name@version#fnv1a64:HASH of the library file.
  std::string identity() const override { return identity_; }
  Support supports(const ProblemSignature& signature) const noexcept override;
  std::size_t workspace_size(const ValidatedProblem& problem) const noexcept override;
  Status run(const ValidatedProblem& problem, Workspace workspace) noexcept override;

 private:
  std::shared_ptr<LibraryHandle> library_;
  kallpa_plugin_table table_;
  std::string path_, name_, version_, description_, identity_;
  DeviceKind device_;
};

// dlopens a plugin library in this process, checks its table and wraps it (field of an error: the
// path). Used by in-process loading and by the plugin host.
Result<std::unique_ptr<PluginBackend>> open_plugin(const std::string& path);

kallpa_signature to_c(const ProblemSignature& signature) noexcept;
// `signature` must outlive the result (the problem points at it).
kallpa_problem to_c(const ValidatedProblem& problem, const kallpa_signature& signature) noexcept;

// A plugin's build identity, in process or isolated: name@version#fnv1a64:HASH, HASH the 64-bit
// FNV-1a of the library file's bytes ("unreadable" when it cannot be read back).
std::string plugin_identity(std::string_view name, std::string_view version, const std::string& path);

}  // namespace kallpa::detail
