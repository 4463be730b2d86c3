// The set of attention backends known to a process. Built-in backends add themselves to the global
// registry at load time (KALLPA_REGISTER_BACKEND); the core names none of them.
//
// Health: a backend starts unchecked. ensure_checked() (called by dispatchers before they choose)
// runs the registry's health check once for every backend not checked yet; a failure quarantines
// it. At run time, record_failure() counts failures and quarantines a backend at a limit. The
// global registry checks with canary cases (health.h); a registry made by hand checks nothing
// until set_health_check() gives it a check, so its backends stay unchecked (and selectable).
//
// Size buckets: a dispatcher checks a backend's first call in each size bucket (SizeBucket) on
// sampled rows against the oracle; the registry keeps the verdict per (backend, bucket), so every
// dispatcher over it trusts the same buckets. A mismatch there quarantines the backend for that
// bucket only; a mismatch found by shadow verification quarantines it entirely (dispatcher.h).
//
// Journal: with set_journal(), every quarantine, whatever its source, is appended to an on-disk
// journal (quarantine_journal.h); a backend whose build identity has an open quarantine there stays
// quarantined at the next start until the fuller check (set_recheck) passes on it.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kallpa/backend.h"
#include "kallpa/quarantine_journal.h"

namespace kallpa {

enum class Health : std::uint8_t {
  unchecked = 0,  // registered; no canary run yet
  healthy = 1,
  quarantined = 2,  // never selected; see BackendInfo::health_reason
};

std::string_view health_name(Health health) noexcept;

// Where a backend is checked before it is trusted: the power of two that bounds the largest key
// count of any sequence, prefill or decode (every sequence has at most one query), and the parts of
// the signature that select different kernels in every backend we know: the dtype, a paged KV cache
// or not, and the device kind. Other features (causal, window, softcap, ...) share a bucket: the
// canaries and the conformance suite cover them at small sizes; what they cannot cover is size.
struct SizeBucket {
  std::int32_t keys_log2 = 0;  // max keys per sequence <= 2^keys_log2
  bool decode = false;
  DType dtype = DType::f32;  // q's
  bool paged = false;
  DeviceKind device = DeviceKind::cpu;

  friend bool operator==(const SizeBucket&, const SizeBucket&) = default;
  std::uint64_t key() const noexcept;
  // e.g. "keys<=2^13/decode/f16/paged/cpu"
  std::string to_string() const;
};
SizeBucket size_bucket(const ValidatedProblem& problem) noexcept;

// A backend's standing in one size bucket.
enum class BucketTrust : std::uint8_t {
  unverified = 0,    // no call checked there yet: the next call is checked before its answer is used
  verified = 1,      // a first-use check passed
  unverifiable = 2,  // a first-use check could not run (outputs not in host memory, no oracle): trusted, counted
  quarantined = 3,   // a first-use check found a mismatch: never run there again
};

// Sampled-row checks of one backend (dispatcher.h): first use in a size bucket, and shadow checks.
struct VerificationCounters {
  std::uint64_t first_use_checks = 0;  // checks that ran (pass or mismatch)
  std::uint64_t first_use_mismatches = 0;
  double first_use_seconds = 0.0;  // wall time of those checks (oracle rows and comparison)
  std::uint64_t shadow_checks = 0;
  std::uint64_t shadow_mismatches = 0;
  double shadow_seconds = 0.0;
  std::uint64_t unverifiable = 0;  // checks that could not run (see BucketTrust::unverifiable)
};

enum class VerifyKind : std::uint8_t { first_use = 0, shadow = 1 };
enum class VerifyOutcome : std::uint8_t { passed = 0, mismatch = 1, unverifiable = 2 };

struct BackendInfo {
  AttentionBackend* backend = nullptr;  // owned by the registry, alive as long as it
  Health health = Health::unchecked;
  std::string health_reason;
  std::uint64_t run_failures = 0;  // recorded by dispatchers (record_failure)
  VerificationCounters verification;
  std::vector<std::string> quarantined_buckets;  // SizeBucket::to_string() of each
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
  std::uint64_t quarantined_at_run = 0;           // by record_failure reaching its limit
  std::uint64_t quarantined_by_verification = 0;  // shadow mismatches (the whole backend)
  std::uint64_t buckets_quarantined = 0;          // first-use mismatches (one bucket each)
  std::uint64_t journal_held = 0;                 // kept quarantined at start by the journal
  std::uint64_t journal_cleared = 0;              // journaled builds that passed the fuller check
  std::uint64_t run_failures = 0;                 // every failure recorded
  double check_milliseconds = 0.0;                // wall time spent in health checks
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
  // Ok when `name` is registered; otherwise not_found naming `field`, the message listing the
  // registered names (what a user who mistyped one needs to see).
  Status require(std::string_view name, std::string_view field) const;

