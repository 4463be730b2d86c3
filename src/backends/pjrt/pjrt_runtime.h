// A PJRT plugin driven through its C API alone (dlopen, no XLA linked): loading with version
// negotiation, one client on one device, compiling StableHLO text, host <-> device buffers and
// execution. Every PJRT object is held by an RAII wrapper, and every PJRT_Error becomes a Status
// that names the call that failed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kallpa/status.h"
#include "kallpa/tensor.h"

// The PJRT types this interface passes around, opaque here: only pjrt_runtime.cpp includes XLA's
// header (which GCC's -Wpedantic rejects in C++, so that one file is built without it).
struct PJRT_Api;
struct PJRT_Error;
struct PJRT_Client;
struct PJRT_Device;
struct PJRT_Buffer;
struct PJRT_LoadedExecutable;

namespace kallpa::pjrt {

// The PJRT API versions this backend drives. Major 0 only (a major bump breaks the ABI). Minors
// from the oldest plugin tested (0.81) up to a bound well past the newest seen: minor bumps only
// append fields, and each slot is checked against PJRT_Api.struct_size before use, but a minor far
// beyond anything released is a sign of a file that is not a real plugin.
inline constexpr int kSupportedMajor = 0;
inline constexpr int kMinSupportedMinor = 81;
inline constexpr int kMaxSupportedMinor = 199;

// Memory the compiler reports for one executable (PJRT_Executable_GetCompiledMemoryStats).
struct MemoryStats {
  std::int64_t argument_bytes = 0;
  std::int64_t output_bytes = 0;
  std::int64_t temp_bytes = 0;
  std::int64_t generated_code_bytes = 0;
};

// A loaded, initialised plugin. Shared by the client and everything made from it, so that the
// library stays loaded while any PJRT object is alive. The library is never dlclose'd: plugins
// start threads and register atexit handlers that must outlive any unload.
class Plugin {
 public:
  // dlopen + GetPjrtApi + version and struct_size checks + PJRT_Plugin_Initialize. Errors:
  // not_found (no file, no GetPjrtApi), unsupported (API version or a missing slot), and
  // backend_failure (the plugin's own initialisation failed).
  static Result<std::shared_ptr<Plugin>> load(const std::string& path);

  const PJRT_Api& api() const noexcept { return *api_; }
  const std::string& path() const noexcept { return path_; }
  int major() const noexcept { return major_; }
  int minor() const noexcept { return minor_; }
  std::string version_string() const;
  // Whether the API table holds a non-null slot at `offset` (offsetof(PJRT_Api, slot)).
  bool has_slot(std::size_t offset) const noexcept;

  // An ok Status when `error` is null; otherwise the error's message and code as a
  // backend_failure naming `call`. Destroys the error either way.
  Status check(PJRT_Error* error, std::string_view call) const;

  // Ahead-of-time compile for a named device topology (libtpu: "v5e:2x2", "v6e:2x2", ...), with no
  // client and no device: what the compiled program needs, for a TPU that is not here. unsupported
  // when the plugin lacks the topology or AOT compile slots.
  Result<MemoryStats> compile_for_topology(std::string_view topology, std::string_view mlir) const;

 private:
  Plugin() = default;
  const PJRT_Api* api_ = nullptr;
  std::string path_;
  int major_ = 0;
  int minor_ = 0;
};

class Client;

class Buffer {
 public:
  Buffer() = default;
  Buffer(std::shared_ptr<const Plugin> plugin, PJRT_Buffer* buffer) noexcept
      : plugin_(std::move(plugin)), buffer_(buffer) {}
  Buffer(Buffer&& other) noexcept { *this = std::move(other); }
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { reset(); }

  PJRT_Buffer* get() const noexcept { return buffer_; }
  void reset() noexcept;
  // Copies the whole buffer into `dst` (exactly `bytes` long) and waits for the copy.
  Status to_host(void* dst, std::size_t bytes) const;

 private:
  std::shared_ptr<const Plugin> plugin_;
  PJRT_Buffer* buffer_ = nullptr;
};

class Executable {
 public:
  Executable(std::shared_ptr<const Plugin> plugin, PJRT_LoadedExecutable* exe, std::size_t num_outputs) noexcept
      : plugin_(std::move(plugin)), exe_(exe), num_outputs_(num_outputs) {}
  Executable(const Executable&) = delete;
  Executable& operator=(const Executable&) = delete;
  ~Executable();

  std::size_t num_outputs() const noexcept { return num_outputs_; }
  // Runs on `device` with the given arguments; returns the outputs once the device is done.
  Result<std::vector<Buffer>> execute(PJRT_Device* device, const std::vector<PJRT_Buffer*>& args) const;
  Result<MemoryStats> memory_stats() const;

 private:
  friend class Client;
  std::shared_ptr<const Plugin> plugin_;
  PJRT_LoadedExecutable* exe_ = nullptr;
  std::size_t num_outputs_ = 0;
};

// Element types that cross the host boundary.
enum class ElementType : std::uint8_t { f32, f16, bf16, s32 };

// The element type of a kallpa dtype's buffers.
inline ElementType element_type(DType t) noexcept {
  switch (t) {
    case DType::f32: return ElementType::f32;
    case DType::f16: return ElementType::f16;
    case DType::bf16: return ElementType::bf16;
  }
  return ElementType::f32;
}

class Client {
 public:
  // Creates a client and picks addressable device `device_index`.
  static Result<std::unique_ptr<Client>> create(std::shared_ptr<const Plugin> plugin, int device_index);
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;
  ~Client();

  const Plugin& plugin() const noexcept { return *plugin_; }
  PJRT_Device* device() const noexcept { return device_; }
  const std::string& platform() const noexcept { return platform_; }
  const std::string& device_kind() const noexcept { return device_kind_; }
  std::size_t device_count() const noexcept { return device_count_; }

  // Compiles StableHLO text (MLIR) for one replica and one partition.
  Result<std::unique_ptr<Executable>> compile(std::string_view mlir) const;
  // Copies a dense row-major host array to the device; returns once the host memory is free again.
  Result<Buffer> upload(const void* data, ElementType type, const std::vector<std::int64_t>& dims) const;

 private:
  Client() = default;
  std::shared_ptr<const Plugin> plugin_;
  PJRT_Client* client_ = nullptr;
  PJRT_Device* device_ = nullptr;
  std::size_t device_count_ = 0;
  std::string platform_;
  std::string device_kind_;
};

// The serialized CompileOptionsProto every compile passes: executable_build_options with
// num_replicas = 1 and num_partitions = 1 (an empty message is rejected, a malformed one aborts).
inline constexpr char kCompileOptions[] = {0x1a, 0x04, 0x20, 0x01, 0x28, 0x01};

}  // namespace kallpa::pjrt
