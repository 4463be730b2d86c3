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

#include "kallpa/server/server.h"
#include "server/access_log.h"
#include "server/api_error.h"
#include "server/http_message.h"
#include "server/http_transport.h"
#include "server/request_parser.h"
#include "server/router.h"
#include "server/server_metrics.h"
#include "server/structured_output.h"

namespace kallpa::server {

using Clock = std::chrono::steady_clock;

// What the access log and the metrics need to know about one HTTP request, filled in as it goes.
struct RequestContext {
  std::string id;             // X-Request-Id: the client's when it sent a valid one
  std::string completion_id;  // chatcmpl-/cmpl-: the id the response body carries
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
  Impl(ServedModels m, ServerOptions o);

  // Routes (completions.cpp).
  void handle_generation(const HttpRequest& req, HttpResponse& res, Endpoint endpoint);
  // Whether `model` names the chat model served: its id or one of its aliases.
  bool serves(const std::string& model) const;
  // POST /v1/embeddings (embeddings_route.cpp).
  void handle_embeddings(const HttpRequest& req, HttpResponse& res);
  bool serves_embedding(const std::string& model) const;
  // False, with a 404 written, when the route's model is not served. A 503 when draining.
  bool has_chat_model(HttpResponse& res) const;
  bool accepting(HttpResponse& res) const;

  // Every request, on a worker thread (server.cpp): request id, CORS, auth, the route, errors.
  void handle(HttpRequest& req, HttpResponse& res);
  bool authorized(const HttpRequest& req, HttpResponse& res);
  void answer_transport_error(const HttpRequest& req, HttpResponse& res);
  std::shared_ptr<RequestContext> context(const HttpRequest& req);
  void begin_request(const HttpRequest& req, HttpResponse& res);
  void end_request(const HttpRequest& req, const HttpResponse& res);
  void drain();

  // Counts a generation request from before it checks for draining until its response is done,
  // so that shutdown waits for it.
  struct InFlight {
    explicit InFlight(Impl& impl);
    ~InFlight();
    Impl& impl;
  };

  runtime::Engine* engine;      // null: no chat model
  runtime::Embedder* embedder;  // null: no embedding model
  ServerOptions options;
  RequestLimits limits;
  std::int64_t max_prompt_tokens = 0;
  std::int64_t created = 0;  // Unix time of start, for /v1/models
  ServerMetrics metrics;
  AccessLog access_log;
  std::unique_ptr<runtime::Scheduler> scheduler;
  Router routes;
  std::unique_ptr<HttpTransport> http;
  std::unique_ptr<StructuredOutput> structured;  // with a chat model
  StatsObserver no_attention;                    // /metrics' attention figures without a chat model
  bool bound = false;

  std::atomic<bool> draining{false};
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
  std::unordered_map<std::uint64_t, std::shared_ptr<RequestContext>> contexts;  // by HttpRequest::serial
  std::atomic<std::uint64_t> next_request{1};
  std::string id_prefix;
};

void write_error(HttpResponse& res, const ApiError& error);

}  // namespace kallpa::server
