#include "server/request_parser.h"

#include <algorithm>
#include <charconv>
#include <optional>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "kallpa/runtime/scheduler.h"
#include "server/structured_output.h"

namespace kallpa::server {
namespace {

using nlohmann::json;

// Thrown inside the parser only, caught at its boundary: lets every field check be one line.
struct Invalid {
  ApiError error;
};

[[noreturn]] void fail(std::string param, std::string message, std::string code = "invalid_value") {
  throw Invalid{bad_request(std::move(param), std::move(message), std::move(code))};
}

using ordered_json = nlohmann::ordered_json;

template <class Json>
[[noreturn]] void wrong_type(const std::string& param, std::string_view expected, const Json& value) {
  fail(param, fmt::format("expected {}, got {}", expected, value.type_name()), "invalid_type");
}

template <class Json>
const Json* field(const Json& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<double> number(const json& obj, const char* key, double lo, double hi, bool lo_open = false) {
  const json* v = field(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_number()) wrong_type(key, "a number", *v);
  const double x = v->get<double>();
  if (!(lo_open ? x > lo : x >= lo) || !(x <= hi)) {
    fail(key, fmt::format("{} is out of range: must be in {}{}, {}]", x, lo_open ? "(" : "[", lo, hi));
  }
  return x;
}

std::optional<std::int64_t> integer(const json& obj, const char* key) {
  const json* v = field(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_number_integer()) wrong_type(key, "an integer", *v);
  if (v->is_number_unsigned() && v->get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX)) {
    fail(key, "is too large");
  }
  return v->get<std::int64_t>();
}

template <class Json>
std::optional<bool> boolean(const Json& obj, const char* key) {
  const Json* v = field(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) wrong_type(key, "a boolean", *v);
  return v->template get<bool>();
}

// `where`: the parameter's full name in errors ("" : the key).
template <class Json>
std::optional<std::string> string(const Json& obj, const char* key, const std::string& where = "") {
  const Json* v = field(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_string()) wrong_type(where.empty() ? std::string(key) : where, "a string", *v);
  return v->template get<std::string>();
}

void unsupported(const std::string& param, const std::string& what) {
  fail(param, fmt::format("{} is not supported by this server", what), "unsupported_value");
}

std::string message_content(const json& content, const std::string& where) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) wrong_type(where, "a string or an array of text parts", content);
  std::string text;
  for (std::size_t i = 0; i < content.size(); ++i) {
    const json& part = content[i];
    const std::string at = fmt::format("{}[{}]", where, i);
    if (!part.is_object()) wrong_type(at, "an object", part);
    auto type = string(part, "type");
    if (type != "text") unsupported(at + ".type", fmt::format("content part type '{}'", type.value_or("")));
    const json* t = field(part, "text");
    if (!t || !t->is_string()) wrong_type(at + ".text", "a string", t ? *t : json());
    text += t->get<std::string>();
  }
  return text;
}

// An assistant message's tool_calls: [{id, type "function", function: {name, arguments}}], the
// arguments a JSON text (an object is taken too, as its text).
std::vector<tokenizer::ChatToolCall> parse_message_tool_calls(const json& calls, const std::string& where) {
  if (!calls.is_array()) wrong_type(where, "an array", calls);
  std::vector<tokenizer::ChatToolCall> out;
  for (std::size_t i = 0; i < calls.size(); ++i) {
    const json& c = calls[i];
    const std::string at = fmt::format("{}[{}]", where, i);
    if (!c.is_object()) wrong_type(at, "an object", c);
    auto id = string(c, "id", at + ".id");
    if (!id) fail(at + ".id", "is required", "missing_required_parameter");
    if (auto type = string(c, "type", at + ".type"); type && *type != "function") {
      fail(at + ".type", fmt::format("'{}' is not 'function'", *type));
    }
    const json* function = field(c, "function");
    if (!function) fail(at + ".function", "is required", "missing_required_parameter");
    if (!function->is_object()) wrong_type(at + ".function", "an object", *function);
    auto name = string(*function, "name", at + ".function.name");
    if (!name) fail(at + ".function.name", "is required", "missing_required_parameter");
    const json* arguments = field(*function, "arguments");
    std::string args = "{}";
    if (arguments && arguments->is_string()) {
      args = arguments->get<std::string>();
    } else if (arguments && arguments->is_object()) {
      args = arguments->dump();
    } else if (arguments) {
      wrong_type(at + ".function.arguments", "a string (JSON text)", *arguments);
    }
    out.push_back({*id, *name, std::move(args)});
  }
  return out;
}

