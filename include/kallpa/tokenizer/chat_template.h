// Chat templates as GGUF files carry them (tokenizer.chat_template: Jinja text), rendered by
// llama.cpp's Jinja engine (third_party/llama-jinja, fetched by scripts/fetch_jinja.sh; why this
// engine: docs/chat-templates.md), and the choice of a chat format for a model: the file's own
// template, or a built-in one (Gemma's turns, or ChatML) only when the file has none.
//
// Rendering keeps track of which text came from the messages: encode_chat() tokenizes the whole
// prompt as one text, as llama.cpp does, but never reads a special token inside a message's text,
// so a message cannot smuggle in "<end_of_turn>" or "<|im_end|>" as a control token.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kallpa/status.h"
#include "kallpa/tokenizer/chat.h"
#include "kallpa/tokenizer/tokenizer.h"

namespace kallpa::tokenizer {

// Whether this build has the Jinja engine (false when third_party/llama-jinja was not fetched:
// ChatTemplate::parse then fails with unsupported, and models fall back to built-in formats).
bool jinja_available() noexcept;

struct ChatTemplateInputs {
  std::span<const ChatMessage> messages;
  bool add_generation_prompt = true;
  std::string bos_token;  // the vocabulary's BOS and EOS texts, as bos_token / eos_token
  std::string eos_token;
  // The tools offered, as the template's `tools` variable (HF transformers' convention): a JSON
  // array of {"type": "function", "function": {"name", "description", "parameters"}}. Empty: the
  // variable is left undefined, as transformers leaves it without tools.
  std::string tools_json;
};

// What a template does with tools, found by rendering probe conversations at parse time (the way
// llama.cpp's minja finds a template's capabilities): a feature counts as supported when the probe's
// marker text shows up in the output, so a template that ignores a variable, or raises on it, does
// not support it.
struct ChatToolSupport {
  bool tools = false;             // renders the `tools` variable (the definitions the model sees)
  bool tool_calls = false;        // renders an assistant message's tool_calls
  bool tool_responses = false;    // renders a message of role "tool"
  bool object_arguments = false;  // reads tool_calls[].function.arguments as an object, not a string
  bool system_role = true;        // renders a system message's content
};

// The rendered prompt and the byte ranges of it that came from the messages.
struct RenderedChat {
  std::string text;
  std::vector<TextRange> from_messages;  // sorted, disjoint
};

class ChatTemplate {
 public:
  // invalid_argument (field "tokenizer.chat_template") with the engine's message and position when
  // the text is not a valid template.
  static Result<ChatTemplate> parse(std::string source);

  ChatTemplate(ChatTemplate&&) noexcept;
  ChatTemplate& operator=(ChatTemplate&&) noexcept;
  ~ChatTemplate();

  // invalid_argument (field "tokenizer.chat_template") when rendering fails, e.g. the template's own
  // raise_exception("Conversation roles must alternate ...").
  Result<RenderedChat> render(const ChatTemplateInputs& inputs) const;
  const std::string& source() const noexcept;
  const ChatToolSupport& tool_support() const noexcept;

 private:
  struct Impl;
  explicit ChatTemplate(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

enum class ChatFormatKind {
  file_template,  // the file's tokenizer.chat_template
  gemma,          // built-in: <start_of_turn>user\n...<end_of_turn>\n ... <start_of_turn>model\n
  chatml,         // built-in: <|im_start|>role\n...<|im_end|>\n ... <|im_start|>assistant\n
};

// How a model's chat prompts are made. Copyable; the template is shared.
struct ChatFormat {
  ChatFormatKind kind = ChatFormatKind::chatml;
  std::shared_ptr<const ChatTemplate> file_template;  // kind == file_template
  ChatMlOptions chatml;                               // kind == chatml
  // What the format does with tools; the built-in formats render none of them (system_role only).
  ChatToolSupport tools;
  // "the file's tokenizer.chat_template", "built-in Gemma turns (the file has no chat template)", ...
  std::string description;
};

// Gemma's chat format, as its own template writes it: BOS, then per message
// "<start_of_turn>{role}\n{content, trimmed}<end_of_turn>\n" with "assistant" written "model" and a
// leading system message's content put before the first user message's (followed by "\n\n");
// add_generation_prompt appends "<start_of_turn>model\n". Message text is marked in from_messages.
RenderedChat render_gemma(std::span<const ChatMessage> messages, bool add_generation_prompt,
                          std::string_view bos_token);

// ChatML (chat.h's layout), with message text marked in from_messages.
RenderedChat render_chatml(std::span<const ChatMessage> messages, const ChatMlOptions& options);

// The prompt text of a chat in the given format. `tools_json` (a JSON array, see
// ChatTemplateInputs) reaches a file template only; an assistant message's tool_calls and a tool
// message's fields reach it as transformers passes them (arguments as an object or as the JSON
// text, whichever the template reads: tool_support().object_arguments). The built-in formats
// render role and content only: a caller rewrites tool messages for them (docs/tools.md).
Result<RenderedChat> render_chat(const Tokenizer& tokenizer, const ChatFormat& format,
                                 std::span<const ChatMessage> messages, bool add_generation_prompt = true,
                                 std::string_view tools_json = {});

// The prompt's token ids: the rendered text encoded with special tokens read only outside the
// messages' text, and BOS prepended when the vocabulary asks for it (add_bos) and the template did
// not write it.
Result<std::vector<TokenId>> encode_chat(const Tokenizer& tokenizer, const ChatFormat& format,
                                         std::span<const ChatMessage> messages, bool add_generation_prompt = true,
                                         std::string_view tools_json = {});

// The format for a model: its template when there is one and it parses; else Gemma's turns when the
// architecture is gemma* or the vocabulary has <start_of_turn>; else ChatML (SmolLM2's defaults).
// `template_source` is empty when the file has no tokenizer.chat_template. The description says
// which, and why a built-in one.
ChatFormat choose_chat_format(const Tokenizer& tokenizer, std::string_view architecture,
                              std::string_view template_source);

}  // namespace kallpa::tokenizer
