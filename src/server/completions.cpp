// POST /v1/chat/completions and /v1/completions: parse, tokenize, check limits, hand the request
// to the scheduler (each prompt with its n choices), then answer with one JSON body or stream SSE
// chunks as tokens arrive.
#include <algorithm>
#include <deque>
#include <random>

#include <fmt/format.h>

#include "server/openai_responses.h"
#include "server/server_impl.h"
#include "server/sse.h"

namespace kallpa::server {
namespace {

using nlohmann::json;

// One choice of a generation.
struct ChoiceState {
  std::deque<std::string> pieces;         // streamed text not yet sent
  std::vector<LogprobEntry> new_entries;  // streamed log-probabilities not yet sent
  std::string text;                       // all text (non-streaming answer; echo included)
  std::vector<LogprobEntry> entries;      // all log-probabilities (non-streaming answer)
  std::int64_t sent_bytes = 0;            // streamed text so far (the legacy text_offset)
  bool started = false;                   // the first chunk (role, echo) is sent
  ToolReply tool_reply;                   // the reply read as tool calls (requests that offer tools)
  bool text_new = false;                  // a stream's reply text grew since it was last looked at
  std::size_t answer_sent = 0;            // bytes of a streamed reply's plain answer already sent
  bool done = false;
  bool finish_sent = false;
  runtime::Completion completion;
};

// One request's generation: every choice of every prompt, shared by the HTTP thread and the
// scheduler's callbacks (under mu).
struct Generation {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<ChoiceState> choices;
  std::int64_t tokens = 0;  // over all choices
  Clock::time_point arrival, last_token;
  double ttft_seconds = -1.0;
  std::vector<std::shared_ptr<runtime::RequestHandle>> handles;  // one per prompt
  // Replies are the tool-call JSON: each choice's text is kept whole and read when it ends (a
  // stream sends a plain answer as it is decoded, calls at the end).
  bool tool_replies = false;