void parse_messages(const json& body, CompletionRequest& r) {
  const json* messages = field(body, "messages");
  if (!messages) fail("messages", "is required", "missing_required_parameter");
  if (!messages->is_array()) wrong_type("messages", "an array", *messages);
  if (messages->empty()) fail("messages", "must not be empty");
  for (std::size_t i = 0; i < messages->size(); ++i) {
    const json& m = (*messages)[i];
    const std::string at = fmt::format("messages[{}]", i);
    if (!m.is_object()) wrong_type(at, "an object", m);
    const json* role = field(m, "role");
    if (!role) fail(at + ".role", "is required", "missing_required_parameter");
    if (!role->is_string()) wrong_type(at + ".role", "a string", *role);
    std::string name = role->get<std::string>();
    if (name == "developer") name = "system";  // OpenAI's newer name for the system role
    if (name != "system" && name != "user" && name != "assistant" && name != "tool") {
      fail(at + ".role", fmt::format("'{}' is not one of system, developer, user, assistant, tool", name));
    }
    tokenizer::ChatMessage message;
    message.role = name;
    if (name == "assistant") {
      if (const json* calls = field(m, "tool_calls"))
        message.tool_calls = parse_message_tool_calls(*calls, at + ".tool_calls");
    }
    const json* content = field(m, "content");
    if (content) {
      message.content = message_content(*content, at + ".content");
    } else if (message.tool_calls.empty()) {  // an assistant message with calls may have no content
      fail(at + ".content", "is required", "missing_required_parameter");
    }
    if (name == "tool") {
      auto id = string(m, "tool_call_id", at + ".tool_call_id");
      if (!id) fail(at + ".tool_call_id", "is required", "missing_required_parameter");
      // The function's name, from the call it answers: templates and the generic scheme show it.
      for (const tokenizer::ChatMessage& earlier : r.messages) {
        for (const tokenizer::ChatToolCall& c : earlier.tool_calls) {
          if (c.id == *id) message.name = c.name;
        }
      }
      if (message.name.empty()) {
        fail(at + ".tool_call_id", fmt::format("'{}' answers no tool call of an earlier assistant message", *id));
      }
      message.tool_call_id = *id;
    }
    r.messages.push_back(std::move(message));
  }
}

// A function name as OpenAI allows it: 1-64 of a-z, A-Z, 0-9, '_' and '-'.
bool valid_function_name(const std::string& name) {
  if (name.empty() || name.size() > 64) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
  });
}

constexpr std::size_t kMaxTools = 128;  // OpenAI's limit

