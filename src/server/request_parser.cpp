#include "server/request_parser.h"

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

[[noreturn]] void wrong_type(const std::string& param, std::string_view expected, const json& value) {
  fail(param, fmt::format("expected {}, got {}", expected, value.type_name()), "invalid_type");
}

const json* field(const json& obj, const char* key) {
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

std::optional<bool> boolean(const json& obj, const char* key) {
  const json* v = field(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) wrong_type(key, "a boolean", *v);
  return v->get<bool>();
}

std::optional<std::string> string(const json& obj, const char* key) {
  const json* v = field(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_string()) wrong_type(key, "a string", *v);
  return v->get<std::string>();
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
    if (name != "system" && name != "user" && name != "assistant") {
      fail(at + ".role", fmt::format("'{}' is not one of system, developer, user, assistant", name));
    }
    const json* content = field(m, "content");
    if (!content) fail(at + ".content", "is required", "missing_required_parameter");
    r.messages.push_back({name, message_content(*content, at + ".content")});
  }
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

CompletionRequest parse(const json& body, Endpoint endpoint, const RequestLimits& limits) {
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
    for (const char* key :
         {"tools", "functions", "tool_choice", "function_call", "audio", "prediction", "web_search_options"}) {
      if (field(body, key)) unsupported(key, key);
    }
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
    CompletionRequest r = parse(doc, endpoint, limits);
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
