#include "server/server_metrics.h"

#include <cmath>

#include <spdlog/spdlog.h>

namespace kallpa::server {
namespace {

std::vector<double> attention_bounds() {
  // StatsObserver's buckets: bucket i holds calls under 2^i microseconds, the last one is open.
  std::vector<double> b;
  for (int i = 0; i + 1 < StatsObserver::BackendStats::kBuckets; ++i) b.push_back(std::ldexp(1e-6, i));
  return b;
}

}  // namespace

ServerMetrics::ServerMetrics() {
  using T = MetricType;
  auto& r = registry_;
  requests_ =
      &r.add("kallpa_http_requests_total", "HTTP requests by route and status code.", T::counter, {"route", "status"});
  request_seconds_ = &r.add("kallpa_http_request_duration_seconds",
                            "Time from receiving a request to the end of its response (streams included).",
                            T::histogram, {"route"}, {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60});
  prompt_tokens_ = &r.add("kallpa_prompt_tokens_total", "Prompt tokens of finished generation requests.", T::counter);
  prompt_cached_ = &r.add("kallpa_prompt_tokens_cached_total",
                          "Prompt tokens whose KV blocks came from the prefix cache, not computed.", T::counter);
  generation_tokens_ = &r.add("kallpa_generation_tokens_total", "Tokens generated.", T::counter);
  finish_ = &r.add("kallpa_request_finish_total", "Generation requests by finish reason.", T::counter, {"reason"});
  ttft_ = &r.add("kallpa_time_to_first_token_seconds", "Time from receiving a request to its first generated token.",
                 T::histogram, {}, {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30});
  itl_ = &r.add("kallpa_inter_token_latency_seconds", "Time between consecutive generated tokens of a request.",
                T::histogram, {}, {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5});
  embedding_inputs_ = &r.add("kallpa_embedding_inputs_total", "Inputs embedded by /v1/embeddings.", T::counter);
  embedding_tokens_ = &r.add("kallpa_embedding_tokens_total",
                             "Tokens embedded by /v1/embeddings ([CLS] and [SEP] included).", T::counter);
  queued_ = &r.add("kallpa_scheduler_queued_requests", "Requests waiting for admission.", T::gauge);
  running_ = &r.add("kallpa_scheduler_running_sequences", "Sequences admitted and generating.", T::gauge);
  inflight_ = &r.add("kallpa_http_inflight_requests", "Generation requests being served.", T::gauge);
  kv_used_ = &r.add("kallpa_kv_cache_used_blocks", "KV cache blocks holding tokens.", T::gauge);
  kv_free_ = &r.add("kallpa_kv_cache_free_blocks", "KV cache blocks free.", T::gauge);
  kv_cached_ =
      &r.add("kallpa_kv_cache_cached_blocks", "Free KV cache blocks still holding a reusable prompt prefix.", T::gauge);
  kv_committed_ = &r.add("kallpa_kv_cache_committed_blocks",
                         "KV cache blocks the running requests may need at most (admission control).", T::gauge);
  steps_ = &r.add("kallpa_scheduler_steps_total", "Forward passes run by the scheduler.", T::counter);
  batch_tokens_ = &r.add("kallpa_scheduler_batch_tokens_total", "Tokens over all forward passes.", T::counter);
  batch_sequences_ = &r.add("kallpa_scheduler_batch_sequences_total", "Sequences over all forward passes.", T::counter);
  att_calls_ = &r.add("kallpa_attention_calls_total", "Attention calls run, by backend.", T::counter, {"backend"});
  att_failures_ =
      &r.add("kallpa_attention_failures_total", "Attention calls that failed, by backend.", T::counter, {"backend"});
  att_fallbacks_ =
      &r.add("kallpa_attention_fallbacks_total",
             "Attention calls a backend ran because an earlier choice failed, by backend.", T::counter, {"backend"});
  att_seconds_ = &r.add("kallpa_attention_duration_seconds", "Attention call latency, by backend.", T::histogram,
                        {"backend"}, attention_bounds());
  verify_checks_ = &r.add("kallpa_attention_verify_checks_total",
                          "Attention calls checked on sampled rows against the reference, by backend and kind "
                          "(first_use: a backend's first call in a size bucket; shadow: the --verify-rate sample).",
                          T::counter, {"backend", "kind"});
  verify_mismatches_ = &r.add("kallpa_attention_verify_mismatches_total",
                              "Sampled-row checks that found a wrong answer (the backend was quarantined and the "
                              "call fell back), by backend and kind.",
                              T::counter, {"backend", "kind"});
  verify_seconds_ = &r.add("kallpa_attention_verify_seconds_total",
                           "Time spent in sampled-row checks (reference rows and comparison), by backend and kind.",
                           T::counter, {"backend", "kind"});
  verify_unverifiable_ = &r.add("kallpa_attention_verify_unverifiable_total",
                                "Sampled-row checks that could not run (outputs not in host memory, no reference), "
                                "by backend.",
                                T::counter, {"backend"});
  quarantined_buckets_ =
      &r.add("kallpa_attention_quarantined_buckets",
             "Size buckets a backend is quarantined for after a failed first-use check.", T::gauge, {"backend"});
  op_fallbacks_ =
      &r.add("kallpa_op_fallbacks_total",
             "Engine ops the device lacked that ran on the CPU with copies, by op (0 on the CPU).", T::counter, {"op"});
  // Series without labels exist from the start, so that a scrape before any traffic shows zeros.
  for (MetricFamily* f : {prompt_tokens_, generation_tokens_, queued_, running_, inflight_, kv_used_, kv_free_,
                          kv_cached_, prompt_cached_, kv_committed_, steps_, batch_tokens_, batch_sequences_}) {
    f->set({}, 0.0);
  }
}

void ServerMetrics::request_finished(const std::string& route, int status, double seconds) {
  requests_->inc({route, std::to_string(status)});
  request_seconds_->observe({route}, seconds);
}

void ServerMetrics::generation_finished(const runtime::Completion& c) {
  prompt_tokens_->inc({}, static_cast<double>(c.prompt_tokens));
  generation_tokens_->inc({}, static_cast<double>(c.generated_tokens));
  finish_->inc({c.finish_reason});
}

void ServerMetrics::publish(const BackendRegistry& backends) {
  std::lock_guard lock(backend_mu_);
  for (const BackendInfo& info : backends.list()) {
    const std::string backend(info.backend->name());
    const VerificationCounters& v = info.verification;
    verify_checks_->set({backend, "first_use"}, static_cast<double>(v.first_use_checks));
    verify_checks_->set({backend, "shadow"}, static_cast<double>(v.shadow_checks));
    verify_mismatches_->set({backend, "first_use"}, static_cast<double>(v.first_use_mismatches));
    verify_mismatches_->set({backend, "shadow"}, static_cast<double>(v.shadow_mismatches));
    verify_seconds_->set({backend, "first_use"}, v.first_use_seconds);
    verify_seconds_->set({backend, "shadow"}, v.shadow_seconds);
    verify_unverifiable_->set({backend}, static_cast<double>(v.unverifiable));
    quarantined_buckets_->set({backend}, static_cast<double>(info.quarantined_buckets.size()));
    for (const BackendCounter& c : info.backend->counters()) {
      // A backend's mistake costs its own series, never the scrape: names that would break the
      // exposition format, and a name another backend publishes as the other kind, are dropped.
      if (!valid_counter_name(c.name)) {
        if (!warned_.insert(backend + "/" + c.name).second) continue;  // once per process, not per scrape
        spdlog::warn("metrics: backend '{}' publishes counter '{}', not a valid name ([a-z][a-z0-9_]*, no _total)",
                     backend, c.name);
        continue;
      }
      const bool counter = c.kind == BackendCounter::Kind::counter;
      const std::string name = "kallpa_backend_" + c.name + (counter ? "_total" : "");
      // Keyed by the bare name, so that `x` published as a counter by one backend and as a gauge by
      // another is one conflict, not two unrelated families `x_total` and `x`.
      auto it = backend_families_.find(c.name);
      if (it == backend_families_.end()) {
        // HELP text escapes backslash and newline (text format 0.0.4); a backend's help is free text.
        std::string help;
        for (char ch : c.help)
          help += ch == '\\' ? std::string("\\\\") : ch == '\n' ? std::string("\\n") : std::string(1, ch);
        MetricFamily& f = registry_.add(name, help, counter ? MetricType::counter : MetricType::gauge, {"backend"});
        it = backend_families_.emplace(c.name, BackendFamily{&f, c.kind}).first;
      } else if (it->second.kind != c.kind) {
        if (!warned_.insert(backend + "/" + c.name).second) continue;
        spdlog::warn("metrics: backend '{}' publishes '{}' as a {}, another backend as a {}; dropped", backend, c.name,
                     counter ? "counter" : "gauge", counter ? "gauge" : "counter");
        continue;
      }
      it->second.family->set({backend}, c.value);
    }
  }
}

std::string ServerMetrics::render(const runtime::SchedulerStats& s, const StatsObserver& attention,
                                  const std::map<std::string, std::uint64_t>& op_fallbacks,
                                  const BackendRegistry& backends) {
  publish(backends);
  for (const auto& [op, n] : op_fallbacks) op_fallbacks_->set({op}, static_cast<double>(n));
  queued_->set({}, static_cast<double>(s.queued));
  running_->set({}, static_cast<double>(s.running));
  kv_used_->set({}, static_cast<double>(s.kv_blocks_used));
  kv_free_->set({}, static_cast<double>(s.kv_blocks_free));
  kv_committed_->set({}, static_cast<double>(s.kv_blocks_committed));
  kv_cached_->set({}, static_cast<double>(s.kv_blocks_cached));
  prompt_cached_->set({}, static_cast<double>(s.prompt_tokens_cached));
  steps_->set({}, static_cast<double>(s.steps));
  batch_tokens_->set({}, static_cast<double>(s.batch_tokens));
  batch_sequences_->set({}, static_cast<double>(s.batch_sequences));
  for (const auto& [backend, st] : attention.snapshot()) {
    att_calls_->set({backend}, static_cast<double>(st.calls));
    att_failures_->set({backend}, static_cast<double>(st.failures));
    att_fallbacks_->set({backend}, static_cast<double>(st.fallbacks));
    att_seconds_->set_histogram({backend}, std::vector<std::uint64_t>(std::begin(st.buckets), std::end(st.buckets)),
                                st.total_seconds);
  }
  return registry_.render();
}

}  // namespace kallpa::server
