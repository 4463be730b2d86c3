// Selection, fallback and telemetry for attention calls.
//
//   kallpa::Dispatcher dispatcher;                 // global registry, automatic choice
//   kallpa::Status s = dispatcher.run(problem);     // validate, choose, run, fall back if needed
//   auto verdicts = dispatcher.explain(problem);   // why each backend was or was not chosen
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "kallpa/attention.h"
#include "kallpa/observer.h"
#include "kallpa/registry.h"

namespace kallpa {

struct DispatchOptions {
  // Explicit choice: the first backend in this list that supports the problem runs. Empty means
  // automatic choice by priority among healthy backends on the tensors' device.
  std::vector<std::string> backends;
  // Strict: an explicit choice that cannot run the problem is an error, never a fallback to
  // another backend (neither at selection nor after a run-time failure). Without an explicit
  // list, the automatic choice runs and its failure is an error.
  bool strict = false;
  // Paranoid: after each run, check o and lse for non-finite values the contract forbids (finite
  // inputs give finite outputs); one is a failure of the backend like an error it returns. Costs a
  // pass over the outputs.
  bool paranoid = false;
  // A backend whose run fails (error, exception at a plugin boundary, paranoid check) this many
  // times in the process is quarantined in the registry; 0 never quarantines.
  int quarantine_after = 3;
  // First-use checks: the first call of a backend in each size bucket (registry.h, SizeBucket) is
  // checked on sampled rows against the oracle before its answer is returned. A mismatch
  // quarantines the backend for that bucket only (it keeps serving the buckets it passed) and the
  // call runs again on the next candidate. Concurrent first calls in a bucket each check; none
  // waits for another. The oracle itself is never checked.
  bool first_use_check = true;
  // Shadow verification: the fraction of calls (0..1) whose answer is checked on a few random
  // rows before it is returned. A mismatch quarantines the backend entirely and the call runs
  // again on the next candidate. The default, 1 in 1,000, costs well under 1% of decode throughput
  // (bench/results/verification.md).
  double verify_rate = 0.001;
  // Seeds which calls and rows are checked; 0 draws a seed from the system.
  std::uint64_t verify_seed = 0;

  // Reads KALLPA_ATTENTION ("name[,name...]"), KALLPA_ATTENTION_STRICT, KALLPA_PARANOID and
  // KALLPA_FIRST_USE_CHECK ("1"/"true"/"0"/"false"), KALLPA_QUARANTINE_AFTER (an integer >= 0) and
  // KALLPA_VERIFY_RATE (parse_rate); a malformed value is an error naming the variable.
  static Result<DispatchOptions> from_env();
  // A verification rate: a fraction in [0, 1] ("0.001") or one in N ("1/1000"; "0" is off).
  static Result<double> parse_rate(std::string_view text);
  // Parses a comma-separated list; rejects empty items.
  static Result<std::vector<std::string>> parse_backend_list(std::string_view text);
};

struct Verdict {
  std::string backend;
  Health health = Health::unchecked;
  bool supported = false;
  bool selected = false;  // the one run() would try first
  int rank = -1;          // position in the candidate order, -1 when not a candidate
  std::string reason;     // why not (or why it is not first)
};

class Dispatcher {
 public:
  // Over the global registry, also loads KALLPA_PLUGIN_PATH (once per process, plugin.h).
  explicit Dispatcher(DispatchOptions options = {}, BackendRegistry* registry = &BackendRegistry::global());

  // Validates, selects and runs; on a backend failure, counts it (quarantining the backend at
  // options().quarantine_after) and tries the next candidate (unless strict). Before the first
  // choice, the registry's health check runs for backends not yet checked.
  Status run(const AttentionProblem& problem);
  Status run(const ValidatedProblem& problem);

  // The ordered candidates for a problem signature, or why there are none. Cached per signature.
  Result<std::vector<AttentionBackend*>> candidates(const ProblemSignature& signature);

  // Every registered backend's verdict on the problem, in registry order.
  std::vector<Verdict> explain(const ProblemSignature& signature) const;

  void add_observer(std::shared_ptr<DispatchObserver> observer);
  const DispatchOptions& options() const noexcept { return options_; }
  BackendRegistry& registry() const noexcept { return *registry_; }

 private:
  using Candidates = std::shared_ptr<const std::vector<AttentionBackend*>>;
  Result<Candidates> lookup(const ProblemSignature& signature);
  Result<std::vector<AttentionBackend*>> compute_candidates(const ProblemSignature& signature) const;
  void notify(const DispatchEvent& event) const noexcept;
  void warn_once(const std::string& key, const std::string& message);

  struct SignatureHash {
    std::size_t operator()(const ProblemSignature& s) const noexcept { return s.hash(); }
  };

  DispatchOptions options_;
  BackendRegistry* registry_;

  mutable std::shared_mutex cache_mu_;
  std::uint64_t cache_generation_ = 0;
  std::unordered_map<ProblemSignature, Candidates, SignatureHash> cache_;

  mutable std::mutex observers_mu_;
  std::shared_ptr<const std::vector<std::shared_ptr<DispatchObserver>>> observers_;

  std::mutex warned_mu_;
  std::vector<std::string> warned_;

  // Draws for shadow verification and row sampling: call n uses splitmix64(seed ^ n).
  std::uint64_t verify_seed_ = 0;
  std::uint64_t verify_threshold_ = 0;  // a call is checked when its draw is below this
  std::atomic<std::uint64_t> draws_{0};
};

}  // namespace kallpa
