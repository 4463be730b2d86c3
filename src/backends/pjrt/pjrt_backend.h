// What the `pjrt` backend offers beyond the attention contract: which plugin and device it drives,
// its executable cache's counters, and compiling a problem's program ahead of time (warm-up, and
// the compiler's memory statistics). Free of PJRT types, so that front ends can use it without the
// PJRT header; they find the backend in the registry by name and dynamic_cast to this interface.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "kallpa/attention.h"
#include "kallpa/backend.h"
#include "kallpa/status.h"

namespace kallpa::pjrt {

// Environment: the plugin to load, the addressable device to run on (default 0), and the keys
// per step of the program's loop (a power of two; default kDefaultChunk).
inline constexpr char kPluginEnv[] = "KALLPA_PJRT_PLUGIN";
inline constexpr char kDeviceEnv[] = "KALLPA_PJRT_DEVICE";
inline constexpr char kChunkEnv[] = "KALLPA_PJRT_CHUNK";
inline constexpr std::int64_t kDefaultChunk = 512;
// First contact with the plugin (load, client, one compile and run) happens in a child process
// unless KALLPA_PJRT_ISOLATE=0, within KALLPA_PJRT_PROBE_TIMEOUT seconds (default below).
inline constexpr char kIsolateEnv[] = "KALLPA_PJRT_ISOLATE";
inline constexpr char kProbeTimeoutEnv[] = "KALLPA_PJRT_PROBE_TIMEOUT";
inline constexpr double kDefaultProbeSeconds = 120.0;
// Paged K/V whose cache states page versions is kept on the device between runs, up to
// KALLPA_PJRT_KV_MIRROR_BYTES of device memory over all pools (0: never; the least recently used
// pool goes first); runs then copy only the pages written since (docs/pjrt.md).
inline constexpr char kKvMirrorBytesEnv[] = "KALLPA_PJRT_KV_MIRROR_BYTES";
inline constexpr std::uint64_t kDefaultKvMirrorBytes = std::uint64_t{4} << 30;

struct PlatformInfo {
  std::string plugin_path;
  std::string api_version;  // "0.115"
  std::string platform;     // the client's platform name: "cpu", "tpu", ...
  std::string device_kind;  // of the chosen device
  std::size_t device_count = 0;
  int device_index = 0;
  std::int64_t chunk = kDefaultChunk;
};

// Counters of the executable cache and the KV mirrors since the process started;
// AttentionBackend::counters() publishes the same numbers (compiles, compile_failures,
// compile_seconds, cache_hits, executions, cached_executables, bytes_to_device, bytes_from_device,
// kv_pages_uploaded, kv_page_updates, kv_mirrors_created, kv_mirror_evictions, kv_mirrors,
// kv_mirror_bytes) for the server's /metrics and `kallpa backends`.
struct CacheStats {
  std::uint64_t compiles = 0;  // programs compiled (each a cache miss)
  std::uint64_t compile_failures = 0;
  std::uint64_t cache_hits = 0;  // runs that found their executable compiled
  std::uint64_t executions = 0;  // runs that executed (hit or fresh compile)
  // Host <-> device copies of runs (arguments up, o and lse down): q and the indices every run;
  // K/V pages every run, or, for a mirrored pool, only the pages that changed since last seen.
  std::uint64_t bytes_to_device = 0;
  std::uint64_t bytes_from_device = 0;
  double compile_milliseconds = 0.0;  // spent compiling, failed compiles included
  std::size_t cached_executables = 0;
  // The device's copies of paged K/V pools (kKvMirrorBytesEnv): pages written into them, update
  // programs run, copies started and evicted; copies and their bytes held now.
  std::uint64_t kv_pages_uploaded = 0;
  std::uint64_t kv_page_updates = 0;
  std::uint64_t kv_mirrors_created = 0;
  std::uint64_t kv_mirror_evictions = 0;
  std::uint64_t kv_mirrors = 0;
  std::uint64_t kv_mirror_bytes = 0;
};

struct CompileReport {
  std::string program_key;  // the executable cache key (program signature and shape bucket)
  bool cached = false;      // already compiled: nothing was compiled now
  double compile_milliseconds = 0.0;
  std::size_t program_bytes = 0;  // StableHLO text
  bool memory_known = false;      // the plugin reports compiled memory statistics
  std::int64_t argument_bytes = 0;
  std::int64_t output_bytes = 0;
  std::int64_t temp_bytes = 0;
  std::int64_t generated_code_bytes = 0;
};

class PjrtAttention : public AttentionBackend {
 public:
  // The plugin, API version and device; the reason when the backend cannot run (no plugin given,
  // not a PJRT plugin, unsupported API version, client creation failed, ...).
  virtual Result<PlatformInfo> platform() const = 0;
  virtual CacheStats cache_stats() const = 0;
  // Compiles (or finds cached) the executable that run() would use for `problem`: ahead-of-time
  // warm-up for a serving shape, and the compiler's memory statistics for it.
  virtual Result<CompileReport> compile(const ValidatedProblem& problem) = 0;
  // Compiles the same program ahead of time for a named device topology of the plugin (libtpu:
  // "v5e:2x2", "v6e:2x2", "v4:2x2x1", ...) without a client or device, and reports its memory:
  // proof that the TPU program compiles and fits, on a machine without a TPU. Nothing is cached.
  virtual Result<CompileReport> compile_for_target(const ValidatedProblem& problem, std::string_view topology) = 0;
};

}  // namespace kallpa::pjrt
