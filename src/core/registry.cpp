#include "kallpa/registry.h"

#include <algorithm>
#include <chrono>
#include <string_view>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "kallpa/health.h"

namespace kallpa {

std::string_view health_name(Health health) noexcept {
  switch (health) {
    case Health::unchecked: return "unchecked";
    case Health::healthy: return "healthy";
    case Health::quarantined: return "quarantined";
  }
  return "unknown";
}

bool valid_counter_name(std::string_view name) noexcept {
  if (name.empty() || name.front() < 'a' || name.front() > 'z') return false;
  const bool charset = std::all_of(name.begin(), name.end(),
                                   [](char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_'; });
  // The server appends `_total` to counters; a name carrying it already would render it twice.
  return charset && !name.ends_with("_total");
}

ExactRows AttentionOracle::compute_rows(const ValidatedProblem& problem, std::span<const OutputRow> rows) const {
  const ExactOutput all = compute_exact(problem);
  std::vector<std::int64_t> first_row(static_cast<std::size_t>(problem.batch()) + 1, 0);
  for (std::int32_t b = 0; b < problem.batch(); ++b) {
    first_row[static_cast<std::size_t>(b) + 1] = first_row[static_cast<std::size_t>(b)] + problem.seqlen_q(b);
  }
  const std::int64_t hq = problem.hq(), dv = problem.head_dim_v();
  ExactRows out;
  out.o.reserve(rows.size() * static_cast<std::size_t>(dv));
  out.lse.reserve(rows.size());
  for (const OutputRow& r : rows) {
    const std::int64_t at = (first_row[static_cast<std::size_t>(r.sequence)] + r.query) * hq + r.head;
    const auto o_begin = all.o.begin() + static_cast<std::ptrdiff_t>(at * dv);
    out.o.insert(out.o.end(), o_begin, o_begin + static_cast<std::ptrdiff_t>(dv));
    out.lse.push_back(all.lse[static_cast<std::size_t>(at)]);
  }
  return out;
}

BackendRegistry& BackendRegistry::global() {
  static BackendRegistry registry;
  // Set on first use, not in a constructor, so that built-ins registering during static
  // initialisation find a registry whatever the order of initialisation.
  static const bool configured = [] {
    registry.set_health_check(default_health_check());
    return true;
  }();
  (void)configured;
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
  auto it =
      std::find_if(entries_.begin(), entries_.end(), [&](const Entry& e) { return before(*backend, *e.backend); });
  entries_.insert(it, Entry{std::move(backend), Health::unchecked, {}, false, 0});
  check_pending_.store(true, std::memory_order_release);
  generation_.fetch_add(1, std::memory_order_acq_rel);
  return {};
}

std::vector<BackendInfo> BackendRegistry::list() const {
  std::lock_guard lock(mu_);
  std::vector<BackendInfo> out;
  out.reserve(entries_.size());
  for (const Entry& e : entries_) out.push_back({e.backend.get(), e.health, e.health_reason, e.run_failures});
  return out;
}

AttentionBackend* BackendRegistry::find(std::string_view name) const {
  std::lock_guard lock(mu_);
  for (const Entry& e : entries_) {
    if (e.backend->name() == name) return e.backend.get();
  }
  return nullptr;
}

const AttentionOracle* BackendRegistry::oracle() const {
  std::lock_guard lock(mu_);
  for (const Entry& e : entries_) {
    if (const AttentionOracle* o = e.backend->oracle(); o != nullptr) return o;
  }
  return nullptr;
}

Result<BackendInfo> BackendRegistry::info(std::string_view name) const {
  std::lock_guard lock(mu_);
  for (const Entry& e : entries_) {
    if (e.backend->name() == name) return BackendInfo{e.backend.get(), e.health, e.health_reason, e.run_failures};
  }
  return Status(ErrorCode::not_found, "backend", fmt::format("no backend named '{}'", name));
}

Status BackendRegistry::set_health(std::string_view name, Health health, std::string reason) {
  std::lock_guard lock(mu_);
  for (Entry& e : entries_) {
    if (e.backend->name() == name) {
      e.health = health;
      e.health_reason = std::move(reason);
      if (health == Health::unchecked) {
        e.check_done = false;
        e.run_failures = 0;
        check_pending_.store(true, std::memory_order_release);
      }
      generation_.fetch_add(1, std::memory_order_acq_rel);
      return {};
    }
  }
  return Status(ErrorCode::not_found, "backend", fmt::format("no backend named '{}'", name));
}

void BackendRegistry::set_health_check(
    std::function<std::vector<HealthReport>(const std::vector<AttentionBackend*>&)> check) {
  std::lock_guard lock(mu_);
  check_ = std::move(check);
  check_pending_.store(true, std::memory_order_release);
}

void BackendRegistry::ensure_checked(std::optional<DeviceKind> device) {
  // Stays set until the verdicts are in, so that concurrent first callers wait on check_mu_
  // instead of choosing among unchecked backends.
  if (!check_pending_.load(std::memory_order_acquire)) return;
  // A backend whose run() dispatches through this registry while being checked must not wait for
  // its own check.
  static thread_local const BackendRegistry* checking = nullptr;
  if (checking == this) return;
  std::lock_guard serial(check_mu_);
  std::vector<AttentionBackend*> todo;
  std::function<std::vector<HealthReport>(const std::vector<AttentionBackend*>&)> check;
  {
    std::lock_guard lock(mu_);
    check = check_;
    bool any_pending = false;
    for (const Entry& e : entries_) {
      if (e.check_done) continue;
      any_pending = true;
      if (!device || e.backend->device_kind() == *device) todo.push_back(e.backend.get());
    }
    if (!check || !any_pending) {
      check_pending_.store(false, std::memory_order_release);
      return;
    }
    if (todo.empty()) return;  // only other devices' backends are pending
  }
  struct Scope {
    const BackendRegistry*& slot;
    ~Scope() { slot = nullptr; }
  } scope{checking};
  checking = this;

  const auto start = std::chrono::steady_clock::now();
  std::vector<HealthReport> reports;
  try {
    reports = check(todo);
  } catch (const std::exception& e) {
    // A check that cannot run proves nothing either way: the backends stay unchecked.
    spdlog::error("kallpa: health check could not run: {}", e.what());
    reports.assign(todo.size(),
                   HealthReport{Health::unchecked, fmt::format("health check could not run: {}", e.what())});
  }
  reports.resize(todo.size(), HealthReport{Health::unchecked, "health check gave no verdict"});
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();

  std::vector<std::string> quarantined;
  {
    std::lock_guard lock(mu_);
    counters_.check_milliseconds += ms;
    for (std::size_t n = 0; n < todo.size(); ++n) {
      auto it =
          std::find_if(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.backend.get() == todo[n]; });
      if (it == entries_.end() || it->check_done) continue;
      it->check_done = true;
      // A verdict given meanwhile by hand (set_health) or at run time stands.
      if (it->health != Health::unchecked) continue;
      it->health = reports[n].health;
      it->health_reason = reports[n].reason;
      if (reports[n].health != Health::unchecked) ++counters_.checked;
      if (reports[n].health == Health::quarantined) {
        ++counters_.quarantined_at_check;
        quarantined.push_back(fmt::format("kallpa: backend '{}' quarantined by its health check: {}",
                                          it->backend->name(), reports[n].reason));
      }
    }
    // Backends added while the check ran keep it pending (add() sets it under mu_ too).
    if (std::all_of(entries_.begin(), entries_.end(), [](const Entry& e) { return e.check_done; })) {
      check_pending_.store(false, std::memory_order_release);
    }
    generation_.fetch_add(1, std::memory_order_acq_rel);
  }
  // Once per backend: a backend is checked once, and its verdict is final.
  for (const std::string& line : quarantined) spdlog::warn("{}", line);
  spdlog::debug("kallpa: health check of {} backend(s) took {:.1f} ms", todo.size(), ms);
}

bool BackendRegistry::record_failure(std::string_view name, const Status& error, int limit) {
  std::string message;
  {
    std::lock_guard lock(mu_);
    ++counters_.run_failures;
    auto it = std::find_if(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.backend->name() == name; });
    if (it == entries_.end()) return false;
    ++it->run_failures;
    // A lost backend (status.h) is quarantined at once: its process is gone or misbehaved.
    const bool lost = error.code() == ErrorCode::backend_lost;
    if (limit <= 0 || it->health == Health::quarantined ||
        (!lost && it->run_failures < static_cast<std::uint64_t>(limit))) {
      return false;
    }
    it->health = Health::quarantined;
    it->health_reason = fmt::format("{} run-time failure(s); last: {}", it->run_failures, error.to_string());
    ++counters_.quarantined_at_run;
    message = fmt::format("kallpa: backend '{}' quarantined at run time: {}", name, it->health_reason);
    generation_.fetch_add(1, std::memory_order_acq_rel);
  }
  spdlog::warn("{}", message);
  return true;
}

HealthCounters BackendRegistry::health_counters() const {
  std::lock_guard lock(mu_);
  return counters_;
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
