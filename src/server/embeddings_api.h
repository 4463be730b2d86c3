// POST /v1/embeddings in OpenAI's shapes, apart from the transport: the request parsed and
// validated (400 naming the field), and the response body.
//
// input: a string, an array of strings, an array of token ids (one input) or an array of arrays
// of token ids; every input non-empty; at most EmbeddingLimits::max_inputs of them. Token ids are
// the encoder's own and are used as given (no [CLS]/[SEP] added). encoding_format: "float"
// (default) or "base64" (little-endian float32, as OpenAI's clients decode it). dimensions: only
// the encoder's own width (the vectors are not truncatable).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "kallpa/runtime/embedder.h"
#include "server/api_error.h"

namespace kallpa::server {

struct EmbeddingLimits {
  std::size_t max_inputs = 2048;
  std::int64_t dim = 0;  // the encoder's width (for `dimensions`)
};

struct EmbeddingsRequest {
  std::string model;
  std::vector<std::string> texts;                 // text inputs, or
  std::vector<std::vector<std::int32_t>> tokens;  // token inputs
  bool base64 = false;
};

using ParsedEmbeddingsRequest = std::variant<EmbeddingsRequest, ApiError>;

ParsedEmbeddingsRequest parse_embeddings_request(std::string_view body, const EmbeddingLimits& limits);

nlohmann::json embeddings_body(const runtime::Embeddings& result, const std::string& model, bool base64);

}  // namespace kallpa::server