  bool all_done() const {
    return std::all_of(choices.begin(), choices.end(), [](const ChoiceState& c) { return c.done; });
  }
  void cancel() {
    for (const auto& h : handles) h->cancel();
  }
};

// The text a token stands for in logprobs: its bytes, or the token's own text for a control
// token (whose bytes are empty).
std::string token_piece(const tokenizer::Tokenizer& tok, std::int32_t id) {
  return tok.is_control(id) ? tok.token_text(id) : tok.token_bytes(id);
}

runtime::RequestCallbacks callbacks_for(const std::shared_ptr<Generation>& g, std::size_t index, bool first_of_prompt,
                                        ServerMetrics& metrics, bool stream, const tokenizer::Tokenizer& tok) {
  runtime::RequestCallbacks cb;
  cb.on_token = [g, index, &metrics, stream](std::string_view text, std::int32_t tokens) {
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
    ChoiceState& c = g->choices[index];
    if (stream && !g->tool_replies) {
      c.pieces.emplace_back(text);
    } else {
      c.text += text;
      c.text_new = stream;
    }
    g->cv.notify_all();
  };
  cb.on_logprobs = [g, index, stream, &tok](const runtime::TokenLogprobs& lp) {
    LogprobEntry e;
    e.token = token_piece(tok, lp.sampled.id);
    e.logprob = lp.sampled.logprob;
    for (const runtime::TokenLogprob& t : lp.top) e.top.emplace_back(token_piece(tok, t.id), t.logprob);
    std::lock_guard lock(g->mu);
    ChoiceState& c = g->choices[index];
    (stream ? c.new_entries : c.entries).push_back(std::move(e));
  };
  // The prompt is counted once, on the first choice of each prompt (the others share its blocks).
  cb.on_done = [g, index, first_of_prompt, &metrics](const runtime::Completion& c) {
    runtime::Completion counted = c;
    if (!first_of_prompt) counted.prompt_tokens = counted.cached_prompt_tokens = 0;
    metrics.generation_finished(counted);
    std::lock_guard lock(g->mu);
    g->choices[index].completion = c;
    g->choices[index].done = true;
    g->cv.notify_all();
  };
  return cb;
}

bool finished_ok(const runtime::Completion& c) { return c.finish_reason == "stop" || c.finish_reason == "length"; }

// A request that ended without an answer: why, in OpenAI's error shape.
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

// The prompt once for all choices, the generated tokens of every choice; cached tokens are counted
// on the first choice of each prompt (the others share its prompt).
Usage usage_of(const Generation& g, std::int64_t n) {
  Usage u;
  for (std::size_t i = 0; i < g.choices.size(); ++i) {
    const runtime::Completion& c = g.choices[i].completion;
    u.completion_tokens += c.generated_tokens;
    if (static_cast<std::int64_t>(i) % n == 0) {
      u.prompt_tokens += c.prompt_tokens;
      u.cached_tokens += c.cached_prompt_tokens;
    }
  }
  return u;
}

Result<std::vector<std::int32_t>> tokenize(const runtime::Engine& engine, const CompletionRequest& r,
                                           const PromptInput* prompt) {
  if (r.endpoint == Endpoint::chat) {
    const tokenizer::ChatFormat& format = engine.chat_format();
    const std::vector<tokenizer::ChatMessage> messages = tool_chat_messages(r.messages, r.tools, format.tools);
    const std::string tools = r.tools.offered() && format.tools.tools ? tools_template_json(r.tools) : "";
    return tokenizer::encode_chat(engine.tokenizer(), format, messages, /*add_generation_prompt=*/true, tools);
  }
  if (prompt->is_tokens) return prompt->tokens;
  // A raw completion prompt is the caller's whole input: special-token text in it is meant.
  return engine.tokenizer().encode(prompt->text, {.add_special = true, .parse_special = true});
}

ApiError model_not_found(const std::string& asked, const std::string& served) {
  ApiError e;
  e.status = 404;
  e.code = "model_not_found";
  e.param = "model";
  e.message = fmt::format("the model '{}' does not exist; this server serves '{}'", asked, served);
  return e;
}

}  // namespace

bool Server::Impl::serves(const std::string& model) const {
  if (model == options.model_name) return true;
  return std::find(options.model_aliases.begin(), options.model_aliases.end(), model) != options.model_aliases.end();
}

void Server::Impl::handle_generation(const HttpRequest& req, HttpResponse& res, Endpoint endpoint) {
  const auto arrival = Clock::now();
  auto in_flight = std::make_shared<InFlight>(*this);  // before the draining check: see drain()
  if (!accepting(res)) return;
  ParsedRequest parsed = parse_completion_request(req.body, endpoint, limits);
  if (auto* error = std::get_if<ApiError>(&parsed)) {
    write_error(res, *error);
    return;
  }
  CompletionRequest& r = std::get<CompletionRequest>(parsed);
  // An absent model means the one served; a named one must be it (or one of its aliases).
  if (!r.model.empty() && !serves(r.model)) {
    ApiError e = model_not_found(r.model, options.model_name);
    if (embedder != nullptr && serves_embedding(r.model)) {
      e.message = fmt::format("'{}' is an embedding model (POST /v1/embeddings); this server chats with '{}'", r.model,
                              options.model_name);
    }
    write_error(res, e);
    return;
  }
  const std::string param = endpoint == Endpoint::chat ? "messages" : "prompt";
  const std::size_t n_prompts = endpoint == Endpoint::chat ? 1 : r.prompts.size();
  std::vector<std::vector<std::int32_t>> prompts;
  std::int64_t n_prompt = 0, longest = 0;
  for (std::size_t p = 0; p < n_prompts; ++p) {
    const std::string where = n_prompts > 1 ? fmt::format("prompt[{}]", p) : param;
    auto prompt = tokenize(*engine, r, endpoint == Endpoint::chat ? nullptr : &r.prompts[p]);
    if (!prompt) {
      write_error(res, bad_request(where, prompt.status().to_string()));
      return;
    }
    const auto size = static_cast<std::int64_t>(prompt->size());
    if (size > max_prompt_tokens) {
      write_error(res, bad_request(where,
                                   fmt::format("the prompt has {} tokens; this server accepts at most {}", size,
                                               max_prompt_tokens),
                                   "context_length_exceeded"));
      return;
    }
    n_prompt += size;
    longest = std::max(longest, size);
    prompts.push_back(std::move(*prompt));
  }
  // An explicit max_tokens that the context cannot hold (after the longest prompt) is refused, as
  // OpenAI does; the default one ends at the context's end instead (finish_reason "length").
  if (const std::int64_t context_length = engine->config().context_length;
      r.max_tokens_given && longest + r.max_tokens > context_length) {
    write_error(res, bad_request("max_tokens",
                                 fmt::format("the prompt has {} tokens and max_tokens is {}: {} in all, over the "
                                             "context of {} tokens",
                                             longest, r.max_tokens, longest + r.max_tokens, context_length),
                                 "context_length_exceeded"));
    return;
  }
  std::shared_ptr<const runtime::CompiledGrammar> grammar;
  if (r.tools.offered()) {
    // The reply's grammar: calls whose arguments follow their tools' schemas, or (auto) an answer.
    // A schema the engine cannot compile is found by compiling each tool's alone.
    const runtime::GrammarSpec spec{runtime::GrammarKind::json_schema, tool_reply_schema(r.tools, r.grammar), true};
    auto compiled = structured->compile(spec, "tools");
    if (auto* error = std::get_if<ApiError>(&compiled)) {
      for (std::size_t i = 0; i < r.tools.tools.size() && error->code != "unsupported_value"; ++i) {
        const std::string where = fmt::format("tools[{}].function.parameters", i);
        const runtime::GrammarSpec one{runtime::GrammarKind::json_schema, tool_reply_schema(r.tools, r.grammar, i),
                                       true};
        auto alone = structured->compile(one, where);
        if (auto* e = std::get_if<ApiError>(&alone)) {
          write_error(res, *e);
          return;
        }
      }
      if (r.grammar && error->code != "unsupported_value") error->param = "response_format";
      write_error(res, *error);
      return;
    }
    grammar = std::get<std::shared_ptr<const runtime::CompiledGrammar>>(std::move(compiled));
  } else if (r.grammar) {
    auto compiled = structured->compile(*r.grammar);
    if (auto* error = std::get_if<ApiError>(&compiled)) {
      write_error(res, *error);
      return;
    }
    grammar = std::get<std::shared_ptr<const runtime::CompiledGrammar>>(std::move(compiled));
  }
  if (!r.seed_given) r.sampling.seed = (std::uint64_t{std::random_device{}()} << 32) | std::random_device{}();

  auto g = std::make_shared<Generation>();
  g->arrival = arrival;
  g->tool_replies = r.tools.offered();
  g->choices.resize(n_prompts * static_cast<std::size_t>(r.n));
  if (r.echo) {
    // The prompt as text, as the tokenizer sees it (a token-id prompt is decoded).
    for (std::size_t p = 0; p < n_prompts; ++p) {
      std::string text = r.prompts[p].text;
      if (r.prompts[p].is_tokens) {
        auto decoded = engine->tokenizer().decode(prompts[p]);
        if (!decoded) {
          write_error(res,
                      bad_request(n_prompts > 1 ? fmt::format("prompt[{}]", p) : param, decoded.status().to_string()));
          return;
        }
        text = std::move(*decoded);
      }
      for (std::int64_t j = 0; j < r.n; ++j) {
        ChoiceState& c = g->choices[p * static_cast<std::size_t>(r.n) + static_cast<std::size_t>(j)];
        (r.stream ? c.pieces.emplace_back() : c.text) = text;
      }
    }
  }
  for (std::size_t p = 0; p < n_prompts; ++p) {
    runtime::RequestOptions ro;
    ro.prompt = std::move(prompts[p]);
    ro.sampling = r.sampling;
    // Every choice of the request draws from its own stream: seed, seed + 1, ... in index order.
    ro.sampling.seed += p * static_cast<std::uint64_t>(r.n);
    ro.max_tokens = r.max_tokens;
    ro.stop = r.stop;
    ro.stop_at_eos = !r.ignore_eos;
    ro.logprobs = r.logprobs;
    ro.grammar = grammar;
    std::vector<runtime::RequestCallbacks> choices;
    for (std::int64_t j = 0; j < r.n; ++j) {
      choices.push_back(callbacks_for(g, p * static_cast<std::size_t>(r.n) + static_cast<std::size_t>(j), j == 0,
                                      metrics, r.stream, engine->tokenizer()));
    }
    auto handle = scheduler->submit_choices(std::move(ro), std::move(choices));
    if (!handle) {
      g->cancel();  // the prompts already queued
      ApiError e = from_status(handle.status());
      if (e.param == "prompt" || e.param.rfind("prompt[", 0) == 0) e.param = param;
      write_error(res, e);
      return;
    }
    g->handles.push_back(*handle);
  }

  ResponseMeta meta;
  meta.endpoint = endpoint;
  meta.id = fmt::format("{}-{}-{}", endpoint == Endpoint::chat ? "chatcmpl" : "cmpl", id_prefix, g->handles[0]->id());
  auto ctx = context(req);
  if (ctx) {
    std::lock_guard lock(ctx->mu);
    ctx->generation = true;
    ctx->stream = r.stream;
    ctx->prompt_tokens = n_prompt;
    ctx->completion_id = meta.id;
  }
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
  const std::int64_t n = r.n;
  const bool want_logprobs = r.logprobs >= 0;

  if (!r.stream) {
    bool hung_up = false;
    std::unique_lock lock(g->mu);
    // The client is looked at while it waits: one that hangs up frees its sequences now.
    while (!g->cv.wait_for(lock, std::chrono::milliseconds(200), [&] { return g->all_done(); })) {
      if (!hung_up && req.client_gone && req.client_gone()) {
        hung_up = true;
        lock.unlock();  // cancel() may finish the request, whose callback takes this lock
        g->cancel();
        lock.lock();
      }
    }
    if (hung_up) {
      lock.unlock();
      record("client_disconnected");
      ApiError e;
      e.status = 499;  // nginx's "client closed request": no one reads it, the access log does
      e.code = "client_closed_request";
      e.message = "the client closed the connection before the response";
      write_error(res, e);
      return;
    }
    std::vector<ChoiceBody> bodies;
    for (std::size_t i = 0; i < g->choices.size(); ++i) {
      ChoiceState& c = g->choices[i];
      if (!finished_ok(c.completion)) {
        const runtime::Completion failed = c.completion;
        lock.unlock();
        record(failed.finish_reason);
        write_error(res, failure(failed));
        return;
      }
      ChoiceBody body{static_cast<std::int64_t>(i), c.text, c.completion.finish_reason,
                      want_logprobs ? &c.entries : nullptr};
      if (g->tool_replies) {
        c.tool_reply = read_tool_reply(c.text);
        const ToolReply& reply = c.tool_reply;
        body.text = reply.content;
        body.tool_calls = &reply.calls;
        body.content_null = reply.content_null;
        if (!reply.calls.empty()) body.finish_reason = "tool_calls";
      }
      bodies.push_back(body);
    }
    const json body = completion_body(meta, bodies, usage_of(*g, n));
    const std::string finish = bodies[0].finish_reason;
    lock.unlock();
    record(finish);
    res.status = 200;
    res.set_content(dump_json(body), "application/json");
    return;
  }

  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");  // proxies: do not buffer the stream
  const bool include_usage = r.include_usage;
  res.set_chunked_content_provider(
      std::string(kSseContentType),
      [g, meta, n, include_usage, want_logprobs, record, in_flight](std::size_t, DataSink& sink) {
        const bool tool_replies = g->tool_replies;
        std::string out;
        bool done = false;
        std::string first_finish;
        Usage usage;
        {
          std::unique_lock lock(g->mu);
          auto pending = [&] {
            for (const ChoiceState& c : g->choices) {
              // (A completions stream has no role chunk to start with: nothing to send yet.)
              const bool role_due = !c.started && meta.endpoint == Endpoint::chat;
              if (role_due || !c.pieces.empty() || !c.new_entries.empty() || c.text_new || (c.done && !c.finish_sent)) {
                return true;
              }
            }
            return false;
          };
          g->cv.wait_for(lock, std::chrono::seconds(1), pending);
          for (std::size_t i = 0; i < g->choices.size(); ++i) {
            ChoiceState& c = g->choices[i];
            const auto index = static_cast<std::int64_t>(i);
            std::string text;
            for (const std::string& piece : c.pieces) text += piece;
            c.pieces.clear();
            const bool first = !c.started;
            c.started = true;
            if (first || !text.empty() || !c.new_entries.empty()) {
              const json lp = want_logprobs && !c.new_entries.empty()
                                  ? logprobs_json(meta.endpoint, c.new_entries, c.sent_bytes)
                                  : json(nullptr);
              for (const LogprobEntry& e : c.new_entries) c.sent_bytes += static_cast<std::int64_t>(e.token.size());
              c.new_entries.clear();
              // A completions stream has no role chunk: its first chunk is its first text.
              if (meta.endpoint == Endpoint::chat || !text.empty() || !lp.is_null()) {
                json chunk = stream_chunk(meta, index, text, "", first && meta.endpoint == Endpoint::chat, lp);
                // A reply that may be tool calls starts without content (null, as OpenAI's does), so
                // that a client accumulating the deltas ends with content null beside the calls.
                if (first && tool_replies) chunk["choices"][0]["delta"]["content"] = nullptr;
                out += sse_event(chunk);
              }
            }
            if (tool_replies && c.text_new && !c.done) {
              // A plain answer streams as it is written; calls wait for the end of the reply.
              c.text_new = false;
              if (auto answer = answer_so_far(c.text); answer && answer->size() > c.answer_sent) {
                out += sse_event(stream_chunk(meta, index, answer->substr(c.answer_sent), ""));
                c.answer_sent = answer->size();
              }
            }
            if (c.done && !c.finish_sent) {
              c.finish_sent = true;
              if (finished_ok(c.completion)) {
                std::string finish = c.completion.finish_reason;
                if (tool_replies) {
                  // The whole reply is known now: its calls (or its answer) go out as deltas.
                  c.tool_reply = read_tool_reply(c.text);
                  for (std::size_t k = 0; k < c.tool_reply.calls.size(); ++k) {
                    for (const json& chunk :
                         tool_call_chunks(meta, index, static_cast<std::int64_t>(k), c.tool_reply.calls[k])) {
                      out += sse_event(chunk);
                    }
                  }
                  if (!c.tool_reply.calls.empty()) {
                    finish = "tool_calls";
                  } else if (c.tool_reply.content.size() > c.answer_sent) {
                    out += sse_event(stream_chunk(meta, index, c.tool_reply.content.substr(c.answer_sent), ""));
                  }
                }
                out += sse_event(stream_chunk(meta, index, "", finish));
              } else {
                out += sse_event(failure(c.completion).to_json());
              }
            }
          }
          done = g->all_done();
          if (done) {
            usage = usage_of(*g, n);
            first_finish = g->choices[0].tool_reply.calls.empty() ? g->choices[0].completion.finish_reason
                                                                  : std::string("tool_calls");
          }
        }
        if (done) {
          if (include_usage) out += sse_event(usage_chunk(meta, usage));
          out += kSseDone;
        }
        if (out.empty()) out = kSseKeepAlive;
        if (!sink.write(out.data(), out.size())) {
          // The client went away: free its sequences now rather than at max_tokens.
          g->cancel();
          record("client_disconnected");
          return false;
        }
        if (done) {
          record(first_finish);
          sink.done();
        }
        return true;
      },
      [g](bool) { g->cancel(); });  // no-op when finished; otherwise the response was abandoned
}

}  // namespace kallpa::server
