#include "kallpa/registry.h"

#include <algorithm>
#include <bit>
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

std::string AttentionBackend::identity() const { return fmt::format("{}@{}", name(), version()); }

SizeBucket size_bucket(const ValidatedProblem& problem) noexcept {
  SizeBucket b;
  const auto keys = static_cast<std::uint64_t>(std::max<std::int64_t>(problem.max_seqlen_k(), 1));
  b.keys_log2 = static_cast<std::int32_t>(std::bit_width(keys - 1));
  b.decode = problem.max_seqlen_q() <= 1;
  const ProblemSignature& sig = problem.signature();
  b.dtype = sig.q_dtype;
  b.paged = sig.kv_layout == KvLayout::paged;
  b.device = sig.device.kind;
  return b;
}

std::uint64_t SizeBucket::key() const noexcept {
  return static_cast<std::uint64_t>(keys_log2) | (std::uint64_t{decode} << 8) |
         (static_cast<std::uint64_t>(dtype) << 9) | (std::uint64_t{paged} << 17) |
         (static_cast<std::uint64_t>(device) << 18);
}

std::string SizeBucket::to_string() const {
  return fmt::format("keys<=2^{}/{}/{}/{}/{}", keys_log2, decode ? "decode" : "prefill", dtype_name(dtype),
                     paged ? "paged" : "unpaged", device_kind_name(device));
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
    registry.set_recheck(run_fuller_check);
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
  Entry entry;
  entry.backend = std::move(backend);
  entries_.insert(it, std::move(entry));
  check_pending_.store(true, std::memory_order_release);
  generation_.fetch_add(1, std::memory_order_acq_rel);
  return {};
}

std::vector<BackendInfo> BackendRegistry::list() const {
  std::lock_guard lock(mu_);
  std::vector<BackendInfo> out;
  out.reserve(entries_.size());
  for (const Entry& e : entries_) out.push_back(info_of(e));
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
    if (e.backend->name() == name) return info_of(e);
  }
  return Status(ErrorCode::not_found, "backend", fmt::format("no backend named '{}'", name));
}

Status BackendRegistry::require(std::string_view name, std::string_view field) const {
  if (find(name) != nullptr) return Status::ok();
  std::string known;
  for (const BackendInfo& info : list()) {
    if (!known.empty()) known += ", ";
    known += info.backend->name();
  }
  return Status(
      ErrorCode::not_found, std::string(field),
      fmt::format("no backend named '{}' (registered: {})", name, known.empty() ? std::string("none") : known));
}

BackendInfo BackendRegistry::info_of(const Entry& e) const {
  BackendInfo info;
  info.backend = e.backend.get();
  info.health = e.health;
  info.health_reason = e.health_reason;
  info.run_failures = e.run_failures;
  info.verification = e.verification;
  info.quarantined_buckets = e.quarantined_buckets;
  return info;
}

void BackendRegistry::journal_event(const AttentionBackend& backend, std::string_view event, std::string_view scope,
                                    std::string_view source, std::string_view reason) const {
  std::shared_ptr<QuarantineJournal> journal;
  {
    std::lock_guard lock(mu_);
    journal = journal_;
  }
  if (!journal) return;
  JournalRecord r;
  try {
    r.event = event;
    r.backend = backend.name();
    r.identity = backend.identity();
    r.scope = scope;
    r.source = source;
    r.reason = reason;
    r.time = journal_time_now();
  } catch (const std::exception& e) {
    spdlog::warn("kallpa: quarantine of '{}' not journaled: {}", backend.name(), e.what());
    return;
  }
  // The quarantine itself already holds in this process; a journal that cannot be written only
  // loses it for the next start, which is worth a warning, never a failed call.
  if (Status s = journal->append(r); !s) {
    spdlog::warn("kallpa: quarantine of '{}' not journaled: {}", backend.name(), s.to_string());
  }
}

Status BackendRegistry::set_health(std::string_view name, Health health, std::string reason) {
  const AttentionBackend* journaled = nullptr;
  std::string why;
  {
    std::lock_guard lock(mu_);
    auto it = std::find_if(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.backend->name() == name; });
    if (it == entries_.end()) {
      return Status(ErrorCode::not_found, "backend", fmt::format("no backend named '{}'", name));
    }
    Entry& e = *it;
    if (health == Health::quarantined && e.health != Health::quarantined) {
      journaled = e.backend.get();
      why = reason;
    }
    e.health = health;
    e.health_reason = std::move(reason);
    if (health == Health::unchecked) {
      e.check_done = false;
      e.run_failures = 0;
      check_pending_.store(true, std::memory_order_release);
    }
    generation_.fetch_add(1, std::memory_order_acq_rel);
  }
  if (journaled != nullptr) journal_event(*journaled, "quarantined", "backend", "manual", why);
  return {};
}

