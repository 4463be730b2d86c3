// `kallpa serve`: the OpenAI-compatible HTTP server (include/kallpa/server/server.h).
#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include <fmt/format.h>

#include "cli.h"
#include "engine_cli.h"
#include "kallpa/server/server.h"
#include "model_path.h"
#include "output.h"

namespace kallpa::cli {
namespace {

// Set by the signal handler, polled by a watcher thread: a handler may run on any thread (some
// were started before the command ran, with the default signal mask), and may only do this much.
// An atomic, not a volatile sig_atomic_t: the reader is another thread, and for that volatile is
// a data race (ThreadSanitizer reported it); a lock-free atomic is also safe in a handler.
std::atomic<int> g_signal{0};
static_assert(std::atomic<int>::is_always_lock_free);

extern "C" void on_stop_signal(int signo) { g_signal.store(signo); }

struct ServeCliOptions {
  EngineCliOptions engine;
  server::ServerOptions server;
  std::string embedding_model;  // a sentence-transformers folder; with no -m it is served alone
  bool no_access_log = false;
};

int run_serve(ServeCliOptions& o, const GlobalOptions& global) {
  if (o.server.api_key.empty()) {
    // Set but empty is a mistake (a missing secret in a deployment), not a wish to turn auth off:
    // refused, so that the server never runs open by accident. Unset the variable to run without.
    if (const char* key = std::getenv("KALLPA_API_KEY"); key != nullptr) {
      if (*key == '\0') {
        print_error("cannot start the server",
                    Status(ErrorCode::invalid_argument, "KALLPA_API_KEY",
                           "is set but empty; set a key, or unset it to serve without authentication"));
        return kExitUsage;
      }
      o.server.api_key = key;
    }
  }
  struct sigaction stop {};
  stop.sa_handler = on_stop_signal;
  sigemptyset(&stop.sa_mask);
  sigaction(SIGINT, &stop, nullptr);
  sigaction(SIGTERM, &stop, nullptr);
  std::signal(SIGPIPE, SIG_IGN);  // a client that hangs up mid-stream is an error return, not death

  int code = kExitOk;
  // A chat model unless only an embedding model was asked for.
  const bool chat = o.embedding_model.empty() || !o.engine.model.empty();
  std::unique_ptr<runtime::Engine> engine;
  if (chat) {
    engine = load_engine(o.engine, global, &code);
    if (!engine) return code;
    const std::string path = o.engine.model.empty() ? default_model_path() : o.engine.model;
    if (o.server.model_name.empty()) o.server.model_name = std::filesystem::path(path).stem().string();
    // A request may also name the model by its file name or the name inside the file
    // (general.name): what clients configured for llama.cpp or vLLM send.
    o.server.model_aliases.push_back(std::filesystem::path(path).filename().string());
    if (!engine->config().name.empty()) o.server.model_aliases.push_back(engine->config().name);
  }
  std::unique_ptr<runtime::Embedder> embedder;
  if (!o.embedding_model.empty()) {
    embedder = load_embedder(o.embedding_model, o.engine.device, global, &code);
    if (!embedder) return code;
    // The folder's name (all-MiniLM-L6-v2), as sentence-transformers and OpenAI-style clients name it.
    const std::filesystem::path folder = std::filesystem::path(o.embedding_model).lexically_normal();
    const std::string folder_name = (folder.has_filename() ? folder : folder.parent_path()).filename().string();
    if (o.server.embedding_model_name.empty()) o.server.embedding_model_name = folder_name;
    o.server.embedding_model_aliases.push_back(folder_name);
    if (!embedder->name().empty()) o.server.embedding_model_aliases.push_back(embedder->name());
  }
  if (o.no_access_log) o.server.access_log = nullptr;

  server::Server srv({.chat = engine.get(), .embedding = embedder.get()}, o.server);
  auto port = srv.bind();
  if (!port) {
    print_error("cannot start the server", port.status());
    return kExitUsage;
  }
  std::string models = engine ? fmt::format("model {}", o.server.model_name) : "";
  if (embedder) {
    models += fmt::format("{}embedding model {}", models.empty() ? "" : ", ", o.server.embedding_model_name);
  }
  fmt::print("kallpa serve: listening on http://{}:{} ({})\n", o.server.host, *port, models);
  std::fflush(stdout);
  if (engine) fmt::print(stderr, "kallpa serve: chat prompts in {}\n", engine->chat_format().description);

  std::atomic<bool> finished{false};
  std::thread signal_thread([&] {
    bool draining = false;
    while (!finished.load()) {
      if (const int signo = g_signal.load(); signo != 0 && !draining) {
        fmt::print(stderr, "kallpa serve: {} received: draining (up to {:g} s)\n",
                   signo == SIGTERM ? "SIGTERM" : "SIGINT", o.server.drain_seconds);
        srv.shutdown();
        draining = true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  Status s = srv.run();
  finished.store(true);
  signal_thread.join();
  if (!s) {
    print_error("server failed", s);
    return kExitFailure;
  }
  fmt::print(stderr, "kallpa serve: stopped\n");
  return kExitOk;
}

}  // namespace

Command add_serve_command(CLI::App& app) {
  auto o = std::make_shared<ServeCliOptions>();
  CLI::App* sub = app.add_subcommand("serve", "OpenAI-compatible HTTP server with continuous batching and /metrics");
  // Every running request's worst case must fit the KV cache at once, so a server wants more of it
  // than one conversation does (--context is the capacity shared by all sequences).
  o->engine.context = 8192;
  add_engine_options(sub, o->engine);
  server::ServerOptions& s = o->server;
  sub->add_option("--host", s.host, "Address to listen on (default 127.0.0.1: this machine only)");
  sub->add_option("--port", s.port, "Port (0: pick a free one and print it)")->check(CLI::Range(0, 65535));
  sub->add_option("--api-key", s.api_key, "Require Authorization: Bearer KEY on /v1/* (env KALLPA_API_KEY)");
  sub->add_option("--model-name", s.model_name, "Model id reported by /v1/models (default: the file name)");
  sub->add_option("--model-alias", s.model_aliases,
                  "Another id requests may name as `model` (repeatable; the file name and its general.name are "
                  "accepted too; any other id gets 404 model_not_found)");
  sub->add_option("--embedding-model", o->embedding_model,
                  "A sentence-transformers folder (models/all-MiniLM-L6-v2) served by POST /v1/embeddings, beside "
                  "the chat model given with -m, or alone when -m is not given");
  sub->add_option("--embedding-model-name", s.embedding_model_name,
                  "Embedding model id reported by /v1/models (default: the folder's name)");
  sub->add_option("--embedding-model-alias", s.embedding_model_aliases,
                  "Another id embeddings requests may name as `model` (repeatable)");
  sub->add_option("--max-embedding-inputs", s.max_embedding_inputs, "Most inputs in one embeddings request")
      ->check(CLI::Range(1, 1 << 20));
  sub->add_option("--max-choices", s.max_choices, "Most choices in one request: n times the prompts (<= --max-running)")
      ->check(CLI::Range(1, 4096));
  sub->add_option("--max-queue", s.scheduler.max_queue, "Requests waiting for a slot; more get 429")
      ->check(CLI::Range(0, 1 << 20));
  sub->add_option("--max-running", s.scheduler.max_running, "Sequences generating at once")->check(CLI::Range(1, 4096));
  sub->add_option("--max-batch-tokens", s.scheduler.max_batch_tokens, "Tokens per forward pass")
      ->check(CLI::Range(1, 1 << 20));
  sub->add_flag("--no-prefix-cache{false}", s.scheduler.prefix_cache,
                "Compute every prompt in full (default: reuse the KV blocks of prompts that begin the same way)");
  sub->add_option("--prefill-chunk", s.scheduler.prefill_chunk, "Prompt tokens per prefill chunk")
      ->check(CLI::Range(1, 1 << 20));
  sub->add_option("--max-tokens", s.max_tokens, "Largest max_tokens a request may ask for (also the default)")
      ->check(CLI::Range(1, 1 << 20));
  sub->add_option("--max-prompt-tokens", s.max_prompt_tokens, "Longest prompt in tokens (0: the model's context)")
      ->check(CLI::Range(0, 1 << 24));
  sub->add_option("--max-body-bytes", s.max_body_bytes, "Largest request body; more gets 413")
      ->check(CLI::Range(64, 1 << 30));
  sub->add_option("--drain-seconds", s.drain_seconds, "On SIGTERM/SIGINT: how long running requests may finish")
      ->check(CLI::Range(0.0, 3600.0));
  sub->add_option("--http-threads", s.http_threads, "HTTP worker threads (0: max-running + max-queue + 8)")
      ->check(CLI::Range(0, 4096));
  sub->add_option("--listen-backlog", s.listen_backlog, "Connections the kernel queues before they are accepted")
      ->check(CLI::Range(1, 1 << 16));
  sub->add_option("--header-timeout", s.header_timeout_seconds,
                  "Seconds for a request's header, from its first byte (a new connection: from connect)")
      ->check(CLI::Range(0.1, 3600.0));
  sub->add_option("--body-timeout", s.body_timeout_seconds, "Seconds for a request's body, after its header")
      ->check(CLI::Range(0.1, 3600.0));
  sub->add_option("--keep-alive-timeout", s.keep_alive_timeout_seconds,
                  "Seconds an idle connection stays open between requests")
      ->check(CLI::Range(0.1, 3600.0));
  sub->add_option("--write-timeout", s.write_timeout_seconds,
                  "Seconds each write of a response may take (a client that stops reading is dropped)")
      ->check(CLI::Range(0.1, 3600.0));
  sub->add_option("--max-header-bytes", s.max_header_bytes, "Largest request line + header; more gets 431")
      ->check(CLI::Range(1024, 1 << 24));
  sub->add_option("--max-header-fields", s.max_header_fields, "Most header fields in a request; more get 431")
      ->check(CLI::Range(8, 1 << 16));
  sub->add_option("--max-connections-per-client", s.max_connections_per_client,
                  "Open connections from one client address; more get 429 (behind a proxy: raise it)")
      ->check(CLI::Range(1, 1 << 20));
  sub->add_option("--max-connections", s.max_connections, "Open connections in all; more get 503")
      ->check(CLI::Range(1, 1 << 20));
  sub->add_option("--cors-origin", s.cors_origins,
                  "Origin browsers may call the API from (repeat for several; '*': any; default: none)");
  sub->add_flag("--no-access-log", o->no_access_log, "No per-request JSON lines on stderr");
  return {sub, [o](const GlobalOptions& g) { return run_serve(*o, g); }};
}

}  // namespace kallpa::cli
