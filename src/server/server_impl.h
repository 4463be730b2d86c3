// The server's shared state, seen by server.cpp (lifecycle, middleware, small routes) and
// completions.cpp (the generation routes).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>

#include <httplib.h>

#include "kallpa/server/server.h"
#include "server/access_log.h"
#include "server/api_error.h"
#include "server/request_parser.h"
#include "server/server_metrics.h"
#include "server/structured_output.h"

namespace kallpa::server {

using Clock = std::chrono::steady_clock;

// What the access log and the metrics need to know about one HTTP request, filled in as it goes.
struct RequestContext {
  std::string id;
  std::string route;
  Clock::time_point start;
  // Generation requests only (under mu).
  std::mutex mu;
  bool generation = false;
  bool stream = false;
  std::int64_t prompt_tokens = 0, completion_tokens = 0;
  std::string finish_reason;
  double ttft_seconds = -1.0;
};

struct Server::Impl {
  Impl(runtime::Engine& e, ServerOptions o);

  // Routes (completions.cpp).
  void handle_generation(const httplib::Request& req, httplib::Response& res, Endpoint endpoint);

  std::shared_ptr<RequestContext> context(const httplib::Response& res);
  void begin_request(const httplib::Request& req, httplib::Response& res);
  void end_request(const httplib::Request& req, const httplib::Response& res);
  void drain();

  // Counts a generation request from before it checks for draining until its response is done,
  // so that shutdown waits for it.
  struct InFlight {
    explicit InFlight(Impl& impl);
    ~InFlight();
    Impl& impl;
  };

  runtime::Engine& engine;
  ServerOptions options;
  RequestLimits limits;
  std::int64_t max_prompt_tokens = 0;
  std::int64_t created = 0;  // Unix time of start, for /v1/models
  ServerMetrics metrics;
  AccessLog access_log;
  std::unique_ptr<runtime::Scheduler> scheduler;
  StructuredOutput structured{engine};
  httplib::Server http;
  bool bound = false;

  std::atomic<bool> draining{false};
  std::atomic<bool> in_run{false};
  std::mutex inflight_mu;
  std::condition_variable inflight_cv;
  std::int64_t inflight = 0;  // under inflight_mu
  // The drain thread is started by shutdown() on whichever thread asks (a signal watcher) while
  // run() may be returning on another, so it is only touched under drainer_mu.
  std::mutex drainer_mu;
  std::thread drainer;  // under drainer_mu
  std::once_flag shutdown_once;
  void join_drainer();

  std::mutex contexts_mu;
  std::unordered_map<std::string, std::shared_ptr<RequestContext>> contexts;
  std::atomic<std::uint64_t> next_request{1};
  std::string id_prefix;
};

void write_error(httplib::Response& res, const ApiError& error);

}  // namespace kallpa::server
