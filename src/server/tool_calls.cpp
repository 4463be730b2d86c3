#include "server/tool_calls.h"

#include <algorithm>
#include <cstdint>
#include <random>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace kallpa::server {
namespace {

using ordered_json = nlohmann::ordered_json;
using tokenizer::ChatMessage;
using tokenizer::ChatToolCall;

// Text the client sent may hold invalid UTF-8 (the chat renderer repairs it later); dumping must
// not throw on it.
std::string dump(const ordered_json& j, int indent = -1) {
  return j.dump(indent, ' ', /*ensure_ascii=*/false, ordered_json::error_handler_t::replace);
}

ordered_json parsed_or_text(const std::string& text) {
  ordered_json j = ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
  return j.is_discarded() ? ordered_json(text) : j;
}

ordered_json function_json(const ToolSpec& t) {
  ordered_json f = ordered_json::object();
  f["name"] = t.name;
  if (!t.description.empty()) f["description"] = t.description;
  f["parameters"] = ordered_json::parse(t.parameters);
  return f;
}

// One call of tool `t`: {"name": const, "arguments": its parameters' schema}.
ordered_json call_schema(const ToolSpec& t) {
  ordered_json properties = ordered_json::object();
  properties["name"] = {{"const", t.name}};
  properties["arguments"] = ordered_json::parse(t.parameters);
  return {{"type", "object"},
          {"properties", std::move(properties)},
          {"required", {"name", "arguments"}},
          {"additionalProperties", false}};
}

ordered_json calls_schema(const ToolRequest& r, std::optional<std::size_t> only_tool) {
  ordered_json alternatives = ordered_json::array();
  for (std::size_t i = 0; i < r.tools.size(); ++i) {
    const ToolSpec& t = r.tools[i];
    if (only_tool && *only_tool != i) continue;
    if (!only_tool && r.choice == ToolChoice::function && t.name != r.function) continue;
    alternatives.push_back(call_schema(t));
  }
  ordered_json items = alternatives.size() == 1 ? alternatives[0] : ordered_json{{"anyOf", alternatives}};
  ordered_json list = {{"type", "array"}, {"items", std::move(items)}, {"minItems", 1}};
  if (!r.parallel || r.choice == ToolChoice::function) list["maxItems"] = 1;
  ordered_json properties = ordered_json::object();
  properties["tool_calls"] = std::move(list);
  return {{"type", "object"},
          {"properties", std::move(properties)},
          {"required", {"tool_calls"}},
          {"additionalProperties", false}};
}

ordered_json response_schema(const std::optional<runtime::GrammarSpec>& format) {
  ordered_json value = {{"type", "string"}};
  if (format && format->kind == runtime::GrammarKind::json) value = {{"type", "object"}};
  if (format && format->kind == runtime::GrammarKind::json_schema) value = ordered_json::parse(format->source);
  ordered_json properties = ordered_json::object();
  properties["response"] = std::move(value);
  return {{"type", "object"},
          {"properties", std::move(properties)},
          {"required", {"response"}},
          {"additionalProperties", false}};
}

// The system text that offers the tools: the reply shape for this tool_choice, and the
// definitions when the template does not render them itself.
std::string tool_instructions(const ToolRequest& r, bool template_renders_tools) {
  const std::string one_call = R"({"name": "<function name>", "arguments": {<its arguments>}})";
  std::string text;
  // The example shows one call: a small model copies the example's length, and a list it was
  // shown as open-ended ("...") it tends to fill with repeats of its first call.
  const std::string calls = r.parallel ? " Call only the functions the question needs, each once; for several calls "
                                         "put one object per call in the list."
                                       : "";
  switch (r.choice) {
    case ToolChoice::automatic:
      text = fmt::format(
          "You can call functions (tools) to answer. Reply with one JSON object and nothing else: either "
          "{{\"tool_calls\": [{}]}} to call a function, or {{\"response\": <your answer>}} to answer without "
          "calling any.{}",
          one_call, calls);
      break;
    case ToolChoice::required:
      text = fmt::format(
          "You answer by calling functions (tools). Reply with one JSON object and nothing else: "
          "{{\"tool_calls\": [{}]}}.{}",
          one_call, calls);
      break;
    case ToolChoice::function:
      text = fmt::format(
          "You answer by calling the function {}. Reply with one JSON object and nothing else: "
          "{{\"tool_calls\": [{{\"name\": \"{}\", \"arguments\": {{<its arguments>}}}}]}}.",
          r.function, r.function);
      break;
    case ToolChoice::none: return {};
  }
  if (!template_renders_tools) {
    text += "\n\nThe functions, each with its parameters' JSON schema:";
    for (const ToolSpec& t : r.tools) text.append("\n").append(dump(function_json(t)));
  }
  return text;
}

// An assistant's calls in the reply shape, for a template that does not render tool_calls.
std::string calls_as_text(const std::vector<ChatToolCall>& calls) {
  ordered_json list = ordered_json::array();
  for (const ChatToolCall& c : calls) {
    ordered_json call = ordered_json::object();
    call["name"] = c.name;
    call["arguments"] = parsed_or_text(c.arguments);
    list.push_back(std::move(call));
  }
  ordered_json reply = ordered_json::object();
  reply["tool_calls"] = std::move(list);
  return dump(reply);
}

ordered_json tool_result_json(const ChatMessage& m) {
  ordered_json result = ordered_json::object();
  if (!m.name.empty()) result["name"] = m.name;
  result["tool_call_id"] = m.tool_call_id;
  result["content"] = m.content;
  return result;
}

}  // namespace

