// Response bodies in OpenAI's shapes: chat.completion, text_completion, their streamed chunks
// (chat.completion.chunk / text_completion), log-probabilities (chat's logprobs.content, the legacy
// completions' tokens/token_logprobs/top_logprobs/text_offset), the usage object and the model list.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

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

// One generated token's log-probability: its text (the token's bytes, which may be part of a
// UTF-8 sequence) and the most likely alternatives at its step, highest first.
struct LogprobEntry {
  std::string token;
  float logprob = 0.0f;
  std::vector<std::pair<std::string, float>> top;
};

// choices[].logprobs of a run of tokens: {"content": [...], "refusal": null} for chat; for
// completions {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, the offsets counted from
// `text_offset` (the bytes of the choice's text before the first of these tokens).
nlohmann::json logprobs_json(Endpoint endpoint, const std::vector<LogprobEntry>& entries, std::int64_t text_offset);

struct ChoiceBody {
  std::int64_t index = 0;
  std::string text;
  std::string finish_reason;
  const std::vector<LogprobEntry>* logprobs = nullptr;  // null: "logprobs": null
  // Chat: the message's tool_calls (null or empty: none) and whether its content is null.
  const std::vector<tokenizer::ChatToolCall>* tool_calls = nullptr;
  bool content_null = false;
};

nlohmann::json usage_json(const Usage& usage);
nlohmann::json completion_body(const ResponseMeta& meta, const std::vector<ChoiceBody>& choices, const Usage& usage);
// finish_reason "" renders as null (the stream goes on). role_delta: the first chat chunk of a
// choice, which carries {"role": "assistant"}. logprobs: the tokens of this chunk (null: none).
nlohmann::json stream_chunk(const ResponseMeta& meta, std::int64_t index, const std::string& text,
                            const std::string& finish_reason, bool role_delta = false,
                            const nlohmann::json& logprobs = nullptr);
// The chunks of one tool call of a chat choice, as OpenAI streams them: the first names it
// (delta.tool_calls[0]: index, id, type, function.name, arguments ""), the second carries the
// arguments. Clients accumulate a call's arguments over the chunks of its index.
std::vector<nlohmann::json> tool_call_chunks(const ResponseMeta& meta, std::int64_t index, std::int64_t call_index,
                                             const tokenizer::ChatToolCall& call);
// The last chunk when stream_options.include_usage: no choices, the usage.
nlohmann::json usage_chunk(const ResponseMeta& meta, const Usage& usage);
// GET /v1/models/{id}: one model object.
nlohmann::json model_body(const std::string& model, std::int64_t created);
nlohmann::json models_body(const std::vector<std::string>& models, std::int64_t created);

}  // namespace kallpa::server
