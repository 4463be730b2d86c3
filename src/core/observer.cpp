#include "kallpa/observer.h"

#include <algorithm>
#include <cmath>

namespace kallpa {

double StatsObserver::BackendStats::quantile_seconds(double q) const noexcept {
  if (calls == 0) return 0.0;
  const double target = std::clamp(q, 0.0, 1.0) * static_cast<double>(calls);
  std::uint64_t seen = 0;
  for (int i = 0; i < kBuckets; ++i) {
    seen += buckets[i];
    if (static_cast<double>(seen) >= target) {
      // Bucket i holds latencies below 2^i microseconds; the last bucket is open, so report max.
      return i + 1 == kBuckets ? max_seconds : std::min(max_seconds, std::ldexp(1e-6, i));
    }
  }
  return max_seconds;
}

void StatsObserver::on_dispatch(const DispatchEvent& event) noexcept {
  const double seconds = std::chrono::duration<double>(event.duration).count();
  int bucket = 0;
  for (double bound = 1e-6; bucket + 1 < BackendStats::kBuckets && seconds >= bound; bound *= 2) ++bucket;
  std::lock_guard lock(mu_);
  auto it = stats_.find(event.backend);
  if (it == stats_.end()) it = stats_.emplace(std::string(event.backend), BackendStats{}).first;
  BackendStats& s = it->second;
  s.min_seconds = s.calls == 0 ? seconds : std::min(s.min_seconds, seconds);
  s.max_seconds = std::max(s.max_seconds, seconds);
  ++s.calls;
  s.total_seconds += seconds;
  if (event.outcome == Outcome::failed) ++s.failures;
  if (event.fallback) ++s.fallbacks;
  ++s.buckets[bucket];
}

std::map<std::string, StatsObserver::BackendStats> StatsObserver::snapshot() const {
  std::lock_guard lock(mu_);
  return {stats_.begin(), stats_.end()};
}

void StatsObserver::reset() {
  std::lock_guard lock(mu_);
  stats_.clear();
}

}  // namespace kallpa
