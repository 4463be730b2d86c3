// response_format in OpenAI request bodies: text, json_object and json_schema read into a grammar
// spec; every malformed shape is a 400 that names the field.
#include <gtest/gtest.h>

#include <string>

#include <nlohmann/json.hpp>

#include "server/request_parser.h"

namespace kallpa::server {
namespace {

using nlohmann::json;

ParsedRequest with_format(const json& format, Endpoint endpoint = Endpoint::chat) {
  json body = {{"response_format", format}};
  if (endpoint == Endpoint::chat) {
    body["messages"] = {{{"role", "user"}, {"content", "hi"}}};
  } else {
    body["prompt"] = "hi";
  }
  return parse_completion_request(body.dump(), endpoint, {.max_tokens = 16});
}

std::optional<runtime::GrammarSpec> grammar_of(const ParsedRequest& p) {
  const auto* r = std::get_if<CompletionRequest>(&p);
  if (r == nullptr) {
    ADD_FAILURE() << std::get<ApiError>(p).message;
    return std::nullopt;
  }
  return r->grammar;
}

TEST(ResponseFormat, TextIsUnconstrained) {
  EXPECT_FALSE(grammar_of(with_format({{"type", "text"}})).has_value());
  EXPECT_FALSE(grammar_of(with_format(nullptr)).has_value());
}

TEST(ResponseFormat, JsonObjectIsAnyObject) {
  for (Endpoint e : {Endpoint::chat, Endpoint::completions}) {
    auto g = grammar_of(with_format({{"type", "json_object"}}, e));
    ASSERT_TRUE(g.has_value());
    EXPECT_EQ(g->kind, runtime::GrammarKind::json);
  }
}

TEST(ResponseFormat, JsonSchemaCarriesTheSchemaAndStrict) {
  const json schema = {{"type", "object"}, {"properties", {{"a", {{"type", "integer"}}}}}};
  auto g = grammar_of(
      with_format({{"type", "json_schema"}, {"json_schema", {{"name", "x"}, {"schema", schema}, {"strict", true}}}}));
  ASSERT_TRUE(g.has_value());
  EXPECT_EQ(g->kind, runtime::GrammarKind::json_schema);
  EXPECT_EQ(json::parse(g->source), schema);
  EXPECT_TRUE(g->strict);
  // OpenAI's default is not strict; no schema means any object.
  g = grammar_of(with_format({{"type", "json_schema"}, {"json_schema", {{"name", "x"}, {"schema", schema}}}}));
  ASSERT_TRUE(g.has_value());
  EXPECT_FALSE(g->strict);
  g = grammar_of(with_format({{"type", "json_schema"}, {"json_schema", {{"name", "x"}}}}));
  ASSERT_TRUE(g.has_value());
  EXPECT_EQ(g->kind, runtime::GrammarKind::json);
}

TEST(ResponseFormat, TheSchemaKeepsTheClientsKeyOrder) {
  // Properties are generated in the schema's order, so it must survive parsing (nlohmann::json
  // sorts keys).
  const std::string body =
      R"({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema",
      "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"zeta": {"type": "integer"},
      "alpha": {"type": "string"}}, "required": ["zeta", "alpha"]}}}})";
  const ParsedRequest p = parse_completion_request(body, Endpoint::chat, {.max_tokens = 16});
  auto g = grammar_of(p);
  ASSERT_TRUE(g.has_value());
  EXPECT_LT(g->source.find("zeta"), g->source.find("alpha")) << g->source;
  EXPECT_LT(g->source.find("\"type\":\"object\""), g->source.find("properties")) << g->source;
}

TEST(ResponseFormat, MalformedShapesNameTheField) {
  struct Case {
    json format;
    std::string param, code;
  };
  const Case cases[] = {
      {"json_object", "response_format", "invalid_type"},
      {json::object(), "response_format.type", "missing_required_parameter"},
      {{{"type", 3}}, "response_format.type", "invalid_type"},
      {{{"type", "yaml"}}, "response_format.type", "invalid_value"},
      {{{"type", "json_schema"}}, "response_format.json_schema", "missing_required_parameter"},
      {{{"type", "json_schema"}, {"json_schema", "x"}}, "response_format.json_schema", "invalid_type"},
      {{{"type", "json_schema"}, {"json_schema", json::object()}},
       "response_format.json_schema.name",
       "missing_required_parameter"},
      {{{"type", "json_schema"}, {"json_schema", {{"name", 1}}}}, "response_format.json_schema.name", "invalid_type"},
      {{{"type", "json_schema"}, {"json_schema", {{"name", "x"}, {"strict", 1}}}},
       "response_format.json_schema.strict",
       "invalid_type"},
      {{{"type", "json_schema"}, {"json_schema", {{"name", "x"}, {"schema", json::array()}}}},
       "response_format.json_schema.schema",
       "invalid_type"},
  };
  for (const Case& c : cases) {
    const ParsedRequest p = with_format(c.format);
    const auto* e = std::get_if<ApiError>(&p);
    ASSERT_NE(e, nullptr) << c.format.dump();
    EXPECT_EQ(e->status, 400) << c.format.dump();
    EXPECT_EQ(e->param, c.param) << c.format.dump();
    EXPECT_EQ(e->code, c.code) << c.format.dump();
    EXPECT_FALSE(e->message.empty()) << c.format.dump();
  }
}

}  // namespace
}  // namespace kallpa::server
