// `kallpa serve`: an OpenAI-compatible HTTP server over a chat engine, a sentence embedder or
// both, with continuous batching (runtime/scheduler.h), SSE streaming, limits, Prometheus metrics
// and structured access logs.
//
//   POST /v1/chat/completions, POST /v1/completions   (stream: Server-Sent Events, then [DONE])
//   POST /tokenize, POST /detokenize                   (llama.cpp's server shapes)
//   POST /v1/embeddings                                (with an embedder)
//   GET  /v1/models, /health (alive), /ready (model loaded, not draining), /metrics (Prometheus)
//
// /v1/* require `Authorization: Bearer KEY` when an API key is set; /health, /ready and /metrics
// do not (probes and scrapers). Errors use OpenAI's body shape {"error": {message, type, param,
// code}}: 400 malformed JSON, wrong types and values out of range, 401 bad key, 404 unknown route
// or model, 413 body too large, 429 queue full and 503 draining (both with Retry-After), 500
// engine failure; 431 header too large, 429/503 too many connections (from one address / in all).
// A client that hangs up before its response is cancelled and logged as 499.
//
//   Server server(engine, options);  // or Server({.chat = &engine, .embedding = &embedder}, options)
//   int port = *server.bind();      // options.port 0: any free port
//   server.run();                   // blocks until shutdown() has drained
//   // from another thread (a signal handler thread):
//   server.shutdown();
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "kallpa/runtime/embedder.h"
#include "kallpa/runtime/engine.h"
#include "kallpa/runtime/scheduler.h"
#include "kallpa/status.h"

namespace kallpa::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;         // 0: pick a free port (bind() returns it)
  std::string api_key;     // "": no authentication
  std::string model_name;  // the id /v1/models reports and responses carry
  // More ids a request's `model` may name (kallpa serve: the file's name, its general.name and
  // every --model-alias); listed by /v1/models after model_name. Any other id gets 404.
  std::vector<std::string> model_aliases;
  // The embedding model's id and more ids for it, as above (an embeddings request naming another
  // model gets 404, as does a chat request naming the embedding model).
  std::string embedding_model_name;
  std::vector<std::string> embedding_model_aliases;
  std::size_t max_embedding_inputs = 2048;  // inputs in one embeddings request
  std::int64_t max_choices = 8;             // the most choices in one request (n times the prompts)
  std::size_t max_body_bytes = 1 << 20;
  std::int64_t max_prompt_tokens = 0;  // 0: the model's context length - 1
  std::int64_t max_tokens = 512;       // the largest max_tokens accepted, and the default
  double drain_seconds = 30.0;         // after shutdown(): how long running requests may finish
  int http_threads = 0;                // 0: enough for every running and queued request, plus 8
  // The transport (docs/server.md): deadlines, header limits and connection bounds.
  int listen_backlog = 1024;
  double header_timeout_seconds = 10.0;      // a request's header, from its first byte (431 past the limits)
  double body_timeout_seconds = 30.0;        // its body, from the end of the header
  double keep_alive_timeout_seconds = 15.0;  // an idle connection between requests
  double write_timeout_seconds = 30.0;       // each write of a response
  std::size_t max_header_bytes = 16 * 1024;
  std::size_t max_header_fields = 100;
  int max_connections_per_client = 128;   // open connections from one address; more get 429
  int max_connections = 4096;             // open connections in all; more get 503
  std::vector<std::string> cors_origins;  // origins browsers may call from ("*": any); none by default
  std::FILE* access_log = stderr;         // one JSON line per request; nullptr: none
  runtime::SchedulerOptions scheduler;    // batch size, max running, queue length
};

// What a server serves: a chat engine (chat, completions, tokenize), an embedder (embeddings), or
// both. Routes of the one absent answer 404 saying so. Neither is owned; both outlive the server.
struct ServedModels {
  runtime::Engine* chat = nullptr;
  runtime::Embedder* embedding = nullptr;
};

class Server {
 public:
  Server(runtime::Engine& engine, ServerOptions options);
  Server(ServedModels models, ServerOptions options);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds the listening socket; returns the port. invalid_argument when there is no model to serve.
  Result<int> bind();
  // Serves until shutdown() has finished draining. Requires bind().
  Status run();
  // Safe from any thread, any number of times; returns at once. New requests get 503 from now
  // on; running and queued ones may finish for up to drain_seconds, then are cancelled; then
  // run() returns.
  void shutdown();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kallpa::server