// tools (read from the body with its keys in the client's order: a schema's properties are
// generated in it), tool_choice, parallel_tool_calls.
void parse_tools(const ordered_json& body, CompletionRequest& r) {
  ToolRequest& t = r.tools;
  if (const ordered_json* tools = field(body, "tools")) {
    if (!tools->is_array()) wrong_type("tools", "an array", *tools);
    if (tools->empty()) fail("tools", "must not be empty (leave it out for no tools)");
    if (tools->size() > kMaxTools) fail("tools", fmt::format("{} tools; at most {}", tools->size(), kMaxTools));
    for (std::size_t i = 0; i < tools->size(); ++i) {
      const ordered_json& tool = (*tools)[i];
      const std::string at = fmt::format("tools[{}]", i);
      if (!tool.is_object()) wrong_type(at, "an object", tool);
      auto type = string(tool, "type", at + ".type");
      if (!type) fail(at + ".type", "is required", "missing_required_parameter");
      if (*type != "function") unsupported(at + ".type", fmt::format("tool type '{}' (only 'function')", *type));
      const ordered_json* function = field(tool, "function");
      if (!function) fail(at + ".function", "is required", "missing_required_parameter");
      if (!function->is_object()) wrong_type(at + ".function", "an object", *function);
      ToolSpec spec;
      auto name = string(*function, "name", at + ".function.name");
      if (!name) fail(at + ".function.name", "is required", "missing_required_parameter");
      if (!valid_function_name(*name)) {
        fail(at + ".function.name",
             fmt::format("'{}' is not a function name: 1 to 64 letters, digits, '_' or '-'", *name));
      }
      for (std::size_t j = 0; j < t.tools.size(); ++j) {
        if (t.tools[j].name == *name)
          fail(at + ".function.name", fmt::format("'{}' is also tools[{}]'s name", *name, j));
      }
      spec.name = *name;
      spec.description = string(*function, "description", at + ".function.description").value_or("");
      if (const ordered_json* strict = field(*function, "strict"); strict && !strict->is_boolean()) {
        wrong_type(at + ".function.strict", "a boolean", *strict);
      }
      if (const ordered_json* parameters = field(*function, "parameters")) {
        if (!parameters->is_object()) wrong_type(at + ".function.parameters", "an object (a JSON schema)", *parameters);
        spec.parameters = parameters->dump();
      } else {
        spec.parameters = R"({"type":"object","properties":{}})";
      }
      t.tools.push_back(std::move(spec));
    }
    t.choice = ToolChoice::automatic;
  }
  if (const ordered_json* choice = field(body, "tool_choice")) {
    if (choice->is_string()) {
      const std::string c = choice->get<std::string>();
      if (c == "none") {
        t.choice = ToolChoice::none;
      } else if (c == "auto" || c == "required") {
        t.choice = c == "auto" ? ToolChoice::automatic : ToolChoice::required;
      } else {
        fail("tool_choice", fmt::format("'{}' is not one of none, auto, required or a function", c));
      }
    } else if (choice->is_object()) {
      auto type = string(*choice, "type", "tool_choice.type");
      if (!type) fail("tool_choice.type", "is required", "missing_required_parameter");
      if (*type != "function") unsupported("tool_choice.type", fmt::format("tool_choice type '{}'", *type));
      const ordered_json* function = field(*choice, "function");
      if (!function) fail("tool_choice.function", "is required", "missing_required_parameter");
      if (!function->is_object()) wrong_type("tool_choice.function", "an object", *function);
      auto name = string(*function, "name", "tool_choice.function.name");
      if (!name) fail("tool_choice.function.name", "is required", "missing_required_parameter");
      const bool known =
          std::any_of(t.tools.begin(), t.tools.end(), [&](const ToolSpec& s) { return s.name == *name; });
      if (!known) fail("tool_choice.function.name", fmt::format("'{}' is not the name of a function in tools", *name));
      t.choice = ToolChoice::function;
      t.function = *name;
    } else {
      wrong_type("tool_choice", "a string or an object", *choice);
    }
    if (t.tools.empty() && t.choice != ToolChoice::none) fail("tool_choice", "is only allowed when tools are given");
  }
  if (auto parallel = boolean(body, "parallel_tool_calls")) t.parallel = *parallel;
}

PromptInput token_prompt(const json& ids, const std::string& where) {
  PromptInput p;
  p.is_tokens = true;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const json& t = ids[i];
    if (!t.is_number_integer()) wrong_type(fmt::format("{}[{}]", where, i), "a token id (integer)", t);
    const auto id = t.get<std::int64_t>();
    if (id < 0 || id > INT32_MAX) fail(fmt::format("{}[{}]", where, i), fmt::format("token id {} is out of range", id));
    p.tokens.push_back(static_cast<std::int32_t>(id));
  }
  return p;
}

// OpenAI's four forms: a string, an array of strings, an array of token ids, an array of arrays of
// token ids. Each prompt of an array is its own set of choices.
void parse_prompt(const json& body, CompletionRequest& r) {
  const json* p = field(body, "prompt");
  if (!p) fail("prompt", "is required", "missing_required_parameter");
  if (p->is_string()) {
    r.prompts.push_back({p->get<std::string>(), {}, false});
    return;
  }
  if (!p->is_array()) {
    wrong_type("prompt", "a string, an array of strings, an array of token ids or an array of such arrays", *p);
  }
  if (p->empty()) fail("prompt", "must not be empty");
  if ((*p)[0].is_string() || (*p)[0].is_array()) {
    const bool strings = (*p)[0].is_string();
    for (std::size_t i = 0; i < p->size(); ++i) {
      const json& one = (*p)[i];
      const std::string at = fmt::format("prompt[{}]", i);
      if (strings) {
        if (!one.is_string()) wrong_type(at, "a string (as prompt[0])", one);
        r.prompts.push_back({one.get<std::string>(), {}, false});
      } else {
        if (!one.is_array()) wrong_type(at, "an array of token ids (as prompt[0])", one);
        r.prompts.push_back(token_prompt(one, at));
      }
    }
    return;
  }
  r.prompts.push_back(token_prompt(*p, "prompt"));
}