std::string tools_template_json(const ToolRequest& r) {
  ordered_json tools = ordered_json::array();
  for (const ToolSpec& t : r.tools) tools.push_back({{"type", "function"}, {"function", function_json(t)}});
  return dump(tools);
}

std::string tool_reply_schema(const ToolRequest& r, const std::optional<runtime::GrammarSpec>& response_format,
                              std::optional<std::size_t> only_tool) {
  ordered_json calls = calls_schema(r, only_tool);
  if (r.choice != ToolChoice::automatic || only_tool) return dump(calls);
  return dump(ordered_json{{"anyOf", {std::move(calls), response_schema(response_format)}}});
}

std::vector<ChatMessage> tool_chat_messages(std::span<const ChatMessage> messages, const ToolRequest& r,
                                            const tokenizer::ChatToolSupport& support) {
  std::vector<ChatMessage> out;
  out.reserve(messages.size() + 1);
  // The user message that holds the tool results being gathered (an index into out; npos: none).
  constexpr std::size_t kNone = static_cast<std::size_t>(-1);
  std::size_t results_at = kNone;
  ordered_json results;
  auto close_results = [&] {
    if (results_at == kNone) return;
    ordered_json wrapped = ordered_json::object();
    wrapped["tool_results"] = std::move(results);
    out[results_at].content = dump(wrapped);
    results_at = kNone;
    results = ordered_json();
  };
  bool after_results = false;  // the last message out is tool results written as a user message
  for (const ChatMessage& m : messages) {
    if (m.role == "tool" && !support.tool_responses) {
      if (results_at == kNone) {
        out.emplace_back("user", "");
        results_at = out.size() - 1;
        results = ordered_json::array();
      }
      results.push_back(tool_result_json(m));
      after_results = true;
      continue;
    }
    close_results();
    if (m.role == "user" && after_results) {
      // A user turn right after tool results joins them: the roles keep alternating.
      out.back().content.append("\n\n").append(m.content);
      after_results = false;
      continue;
    }
    after_results = false;
    ChatMessage copy = m;
    if (!copy.tool_calls.empty() && !support.tool_calls) {
      // Text the assistant wrote beside its calls stays, before them.
      copy.content = copy.content.empty() ? calls_as_text(copy.tool_calls)
                                          : copy.content + "\n\n" + calls_as_text(copy.tool_calls);
      copy.tool_calls.clear();
    }
    out.push_back(std::move(copy));
  }
  close_results();

  if (!r.offered()) return out;
  const std::string instructions = tool_instructions(r, support.tools);
  if (!out.empty() && out.front().role == "system" && support.system_role) {
    out.front().content.append("\n\n").append(instructions);
  } else if (support.system_role) {
    out.insert(out.begin(), ChatMessage("system", instructions));
  } else {
    auto user = std::find_if(out.begin(), out.end(), [](const ChatMessage& m) { return m.role == "user"; });
    if (user != out.end()) {
      user->content.insert(0, instructions + "\n\n");
    } else {
      out.insert(out.begin(), ChatMessage("user", instructions));
    }
  }
  return out;
}

