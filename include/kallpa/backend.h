// The interface every attention backend implements. A backend sees only validated problems, never
// throws out of these calls, and must not reach into anything above the attention library.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kallpa/attention.h"
#include "kallpa/status.h"

namespace kallpa {

class DeviceMemory;  // kallpa/device.h

// A backend's verdict on a problem: yes, or a reason a person can act on.
struct Support {
  bool ok = true;
  std::string why_not;

  static Support yes() { return {}; }
  static Support no(std::string reason) { return {false, std::move(reason)}; }
};

// Scratch memory the dispatcher hands to run(); at least workspace_size(problem) bytes, 64-aligned.
struct Workspace {
  void* data = nullptr;
  std::size_t bytes = 0;
};

// The exact answer to a problem in double precision, in logical order: row r = (sum of Sq over
// earlier sequences) + i.
struct ExactOutput {
  std::vector<double> o;    // [total_q, hq, dv]
  std::vector<double> lse;  // [total_q, hq]; -inf for rows with no visible key
};

// What makes a backend the oracle: the exact answer that the conformance suite and the health
// check judge every backend against. The core and the suite find it through the registry
// (BackendRegistry::oracle()), never by a backend's name.
// One output row of one head: query `query` of sequence `sequence`, head `head` (of the q heads).
struct OutputRow {
  std::int32_t sequence = 0;
  std::int64_t query = 0;
  std::int32_t head = 0;
};

// The exact answer for chosen rows only, in the order they were asked for.
struct ExactRows {
  std::vector<double> o;    // [rows, dv]
  std::vector<double> lse;  // [rows]; -inf for a row with no visible key
};

class AttentionOracle {
 public:
  virtual ~AttentionOracle() = default;
  // Every feature of the contract; may throw std::bad_alloc.
  virtual ExactOutput compute_exact(const ValidatedProblem& problem) const = 0;
  // The same numbers as compute_exact for the rows asked for, at the cost of those rows only: what
  // checks on sampled rows of a large problem use. Rows must lie inside the problem (sequence <
  // batch, query < seqlen_q(sequence), head < hq); may throw std::bad_alloc. The default computes
  // the whole problem and picks the rows.
  virtual ExactRows compute_rows(const ValidatedProblem& problem, std::span<const OutputRow> rows) const;
};

// Version of BackendCounter and AttentionBackend::counters(); bumped when either changes shape.
inline constexpr int kBackendCountersVersion = 1;

// A number a backend publishes about itself (executables compiled, cache hits, bytes copied to a
// device, ...), so that front ends can show it without knowing the backend: the server renders
// each one as `kallpa_backend_<name>[_total]{backend="<backend>"}` on /metrics, and `kallpa
// backends` lists them. Names and kinds are fixed for a backend's lifetime, values only move.
struct BackendCounter {
  enum class Kind : std::uint8_t {
    counter,  // only grows since the process started; the server appends `_total` to its name
    gauge,    // a current amount (executables held, bytes resident)
  };
  std::string name;  // [a-z][a-z0-9_]*, unique within the backend, without a `_total` suffix
  std::string help;  // one sentence, for the metric's HELP line
  Kind kind = Kind::counter;
  double value = 0.0;
};

// True when `name` is a valid BackendCounter name ([a-z][a-z0-9_]*, not ending in `_total`).
bool valid_counter_name(std::string_view name) noexcept;

class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;

  virtual std::string_view name() const noexcept = 0;
  virtual std::string_view version() const noexcept = 0;
  virtual DeviceKind device_kind() const noexcept = 0;
  // Higher wins in automatic selection. reference uses 0; fast paths use more.
  virtual int priority() const noexcept = 0;
  // One line on what the backend is, for `kallpa backends`.
  virtual std::string_view description() const noexcept { return {}; }
  // The build this backend is, for the quarantine journal (registry.h): a journaled quarantine
  // holds at the next start only for the same identity. Default "name@version"; a plugin adds a
  // hash of its library file, so that a rebuilt plugin is a new identity. May throw std::bad_alloc.
  virtual std::string identity() const;

  // Cheap and side-effect free. Takes the signature, not the tensors, so that verdicts can be
  // cached per signature and explained for a problem that was never allocated.
  virtual Support supports(const ProblemSignature& signature) const noexcept = 0;
  virtual std::size_t workspace_size(const ValidatedProblem& /*problem*/) const noexcept { return 0; }
  // Writes o (and lse when requested). May be called concurrently from several threads.
  virtual Status run(const ValidatedProblem& problem, Workspace workspace) noexcept = 0;

  // The memory of the device this backend runs on (device.h), so that callers can put tensors
  // there; nullptr for host backends, and for a device backend whose device is unavailable.
  // The workspace handed to run() stays host memory for every backend.
  virtual DeviceMemory* device_memory() const noexcept { return nullptr; }

  // The backend's own counters (BackendCounter), read at any time from any thread, cheaply: no
  // device call, no lazy start-up. The same names on every call, whatever the values; empty for a
  // backend with nothing to publish. May throw std::bad_alloc.
  virtual std::vector<BackendCounter> counters() const { return {}; }

  // Non-null for the one backend that is the oracle (reference, in-tree); nullptr for every other.
  virtual const AttentionOracle* oracle() const noexcept { return nullptr; }
};

}  // namespace kallpa
