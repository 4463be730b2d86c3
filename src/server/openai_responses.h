// Response bodies in OpenAI's shapes: chat.completion, text_completion, their streamed chunks
// (chat.completion.chunk / text_completion), the usage object and the model list.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "server/request_parser.h"

namespace kallpa::server {

struct ResponseMeta {
  Endpoint endpoint = Endpoint::chat;
  std::string id;  // chatcmpl-... / cmpl-...
  std::string model;
  std::int64_t created = 0;  // Unix seconds
};

struct Usage {
  std::int64_t prompt_tokens = 0;
  std::int64_t completion_tokens = 0;
  std::int64_t cached_tokens = 0;  // of prompt_tokens, from the prefix cache
};

nlohmann::json usage_json(const Usage& usage);
nlohmann::json completion_body(const ResponseMeta& meta, const std::string& text, const std::string& finish_reason,
                               const Usage& usage);
// finish_reason "" renders as null (the stream goes on). role_delta: the first chat chunk, which
// carries {"role": "assistant"}.
nlohmann::json stream_chunk(const ResponseMeta& meta, const std::string& text, const std::string& finish_reason,
                            bool role_delta = false);
// The last chunk when stream_options.include_usage: no choices, the usage.
nlohmann::json usage_chunk(const ResponseMeta& meta, const Usage& usage);
// GET /v1/models/{id}: one model object.
nlohmann::json model_body(const std::string& model, std::int64_t created);
nlohmann::json models_body(const std::string& model, std::int64_t created);

}  // namespace kallpa::server
