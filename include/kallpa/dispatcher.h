// Selection, fallback and telemetry for attention calls.
//
//   kallpa::Dispatcher dispatcher;                 // global registry, automatic choice
//   kallpa::Status s = dispatcher.run(problem);     // validate, choose, run, fall back if needed
//   auto verdicts = dispatcher.explain(problem);   // why each backend was or was not chosen
#pragma once

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

  // Reads KALLPA_ATTENTION ("name[,name...]"), KALLPA_ATTENTION_STRICT and KALLPA_PARANOID
  // ("1"/"true"/"0"/"false") and KALLPA_QUARANTINE_AFTER (an integer >= 0); a malformed value is
  // an error naming the variable.
  static Result<DispatchOptions> from_env();
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
};

}  // namespace kallpa
