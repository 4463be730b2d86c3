#include "server/embeddings_api.h"

#include <array>
#include <cstring>
#include <limits>

#include <fmt/format.h>

namespace kallpa::server {
namespace {

using nlohmann::json;

std::string base64_of(const float* values, std::size_t n) {
  static constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string bytes(n * sizeof(float), '\0');
  std::memcpy(bytes.data(), values, bytes.size());  // x86 and every target kallpa builds for: little-endian
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  std::size_t i = 0;
  for (; i + 2 < bytes.size(); i += 3) {
    const std::uint32_t v = std::uint32_t(std::uint8_t(bytes[i])) << 16 |
                            std::uint32_t(std::uint8_t(bytes[i + 1])) << 8 | std::uint8_t(bytes[i + 2]);
    for (int s = 18; s >= 0; s -= 6) out += kAlphabet[(v >> s) & 63];
  }
  if (i < bytes.size()) {
    std::uint32_t v = std::uint32_t(std::uint8_t(bytes[i])) << 16;
    if (i + 1 < bytes.size()) v |= std::uint32_t(std::uint8_t(bytes[i + 1])) << 8;
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += i + 1 < bytes.size() ? kAlphabet[(v >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

// One input of token ids, or an ApiError naming where it is wrong.
std::variant<std::vector<std::int32_t>, ApiError> token_input(const json& array, const std::string& param) {
  std::vector<std::int32_t> ids;
  if (array.empty()) return bad_request(param, "an input must not be empty");
  for (std::size_t i = 0; i < array.size(); ++i) {
    const json& id = array[i];
    if (!id.is_number_integer() || id.get<std::int64_t>() < 0 ||
        id.get<std::int64_t>() > std::numeric_limits<std::int32_t>::max()) {
      return bad_request(fmt::format("{}[{}]", param, i), fmt::format("expected a token id, got {}", id.dump()),
                         "invalid_type");
    }
    ids.push_back(id.get<std::int32_t>());
  }
  return ids;
}

}  // namespace

ParsedEmbeddingsRequest parse_embeddings_request(std::string_view body, const EmbeddingLimits& limits) {
  const json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return bad_request("", "the request body is not valid JSON", "invalid_json");
  if (!j.is_object()) return bad_request("", "the request body must be a JSON object", "invalid_type");
  EmbeddingsRequest r;
  if (auto it = j.find("model"); it != j.end() && !it->is_null()) {
    if (!it->is_string()) return bad_request("model", "expected a string", "invalid_type");
    r.model = it->get<std::string>();
  }
  const auto input = j.find("input");
  if (input == j.end() || input->is_null()) return bad_request("input", "is required", "missing_required_parameter");
  if (input->is_string()) {
    r.texts.push_back(input->get<std::string>());
  } else if (input->is_array() && !input->empty() && input->at(0).is_number()) {
    auto ids = token_input(*input, "input");
    if (auto* e = std::get_if<ApiError>(&ids)) return *e;
    r.tokens.push_back(std::move(std::get<std::vector<std::int32_t>>(ids)));
  } else if (input->is_array()) {
    if (input->empty()) return bad_request("input", "must not be an empty array");
    const bool texts = input->at(0).is_string();
    for (std::size_t i = 0; i < input->size(); ++i) {
      const json& item = input->at(i);
      const std::string param = fmt::format("input[{}]", i);
      if (texts && item.is_string()) {
        r.texts.push_back(item.get<std::string>());
      } else if (!texts && item.is_array()) {
        auto ids = token_input(item, param);
        if (auto* e = std::get_if<ApiError>(&ids)) return *e;
        r.tokens.push_back(std::move(std::get<std::vector<std::int32_t>>(ids)));
      } else {
        return bad_request(param, texts ? "expected a string, like input[0]" : "expected an array of token ids",
                           "invalid_type");
      }
    }
  } else {
    return bad_request("input", "expected a string, an array of strings or an array of token-id arrays",
                       "invalid_type");
  }
  for (std::size_t i = 0; i < r.texts.size(); ++i) {
    if (r.texts[i].empty()) {
      return bad_request(r.texts.size() == 1 && input->is_string() ? "input" : fmt::format("input[{}]", i),
                         "an input must not be empty");
    }
  }
  if (r.texts.size() + r.tokens.size() > limits.max_inputs) {
    return bad_request(
        "input", fmt::format("{} inputs; at most {} per request", r.texts.size() + r.tokens.size(), limits.max_inputs));
  }
  if (auto it = j.find("encoding_format"); it != j.end() && !it->is_null()) {
    if (!it->is_string() || (*it != "float" && *it != "base64")) {
      return bad_request("encoding_format", fmt::format("must be \"float\" or \"base64\", got {}", it->dump()));
    }
    r.base64 = *it == "base64";
  }
  if (auto it = j.find("dimensions"); it != j.end() && !it->is_null()) {
    if (!it->is_number_integer()) return bad_request("dimensions", "expected an integer", "invalid_type");
    if (it->get<std::int64_t>() != limits.dim) {
      return bad_request("dimensions", fmt::format("this model's vectors have {} dimensions and cannot be shortened; "
                                                   "got {}",
                                                   limits.dim, it->dump()));
    }
  }
  return r;
}

json embeddings_body(const runtime::Embeddings& result, const std::string& model, bool base64) {
  json data = json::array();
  const auto dim = static_cast<std::size_t>(result.dim);
  const std::size_t n = dim == 0 ? 0 : result.vectors.size() / dim;
  for (std::size_t i = 0; i < n; ++i) {
    const float* v = result.vectors.data() + i * dim;
    json item{{"object", "embedding"}, {"index", i}};
    if (base64) {
      item["embedding"] = base64_of(v, dim);
    } else {
      item["embedding"] = std::vector<float>(v, v + dim);
    }
    data.push_back(std::move(item));
  }
  return json{{"object", "list"},
              {"data", std::move(data)},
              {"model", model},
              {"usage", {{"prompt_tokens", result.tokens}, {"total_tokens", result.tokens}}}};
}

}  // namespace kallpa::server