std::optional<std::string> answer_so_far(std::string_view text) {
  std::size_t i = 0;
  auto skip_space = [&] {
    while (i < text.size() && (text[i] == ' ' || text[i] == '\n' || text[i] == '\t' || text[i] == '\r')) ++i;
  };
  auto take = [&](std::string_view word) {
    skip_space();
    if (text.substr(i, word.size()) != word) return false;
    i += word.size();
    return true;
  };
  if (!take("{") || !take("\"response\"") || !take(":") || !take("\"")) return std::nullopt;
  // The string's complete part: up to its closing quote, or to an escape the text cuts short.
  const std::string_view body = text.substr(i);
  std::size_t end = 0;
  while (end < body.size() && body[end] != '"') {
    if (body[end] != '\\') {
      ++end;
      continue;
    }
    std::size_t length = 2;  // \n, \", ...
    if (end + 1 < body.size() && body[end + 1] == 'u') {
      length = 6;
      // A high surrogate decodes only with the low one after it.
      if (end + 2 < body.size() && (body[end + 2] == 'd' || body[end + 2] == 'D') && end + 3 < body.size() &&
          std::string_view("89abAB").find(body[end + 3]) != std::string_view::npos) {
        length = 12;
      }
    }
    if (end + length > body.size()) break;
    end += length;
  }
  // Decoded by the JSON library; a UTF-8 sequence cut at the end is left for the next call.
  for (std::size_t cut = 0; cut < 4 && cut <= end; ++cut) {
    std::string quoted;
    quoted.reserve(end - cut + 2);
    quoted.append(1, '"').append(body.substr(0, end - cut)).append(1, '"');
    const ordered_json s = ordered_json::parse(quoted, nullptr, /*allow_exceptions=*/false);
    if (!s.is_discarded() && s.is_string()) return s.get<std::string>();
  }
  return std::string();
}

ToolReply read_tool_reply(std::string_view text) {
  ToolReply reply;
  reply.content = std::string(text);
  const ordered_json j = ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    if (auto answer = answer_so_far(text)) reply.content = std::move(*answer);
    return reply;
  }
  if (!j.is_object()) return reply;
  if (auto calls = j.find("tool_calls"); calls != j.end() && calls->is_array() && !calls->empty()) {
    std::vector<ChatToolCall> out;
    for (const ordered_json& c : *calls) {
      if (!c.is_object() || !c.contains("name") || !c["name"].is_string() || !c.contains("arguments")) return reply;
      out.push_back({new_tool_call_id(), c["name"].get<std::string>(), dump(c["arguments"])});
    }
    reply.calls = std::move(out);
    reply.content.clear();
    reply.content_null = true;
    return reply;
  }
  if (auto response = j.find("response"); response != j.end()) {
    reply.content = response->is_string() ? response->get<std::string>() : dump(*response);
  }
  return reply;
}

std::string new_tool_call_id() {
  static constexpr std::string_view kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  thread_local std::mt19937_64 rng{(std::uint64_t{std::random_device{}()} << 32) | std::random_device{}()};
  std::uniform_int_distribution<std::size_t> pick(0, kAlphabet.size() - 1);
  std::string id = "call_";
  for (int i = 0; i < 24; ++i) id.push_back(kAlphabet[pick(rng)]);
  return id;
}

}  // namespace kallpa::server
