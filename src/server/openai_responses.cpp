#include "server/openai_responses.h"

#include <cmath>

namespace kallpa::server {
namespace {

using nlohmann::json;

json finish_json(const std::string& reason) { return reason.empty() ? json(nullptr) : json(reason); }

json envelope(const ResponseMeta& meta, const char* chat_object, const char* text_object) {
  return {{"id", meta.id},
          {"object", meta.endpoint == Endpoint::chat ? chat_object : text_object},
          {"created", meta.created},
          {"model", meta.model}};
}

// JSON has no infinity: a token the model rules out gets OpenAI's floor.
double finite_logprob(float lp) { return std::isfinite(lp) ? double(lp) : -9999.0; }

json bytes_json(const std::string& token) {
  json bytes = json::array();
  for (char c : token) bytes.push_back(static_cast<unsigned char>(c));
  return bytes;
}

}  // namespace

json logprobs_json(Endpoint endpoint, const std::vector<LogprobEntry>& entries, std::int64_t text_offset) {
  if (endpoint == Endpoint::chat) {
    json content = json::array();
    for (const LogprobEntry& e : entries) {
      json top = json::array();
      for (const auto& [token, lp] : e.top) {
        top.push_back({{"token", token}, {"logprob", finite_logprob(lp)}, {"bytes", bytes_json(token)}});
      }
      content.push_back({{"token", e.token},
                         {"logprob", finite_logprob(e.logprob)},
                         {"bytes", bytes_json(e.token)},
                         {"top_logprobs", std::move(top)}});
    }
    return {{"content", std::move(content)}, {"refusal", nullptr}};
  }
  json tokens = json::array(), token_logprobs = json::array(), top_logprobs = json::array(), offsets = json::array();
  for (const LogprobEntry& e : entries) {
    tokens.push_back(e.token);
    token_logprobs.push_back(finite_logprob(e.logprob));
    json top = json::object();
    for (const auto& [token, lp] : e.top) top[token] = finite_logprob(lp);
    top_logprobs.push_back(std::move(top));
    offsets.push_back(text_offset);
    text_offset += static_cast<std::int64_t>(e.token.size());
  }
  return {{"tokens", std::move(tokens)},
          {"token_logprobs", std::move(token_logprobs)},
          {"top_logprobs", std::move(top_logprobs)},
          {"text_offset", std::move(offsets)}};
}

json usage_json(const Usage& u) {
  return {{"prompt_tokens", u.prompt_tokens},
          {"completion_tokens", u.completion_tokens},
          {"total_tokens", u.prompt_tokens + u.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", u.cached_tokens}}}};
}

json completion_body(const ResponseMeta& meta, const std::vector<ChoiceBody>& choices, const Usage& usage) {
  json body = envelope(meta, "chat.completion", "text_completion");
  json list = json::array();
  for (const ChoiceBody& c : choices) {
    json choice = {{"index", c.index},
                   {"finish_reason", finish_json(c.finish_reason)},
                   {"logprobs", c.logprobs ? logprobs_json(meta.endpoint, *c.logprobs, 0) : json(nullptr)}};
    if (meta.endpoint == Endpoint::chat) {
      json message = {{"role", "assistant"}, {"content", c.content_null ? json(nullptr) : json(c.text)}};
      if (c.tool_calls && !c.tool_calls->empty()) {
        json calls = json::array();
        for (const tokenizer::ChatToolCall& call : *c.tool_calls) {
          calls.push_back({{"id", call.id},
                           {"type", "function"},
                           {"function", {{"name", call.name}, {"arguments", call.arguments}}}});
        }
        message["tool_calls"] = std::move(calls);
      }
      choice["message"] = std::move(message);
    } else {
      choice["text"] = c.text;
    }
    list.push_back(std::move(choice));
  }
  body["choices"] = std::move(list);
  body["usage"] = usage_json(usage);
  return body;
}

json stream_chunk(const ResponseMeta& meta, std::int64_t index, const std::string& text,
                  const std::string& finish_reason, bool role_delta, const json& logprobs) {
  json body = envelope(meta, "chat.completion.chunk", "text_completion");
  json choice = {{"index", index}, {"finish_reason", finish_json(finish_reason)}, {"logprobs", logprobs}};
  if (meta.endpoint == Endpoint::chat) {
    json delta = json::object();
    if (role_delta) delta["role"] = "assistant";
    if (!text.empty() || role_delta) delta["content"] = text;
    choice["delta"] = delta;
  } else {
    choice["text"] = text;
  }
  body["choices"] = json::array({choice});
  return body;
}

std::vector<json> tool_call_chunks(const ResponseMeta& meta, std::int64_t index, std::int64_t call_index,
                                   const tokenizer::ChatToolCall& call) {
  std::vector<json> chunks;
  const json deltas[] = {
      {{"index", call_index},
       {"id", call.id},
       {"type", "function"},
       {"function", {{"name", call.name}, {"arguments", ""}}}},
      {{"index", call_index}, {"function", {{"arguments", call.arguments}}}},
  };
  for (const json& d : deltas) {
    json body = envelope(meta, "chat.completion.chunk", "text_completion");
    body["choices"] = json::array({{{"index", index},
                                    {"delta", {{"tool_calls", json::array({d})}}},
                                    {"finish_reason", nullptr},
                                    {"logprobs", nullptr}}});
    chunks.push_back(std::move(body));
  }
  return chunks;
}

json usage_chunk(const ResponseMeta& meta, const Usage& usage) {
  json body = envelope(meta, "chat.completion.chunk", "text_completion");
  body["choices"] = json::array();
  body["usage"] = usage_json(usage);
  return body;
}

json model_body(const std::string& model, std::int64_t created) {
  return {{"id", model}, {"object", "model"}, {"created", created}, {"owned_by", "kallpa"}};
}

json models_body(const std::vector<std::string>& models, std::int64_t created) {
  json data = json::array();
  for (const std::string& m : models) data.push_back(model_body(m, created));
  return {{"object", "list"}, {"data", std::move(data)}};
}

}  // namespace kallpa::server
