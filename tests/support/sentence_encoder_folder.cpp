#include "support/sentence_encoder_folder.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace kallpa::testing {

std::string safetensors_bytes(const std::map<std::string, SafetensorsEntry>& tensors) {
  nlohmann::json header = nlohmann::json::object();
  header["__metadata__"] = {{"format", "pt"}};
  std::string data;
  for (const auto& [name, t] : tensors) {
    header[name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {data.size(), data.size() + t.bytes.size()}}};
    data += t.bytes;
  }
  std::string text = header.dump();
  while (text.size() % 8 != 0) text += ' ';  // as the format's writers pad it
  std::string out(8, '\0');
  const std::uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + text + data;
}

std::vector<std::string> encoder_vocabulary() {
  std::vector<std::string> v = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "!", ",", ".", "?"};
  for (char c = 'a'; c <= 'z'; ++c) v.emplace_back(1, c);
  for (char c = 'a'; c <= 'z'; ++c) v.push_back(std::string("##") + c);
  for (const char* w : {"the", "cat", "sat", "on", "mat", "un", "##aff", "##able", "hello", "world"}) {
    v.emplace_back(w);
  }
  return v;
}

std::string write_encoder_folder(const std::string& dir, const EncoderFolderOptions& o) {
  namespace fs = std::filesystem;
  fs::create_directories(fs::path(dir) / "1_Pooling");
  const std::vector<std::string> vocab = encoder_vocabulary();
  {
    std::ofstream out(fs::path(dir) / "vocab.txt");
    for (const std::string& t : vocab) out << t << '\n';
  }
  const nlohmann::json config = {{"model_type", "bert"},
                                 {"hidden_act", "gelu"},
                                 {"hidden_size", o.hidden},
                                 {"num_hidden_layers", o.layers},
                                 {"num_attention_heads", o.heads},
                                 {"intermediate_size", o.intermediate},
                                 {"max_position_embeddings", o.max_positions},
                                 {"type_vocab_size", 2},
                                 {"vocab_size", vocab.size()},
                                 {"layer_norm_eps", 1e-12}};
  std::ofstream(fs::path(dir) / "config.json") << config.dump(2);
  std::ofstream(fs::path(dir) / "modules.json")
      << R"([{"idx":0,"name":"0","path":"","type":"sentence_transformers.models.Transformer"},)"
      << R"({"idx":1,"name":"1","path":"1_Pooling","type":"sentence_transformers.models.Pooling"},)"
      << R"({"idx":2,"name":"2","path":"2_Normalize","type":"sentence_transformers.models.Normalize"}])";
  std::ofstream(fs::path(dir) / "1_Pooling" / "config.json") << nlohmann::json{
      {"pooling_mode_mean_tokens", o.pooling == "mean"},
      {"pooling_mode_cls_token", o.pooling == "cls"},
      {"pooling_mode_max_tokens", o.pooling == "max"}}.dump();
  std::ofstream(fs::path(dir) / "tokenizer_config.json") << R"({"do_lower_case": true})";

  std::mt19937_64 rng(o.seed);
  std::normal_distribution<float> normal(0.0f, 0.2f);
  std::map<std::string, SafetensorsEntry> tensors;
  const std::string prefix = o.prefix_bert ? "bert." : "";
  const auto add = [&](const std::string& name, std::vector<std::int64_t> shape, float offset = 0.0f) {
    if (name == o.drop_tensor) return;
    if (name == o.misshape_tensor) shape.back() += 1;
    std::int64_t n = 1;
    for (std::int64_t d : shape) n *= d;
    std::vector<float> values(static_cast<std::size_t>(n));
    for (float& v : values) v = offset + normal(rng);
    SafetensorsEntry e;
    e.shape = shape;
    e.bytes.assign(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
    tensors[prefix + name] = std::move(e);
  };
  const std::int64_t H = o.hidden, F = o.intermediate;
  add("embeddings.word_embeddings.weight", {static_cast<std::int64_t>(vocab.size()), H});
  add("embeddings.position_embeddings.weight", {o.max_positions, H});
  add("embeddings.token_type_embeddings.weight", {2, H});
  add("embeddings.LayerNorm.weight", {H}, 1.0f);
  add("embeddings.LayerNorm.bias", {H});
  for (int l = 0; l < o.layers; ++l) {
    const std::string p = fmt::format("encoder.layer.{}.", l);
    for (const char* m :
         {"attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"}) {
      add(p + m + ".weight", {H, H});
      add(p + m + ".bias", {H});
    }
    add(p + "attention.output.LayerNorm.weight", {H}, 1.0f);
    add(p + "attention.output.LayerNorm.bias", {H});
    add(p + "intermediate.dense.weight", {F, H});
    add(p + "intermediate.dense.bias", {F});
    add(p + "output.dense.weight", {H, F});
    add(p + "output.dense.bias", {H});
    add(p + "output.LayerNorm.weight", {H}, 1.0f);
    add(p + "output.LayerNorm.bias", {H});
  }
  std::ofstream(fs::path(dir) / "model.safetensors", std::ios::binary) << safetensors_bytes(tensors);
  return dir;
}

}  // namespace kallpa::testing
