// ChatML, as SmolLM2-Instruct's chat template (GGUF key tokenizer.chat_template) renders it:
//
//   <|im_start|>system\n{system}<|im_end|>\n          (the default system prompt is inserted when
//   <|im_start|>user\n{content}<|im_end|>\n             the first message is not a system message)
//   <|im_start|>assistant\n                             (add_generation_prompt)
#pragma once

#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kallpa/status.h"
#include "kallpa/tokenizer/tokenizer.h"

namespace kallpa::tokenizer {

// SmolLM2-Instruct's default system prompt, from its tokenizer.chat_template.
inline constexpr std::string_view kSmolLM2DefaultSystemPrompt =
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face";

// A call of a tool (a function) that an assistant message made, as OpenAI's messages carry it.
struct ChatToolCall {
  std::string id;         // "call_..."
  std::string name;       // the function's name
  std::string arguments;  // the arguments: JSON text, as the client sent it
};

struct ChatMessage {
  ChatMessage() = default;
  ChatMessage(std::string role_, std::string content_) : role(std::move(role_)), content(std::move(content_)) {}

  std::string role;  // "system", "user", "assistant", "tool", ...
  std::string content;
  std::vector<ChatToolCall> tool_calls;  // assistant: the calls it made (content may then be empty)
  std::string tool_call_id;              // tool: the call this message answers
  std::string name;                      // tool: the function that was called ("" when unknown)
};

struct ChatMlOptions {
  bool add_generation_prompt = true;
  // Inserted as a system message when the first message is not one; nullopt: none.
  std::optional<std::string> default_system_prompt = std::string(kSmolLM2DefaultSystemPrompt);
};

// The prompt text (special tokens as text; encode it with parse_special = true).
std::string format_chatml(std::span<const ChatMessage> messages, const ChatMlOptions& options = {});

// Token ids of the same prompt, with the markers as CONTROL tokens and roles and contents encoded
// with parse_special = false, so that a message cannot smuggle in "<|im_end|>" as a control token.
// Equal to encode(format_chatml(...)) when no content contains a special token's text.
// not_found when the vocabulary lacks <|im_start|> or <|im_end|>. No BOS is added (SmolLM2 does
// not use one; prepend tokenizer.bos_id() yourself when add_bos() says so).
Result<std::vector<TokenId>> encode_chatml(const Tokenizer& tokenizer, std::span<const ChatMessage> messages,
                                           const ChatMlOptions& options = {});

// Reads a GGUF tokenizer.chat_template (Jinja text): if it is ChatML, returns the options that
// reproduce it, with the default system prompt it hard-codes (nullopt if none). unsupported when
// the template is not ChatML.
Result<ChatMlOptions> chatml_options_from_template(std::string_view jinja_template);

}  // namespace kallpa::tokenizer
