// Telemetry: every dispatched call is reported to observers, whichever backend ran it. The server
// turns these into Prometheus metrics; the CLI prints a summary.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "kallpa/attention.h"

namespace kallpa {

enum class Outcome : std::uint8_t {
  ok = 0,      // the backend ran and succeeded
  failed = 1,  // the backend's run() returned an error (the call may still fall back)
};

struct DispatchEvent {
  std::string_view backend;
  const ProblemSignature* signature = nullptr;
  std::chrono::nanoseconds duration{0};
  Outcome outcome = Outcome::ok;
  bool fallback = false;          // this backend was not the first choice for the call
  const Status* error = nullptr;  // set when outcome == failed
};

class DispatchObserver {
 public:
  virtual ~DispatchObserver() = default;
  // Called on the dispatching thread; must be cheap and thread-safe.
  virtual void on_dispatch(const DispatchEvent& event) noexcept = 0;
};

// Per-backend call counts and latency summaries.
class StatsObserver final : public DispatchObserver {
 public:
  struct BackendStats {
    std::uint64_t calls = 0;      // every run() attempt
    std::uint64_t failures = 0;   // attempts that returned an error
    std::uint64_t fallbacks = 0;  // attempts made because an earlier choice failed
    double total_seconds = 0.0;
    double min_seconds = 0.0;
    double max_seconds = 0.0;
    // Latency histogram over powers of two from 1 us (bucket i: < 2^i us), last bucket open.
    static constexpr int kBuckets = 24;
    std::uint64_t buckets[kBuckets] = {};

    double mean_seconds() const noexcept { return calls ? total_seconds / double(calls) : 0.0; }
    // Upper bound of the bucket holding the q-quantile (0..1), in seconds.
    double quantile_seconds(double q) const noexcept;
  };

  void on_dispatch(const DispatchEvent& event) noexcept override;
  std::map<std::string, BackendStats> snapshot() const;
  void reset();

 private:
  mutable std::mutex mu_;
  std::map<std::string, BackendStats, std::less<>> stats_;
};

}  // namespace kallpa