// {"token id": bias}: ids in the vocabulary, biases in [-100, 100] (OpenAI's rule).
void parse_logit_bias(const json& body, const RequestLimits& limits, CompletionRequest& r) {
  const json* bias = field(body, "logit_bias");
  if (!bias) return;
  if (!bias->is_object()) wrong_type("logit_bias", "an object mapping token ids to biases", *bias);
  for (const auto& [key, value] : bias->items()) {
    std::int64_t id = -1;
    const char* end = key.data() + key.size();
    auto [ptr, ec] = std::from_chars(key.data(), end, id);
    if (ec != std::errc() || ptr != end || key.empty()) {
      fail("logit_bias", fmt::format("key '{}' is not a token id", key));
    }
    if (id < 0 || id > INT32_MAX || (limits.vocab_size > 0 && id >= limits.vocab_size)) {
      fail("logit_bias", fmt::format("token id {} is outside the vocabulary [0, {})", id, limits.vocab_size));
    }
    if (!value.is_number()) wrong_type(fmt::format("logit_bias.{}", key), "a number", value);
    const double b = value.get<double>();
    if (!(b >= -100.0 && b <= 100.0)) {
      fail("logit_bias", fmt::format("the bias {} of token {} is out of range: must be in [-100, 100]", b, id));
    }
    r.sampling.logit_bias.emplace_back(static_cast<std::int32_t>(id), static_cast<float>(b));
  }
}

void parse_logprobs(const json& body, Endpoint endpoint, CompletionRequest& r) {
  const auto limit = static_cast<std::int64_t>(runtime::kMaxLogprobs);
  if (endpoint == Endpoint::chat) {
    const bool wanted = boolean(body, "logprobs").value_or(false);
    const std::optional<std::int64_t> top = integer(body, "top_logprobs");
    if (top && (*top < 0 || *top > limit)) fail("top_logprobs", fmt::format("is {}, must be in [0, {}]", *top, limit));
    if (top && !wanted) fail("top_logprobs", "needs logprobs: true");
    if (wanted) r.logprobs = static_cast<std::int32_t>(top.value_or(0));
    return;
  }
  if (const std::optional<std::int64_t> k = integer(body, "logprobs")) {
    if (*k < 0 || *k > limit) fail("logprobs", fmt::format("is {}, must be in [0, {}]", *k, limit));
    r.logprobs = static_cast<std::int32_t>(*k);
  }
}

void parse_stop(const json& body, CompletionRequest& r) {
  const json* stop = field(body, "stop");
  if (!stop) return;
  if (stop->is_string()) {
    r.stop.push_back(stop->get<std::string>());
  } else if (stop->is_array()) {
    if (stop->size() > 4) fail("stop", fmt::format("{} stop strings; at most 4", stop->size()));
    for (std::size_t i = 0; i < stop->size(); ++i) {
      if (!(*stop)[i].is_string()) wrong_type(fmt::format("stop[{}]", i), "a string", (*stop)[i]);
      r.stop.push_back((*stop)[i].get<std::string>());
    }
  } else {
    wrong_type("stop", "a string or an array of strings", *stop);
  }
  for (const std::string& s : r.stop) {
    if (s.empty()) fail("stop", "stop strings must not be empty");
  }
}

