// POST /v1/chat/completions and /v1/completions: parse, tokenize, check limits, hand the request
// to the scheduler, then answer with one JSON body or stream SSE chunks as tokens arrive.
#include <deque>
#include <random>

#include <fmt/format.h>

#include "server/openai_responses.h"
#include "server/server_impl.h"
#include "server/sse.h"

namespace kallpa::server {
namespace {

// One generation, shared by the HTTP thread and the scheduler's callbacks.
struct Generation {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::string> pieces;  // streamed text not yet sent
  std::string text;                // all text (non-streaming answer)
  std::int64_t tokens = 0;
  bool done = false;
  runtime::Completion completion;
  Clock::time_point arrival, last_token;
  double ttft_seconds = -1.0;
  std::shared_ptr<runtime::RequestHandle> handle;
};

runtime::RequestCallbacks callbacks_for(const std::shared_ptr<Generation>& g, ServerMetrics& metrics, bool stream) {
  runtime::RequestCallbacks cb;
  cb.on_token = [g, &metrics, stream](std::string_view text, std::int32_t tokens) {
    const auto now = Clock::now();
    std::lock_guard lock(g->mu);
    if (tokens > 0) {
      if (g->tokens == 0) {
        g->ttft_seconds = std::chrono::duration<double>(now - g->arrival).count();
        metrics.time_to_first_token(g->ttft_seconds);
      } else {
        metrics.inter_token_latency(std::chrono::duration<double>(now - g->last_token).count());
      }
      g->last_token = now;
      g->tokens += tokens;
    }
    if (text.empty()) return;
    if (stream) {
      g->pieces.emplace_back(text);
    } else {
      g->text += text;
    }
    g->cv.notify_all();
  };
  cb.on_done = [g, &metrics](const runtime::Completion& c) {
    metrics.generation_finished(c);
    std::lock_guard lock(g->mu);
    g->completion = c;
    g->done = true;
    g->cv.notify_all();
  };
  return cb;
}

// A request that ended without an answer: why, in OpenAI's error shape.
Usage usage_of(const runtime::Completion& c) { return {c.prompt_tokens, c.generated_tokens, c.cached_prompt_tokens}; }

ApiError failure(const runtime::Completion& c) {
  if (c.finish_reason == "cancelled") {
    ApiError e;
    e.status = 503;
    e.type = "server_error";
    e.code = "cancelled";
    e.message = "the request was cancelled: the server is shutting down";
    e.retry_after_seconds = 5;
    return e;
  }
  return from_status(c.status);
}

Result<std::vector<std::int32_t>> tokenize(const runtime::Engine& engine, const CompletionRequest& r) {
  if (r.endpoint == Endpoint::chat) return tokenizer::encode_chat(engine.tokenizer(), engine.chat_format(), r.messages);
  if (r.prompt_is_tokens) return r.prompt_tokens;
  // A raw completion prompt is the caller's whole input: special-token text in it is meant.
  return engine.tokenizer().encode(r.prompt, {.add_special = true, .parse_special = true});
}

}  // namespace

void Server::Impl::handle_generation(const httplib::Request& req, httplib::Response& res, Endpoint endpoint) {
  const auto arrival = Clock::now();
  auto in_flight = std::make_shared<InFlight>(*this);  // before the draining check: see drain()
  if (draining.load()) {
    ApiError e;
    e.status = 503;
    e.type = "server_error";
    e.code = "shutting_down";
    e.message = "the server is shutting down";
    e.retry_after_seconds = 5;
    write_error(res, e);
    return;
  }
  ParsedRequest parsed = parse_completion_request(req.body, endpoint, limits);
  if (auto* error = std::get_if<ApiError>(&parsed)) {
    write_error(res, *error);
    return;
  }
  CompletionRequest& r = std::get<CompletionRequest>(parsed);
  const std::string param = endpoint == Endpoint::chat ? "messages" : "prompt";
  auto prompt = tokenize(engine, r);
  if (!prompt) {
    write_error(res, bad_request(param, prompt.status().to_string()));
    return;
  }
  const auto n_prompt = static_cast<std::int64_t>(prompt->size());
  if (n_prompt > max_prompt_tokens) {
    write_error(res, bad_request(param,
                                 fmt::format("the prompt has {} tokens; this server accepts at most {}", n_prompt,
                                             max_prompt_tokens),
                                 "context_length_exceeded"));
    return;
  }
  std::shared_ptr<const runtime::CompiledGrammar> grammar;
  if (r.grammar) {
    auto compiled = structured.compile(*r.grammar);
    if (auto* error = std::get_if<ApiError>(&compiled)) {
      write_error(res, *error);
      return;
    }
    grammar = std::get<std::shared_ptr<const runtime::CompiledGrammar>>(std::move(compiled));
  }
  if (!r.seed_given) r.sampling.seed = (std::uint64_t{std::random_device{}()} << 32) | std::random_device{}();

  runtime::RequestOptions ro;
  ro.prompt = std::move(*prompt);
  ro.sampling = r.sampling;
  ro.max_tokens = r.max_tokens;
  ro.stop = r.stop;
  ro.stop_at_eos = !r.ignore_eos;
  ro.grammar = std::move(grammar);
  auto g = std::make_shared<Generation>();
  g->arrival = arrival;
  auto handle = scheduler->submit(std::move(ro), callbacks_for(g, metrics, r.stream));
  if (!handle) {
    ApiError e = from_status(handle.status());
    if (e.param == "prompt" || e.param.rfind("prompt[", 0) == 0) e.param = param;
    write_error(res, e);
    return;
  }
  g->handle = *handle;

  auto ctx = context(res);
  if (ctx) {
    std::lock_guard lock(ctx->mu);
    ctx->generation = true;
    ctx->stream = r.stream;
    ctx->prompt_tokens = n_prompt;
  }
  ResponseMeta meta;
  meta.endpoint = endpoint;
  meta.id = fmt::format("{}-{}-{}", endpoint == Endpoint::chat ? "chatcmpl" : "cmpl", id_prefix, (*handle)->id());
  meta.model = options.model_name;
  meta.created =
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  // What the access log reports once the response is over.
  auto record = [g, ctx](const std::string& finish_reason) {
    if (!ctx) return;
    std::lock_guard glock(g->mu);
    std::lock_guard lock(ctx->mu);
    ctx->completion_tokens = g->tokens;
    ctx->finish_reason = finish_reason;
    ctx->ttft_seconds = g->ttft_seconds;
  };

  if (!r.stream) {
    runtime::Completion c;
    {
      std::unique_lock lock(g->mu);
      g->cv.wait(lock, [&] { return g->done; });
      c = g->completion;
    }
    record(c.finish_reason);
    if (c.finish_reason != "stop" && c.finish_reason != "length") {
      write_error(res, failure(c));
      return;
    }
    std::lock_guard lock(g->mu);
    res.status = 200;
    res.set_content(dump_json(completion_body(meta, g->text, c.finish_reason, usage_of(c))), "application/json");
    return;
  }

  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");  // proxies: do not buffer the stream
  const bool include_usage = r.include_usage;
  auto role_sent = std::make_shared<bool>(false);
  res.set_chunked_content_provider(
      std::string(kSseContentType),
      [g, meta, include_usage, role_sent, record, in_flight](std::size_t, httplib::DataSink& sink) {
        std::string out;
        if (meta.endpoint == Endpoint::chat && !*role_sent) {
          out += sse_event(stream_chunk(meta, "", "", /*role_delta=*/true));
          *role_sent = true;
        }
        bool done = false;
        runtime::Completion c;
        {
          std::unique_lock lock(g->mu);
          if (out.empty()) {
            g->cv.wait_for(lock, std::chrono::seconds(1), [&] { return !g->pieces.empty() || g->done; });
          }
          for (const std::string& piece : g->pieces) out += sse_event(stream_chunk(meta, piece, ""));
          g->pieces.clear();
          done = g->done;
          c = g->completion;
        }
        if (done) {
          if (c.finish_reason == "stop" || c.finish_reason == "length") {
            out += sse_event(stream_chunk(meta, "", c.finish_reason));
          } else {
            out += sse_event(failure(c).to_json());
          }
          if (include_usage) out += sse_event(usage_chunk(meta, usage_of(c)));
          out += kSseDone;
        }
        if (out.empty()) out = kSseKeepAlive;
        if (!sink.write(out.data(), out.size())) {
          // The client went away: free its sequence now rather than at max_tokens.
          g->handle->cancel();
          record("client_disconnected");
          return false;
        }
        if (done) {
          record(c.finish_reason);
          sink.done();
        }
        return true;
      },
      [g](bool) { g->handle->cancel(); });  // no-op when finished; otherwise the response was abandoned
}

}  // namespace kallpa::server
