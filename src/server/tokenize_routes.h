// POST /tokenize and POST /detokenize in llama.cpp's server shapes, so that its clients and tools
// work unchanged:
//   /tokenize   {"content": "text", "add_special": false, "parse_special": true, "with_pieces": false}
//               -> {"tokens": [ids]}, or with_pieces {"tokens": [{"id": 1, "piece": "text"}, ...]}
//               (a piece that is not valid UTF-8 on its own is given as its bytes: [240, 159])
//   /detokenize {"tokens": [ids], "skip_special": false} -> {"content": "text"}
// Bad bodies are 400 errors naming the field (an id outside the vocabulary names its index).
#pragma once

#include <string_view>
#include <variant>

#include <nlohmann/json.hpp>

#include "kallpa/tokenizer/tokenizer.h"
#include "server/api_error.h"

namespace kallpa::server {

using TokenizeResult = std::variant<nlohmann::json, ApiError>;

TokenizeResult tokenize_body(const tokenizer::Tokenizer& tok, std::string_view body);
TokenizeResult detokenize_body(const tokenizer::Tokenizer& tok, std::string_view body);

}  // namespace kallpa::server
