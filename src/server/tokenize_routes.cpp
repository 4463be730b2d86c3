#include "server/tokenize_routes.h"

#include <cstdint>
#include <vector>

#include <fmt/format.h>

#include "tokenizer/utf8.h"

namespace kallpa::server {
namespace {

using nlohmann::json;

std::variant<json, ApiError> parse_object(std::string_view body) {
  json doc = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return bad_request("", "the body is not valid JSON", "invalid_json");
  if (!doc.is_object())
    return bad_request("body", fmt::format("expected a JSON object, got {}", doc.type_name()), "invalid_type");
  return doc;
}

// A boolean field, its default when absent; an error when of another type.
std::variant<bool, ApiError> flag(const json& body, const char* key, bool fallback) {
  auto it = body.find(key);
  if (it == body.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) {
    return bad_request(key, fmt::format("expected a boolean, got {}", it->type_name()), "invalid_type");
  }
  return it->get<bool>();
}

// llama.cpp's rule: a piece is a string when it is valid UTF-8, else its bytes.
json piece_json(const std::string& bytes) {
  if (!tokenizer::detail::first_invalid_utf8(bytes)) return bytes;
  json out = json::array();
  for (char c : bytes) out.push_back(static_cast<unsigned char>(c));
  return out;
}

}  // namespace

TokenizeResult tokenize_body(const tokenizer::Tokenizer& tok, std::string_view text) {
  auto parsed = parse_object(text);
  if (auto* e = std::get_if<ApiError>(&parsed)) return *e;
  const json& body = std::get<json>(parsed);
  auto content = body.find("content");
  if (content == body.end() || content->is_null()) {
    return bad_request("content", "is required", "missing_required_parameter");
  }
  if (!content->is_string()) {
    return bad_request("content", fmt::format("expected a string, got {}", content->type_name()), "invalid_type");
  }
  // llama.cpp's defaults: no BOS/EOS added, special-token text read as the special token.
  auto add_special = flag(body, "add_special", false);
  auto parse_special = flag(body, "parse_special", true);
  auto with_pieces = flag(body, "with_pieces", false);
  for (auto* f : {&add_special, &parse_special, &with_pieces}) {
    if (auto* e = std::get_if<ApiError>(f)) return *e;
  }
  auto ids = tok.encode(content->get<std::string>(),
                        {.add_special = std::get<bool>(add_special), .parse_special = std::get<bool>(parse_special)});
  if (!ids) return bad_request("content", ids.status().to_string());
  json tokens = json::array();
  for (tokenizer::TokenId id : *ids) {
    if (!std::get<bool>(with_pieces)) {
      tokens.push_back(id);
      continue;
    }
    auto piece = tok.decode_bytes(std::span<const tokenizer::TokenId>(&id, 1));
    tokens.push_back({{"id", id}, {"piece", piece_json(piece ? *piece : std::string())}});
  }
  return json{{"tokens", std::move(tokens)}};
}

TokenizeResult detokenize_body(const tokenizer::Tokenizer& tok, std::string_view text) {
  auto parsed = parse_object(text);
  if (auto* e = std::get_if<ApiError>(&parsed)) return *e;
  const json& body = std::get<json>(parsed);
  auto list = body.find("tokens");
  if (list == body.end() || list->is_null()) return bad_request("tokens", "is required", "missing_required_parameter");
  if (!list->is_array()) {
    return bad_request("tokens", fmt::format("expected an array of token ids, got {}", list->type_name()),
                       "invalid_type");
  }
  auto skip_special = flag(body, "skip_special", false);
  if (auto* e = std::get_if<ApiError>(&skip_special)) return *e;
  std::vector<tokenizer::TokenId> ids;
  const auto vocab = static_cast<std::int64_t>(tok.vocab_size());
  for (std::size_t i = 0; i < list->size(); ++i) {
    const json& t = (*list)[i];
    const std::string at = fmt::format("tokens[{}]", i);
    if (!t.is_number_integer()) {
      return bad_request(at, fmt::format("expected a token id (integer), got {}", t.type_name()), "invalid_type");
    }
    const auto id = t.get<std::int64_t>();
    if (id < 0 || id >= vocab) {
      return bad_request(at, fmt::format("token id {} is outside the vocabulary [0, {})", id, vocab));
    }
    ids.push_back(static_cast<tokenizer::TokenId>(id));
  }
  auto content = tok.decode(ids, {.skip_special = std::get<bool>(skip_special)});
  if (!content) return bad_request("tokens", content.status().to_string());
  return json{{"content", *content}};
}

}  // namespace kallpa::server