  // Quarantining by hand is journaled like any other quarantine (source "manual").
  Status set_health(std::string_view name, Health health, std::string reason = {});

  // Quarantines `name` entirely (never selected again in this process) and journals it with
  // `source` ("shadow_check", "plugin_crash", ...). False when there is no such backend or it
  // was quarantined already.
  bool quarantine(std::string_view name, std::string_view source, std::string reason);

  // Size buckets (SizeBucket). Thread-safe and cheap: one shared lock and a hash lookup.
  BucketTrust bucket_trust(const AttentionBackend& backend, const SizeBucket& bucket) const;
  // Records a first-use verdict. A quarantine always wins over a concurrent pass; quarantining
  // logs, counts and journals the bucket (source "first_use_check").
  void set_bucket_trust(const AttentionBackend& backend, const SizeBucket& bucket, BucketTrust trust,
                        std::string reason = {});
  // Counts one sampled-row check of `backend`.
  void record_verification(const AttentionBackend& backend, VerifyKind kind, VerifyOutcome outcome, double seconds);

  // Opens the journal: its open quarantines (by build identity) hold the matching backends,
  // registered now or later, quarantined until the fuller check passes; from now on every
  // quarantine is appended to it. nullptr turns journaling off.
  void set_journal(std::shared_ptr<QuarantineJournal> journal);
  std::shared_ptr<QuarantineJournal> journal() const;
  // The fuller check a backend held by the journal must pass (the global registry's: the default
  // conformance tier, health.h); without one such a backend stays quarantined.
  void set_recheck(std::function<std::vector<HealthReport>(const std::vector<AttentionBackend*>&)> recheck);

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
    VerificationCounters verification;
    std::vector<std::string> quarantined_buckets;
  };
  BackendInfo info_of(const Entry& e) const;
  // Appends a quarantine (or "cleared") record for `backend` when a journal is set; never fails.
  void journal_event(const AttentionBackend& backend, std::string_view event, std::string_view scope,
                     std::string_view source, std::string_view reason) const;
  // Reports for `todo` from the canary check, or for backends held by the journal, the recheck
  // (*fuller_failures: per todo, the recheck's own failure, empty when none).
  std::vector<HealthReport> run_checks(
      const std::vector<AttentionBackend*>& todo,
      const std::function<std::vector<HealthReport>(const std::vector<AttentionBackend*>&)>& check,
      const std::function<std::vector<HealthReport>(const std::vector<AttentionBackend*>&)>& recheck,
      const std::vector<std::string>& held, std::vector<std::string>* fuller_failures);

  mutable std::mutex mu_;
  std::vector<Entry> entries_;  // kept in selection order
  std::atomic<std::uint64_t> generation_{1};

  std::mutex check_mu_;  // serialises health checks; held while one runs
  std::atomic<bool> check_pending_{false};
  std::function<std::vector<HealthReport>(const std::vector<AttentionBackend*>&)> check_;    // under mu_
  HealthCounters counters_;                                                                  // under mu_
  std::function<std::vector<HealthReport>(const std::vector<AttentionBackend*>&)> recheck_;  // under mu_
  std::shared_ptr<QuarantineJournal> journal_;                                               // under mu_
  // Open journal quarantines by build identity: "time: source: reason" of the last one.
  std::map<std::string, std::string> journal_open_;  // under mu_

  struct BucketKey {
    const AttentionBackend* backend;
    std::uint64_t bucket;
    friend bool operator==(const BucketKey&, const BucketKey&) = default;
  };
  struct BucketKeyHash {
    std::size_t operator()(const BucketKey& k) const noexcept {
      return std::hash<const void*>()(k.backend) ^ (k.bucket * 0x9E3779B97F4A7C15ull);
    }
  };
  mutable std::shared_mutex buckets_mu_;
  std::unordered_map<BucketKey, BucketTrust, BucketKeyHash> buckets_;  // under buckets_mu_
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