bool BackendRegistry::quarantine(std::string_view name, std::string_view source, std::string reason) {
  const AttentionBackend* backend = nullptr;
  {
    std::lock_guard lock(mu_);
    auto it = std::find_if(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.backend->name() == name; });
    if (it == entries_.end() || it->health == Health::quarantined) return false;
    it->health = Health::quarantined;
    it->health_reason = reason;
    if (source == "shadow_check") ++counters_.quarantined_by_verification;
    backend = it->backend.get();
    generation_.fetch_add(1, std::memory_order_acq_rel);
  }
  spdlog::warn("kallpa: backend '{}' quarantined ({}): {}", name, source, reason);
  journal_event(*backend, "quarantined", "backend", source, reason);
  return true;
}

BucketTrust BackendRegistry::bucket_trust(const AttentionBackend& backend, const SizeBucket& bucket) const {
  std::shared_lock lock(buckets_mu_);
  auto it = buckets_.find(BucketKey{&backend, bucket.key()});
  return it == buckets_.end() ? BucketTrust::unverified : it->second;
}

void BackendRegistry::set_bucket_trust(const AttentionBackend& backend, const SizeBucket& bucket, BucketTrust trust,
                                       std::string reason) {
  {
    std::unique_lock lock(buckets_mu_);
    BucketTrust& slot = buckets_[BucketKey{&backend, bucket.key()}];
    // Concurrent first calls each check; a mismatch any of them found stands.
    if (slot == BucketTrust::quarantined) return;
    slot = trust;
  }
  if (trust != BucketTrust::quarantined) return;
  const std::string scope = bucket.to_string();
  {
    std::lock_guard lock(mu_);
    ++counters_.buckets_quarantined;
    for (Entry& e : entries_) {
      if (e.backend.get() == &backend) e.quarantined_buckets.push_back(scope);
    }
  }
  spdlog::warn("kallpa: backend '{}' quarantined for size bucket {}: {}", backend.name(), scope, reason);
  journal_event(backend, "quarantined", scope, "first_use_check", reason);
}

void BackendRegistry::record_verification(const AttentionBackend& backend, VerifyKind kind, VerifyOutcome outcome,
                                          double seconds) {
  std::lock_guard lock(mu_);
  for (Entry& e : entries_) {
    if (e.backend.get() != &backend) continue;
    VerificationCounters& v = e.verification;
    if (outcome == VerifyOutcome::unverifiable) {
      ++v.unverifiable;
    } else if (kind == VerifyKind::first_use) {
      ++v.first_use_checks;
      v.first_use_mismatches += outcome == VerifyOutcome::mismatch ? 1 : 0;
      v.first_use_seconds += seconds;
    } else {
      ++v.shadow_checks;
      v.shadow_mismatches += outcome == VerifyOutcome::mismatch ? 1 : 0;
      v.shadow_seconds += seconds;
    }
    return;
  }
}

void BackendRegistry::set_journal(std::shared_ptr<QuarantineJournal> journal) {
  std::map<std::string, std::string> open;
  if (journal) {
    for (const auto& [identity, r] : open_quarantines(journal->read())) {
      open.emplace(identity, fmt::format("{}: {} ({}): {}", r.time, r.source, r.scope, r.reason));
    }
  }
  std::lock_guard lock(mu_);
  journal_ = std::move(journal);
  journal_open_ = std::move(open);
  // Backends already checked keep their verdict in this process; the journal holds builds at the
  // start, when no check has run yet.
  check_pending_.store(true, std::memory_order_release);
}

std::shared_ptr<QuarantineJournal> BackendRegistry::journal() const {
  std::lock_guard lock(mu_);
  return journal_;
}

void BackendRegistry::set_recheck(
    std::function<std::vector<HealthReport>(const std::vector<AttentionBackend*>&)> recheck) {
  std::lock_guard lock(mu_);
  recheck_ = std::move(recheck);
}

