// The server's Prometheus metrics: HTTP requests, tokens, latency histograms, scheduler and KV
// cache state, and the attention dispatcher's per-backend telemetry. The names are the same
// whichever backend runs underneath.
#pragma once

#include <map>
#include <mutex>
#include <set>
#include <string>

#include "kallpa/observer.h"
#include "kallpa/registry.h"
#include "kallpa/runtime/scheduler.h"
#include "server/metrics.h"

namespace kallpa::server {

class ServerMetrics {
 public:
  ServerMetrics();

  void request_finished(const std::string& route, int status, double seconds);
  void time_to_first_token(double seconds) { ttft_->observe({}, seconds); }
  void inter_token_latency(double seconds) { itl_->observe({}, seconds); }
  void generation_finished(const runtime::Completion& c);
  void set_inflight(std::int64_t n) { inflight_->set({}, static_cast<double>(n)); }
  void embeddings_finished(std::int64_t inputs, std::int64_t tokens) {
    embedding_inputs_->inc({}, static_cast<double>(inputs));
    embedding_tokens_->inc({}, static_cast<double>(tokens));
  }

  // Refreshes the gauges and mirrored counters, then renders everything.
  // `op_fallbacks`: device ops run on the CPU, by op (runtime::Engine::op_fallbacks()).
  // `backends`: every registered backend's own counters (AttentionBackend::counters()) render as
  // `kallpa_backend_<name>[_total]{backend="..."}`, one family per name across backends; their
  // sampled-row checks as kallpa_attention_verify_*{backend,kind} (registry.h, VerificationCounters).
  std::string render(const runtime::SchedulerStats& scheduler, const StatsObserver& attention,
                     const std::map<std::string, std::uint64_t>& op_fallbacks, const BackendRegistry& backends);

 private:
  MetricsRegistry registry_;
  MetricFamily *requests_, *request_seconds_, *prompt_tokens_, *generation_tokens_, *finish_, *ttft_, *itl_;
  MetricFamily *queued_, *running_, *inflight_, *kv_used_, *kv_free_, *kv_committed_, *kv_cached_, *prompt_cached_;
  MetricFamily *steps_, *batch_tokens_, *batch_sequences_;
  MetricFamily *att_calls_, *att_failures_, *att_fallbacks_, *att_seconds_;
  MetricFamily *verify_checks_, *verify_mismatches_, *verify_seconds_, *verify_unverifiable_, *quarantined_buckets_;
  MetricFamily* op_fallbacks_;
  MetricFamily *embedding_inputs_, *embedding_tokens_;
  // Families of backend counters, by counter name, created on the first scrape that sees them.
  struct BackendFamily {
    MetricFamily* family;
    BackendCounter::Kind kind;
  };
  std::mutex backend_mu_;
  std::map<std::string, BackendFamily> backend_families_;  // under backend_mu_
  std::set<std::string> warned_;                           // "backend/name" dropped; under backend_mu_
  void publish(const BackendRegistry& backends);
};

}  // namespace kallpa::server
