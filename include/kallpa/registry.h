// The set of attention backends known to a process. Built-in backends add themselves to the global
// registry at load time (KALLPA_REGISTER_BACKEND); the core names none of them.
//
// Health: a backend starts unchecked. ensure_checked() (called by dispatchers before they choose)
// runs the registry's health check once for every backend not checked yet; a failure quarantines
// it. At run time, record_failure() counts failures and quarantines a backend at a limit. The
// global registry checks with canary cases (health.h); a registry made by hand checks nothing
// until set_health_check() gives it a check, so its backends stay unchecked (and selectable).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kallpa/backend.h"

namespace kallpa {

enum class Health : std::uint8_t {
  unchecked = 0,  // registered; no canary run yet
  healthy = 1,
  quarantined = 2,  // never selected; see BackendInfo::health_reason
};

std::string_view health_name(Health health) noexcept;

struct BackendInfo {
  AttentionBackend* backend = nullptr;  // owned by the registry, alive as long as it
  Health health = Health::unchecked;
  std::string health_reason;
  std::uint64_t run_failures = 0;  // recorded by dispatchers (record_failure)
};

// One backend's health check verdict.
struct HealthReport {
  Health health = Health::unchecked;  // healthy, quarantined, or unchecked (nothing applied/skipped)
  std::string reason;                 // quarantined: "canary 'CASE': FAILURE"; unchecked: why
  std::size_t cases_run = 0;
  std::size_t cases_skipped = 0;  // the backend does not support the case's signature
};

// What the registry's health machinery has done so far (for metrics and `kallpa backends`).
struct HealthCounters {
  std::uint64_t checked = 0;  // backends that went through a health check
  std::uint64_t quarantined_at_check = 0;
  std::uint64_t quarantined_at_run = 0;  // by record_failure reaching its limit
  std::uint64_t run_failures = 0;        // every failure recorded
  double check_milliseconds = 0.0;       // wall time spent in health checks
};

class BackendRegistry {
 public:
  BackendRegistry() = default;
  BackendRegistry(const BackendRegistry&) = delete;
  BackendRegistry& operator=(const BackendRegistry&) = delete;

  // The process-wide registry that built-in backends register into.
  static BackendRegistry& global();

  // Fails (invalid_argument) on an empty or duplicate name.
  Status add(std::unique_ptr<AttentionBackend> backend);

  // Snapshot, sorted by descending priority then name (the automatic selection order).
  std::vector<BackendInfo> list() const;
  AttentionBackend* find(std::string_view name) const;
  // The oracle: the first backend, in selection order, whose oracle() is non-null; nullptr when
  // none is registered.
  const AttentionOracle* oracle() const;
  Result<BackendInfo> info(std::string_view name) const;

  Status set_health(std::string_view name, Health health, std::string reason = {});

  // The check ensure_checked() runs; an empty function checks nothing. Backends already checked
  // keep their verdict; set_health(name, Health::unchecked) makes one eligible again.
  void set_health_check(std::function<std::vector<HealthReport>(const std::vector<AttentionBackend*>&)> check);
  // Runs the health check for every backend that has not been through one yet; with `device`, only
  // for the backends of that device kind (a dispatcher checks the device its problem is on, so a
  // CPU-only program never starts an OpenCL or CUDA runtime for canaries). Thread-safe: the first
  // caller checks, concurrent callers wait for its verdicts. Cheap when nothing is pending.
  void ensure_checked(std::optional<DeviceKind> device = std::nullopt);

  // Counts a run-time failure of `name`. When `limit` > 0 and the backend has now failed `limit`
  // times, or the error is ErrorCode::backend_lost (its process died, hung or wrote out of
  // bounds), it is quarantined (logged once) and true is returned.
  bool record_failure(std::string_view name, const Status& error, int limit);

  HealthCounters health_counters() const;

  // Bumped on every change, so that dispatchers know when their cached choices are stale.
  std::uint64_t generation() const noexcept { return generation_.load(std::memory_order_acquire); }

 private:
  struct Entry {
    std::unique_ptr<AttentionBackend> backend;
    Health health = Health::unchecked;
    std::string health_reason;
    bool check_done = false;  // went through ensure_checked (whatever the verdict)
    std::uint64_t run_failures = 0;
  };
  mutable std::mutex mu_;
  std::vector<Entry> entries_;  // kept in selection order
  std::atomic<std::uint64_t> generation_{1};

  std::mutex check_mu_;  // serialises health checks; held while one runs
  std::atomic<bool> check_pending_{false};
  std::function<std::vector<HealthReport>(const std::vector<AttentionBackend*>&)> check_;  // under mu_
  HealthCounters counters_;                                                                // under mu_
};

namespace detail {
struct BackendRegistrar {
  explicit BackendRegistrar(std::unique_ptr<AttentionBackend> backend);
};
}  // namespace detail

}  // namespace kallpa

// Registers a default-constructed backend of class TYPE into the global registry at load time.
#define KALLPA_REGISTER_BACKEND(TYPE) \
  static const ::kallpa::detail::BackendRegistrar kallpa_registrar_##TYPE { std::make_unique<TYPE>() }
