// Structured output for the OpenAI routes: `response_format` read into a grammar spec, and the
// model's grammar compiler, made on first use (the vocabulary is prepared once per model) and then
// shared by every request.
#pragma once

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <variant>

#include <nlohmann/json.hpp>

#include "kallpa/runtime/engine.h"
#include "kallpa/runtime/grammar.h"
#include "server/api_error.h"

namespace kallpa::server {

// {"type": "text"} is unconstrained (nullopt); {"type": "json_object"} any JSON object;
// {"type": "json_schema", "json_schema": {"name", "schema", "strict"}} the schema (absent: any JSON
// object). Anything else is a 400 naming the field.
std::variant<std::optional<runtime::GrammarSpec>, ApiError> parse_response_format(const nlohmann::json& value);

// response_format.json_schema.schema of a request body (valid JSON, with that schema), with its
// keys in the order the client wrote them: properties are generated in the schema's order, which
// nlohmann::json (sorted keys) would lose.
std::string json_schema_in_given_order(std::string_view body);

class StructuredOutput {
 public:
  explicit StructuredOutput(runtime::Engine& engine) : engine_(engine) {}
  // The compiled grammar for `spec`: a 400 naming response_format's part the engine cannot
  // compile (or `param` when given: the part of the request the grammar came from), a 400
  // unsupported_value when kallpa was built without the grammar engine.
  std::variant<std::shared_ptr<const runtime::CompiledGrammar>, ApiError> compile(const runtime::GrammarSpec& spec,
                                                                                  const std::string& param = "");

 private:
  runtime::Engine& engine_;
  std::once_flag once_;
  Result<std::unique_ptr<runtime::GrammarCompiler>> compiler_{Status(ErrorCode::internal, "grammar", "not made")};
};

}  // namespace kallpa::server
