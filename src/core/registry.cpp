#include "kallpa/registry.h"

#include <algorithm>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

namespace kallpa {

std::string_view health_name(Health health) noexcept {
  switch (health) {
    case Health::unchecked: return "unchecked";
    case Health::healthy: return "healthy";
    case Health::quarantined: return "quarantined";
  }
  return "unknown";
}

BackendRegistry& BackendRegistry::global() {
  static BackendRegistry registry;
  return registry;
}

Status BackendRegistry::add(std::unique_ptr<AttentionBackend> backend) {
  if (!backend) return Status::invalid("backend", "is null");
  const std::string_view name = backend->name();
  if (name.empty()) return Status::invalid("backend.name", "is empty");
  std::lock_guard lock(mu_);
  for (const Entry& e : entries_) {
    if (e.backend->name() == name) {
      return Status::invalid("backend.name", fmt::format("'{}' is already registered", name));
    }
  }
  // Keep selection order: descending priority, then name, so automatic choice is deterministic.
  auto before = [](const AttentionBackend& a, const AttentionBackend& b) {
    if (a.priority() != b.priority()) return a.priority() > b.priority();
    return a.name() < b.name();
  };
  auto it = std::find_if(entries_.begin(), entries_.end(),
                         [&](const Entry& e) { return before(*backend, *e.backend); });
  entries_.insert(it, Entry{std::move(backend), Health::unchecked, {}});
  generation_.fetch_add(1, std::memory_order_acq_rel);
  return {};
}

std::vector<BackendInfo> BackendRegistry::list() const {
  std::lock_guard lock(mu_);
  std::vector<BackendInfo> out;
  out.reserve(entries_.size());
  for (const Entry& e : entries_) out.push_back({e.backend.get(), e.health, e.health_reason});
  return out;
}

AttentionBackend* BackendRegistry::find(std::string_view name) const {
  std::lock_guard lock(mu_);
  for (const Entry& e : entries_) {
    if (e.backend->name() == name) return e.backend.get();
  }
  return nullptr;
}

Result<BackendInfo> BackendRegistry::info(std::string_view name) const {
  std::lock_guard lock(mu_);
  for (const Entry& e : entries_) {
    if (e.backend->name() == name) return BackendInfo{e.backend.get(), e.health, e.health_reason};
  }
  return Status(ErrorCode::not_found, "backend", fmt::format("no backend named '{}'", name));
}

Status BackendRegistry::set_health(std::string_view name, Health health, std::string reason) {
  std::lock_guard lock(mu_);
  for (Entry& e : entries_) {
    if (e.backend->name() == name) {
      e.health = health;
      e.health_reason = std::move(reason);
      generation_.fetch_add(1, std::memory_order_acq_rel);
      return {};
    }
  }
  return Status(ErrorCode::not_found, "backend", fmt::format("no backend named '{}'", name));
}

namespace detail {
BackendRegistrar::BackendRegistrar(std::unique_ptr<AttentionBackend> backend) {
  const std::string name(backend ? backend->name() : "");
  Status s = BackendRegistry::global().add(std::move(backend));
  // Registration runs during static initialisation, where there is no caller to return to.
  if (!s) spdlog::error("kallpa: built-in backend '{}' not registered: {}", name, s.to_string());
}
}  // namespace detail

}  // namespace kallpa
