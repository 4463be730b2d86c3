#include "server/structured_output.h"

#include <string>

#include <fmt/format.h>

namespace kallpa::server {
namespace {

using nlohmann::json;

ApiError type_error(const std::string& param, std::string_view expected, const json& value) {
  return bad_request(param, fmt::format("expected {}, got {}", expected, value.type_name()), "invalid_type");
}

}  // namespace

std::variant<std::optional<runtime::GrammarSpec>, ApiError> parse_response_format(const json& value) {
  if (!value.is_object()) return type_error("response_format", "an object", value);
  auto type = value.find("type");
  if (type == value.end()) return bad_request("response_format.type", "is required", "missing_required_parameter");
  if (!type->is_string()) return type_error("response_format.type", "a string", *type);
  const std::string kind = type->get<std::string>();
  if (kind == "text") return std::optional<runtime::GrammarSpec>();
  if (kind == "json_object") return std::optional<runtime::GrammarSpec>(runtime::GrammarSpec{});
  if (kind != "json_schema") {
    return bad_request("response_format.type", fmt::format("'{}' is not one of text, json_object, json_schema", kind));
  }
  auto js = value.find("json_schema");
  if (js == value.end() || js->is_null()) {
    return bad_request("response_format.json_schema", "is required when type is json_schema",
                       "missing_required_parameter");
  }
  if (!js->is_object()) return type_error("response_format.json_schema", "an object", *js);
  auto name = js->find("name");
  if (name == js->end() || name->is_null()) {
    return bad_request("response_format.json_schema.name", "is required", "missing_required_parameter");
  }
  if (!name->is_string()) return type_error("response_format.json_schema.name", "a string", *name);
  runtime::GrammarSpec spec;
  if (auto strict = js->find("strict"); strict != js->end() && !strict->is_null()) {
    if (!strict->is_boolean()) return type_error("response_format.json_schema.strict", "a boolean", *strict);
    spec.strict = strict->get<bool>();
  } else {
    spec.strict = false;  // OpenAI's default
  }
  auto schema = js->find("schema");
  if (schema == js->end() || schema->is_null()) return std::optional<runtime::GrammarSpec>(spec);  // any object
  if (!schema->is_object() && !schema->is_boolean()) {
    return type_error("response_format.json_schema.schema", "an object", *schema);
  }
  spec.kind = runtime::GrammarKind::json_schema;
  spec.source = schema->dump();
  return std::optional<runtime::GrammarSpec>(spec);
}

std::string json_schema_in_given_order(std::string_view body) {
  const auto doc = nlohmann::ordered_json::parse(body, nullptr, /*allow_exceptions=*/false);
  return doc.at("response_format").at("json_schema").at("schema").dump();
}

std::variant<std::shared_ptr<const runtime::CompiledGrammar>, ApiError> StructuredOutput::compile(
    const runtime::GrammarSpec& spec, const std::string& param) {
  std::call_once(
      once_, [&] { compiler_ = runtime::GrammarCompiler::create(engine_.tokenizer(), engine_.config().vocab_size); });
  if (!compiler_) {
    return bad_request(param.empty() ? "response_format" : param,
                       fmt::format("structured output is not available: {}", compiler_.status().message()),
                       "unsupported_value");
  }
  auto compiled = (*compiler_)->compile(spec);
  if (!compiled) {
    const std::string where = !param.empty()                                   ? param
                              : spec.kind == runtime::GrammarKind::json_schema ? "response_format.json_schema.schema"
                                                                               : "response_format";
    return bad_request(where, compiled.status().message());
  }
  return *compiled;
}

}  // namespace kallpa::server
