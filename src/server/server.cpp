#include <algorithm>
#include <random>

#include <fmt/format.h>

#include "server/cors.h"
#include "server/openai_responses.h"
#include "server/server_impl.h"
#include "server/sse.h"
#include "server/tokenize_routes.h"

namespace kallpa::server {
namespace {

struct Route {
  const char* path;
  const char* method;
};
constexpr Route kRoutes[] = {{"/v1/chat/completions", "POST"},
                             {"/v1/completions", "POST"},
                             {"/tokenize", "POST"},
                             {"/detokenize", "POST"},
                             {"/v1/embeddings", "POST"},
                             {"/v1/models", "GET"},
                             {"/health", "GET"},
                             {"/ready", "GET"},
                             {"/metrics", "GET"}};
constexpr std::string_view kModelPrefix = "/v1/models/";

// The route a path belongs to, as metrics label it (one label for every model id, so that a client
// cannot grow the label set).
std::string route_of(const std::string& path) {
  for (const Route& r : kRoutes) {
    if (path == r.path) return r.path;
  }
  if (path.size() > kModelPrefix.size() && path.rfind(kModelPrefix, 0) == 0) return "/v1/models/{model}";
  return "unmatched";
}

// The method a known path accepts, or nullptr for an unknown path.
const char* method_of(const std::string& path) {
  for (const Route& r : kRoutes) {
    if (path == r.path) return r.method;
  }
  return route_of(path) == "unmatched" ? nullptr : "GET";
}

void write_json(HttpResponse& res, int status, const nlohmann::json& body) {
  res.status = status;
  res.set_content(dump_json(body), "application/json");
}

// A constant-time comparison, so that the key cannot be guessed byte by byte from timings.
bool same_secret(std::string_view a, std::string_view b) {
  std::size_t diff = a.size() ^ b.size();
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

// A client's X-Request-Id is kept when it is 1-128 visible ASCII characters; anything else could
// break the access log's lines or grow them without bound, and is replaced.
bool valid_request_id(std::string_view id) {
  return !id.empty() && id.size() <= 128 &&
         std::all_of(id.begin(), id.end(), [](char c) { return c > 0x20 && c < 0x7f; });
}

}  // namespace

void write_error(HttpResponse& res, const ApiError& error) {
  write_json(res, error.status, error.to_json());
  if (error.retry_after_seconds > 0) res.set_header("Retry-After", std::to_string(error.retry_after_seconds));
}

Server::Impl::InFlight::InFlight(Impl& i) : impl(i) {
  std::lock_guard lock(impl.inflight_mu);
  ++impl.inflight;
  impl.metrics.set_inflight(impl.inflight);
}

Server::Impl::InFlight::~InFlight() {
  std::lock_guard lock(impl.inflight_mu);
  --impl.inflight;
  impl.metrics.set_inflight(impl.inflight);
  impl.inflight_cv.notify_all();
}

Server::Impl::Impl(ServedModels m, ServerOptions o)
    : engine(m.chat), embedder(m.embedding), options(std::move(o)), access_log(options.access_log) {
  created =
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  id_prefix = fmt::format("{:08x}", std::random_device{}());
  if (options.embedding_model_name.empty() && embedder != nullptr) {
    options.embedding_model_name = embedder->name().empty() ? "embedding" : embedder->name();
  }
  if (engine == nullptr) return;
  const std::int64_t context = engine->config().context_length;
  max_prompt_tokens = options.max_prompt_tokens > 0 ? std::min(options.max_prompt_tokens, context - 1) : context - 1;
  limits.max_tokens = std::max<std::int64_t>(1, options.max_tokens);
  if (options.model_name.empty()) options.model_name = "kallpa";
  limits.max_choices = std::clamp<std::int64_t>(options.max_choices, 1, options.scheduler.max_running);
  limits.vocab_size = engine->config().vocab_size;
  scheduler = std::make_unique<runtime::Scheduler>(*engine, options.scheduler);
  structured = std::make_unique<StructuredOutput>(*engine);
}

bool Server::Impl::has_chat_model(HttpResponse& res) const {
  if (engine != nullptr) return true;
  ApiError e;
  e.status = 404;
  e.code = "model_not_found";
  e.param = "model";
  e.message = fmt::format("this server serves no chat model, only the embedding model '{}' (POST /v1/embeddings)",
                          options.embedding_model_name);
  write_error(res, e);
  return false;
}

bool Server::Impl::accepting(HttpResponse& res) const {
  if (!draining.load()) return true;
  ApiError e;
  e.status = 503;
  e.type = "server_error";
  e.code = "shutting_down";
  e.message = "the server is shutting down";
  e.retry_after_seconds = 5;
  write_error(res, e);
  return false;
}

std::shared_ptr<RequestContext> Server::Impl::context(const HttpRequest& req) {
  std::lock_guard lock(contexts_mu);
  auto it = contexts.find(req.serial);
  return it == contexts.end() ? nullptr : it->second;
}

void Server::Impl::begin_request(const HttpRequest& req, HttpResponse& res) {
  auto ctx = std::make_shared<RequestContext>();
  const std::string sent = req.get_header_value("X-Request-Id");
  ctx->id = valid_request_id(sent) ? sent : fmt::format("req-{}-{}", id_prefix, next_request.fetch_add(1));
  ctx->route = route_of(req.path);
  ctx->start = Clock::now();
  res.set_header("X-Request-Id", ctx->id);
  std::lock_guard lock(contexts_mu);
  contexts[req.serial] = std::move(ctx);
}

void Server::Impl::end_request(const HttpRequest& req, const HttpResponse& res) {
  std::shared_ptr<RequestContext> ctx;
  {
    std::lock_guard lock(contexts_mu);
    if (auto it = contexts.find(req.serial); it != contexts.end()) {
      ctx = std::move(it->second);
      contexts.erase(it);
    }
  }
  AccessLogEntry e;
  e.method = req.method;
  e.path = req.path;
  e.remote = req.remote_addr;
  e.status = res.status;
  e.route = route_of(req.path);
  if (ctx) {
    e.id = ctx->id;
    e.latency_seconds = std::chrono::duration<double>(Clock::now() - ctx->start).count();
    std::lock_guard lock(ctx->mu);
    e.completion_id = ctx->completion_id;
    if (ctx->generation) {
      e.stream = ctx->stream;
      e.prompt_tokens = ctx->prompt_tokens;
      e.completion_tokens = ctx->completion_tokens;
      e.finish_reason = ctx->finish_reason;
      e.ttft_seconds = ctx->ttft_seconds;
    }
  }
  metrics.request_finished(e.route, e.status, e.latency_seconds);
  access_log.write(e);
}

void Server::Impl::drain() {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(std::max(0.0, options.drain_seconds)));
  std::unique_lock lock(inflight_mu);
  if (!inflight_cv.wait_until(lock, deadline, [&] { return inflight == 0; })) {
    lock.unlock();
    if (scheduler) scheduler->cancel_all();  // past the grace period: end what is left (streams get an error event)
    lock.lock();
    inflight_cv.wait(lock, [&] { return inflight == 0; });
  }
  lock.unlock();
  http->stop();  // closes idle connections and the listener; run() returns
}

bool Server::Impl::authorized(const HttpRequest& req, HttpResponse& res) {
  if (options.api_key.empty() || req.path.rfind("/v1/", 0) != 0) return true;
  const std::string auth = req.get_header_value("Authorization");
  const std::string_view prefix = "Bearer ";
  if (auth.rfind(prefix, 0) == 0 && same_secret(std::string_view(auth).substr(prefix.size()), options.api_key)) {
    return true;
  }
  ApiError e;
  e.status = 401;
  e.type = "authentication_error";
  e.code = "invalid_api_key";
  e.message = auth.empty() ? "missing API key: send Authorization: Bearer KEY" : "incorrect API key";
  write_error(res, e);
  return false;
}

void Server::Impl::handle(HttpRequest& req, HttpResponse& res) {
  begin_request(req, res);
  const Cors cors(options.cors_origins);
  try {
    if (req.method == "OPTIONS" && method_of(req.path) != nullptr) {
      cors.preflight(req, method_of(req.path), res);  // before auth: browsers send no key in a preflight
    } else if (authorized(req, res)) {
      std::string allowed;
      switch (routes.dispatch(req, res, &allowed)) {
        case Router::Outcome::handled: break;
        case Router::Outcome::wrong_method: {
          ApiError e;
          e.status = 405;
          e.code = "method_not_allowed";
          e.message = fmt::format("{} accepts {}, not {}", req.path, allowed, req.method);
          write_error(res, e);
          res.set_header("Allow", allowed);
          break;
        }
        case Router::Outcome::no_route: {
          ApiError e;
          e.status = 404;
          e.code = "unknown_route";
          e.message = fmt::format("no route {} {}", req.method, req.path);
          write_error(res, e);
          break;
        }
      }
    }
  } catch (const std::exception& x) {
    ApiError e;
    e.status = 500;
    e.type = "server_error";
    e.code = "internal";
    e.message = fmt::format("internal error: {}", x.what());
    write_error(res, e);
  }
  cors.decorate(req, res);
}

void Server::Impl::answer_transport_error(const HttpRequest& req, HttpResponse& res) {
  ApiError e;
  e.status = res.status;
  e.message = res.body;
  switch (res.status) {
    case 413: e.code = "body_too_large"; break;
    case 431: e.code = "header_too_large"; break;
    case 429:
      e.code = "too_many_connections";
      e.retry_after_seconds = 1;
      break;
    case 503:
      e.type = "server_error";
      e.code = "too_many_connections";
      e.retry_after_seconds = 1;
      break;
    default: e.code = "bad_request"; break;
  }
  write_error(res, e);
  Cors(options.cors_origins).decorate(req, res);
}

Server::Server(runtime::Engine& engine, ServerOptions options)
    : Server(ServedModels{.chat = &engine}, std::move(options)) {}

Server::Server(ServedModels models, ServerOptions options) : impl_(std::make_unique<Impl>(models, std::move(options))) {
  Impl& s = *impl_;
  const ServerOptions& o = s.options;
  TransportOptions t;
  t.host = o.host;
  t.port = o.port;
  t.backlog = o.listen_backlog;
  t.worker_threads =
      o.http_threads > 0 ? o.http_threads : static_cast<int>(o.scheduler.max_running + o.scheduler.max_queue + 8);
  t.header_timeout_seconds = o.header_timeout_seconds;
  t.body_timeout_seconds = o.body_timeout_seconds;
  t.keep_alive_timeout_seconds = o.keep_alive_timeout_seconds;
  t.write_timeout_seconds = o.write_timeout_seconds;
  t.max_header_bytes = o.max_header_bytes;
  t.max_header_fields = o.max_header_fields;
  t.max_body_bytes = o.max_body_bytes;
  t.max_connections_per_client = o.max_connections_per_client;
  t.max_connections = o.max_connections;
  s.http = std::make_unique<HttpTransport>(
      t, [&s](HttpRequest& req, HttpResponse& res) { s.handle(req, res); },
      [&s](const HttpRequest& req, HttpResponse& res) { s.answer_transport_error(req, res); },
      [&s](const HttpRequest& req, const HttpResponse& res) { s.end_request(req, res); });

  s.routes.Post("/v1/chat/completions", [&s](const HttpRequest& req, HttpResponse& res) {
    if (s.has_chat_model(res)) s.handle_generation(req, res, Endpoint::chat);
  });
  s.routes.Post("/v1/completions", [&s](const HttpRequest& req, HttpResponse& res) {
    if (s.has_chat_model(res)) s.handle_generation(req, res, Endpoint::completions);
  });
  s.routes.Post("/v1/embeddings", [&s](const HttpRequest& req, HttpResponse& res) { s.handle_embeddings(req, res); });
  for (const char* path : {"/tokenize", "/detokenize"}) {
    const bool encode = path == std::string_view("/tokenize");
    s.routes.Post(path, [&s, encode](const HttpRequest& req, HttpResponse& res) {
      if (!s.has_chat_model(res)) return;
      auto result =
          encode ? tokenize_body(s.engine->tokenizer(), req.body) : detokenize_body(s.engine->tokenizer(), req.body);
      if (auto* e = std::get_if<ApiError>(&result)) {
        write_error(res, *e);
      } else {
        write_json(res, 200, std::get<nlohmann::json>(result));
      }
    });
  }
  s.routes.Get("/v1/models", [&s](const HttpRequest&, HttpResponse& res) {
    std::vector<std::string> ids;
    const auto add = [&ids](const std::string& id) {
      if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
    };
    if (s.engine != nullptr) {
      add(s.options.model_name);
      for (const std::string& alias : s.options.model_aliases) add(alias);
    }
    if (s.embedder != nullptr) {
      add(s.options.embedding_model_name);
      for (const std::string& alias : s.options.embedding_model_aliases) add(alias);
    }
    write_json(res, 200, models_body(ids, s.created));
  });
  s.routes.Get("/v1/models/*", [&s](const HttpRequest& req, HttpResponse& res) {
    const std::string id = req.matches[1];
    if (!(s.engine != nullptr && s.serves(id)) && !(s.embedder != nullptr && s.serves_embedding(id))) {
      ApiError e;
      e.status = 404;
      e.code = "model_not_found";
      e.param = "model";
      e.message = fmt::format("the model '{}' does not exist; see GET /v1/models", id);
      write_error(res, e);
      return;
    }
    write_json(res, 200, model_body(id, s.created));
  });
  s.routes.Get("/health", [](const HttpRequest&, HttpResponse& res) { write_json(res, 200, {{"status", "ok"}}); });
  s.routes.Get("/ready", [&s](const HttpRequest&, HttpResponse& res) {
    if (s.draining.load()) {
      write_json(res, 503, {{"status", "draining"}});
    } else {
      nlohmann::json body = {{"status", "ready"}};
      if (s.engine != nullptr) body["model"] = s.options.model_name;
      if (s.embedder != nullptr) body["embedding_model"] = s.options.embedding_model_name;
      write_json(res, 200, body);
    }
  });
  s.routes.Get("/metrics", [&s](const HttpRequest&, HttpResponse& res) {
    res.status = 200;
    res.set_content(s.engine != nullptr ? s.metrics.render(s.scheduler->stats(), s.engine->attention_stats(),
                                                           s.engine->op_fallbacks(), s.engine->dispatcher().registry())
                                        : s.metrics.render({}, s.no_attention, {}, BackendRegistry::global()),
                    "text/plain; version=0.0.4; charset=utf-8");
  });
}

void Server::Impl::join_drainer() {
  std::thread t;
  {
    std::lock_guard<std::mutex> lock(drainer_mu);
    t = std::move(drainer);
  }
  if (t.joinable()) t.join();
}

Server::~Server() {
  shutdown();
  impl_->join_drainer();
}

Result<int> Server::bind() {
  Impl& s = *impl_;
  if (s.engine == nullptr && s.embedder == nullptr) {
    return Status(ErrorCode::invalid_argument, "server", "no model to serve: give a chat model, an embedder or both");
  }
  auto port = s.http->bind();
  if (!port) return port.status();
  s.bound = true;
  return *port;
}

Status Server::run() {
  Impl& s = *impl_;
  if (!s.bound) return Status(ErrorCode::invalid_argument, "server", "run() before bind()");
  if (!s.draining.load()) s.http->run();
  s.join_drainer();
  return {};
}

void Server::shutdown() {
  Impl& s = *impl_;
  std::call_once(s.shutdown_once, [&s] {
    // draining is set under the lock too: run() that saw it, then joins, waits for the thread.
    std::lock_guard<std::mutex> lock(s.drainer_mu);
    s.draining.store(true);
    s.drainer = std::thread([&s] { s.drain(); });
  });
}

}  // namespace kallpa::server
