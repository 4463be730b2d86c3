// POST /v1/embeddings' request parsing and response body (server/embeddings_api.h).
#include <string>
#include <variant>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "server/embeddings_api.h"

namespace kallpa::server {
namespace {

const EmbeddingLimits kLimits{.max_inputs = 4, .dim = 2};

EmbeddingsRequest ok(const std::string& body) {
  ParsedEmbeddingsRequest r = parse_embeddings_request(body, kLimits);
  if (auto* e = std::get_if<ApiError>(&r)) ADD_FAILURE() << body << ": " << e->message;
  return std::holds_alternative<EmbeddingsRequest>(r) ? std::get<EmbeddingsRequest>(r) : EmbeddingsRequest{};
}

ApiError error(const std::string& body) {
  ParsedEmbeddingsRequest r = parse_embeddings_request(body, kLimits);
  EXPECT_TRUE(std::holds_alternative<ApiError>(r)) << body;
  return std::holds_alternative<ApiError>(r) ? std::get<ApiError>(r) : ApiError{};
}

TEST(EmbeddingsApi, EveryInputShape) {
  EmbeddingsRequest r = ok(R"({"model": "m", "input": "hello"})");
  EXPECT_EQ(r.model, "m");
  EXPECT_EQ(r.texts, (std::vector<std::string>{"hello"}));
  r = ok(R"({"input": ["a", "b"], "encoding_format": "base64", "dimensions": 2, "user": "u"})");
  EXPECT_EQ(r.texts.size(), 2u);
  EXPECT_TRUE(r.base64);
  r = ok(R"({"input": [101, 7, 102]})");
  ASSERT_EQ(r.tokens.size(), 1u);
  EXPECT_EQ(r.tokens[0], (std::vector<std::int32_t>{101, 7, 102}));
  r = ok(R"({"input": [[1, 2], [3]]})");
  EXPECT_EQ(r.tokens.size(), 2u);
}

TEST(EmbeddingsApi, BadRequestsNameTheField) {
  struct Case {
    const char* body;
    const char* param;
  };
  for (const Case& c :
       {Case{"{", ""}, Case{"[]", ""}, Case{R"({"model": "m"})", "input"}, Case{R"({"input": ""})", "input"},
        Case{R"({"input": []})", "input"}, Case{R"({"input": ["a", ""]})", "input[1]"},
        Case{R"({"input": ["a", 3]})", "input[1]"}, Case{R"({"input": [[1], "a"]})", "input[1]"},
        Case{R"({"input": [[1], []]})", "input[1]"}, Case{R"({"input": [1, -2]})", "input[1]"},
        Case{R"({"input": ["a", "b", "c", "d", "e"]})", "input"}, Case{R"({"input": 7})", "input"},
        Case{R"({"input": "a", "encoding_format": "int8"})", "encoding_format"},
        Case{R"({"input": "a", "dimensions": 1})", "dimensions"}, Case{R"({"input": "a", "model": 3})", "model"}}) {
    const ApiError e = error(c.body);
    EXPECT_EQ(e.status, 400) << c.body;
    EXPECT_EQ(e.param, c.param) << c.body << ": " << e.message;
  }
}

TEST(EmbeddingsApi, BodyInOpenAIsShapeWithBase64AsLittleEndianFloats) {
  runtime::Embeddings result;
  result.dim = 2;
  result.vectors = {1.0f, -2.0f, 0.5f, 0.0f};
  result.tokens = 9;
  const nlohmann::json body = embeddings_body(result, "enc", false);
  EXPECT_EQ(body["object"], "list");
  EXPECT_EQ(body["model"], "enc");
  ASSERT_EQ(body["data"].size(), 2u);
  EXPECT_EQ(body["data"][1]["index"], 1);
  EXPECT_EQ(body["data"][1]["object"], "embedding");
  EXPECT_EQ(body["data"][1]["embedding"], (std::vector<float>{0.5f, 0.0f}));
  EXPECT_EQ(body["usage"]["prompt_tokens"], 9);
  EXPECT_EQ(body["usage"]["total_tokens"], 9);
  // 1.0f = 00 00 80 3f, -2.0f = 00 00 00 c0: base64 of the 8 bytes.
  const nlohmann::json b64 = embeddings_body(result, "enc", true);
  EXPECT_EQ(b64["data"][0]["embedding"], "AACAPwAAAMA=");
  EXPECT_EQ(b64["data"][1]["embedding"], "AAAAPwAAAAA=");
}

}  // namespace
}  // namespace kallpa::server
