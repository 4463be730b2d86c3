#include "server/access_log.h"

#include <chrono>

#include <fmt/chrono.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "server/sse.h"

namespace kallpa::server {

std::string format_access_log(const AccessLogEntry& e) {
  nlohmann::json j;
  j["ts"] = fmt::format("{:%Y-%m-%dT%H:%M:%S}Z",
                        std::chrono::floor<std::chrono::milliseconds>(std::chrono::system_clock::now()));
  j["event"] = "http_request";
  j["id"] = e.id;
  if (!e.completion_id.empty()) j["completion_id"] = e.completion_id;
  j["method"] = e.method;
  j["path"] = e.path;
  j["route"] = e.route;
  j["status"] = e.status;
  j["remote"] = e.remote;
  j["latency_ms"] = std::round(e.latency_seconds * 1e6) / 1e3;
  if (e.prompt_tokens >= 0) {
    j["stream"] = e.stream;
    j["prompt_tokens"] = e.prompt_tokens;
    j["completion_tokens"] = e.completion_tokens;
    if (!e.finish_reason.empty()) j["finish_reason"] = e.finish_reason;
    if (e.ttft_seconds >= 0) j["ttft_ms"] = std::round(e.ttft_seconds * 1e6) / 1e3;
  }
  return dump_json(j);
}

void AccessLog::write(const AccessLogEntry& entry) {
  if (!out_) return;
  const std::string line = format_access_log(entry) + "\n";
  std::lock_guard lock(mu_);
  std::fwrite(line.data(), 1, line.size(), out_);
  std::fflush(out_);
}

}  // namespace kallpa::server
