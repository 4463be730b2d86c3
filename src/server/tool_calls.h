// Tool calling for /v1/chat/completions (docs/tools.md): the tools a request offers, the prompt
// that offers them, the JSON schema that constrains the reply, and the reply read back into
// OpenAI's tool_calls.
//
// Every model answers in one JSON shape, the "generic" scheme of llama.cpp's server:
//
//   {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]}
//   {"response": "plain answer"}                                 (tool_choice "auto" only)
//
// The reply is generated under a grammar built from the tools' parameter schemas (anyOf over the
// tools, the name a const), so it always parses and every call's arguments validate. The tools
// reach the model through its own template's `tools` variable when the template renders it, and
// always through a system message that describes the reply shape (with the definitions too, when
// the template does not render them). Earlier calls and tool results are written for templates that
// do not render them as the same JSON, in assistant and user messages.
#pragma once

#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kallpa/runtime/grammar.h"
#include "kallpa/tokenizer/chat.h"
#include "kallpa/tokenizer/chat_template.h"

namespace kallpa::server {

struct ToolSpec {
  std::string name;
  std::string description;  // "" when absent
  // The parameters' JSON schema, keys in the client's order (properties are generated in it);
  // {"type":"object","properties":{}} when absent (a function without arguments).
  std::string parameters;
};

enum class ToolChoice {
  none,       // no tools offered to the model (also the default without tools)
  automatic,  // "auto": a call or a plain answer (the default with tools)
  required,   // one or more calls
  function,   // a call of the named function
};

struct ToolRequest {
  std::vector<ToolSpec> tools;
  ToolChoice choice = ToolChoice::none;
  std::string function;  // choice == function: its name
  bool parallel = true;  // parallel_tool_calls: several calls in one reply (false: exactly one)

  // Whether the model is offered tools (and its reply is read as the JSON shape above).
  bool offered() const noexcept { return !tools.empty() && choice != ToolChoice::none; }
};

// The tools as a template's `tools` variable: [{"type":"function","function":{name, description,
// parameters}}] (JSON text).
std::string tools_template_json(const ToolRequest& request);

// The JSON schema of a reply (keys in order: the grammar engine generates properties in it). The
// plain answer of "auto" is {"response": string}, or {"response": <the schema>} when
// response_format asks for JSON. `only_tool`: the calls' schema with just that tool (used to find a
// tool whose parameters do not compile).
std::string tool_reply_schema(const ToolRequest& request, const std::optional<runtime::GrammarSpec>& response_format,
                              std::optional<std::size_t> only_tool = std::nullopt);

// The messages to render for a model whose template supports what `support` says: the reply
// shape (and, when the template does not render `tools`, the definitions) added to the system
// message when tools are offered; assistant tool_calls and tool results rewritten as JSON text in
// assistant and user messages where the template does not render them (consecutive tool results
// become one user message, so templates that want alternating roles accept them).
std::vector<tokenizer::ChatMessage> tool_chat_messages(std::span<const tokenizer::ChatMessage> messages,
                                                       const ToolRequest& request,
                                                       const tokenizer::ChatToolSupport& support);

// A reply read back: calls (ids are new, arguments compact JSON text), or the plain answer (also
// when cut by max_tokens or a stop string inside its string: the answer so far), or, when the text
// is no such shape (a call cut short), the text as it is.
struct ToolReply {
  std::vector<tokenizer::ChatToolCall> calls;
  std::string content;
  bool content_null = false;  // calls and no answer: OpenAI's "content": null
};
ToolReply read_tool_reply(std::string_view text);

// The plain answer of a reply still being generated, decoded as far as it is complete (an escape or
// a UTF-8 sequence cut at the end waits for the rest): what a stream can send before the reply
// ends. nullopt when the reply is not {"response": "<string>..." (calls, or a JSON answer).
std::optional<std::string> answer_so_far(std::string_view text);

// "call_" and 24 random letters and digits, as OpenAI's ids look.
std::string new_tool_call_id();

}  // namespace kallpa::server
