// The set of attention backends known to a process. Built-in backends add themselves to the global
// registry at load time (KALLPA_REGISTER_BACKEND); the core names none of them.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
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
  Result<BackendInfo> info(std::string_view name) const;

  Status set_health(std::string_view name, Health health, std::string reason = {});

  // Bumped on every change, so that dispatchers know when their cached choices are stale.
  std::uint64_t generation() const noexcept { return generation_.load(std::memory_order_acquire); }

 private:
  struct Entry {
    std::unique_ptr<AttentionBackend> backend;
    Health health = Health::unchecked;
    std::string health_reason;
  };
  mutable std::mutex mu_;
  std::vector<Entry> entries_;  // kept in selection order
  std::atomic<std::uint64_t> generation_{1};
};

namespace detail {
struct BackendRegistrar {
  explicit BackendRegistrar(std::unique_ptr<AttentionBackend> backend);
};
}  // namespace detail

}  // namespace kallpa

// Registers a default-constructed backend of class TYPE into the global registry at load time.
#define KALLPA_REGISTER_BACKEND(TYPE) \
  static const ::kallpa::detail::BackendRegistrar kallpa_registrar_##TYPE{std::make_unique<TYPE>()}