std::vector<HealthReport> BackendRegistry::run_checks(
    const std::vector<AttentionBackend*>& todo,
    const std::function<std::vector<HealthReport>(const std::vector<AttentionBackend*>&)>& check,
    const std::function<std::vector<HealthReport>(const std::vector<AttentionBackend*>&)>& recheck,
    const std::vector<std::string>& held, std::vector<std::string>* fuller_failures) {
  std::vector<AttentionBackend*> plain, fuller;
  for (std::size_t n = 0; n < todo.size(); ++n) (held[n].empty() ? plain : fuller).push_back(todo[n]);
  std::vector<HealthReport> plain_reports, fuller_reports;
  auto guarded = [](const auto& fn, const std::vector<AttentionBackend*>& batch) {
    std::vector<HealthReport> reports;
    if (batch.empty()) return reports;
    if (fn) {
      try {
        reports = fn(batch);
      } catch (const std::exception& e) {
        // A check that cannot run proves nothing either way: the backends stay unchecked.
        spdlog::error("kallpa: health check could not run: {}", e.what());
        reports.assign(batch.size(),
                       HealthReport{Health::unchecked, fmt::format("health check could not run: {}", e.what())});
      }
    }
    reports.resize(batch.size(), HealthReport{Health::unchecked, "health check gave no verdict"});
    return reports;
  };
  // Without a check, backends no journal holds stay unchecked and selectable, as before.
  if (check) plain_reports = guarded(check, plain);
  plain_reports.resize(plain.size(), HealthReport{Health::unchecked, {}});
  fuller_reports = guarded(recheck, fuller);
  std::vector<HealthReport> out(todo.size());
  fuller_failures->assign(todo.size(), std::string());
  std::size_t p = 0, f = 0;
  for (std::size_t n = 0; n < todo.size(); ++n) {
    if (held[n].empty()) {
      out[n] = std::move(plain_reports[p++]);
      continue;
    }
    HealthReport r = std::move(fuller_reports[f++]);
    (*fuller_failures)[n] = r.health == Health::quarantined ? r.reason : std::string();
    // Only a pass of the fuller check releases a journaled build; anything else keeps it held.
    if (r.health != Health::healthy) {
      r.reason = fmt::format("held by the quarantine journal ({}) until a fuller check passes; {}", held[n],
                             r.health == Health::quarantined ? "it failed: " + r.reason
                             : recheck                       ? "it gave no verdict: " + r.reason
                                                             : std::string("no fuller check is configured"));
      r.health = Health::quarantined;
    }
    out[n] = std::move(r);
  }
  return out;
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
  std::vector<std::string> held;           // per todo: the open journal quarantine holding it, or empty
  std::vector<std::string> held_identity;  // per todo: its identity when held
  std::function<std::vector<HealthReport>(const std::vector<AttentionBackend*>&)> check, recheck;
  {
    std::lock_guard lock(mu_);
    check = check_;
    recheck = recheck_;
    bool any_pending = false, any_held = false;
    for (const Entry& e : entries_) {
      if (e.check_done) continue;
      any_pending = true;
      if (!device || e.backend->device_kind() == *device) {
        todo.push_back(e.backend.get());
        std::string why, identity;
        if (!journal_open_.empty()) {
          try {
            identity = e.backend->identity();
            auto it = journal_open_.find(identity);
            if (it != journal_open_.end()) why = it->second;
          } catch (const std::exception&) {
            // Without its identity the journal cannot tell; the canaries decide as usual.
          }
        }
        any_held = any_held || !why.empty();
        held.push_back(std::move(why));
        held_identity.push_back(std::move(identity));
      }
    }
    if ((!check && !any_held) || !any_pending) {
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
  std::vector<std::string> fuller_failures;  // what the fuller check found, journaled as it is
  const std::vector<HealthReport> reports = run_checks(todo, check, recheck, held, &fuller_failures);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();

  std::vector<std::string> quarantined;
  // Journal records to write once the lock is released: (backend, event, source, reason).
  struct Pending {
    const AttentionBackend* backend;
    const char* event;
    const char* source;
    std::string reason;
  };
  std::vector<Pending> journal;
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
      if (!held[n].empty()) {
        if (reports[n].health == Health::healthy) {
          ++counters_.journal_cleared;
          journal_open_.erase(held_identity[n]);
          journal.push_back({it->backend.get(), "cleared", "recheck", "passed the fuller check"});
        } else {
          ++counters_.journal_held;
          quarantined.push_back(
              fmt::format("kallpa: backend '{}' stays quarantined: {}", it->backend->name(), reports[n].reason));
          // Journaled again only when the fuller check found something; a held build that was
          // not rechecked keeps its earlier record.
          if (!fuller_failures[n].empty()) {
            journal.push_back({it->backend.get(), "quarantined", "recheck", fuller_failures[n]});
          }
        }
        continue;
      }
      if (reports[n].health == Health::quarantined) {
        ++counters_.quarantined_at_check;
        quarantined.push_back(fmt::format("kallpa: backend '{}' quarantined by its health check: {}",
                                          it->backend->name(), reports[n].reason));
        journal.push_back({it->backend.get(), "quarantined", "health_check", reports[n].reason});
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
  for (const Pending& p : journal) journal_event(*p.backend, p.event, "backend", p.source, p.reason);
  spdlog::debug("kallpa: health check of {} backend(s) took {:.1f} ms", todo.size(), ms);
}

bool BackendRegistry::record_failure(std::string_view name, const Status& error, int limit) {
  std::string message;
  const AttentionBackend* backend = nullptr;
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
    backend = it->backend.get();
    generation_.fetch_add(1, std::memory_order_acq_rel);
  }
  spdlog::warn("{}", message);
  journal_event(*backend, "quarantined", "backend", "run_failures",
                fmt::format("{} run-time failure(s); last: {}", limit, error.to_string()));
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
