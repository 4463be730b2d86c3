// Parsing and validation of OpenAI request bodies (/v1/chat/completions, /v1/completions):
// malformed JSON, wrong types and out-of-range values become 400 errors that name the field.
// Unknown fields are ignored; known but unsupported options (functions, best_of, suffix, ...) are
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
#include "server/tool_calls.h"

namespace kallpa::server {

enum class Endpoint { chat, completions };

struct RequestLimits {
  std::int64_t max_tokens = 512;  // the largest max_tokens accepted; also the default when absent
  std::int64_t max_choices = 8;   // the most choices of one request: n times the number of prompts
  std::int64_t vocab_size = 0;    // logit_bias ids must be below it (0: not checked here)
};

// One completions prompt: text, or token ids.
struct PromptInput {
  std::string text;
  std::vector<std::int32_t> tokens;
  bool is_tokens = false;
};

struct CompletionRequest {
  Endpoint endpoint = Endpoint::chat;
  std::string model;                             // as given ("" when absent)
  std::vector<tokenizer::ChatMessage> messages;  // chat
  std::vector<PromptInput> prompts;              // completions: one or more, each its own choices
  std::int64_t max_tokens = 0;
  bool max_tokens_given = false;  // false: the server's default, cut at the context's end
  std::int64_t n = 1;             // choices per prompt
  // Log-probabilities of the generated tokens with this many alternatives each; -1: none. Chat:
  // logprobs true with top_logprobs (default 0); completions: the legacy integer logprobs.
  std::int32_t logprobs = -1;
  bool echo = false;  // completions: the prompt's text begins each choice's text
  runtime::SamplingParams sampling;
  bool seed_given = false;  // false: the caller picks a random seed
  std::vector<std::string> stop;
  bool ignore_eos = false;  // vLLM's extension: run to max_tokens or a stop string
  bool stream = false;
  bool include_usage = false;                   // stream_options.include_usage
  std::optional<runtime::GrammarSpec> grammar;  // response_format json_object / json_schema
  ToolRequest tools;                            // chat: tools, tool_choice, parallel_tool_calls
};

using ParsedRequest = std::variant<CompletionRequest, ApiError>;

ParsedRequest parse_completion_request(std::string_view body, Endpoint endpoint, const RequestLimits& limits);

}  // namespace kallpa::server
