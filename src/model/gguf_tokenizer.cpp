#include "kallpa/model/gguf_tokenizer.h"

#include <string>

namespace kallpa::model {

Result<tokenizer::Tokenizer> tokenizer_from_gguf(const GgufFile& file) {
  tokenizer::TokenizerData data;
  auto model = file.get_string("tokenizer.ggml.model");
  if (!model) return model.status();
  data.model = std::string(*model);
  if (file.has("tokenizer.ggml.pre")) {
    auto pre = file.get_string("tokenizer.ggml.pre");
    if (!pre) return pre.status();
    data.pre = std::string(*pre);
  }
  auto tokens = file.get_string_array("tokenizer.ggml.tokens");
  if (!tokens) return tokens.status();
  data.tokens.assign(tokens->begin(), tokens->end());
  if (file.has("tokenizer.ggml.token_type")) {
    auto types = file.get_numeric_array<std::int32_t>("tokenizer.ggml.token_type");
    if (!types) return types.status();
    data.token_types = std::move(*types);
  }
  if (file.has("tokenizer.ggml.scores")) {
    auto scores = file.get_numeric_array<float>("tokenizer.ggml.scores");
    if (!scores) return scores.status();
    data.scores = std::move(*scores);
  }
  if (file.has("tokenizer.ggml.merges")) {
    auto merges = file.get_string_array("tokenizer.ggml.merges");
    if (!merges) return merges.status();
    data.merges.assign(merges->begin(), merges->end());
  }
  auto id = [&](const char* key, std::optional<std::int64_t>* out) -> Status {
    if (!file.has(key)) return {};
    auto v = file.get_uint(key);
    if (!v) return v.status();
    *out = static_cast<std::int64_t>(*v);
    return {};
  };
  auto flag = [&](const char* key, bool* out) -> Status {
    if (!file.has(key)) return {};
    auto v = file.get_bool(key);
    if (!v) return v.status();
    *out = *v;
    return {};
  };
  Status s;
  if (!(s = id("tokenizer.ggml.bos_token_id", &data.bos_id)) ||
      !(s = id("tokenizer.ggml.eos_token_id", &data.eos_id)) ||
      !(s = id("tokenizer.ggml.unknown_token_id", &data.unk_id)) ||
      !(s = id("tokenizer.ggml.padding_token_id", &data.pad_id)) ||
      !(s = id("tokenizer.ggml.eot_token_id", &data.eot_id)) ||
      !(s = id("tokenizer.ggml.eom_token_id", &data.eom_id)) ||
      !(s = flag("tokenizer.ggml.add_bos_token", &data.add_bos)) ||
      !(s = flag("tokenizer.ggml.add_eos_token", &data.add_eos))) {
    return s;
  }
  if (file.has("tokenizer.ggml.add_space_prefix")) {
    bool prefix = true;
    if (!(s = flag("tokenizer.ggml.add_space_prefix", &prefix))) return s;
    data.add_space_prefix = prefix;
  }
  return tokenizer::Tokenizer::create(std::move(data));
}

tokenizer::ChatMlOptions chat_options_from_gguf(const GgufFile& file) {
  if (auto tmpl = file.get_string("tokenizer.chat_template"); tmpl) {
    if (auto opts = tokenizer::chatml_options_from_template(*tmpl); opts) return *opts;
  }
  return {};
}

tokenizer::ChatFormat chat_format_from_gguf(const GgufFile& file, const tokenizer::Tokenizer& tokenizer) {
  std::string_view source, architecture;
  if (auto tmpl = file.get_string("tokenizer.chat_template"); tmpl) source = *tmpl;
  if (auto arch = file.get_string("general.architecture"); arch) architecture = *arch;
  return tokenizer::choose_chat_format(tokenizer, architecture, source);
}

}  // namespace kallpa::model
