// Parsing and validation of OpenAI request bodies (/v1/chat/completions, /v1/completions):
// malformed JSON, wrong types and out-of-range values become 400 errors that name the field.
// Unknown fields are ignored; known but unsupported options (n > 1, logprobs, tools, ...) are
// refused rather than silently dropped.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "kallpa/runtime/grammar.h"
#include "kallpa/runtime/sampler.h"
#include "kallpa/tokenizer/chat.h"
#include "server/api_error.h"

namespace kallpa::server {

enum class Endpoint { chat, completions };

struct RequestLimits {
  std::int64_t max_tokens = 512;  // the largest max_tokens accepted; also the default when absent
};

struct CompletionRequest {
  Endpoint endpoint = Endpoint::chat;
  std::string model;                             // as given ("" when absent)
  std::vector<tokenizer::ChatMessage> messages;  // chat
  std::string prompt;                            // completions, text
  std::vector<std::int32_t> prompt_tokens;       // completions, given as token ids
  bool prompt_is_tokens = false;
  std::int64_t max_tokens = 0;
  runtime::SamplingParams sampling;
  bool seed_given = false;  // false: the caller picks a random seed
  std::vector<std::string> stop;
  bool ignore_eos = false;  // vLLM's extension: run to max_tokens or a stop string
  bool stream = false;
  bool include_usage = false;                   // stream_options.include_usage
  std::optional<runtime::GrammarSpec> grammar;  // response_format json_object / json_schema
};

using ParsedRequest = std::variant<CompletionRequest, ApiError>;

ParsedRequest parse_completion_request(std::string_view body, Endpoint endpoint, const RequestLimits& limits);

}  // namespace kallpa::server
