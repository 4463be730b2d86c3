#include "server/openai_responses.h"

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

}  // namespace

json usage_json(const Usage& u) {
  return {{"prompt_tokens", u.prompt_tokens},
          {"completion_tokens", u.completion_tokens},
          {"total_tokens", u.prompt_tokens + u.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", u.cached_tokens}}}};
}

json completion_body(const ResponseMeta& meta, const std::string& text, const std::string& finish_reason,
                     const Usage& usage) {
  json body = envelope(meta, "chat.completion", "text_completion");
  json choice = {{"index", 0}, {"finish_reason", finish_json(finish_reason)}, {"logprobs", nullptr}};
  if (meta.endpoint == Endpoint::chat) {
    choice["message"] = {{"role", "assistant"}, {"content", text}};
  } else {
    choice["text"] = text;
  }
  body["choices"] = json::array({choice});
  body["usage"] = usage_json(usage);
  return body;
}

json stream_chunk(const ResponseMeta& meta, const std::string& text, const std::string& finish_reason,
                  bool role_delta) {
  json body = envelope(meta, "chat.completion.chunk", "text_completion");
  json choice = {{"index", 0}, {"finish_reason", finish_json(finish_reason)}, {"logprobs", nullptr}};
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

json usage_chunk(const ResponseMeta& meta, const Usage& usage) {
  json body = envelope(meta, "chat.completion.chunk", "text_completion");
  body["choices"] = json::array();
  body["usage"] = usage_json(usage);
  return body;
}

json model_body(const std::string& model, std::int64_t created) {
  return {{"id", model}, {"object", "model"}, {"created", created}, {"owned_by", "kallpa"}};
}

json models_body(const std::string& model, std::int64_t created) {
  return {{"object", "list"}, {"data", json::array({model_body(model, created)})}};
}

}  // namespace kallpa::server
