// Structured access log: one JSON object per line for every HTTP request, written when the
// response has been sent (for a stream, when the stream ends).
#pragma once

#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>

namespace kallpa::server {

struct AccessLogEntry {
  std::string id;             // the X-Request-Id the response carried
  std::string completion_id;  // the chatcmpl-/cmpl- id of a generation ("" when none)
  std::string method;
  std::string path;
  std::string route;   // the matched route, or "unmatched"
  std::string remote;  // client address
  int status = 0;
  bool stream = false;
  std::int64_t prompt_tokens = -1;  // -1: not a generation request (omitted)
  std::int64_t completion_tokens = -1;
  std::string finish_reason;     // "" when none
  double latency_seconds = 0.0;  // request received to response finished
  double ttft_seconds = -1.0;    // -1: no token was generated
};

std::string format_access_log(const AccessLogEntry& entry);

class AccessLog {
 public:
  explicit AccessLog(std::FILE* out) : out_(out) {}  // nullptr: discard
  void write(const AccessLogEntry& entry);

 private:
  std::FILE* out_;
  std::mutex mu_;
};

}  // namespace kallpa::server