CompletionRequest parse(const json& body, const ordered_json* ordered_body, Endpoint endpoint,
                        const RequestLimits& limits) {
  if (!body.is_object()) wrong_type("body", "a JSON object", body);
  CompletionRequest r;
  r.endpoint = endpoint;
  r.model = string(body, "model").value_or("");
  if (endpoint == Endpoint::chat) {
    parse_messages(body, r);
  } else {
    parse_prompt(body, r);
  }

  std::optional<std::int64_t> max_tokens = integer(body, "max_tokens");
  if (endpoint == Endpoint::chat) {
    if (auto m = integer(body, "max_completion_tokens")) max_tokens = m;
  }
  if (max_tokens && (*max_tokens < 1 || *max_tokens > limits.max_tokens)) {
    fail("max_tokens", fmt::format("is {}, must be in [1, {}] on this server", *max_tokens, limits.max_tokens));
  }
  r.max_tokens = max_tokens.value_or(limits.max_tokens);
  r.max_tokens_given = max_tokens.has_value();

  // OpenAI's defaults: temperature 1, nucleus off; kallpa's extra filters off unless asked for.
  runtime::SamplingParams& s = r.sampling;
  s.temperature = static_cast<float>(number(body, "temperature", 0.0, 2.0).value_or(1.0));
  s.top_p = static_cast<float>(number(body, "top_p", 0.0, 1.0, /*lo_open=*/true).value_or(1.0));
  s.top_k = static_cast<std::int32_t>(integer(body, "top_k").value_or(0));
  if (s.top_k < 0) fail("top_k", "must be >= 0");
  s.min_p = static_cast<float>(number(body, "min_p", 0.0, 1.0).value_or(0.0));
  s.repetition_penalty = static_cast<float>(number(body, "repetition_penalty", 0.0, 10.0, true).value_or(1.0));
  if (auto seed = integer(body, "seed")) {
    s.seed = static_cast<std::uint64_t>(*seed);
    r.seed_given = true;
  }
  s.presence_penalty = static_cast<float>(number(body, "presence_penalty", -2.0, 2.0).value_or(0.0));
  s.frequency_penalty = static_cast<float>(number(body, "frequency_penalty", -2.0, 2.0).value_or(0.0));
  parse_logit_bias(body, limits, r);
  parse_logprobs(body, endpoint, r);

  const std::int64_t prompts = endpoint == Endpoint::chat ? 1 : static_cast<std::int64_t>(r.prompts.size());
  if (auto n = integer(body, "n")) {
    if (*n < 1 || *n * prompts > limits.max_choices) {
      fail("n", fmt::format("is {}, must be in [1, {}] on this server{}", *n, limits.max_choices / prompts,
                            prompts > 1 ? fmt::format(" for {} prompts", prompts) : ""));
    }
    r.n = *n;
  }
  if (prompts > limits.max_choices) {
    fail("prompt", fmt::format("{} prompts; this server takes at most {} in one request", prompts, limits.max_choices));
  }
  if (auto best_of = integer(body, "best_of"); best_of && *best_of != 1) unsupported("best_of", "best_of > 1");
  if (endpoint == Endpoint::chat) {
    // Options that would change what is generated are refused; bookkeeping ones (store,
    // metadata, user, service_tier, ...) are ignored as unknown fields are.
    for (const char* key : {"audio", "prediction", "web_search_options"}) {
      if (field(body, key)) unsupported(key, key);
    }
    for (const char* key : {"functions", "function_call"}) {
      if (field(body, key)) unsupported(key, fmt::format("{} (deprecated by OpenAI; use tools and tool_choice)", key));
    }
    if (ordered_body) parse_tools(*ordered_body, r);
    if (const json* modalities = field(body, "modalities")) {
      if (*modalities != json::array({"text"})) unsupported("modalities", "an output other than [\"text\"]");
    }
  } else {
    r.echo = boolean(body, "echo").value_or(false);
    if (r.echo && r.logprobs >= 0) unsupported("echo", "echo with logprobs (the prompt's log-probabilities)");
    if (auto suffix = string(body, "suffix"); suffix && !suffix->empty()) unsupported("suffix", "suffix");
  }
  if (const json* format = field(body, "response_format")) {
    auto parsed = parse_response_format(*format);
    if (auto* error = std::get_if<ApiError>(&parsed)) throw Invalid{*error};
    r.grammar = std::get<std::optional<runtime::GrammarSpec>>(std::move(parsed));
  }
  parse_stop(body, r);
  r.ignore_eos = boolean(body, "ignore_eos").value_or(false);

  r.stream = boolean(body, "stream").value_or(false);
  if (const json* so = field(body, "stream_options")) {
    if (!so->is_object()) wrong_type("stream_options", "an object", *so);
    if (!r.stream) fail("stream_options", "is only allowed when stream is true");
    r.include_usage = boolean(*so, "include_usage").value_or(false);
  }
  return r;
}

}  // namespace

ParsedRequest parse_completion_request(std::string_view body, Endpoint endpoint, const RequestLimits& limits) {
  json doc = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) {
    // Locate the error for the client: parse again with exceptions for the byte offset.
    std::string where = "the body is not valid JSON";
    try {
      json again = json::parse(body);
    } catch (const json::parse_error& e) {
      where = fmt::format("the body is not valid JSON (at byte {})", e.byte);
    } catch (const json::exception& e) {  // e.g. a number beyond double's range (out_of_range.406)
      where = fmt::format("the body is not valid JSON: {}", e.what());
    }
    return bad_request("", where, "invalid_json");
  }
  try {
    // Tools are read again with their keys in the client's order (a schema's properties are
    // generated in it), only when there are tools.
    std::optional<ordered_json> ordered;
    if (endpoint == Endpoint::chat && doc.is_object() &&
        (doc.contains("tools") || doc.contains("tool_choice") || doc.contains("parallel_tool_calls"))) {
      ordered = ordered_json::parse(body);
    }
    CompletionRequest r = parse(doc, ordered ? &*ordered : nullptr, endpoint, limits);
    if (r.grammar && r.grammar->kind == runtime::GrammarKind::json_schema) {
      r.grammar->source = json_schema_in_given_order(body);
    }
    return r;
  } catch (const Invalid& e) {
    return e.error;
  } catch (const json::exception& e) {
    return bad_request("", fmt::format("invalid request: {}", e.what()), "invalid_value");
  }
}

}  // namespace kallpa::server
