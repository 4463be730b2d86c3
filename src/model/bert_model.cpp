#include "kallpa/model/bert_model.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "kallpa/half.h"
#include "kallpa/ops/scratch.h"

namespace kallpa::model {
namespace {

using nlohmann::json;

Result<json> read_json(const std::filesystem::path& path, bool required) {
  std::ifstream in(path);
  if (!in) {
    if (!required) return json();
    return Status(ErrorCode::not_found, path.filename().string(), fmt::format("cannot open '{}'", path.string()));
  }
  json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() && !j.is_array()) {
    return Status(ErrorCode::parse_error, path.filename().string(), fmt::format("'{}' is not JSON", path.string()));
  }
  return j;
}

Result<std::int64_t> positive(const json& config, const char* key) {
  const json* v = config.contains(key) ? &config[key] : nullptr;
  if (v == nullptr || !v->is_number_integer() || v->get<std::int64_t>() <= 0 || v->get<std::int64_t>() > (1 << 20)) {
    return Status(ErrorCode::invalid_argument, fmt::format("config.json:{}", key),
                  fmt::format("must be a positive integer, got {}", v == nullptr ? "nothing" : v->dump()));
  }
  return v->get<std::int64_t>();
}

}  // namespace

Result<BertConfig> read_bert_folder(const std::string& folder) {
  const std::filesystem::path dir(folder);
  if (!std::filesystem::is_directory(dir)) {
    return Status(ErrorCode::not_found, "path",
                  fmt::format("'{}' is not a folder (an encoder is a sentence-transformers folder)", folder));
  }
  Result<json> config = read_json(dir / "config.json", true);
  if (!config) return config.status();
  BertConfig c;
  c.name = dir.filename().empty() ? dir.parent_path().filename().string() : dir.filename().string();
  const std::string model_type = config->value("model_type", std::string());
  if (model_type != "bert") {
    return Status(ErrorCode::unsupported, "config.json:model_type",
                  fmt::format("model_type '{}' is not an encoder kallpa runs (bert)", model_type));
  }
  if (const std::string act = config->value("hidden_act", std::string("gelu")); act != "gelu") {
    return Status(ErrorCode::unsupported, "config.json:hidden_act", fmt::format("hidden_act '{}' (only gelu)", act));
  }
  if (const std::string pos = config->value("position_embedding_type", std::string("absolute")); pos != "absolute") {
    return Status(ErrorCode::unsupported, "config.json:position_embedding_type",
                  fmt::format("position_embedding_type '{}' (only absolute)", pos));
  }
  for (auto [key, field] : {std::pair<const char*, std::int64_t*>{"vocab_size", &c.vocab_size},
                            {"hidden_size", &c.hidden},
                            {"num_hidden_layers", &c.layers},
                            {"num_attention_heads", &c.heads},
                            {"intermediate_size", &c.intermediate},
                            {"max_position_embeddings", &c.max_positions},
                            {"type_vocab_size", &c.type_vocab_size}}) {
    Result<std::int64_t> v = positive(*config, key);
    if (!v) return v.status();
    *field = *v;
  }
  if (c.hidden % c.heads != 0) {
    return Status(ErrorCode::invalid_argument, "config.json:num_attention_heads",
                  fmt::format("{} heads do not divide hidden_size {}", c.heads, c.hidden));
  }
  const json& eps = (*config)["layer_norm_eps"];
  if (eps.is_number()) c.layer_norm_eps = eps.get<float>();
  if (!(c.layer_norm_eps > 0.0f && c.layer_norm_eps < 1.0f)) {
    return Status(ErrorCode::invalid_argument, "config.json:layer_norm_eps", "must be in (0, 1)");
  }

  // sentence-transformers' modules: pooling and normalisation. A bare BERT folder pools by mean.
  Result<json> modules = read_json(dir / "modules.json", false);
  if (!modules) return modules.status();
  std::string pooling_path = "1_Pooling";
  if (modules->is_array()) {
    for (const json& m : *modules) {
      const std::string type = m.is_object() ? m.value("type", std::string()) : std::string();
      if (type.ends_with(".Normalize")) c.normalize = true;
      if (type.ends_with(".Pooling")) pooling_path = m.value("path", pooling_path);
    }
  }
  Result<json> pooling = read_json(dir / pooling_path / "config.json", false);
  if (!pooling) return pooling.status();
  if (pooling->is_object()) {
    const bool mean = pooling->value("pooling_mode_mean_tokens", false);
    const bool cls = pooling->value("pooling_mode_cls_token", false);
    for (const char* other : {"pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                              "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken"}) {
      if (pooling->value(other, false)) {
        return Status(ErrorCode::unsupported, pooling_path + "/config.json",
                      fmt::format("{} (mean or cls only)", other));
      }
    }
    if (mean == cls) {
      return Status(ErrorCode::unsupported, pooling_path + "/config.json", "exactly one of mean and cls pooling");
    }
    c.pooling = mean ? Pooling::mean : Pooling::cls;
  }
  c.max_tokens = c.max_positions;
  Result<json> sbert = read_json(dir / "sentence_bert_config.json", false);
  if (!sbert) return sbert.status();
  if (sbert->is_object() && (*sbert)["max_seq_length"].is_number_integer()) {
    c.max_tokens = std::min(c.max_tokens, (*sbert)["max_seq_length"].get<std::int64_t>());
  }
  Result<json> tok = read_json(dir / "tokenizer_config.json", false);
  if (!tok) return tok.status();
  if (tok->is_object()) {
    c.tokenizer.lowercase = tok->value("do_lower_case", true);
    const json& strip = (*tok)["strip_accents"];
    c.tokenizer.strip_accents = strip.is_boolean() ? strip.get<bool>() : c.tokenizer.lowercase;
    c.tokenizer.split_cjk = tok->value("tokenize_chinese_chars", true);
  }
  return c;
}

// Every weight, placed: matrices for the products, 1-row matrices for vectors and tables.
struct BertModel::Weights {
  struct Layer {
    ops::WeightMatrix q, k, v, bq, bk, bv, attn_out, b_attn_out, ln1_w, ln1_b, up, b_up, down, b_down, ln2_w, ln2_b;
  };
  ops::WeightMatrix word, position, token_type, ln_w, ln_b;
  std::vector<Layer> layers;
  std::vector<std::vector<float>> converted;        // F16/BF16 or unaligned tensors as f32
  std::vector<std::shared_ptr<const void>> placed;  // the device's copies
  // Activations and the packed attention geometry.
  ops::Scratch x, q, k, v, att, tmp, up_out;
  std::vector<std::int32_t> ids, positions, types, cu_seqlens;
};

BertModel::~BertModel() = default;

Result<std::unique_ptr<BertModel>> BertModel::load(const std::string& folder, ops::Ops& ops) {
  Result<BertConfig> config = read_bert_folder(folder);
  if (!config) return config.status();
  std::unique_ptr<BertModel> m(new BertModel());
  m->config_ = std::move(*config);
  m->ops_ = &ops;
  const BertConfig& c = m->config_;
  const std::filesystem::path dir(folder);
  Result<tokenizer::WordPieceTokenizer> tok =
      tokenizer::WordPieceTokenizer::load((dir / "vocab.txt").string(), c.tokenizer);
  if (!tok) return tok.status();
  if (static_cast<std::int64_t>(tok->vocab_size()) != c.vocab_size) {
    return Status(ErrorCode::invalid_argument, "vocab.txt",
                  fmt::format("{} tokens, but config.json says vocab_size {}", tok->vocab_size(), c.vocab_size));
  }
  m->tokenizer_ = std::move(*tok);
  Result<std::shared_ptr<const SafetensorsFile>> file = SafetensorsFile::open((dir / "model.safetensors").string());
  if (!file) return file.status();
  m->file_ = std::move(*file);
  m->w_ = std::make_unique<Weights>();
  Weights& w = *m->w_;

  // Names with or without the "bert." prefix BertForX checkpoints carry.
  const std::string prefix = m->file_->find("bert.embeddings.word_embeddings.weight") != nullptr ? "bert." : "";
  const auto take = [&](const std::string& name, std::int64_t rows, std::int64_t cols, bool vector,
                        ops::WeightMatrix& out) -> Status {
    const SafetensorsTensor* t = m->file_->find(prefix + name);
    if (t == nullptr) {
      return Status(ErrorCode::not_found, prefix + name, fmt::format("tensor '{}' is not in the model", prefix + name));
    }
    const bool shape_ok = vector ? (t->shape.size() == 1 && t->shape[0] == cols)
                                 : (t->shape.size() == 2 && t->shape[0] == rows && t->shape[1] == cols);
    if (!shape_ok) {
      std::string got;
      for (std::int64_t d : t->shape) got += (got.empty() ? "" : ", ") + std::to_string(d);
      return Status(ErrorCode::invalid_argument, t->name,
                    vector ? fmt::format("shape [{}], expected [{}]", got, cols)
                           : fmt::format("shape [{}], expected [{}, {}]", got, rows, cols));
    }
    const float* data = nullptr;
    const bool aligned = reinterpret_cast<std::uintptr_t>(t->data) % alignof(float) == 0;
    if (t->dtype == SafetensorsDType::f32 && aligned) {
      data = reinterpret_cast<const float*>(t->data);
    } else if (t->dtype == SafetensorsDType::f32 || t->dtype == SafetensorsDType::f16 ||
               t->dtype == SafetensorsDType::bf16) {
      std::vector<float>& f = w.converted.emplace_back(static_cast<std::size_t>(t->elements()));
      for (std::int64_t i = 0; i < t->elements(); ++i) {
        std::uint16_t h = 0;
        if (t->dtype == SafetensorsDType::f32) {
          std::memcpy(&f[static_cast<std::size_t>(i)], t->data + i * 4, 4);
          continue;
        }
        std::memcpy(&h, t->data + i * 2, 2);
        f[static_cast<std::size_t>(i)] = t->dtype == SafetensorsDType::f16 ? f16_to_f32(h) : bf16_to_f32(h);
      }
      data = f.data();
    } else {
      return Status(ErrorCode::unsupported, t->name,
                    fmt::format("dtype {} (F32, F16 or BF16)", safetensors_dtype_name(t->dtype)));
    }
    out.type = ops::GgmlType::f32;
    out.data = data;
    out.rows = vector ? 1 : rows;
    out.cols = cols;
    out.row_bytes = static_cast<std::uint64_t>(cols) * sizeof(float);
    return {};
  };

  const std::int64_t H = c.hidden, F = c.intermediate;
  std::vector<ops::WeightMatrix*> matrices, lookups;
  Status s;
  const auto matrix = [&](const std::string& name, std::int64_t rows, std::int64_t cols, ops::WeightMatrix& out) {
    if (s) s = take(name, rows, cols, false, out);
    matrices.push_back(&out);
  };
  const auto lookup = [&](const std::string& name, std::int64_t rows, std::int64_t cols, bool vector,
                          ops::WeightMatrix& out) {
    if (s) s = take(name, rows, cols, vector, out);
    lookups.push_back(&out);
  };
  lookup("embeddings.word_embeddings.weight", c.vocab_size, H, false, w.word);
  lookup("embeddings.position_embeddings.weight", c.max_positions, H, false, w.position);
  lookup("embeddings.token_type_embeddings.weight", c.type_vocab_size, H, false, w.token_type);
  lookup("embeddings.LayerNorm.weight", 1, H, true, w.ln_w);
  lookup("embeddings.LayerNorm.bias", 1, H, true, w.ln_b);
  w.layers.resize(static_cast<std::size_t>(c.layers));
  for (std::size_t l = 0; l < w.layers.size(); ++l) {
    Weights::Layer& L = w.layers[l];
    const std::string p = fmt::format("encoder.layer.{}.", l);
    matrix(p + "attention.self.query.weight", H, H, L.q);
    matrix(p + "attention.self.key.weight", H, H, L.k);
    matrix(p + "attention.self.value.weight", H, H, L.v);
    matrix(p + "attention.output.dense.weight", H, H, L.attn_out);
    matrix(p + "intermediate.dense.weight", F, H, L.up);
    matrix(p + "output.dense.weight", H, F, L.down);
    lookup(p + "attention.self.query.bias", 1, H, true, L.bq);
    lookup(p + "attention.self.key.bias", 1, H, true, L.bk);
    lookup(p + "attention.self.value.bias", 1, H, true, L.bv);
    lookup(p + "attention.output.dense.bias", 1, H, true, L.b_attn_out);
    lookup(p + "attention.output.LayerNorm.weight", 1, H, true, L.ln1_w);
    lookup(p + "attention.output.LayerNorm.bias", 1, H, true, L.ln1_b);
    lookup(p + "intermediate.dense.bias", 1, F, true, L.b_up);
    lookup(p + "output.dense.bias", 1, H, true, L.b_down);
    lookup(p + "output.LayerNorm.weight", 1, H, true, L.ln2_w);
    lookup(p + "output.LayerNorm.bias", 1, H, true, L.ln2_b);
  }
  if (!s) return s;
  for (auto [list, use] :
       {std::pair{&matrices, ops::Ops::WeightUse::matmul}, {&lookups, ops::Ops::WeightUse::lookup}}) {
    Result<std::shared_ptr<const void>> placed = ops.place_weights(*list, use, {});
    if (!placed) return placed.status();
    w.placed.push_back(std::move(*placed));
  }
  return m;
}

Status BertModel::embed(std::span<const std::vector<std::int32_t>> sequences, Dispatcher& dispatcher,
                        std::vector<float>& out) {
  const BertConfig& c = config_;
  Weights& w = *w_;
  ops::Ops& ops = *ops_;
  out.clear();
  if (sequences.empty()) return {};
  w.ids.clear();
  w.positions.clear();
  w.cu_seqlens.assign(1, 0);
  for (std::size_t b = 0; b < sequences.size(); ++b) {
    const std::vector<std::int32_t>& seq = sequences[b];
    if (seq.empty() || static_cast<std::int64_t>(seq.size()) > c.max_tokens) {
      return Status(ErrorCode::invalid_argument, fmt::format("input[{}]", b),
                    fmt::format("{} tokens; this encoder takes 1 to {}", seq.size(), c.max_tokens));
    }
    for (std::size_t t = 0; t < seq.size(); ++t) {
      if (seq[t] < 0 || seq[t] >= c.vocab_size) {
        return Status(ErrorCode::invalid_argument, fmt::format("input[{}]", b),
                      fmt::format("token id {} at {} is outside the vocabulary of {}", seq[t], t, c.vocab_size));
      }
      w.ids.push_back(seq[t]);
      w.positions.push_back(static_cast<std::int32_t>(t));
    }
    w.cu_seqlens.push_back(static_cast<std::int32_t>(w.ids.size()));
  }
  const auto total = static_cast<std::int64_t>(w.ids.size());
  const std::int64_t H = c.hidden, F = c.intermediate, D = c.hidden / c.heads;
  Status s;
  for (auto [buffer, floats, what] : {std::tuple{&w.x, total * H, "encoder activations"},
                                      {&w.q, total * H, "encoder q"},
                                      {&w.k, total * H, "encoder k"},
                                      {&w.v, total * H, "encoder v"},
                                      {&w.att, total * H, "encoder attention"},
                                      {&w.tmp, total * H, "encoder scratch"},
                                      {&w.up_out, total * F, "encoder ffn"}}) {
    if (!(s = buffer->reserve(ops, floats, what))) return s;
  }
  float *x = w.x.get(), *tmp = w.tmp.get();
  const auto N = static_cast<std::size_t>(total);

  // Embeddings: word + position + token type 0, then layer norm.
  w.types.assign(N, 0);
  if (!(s = ops.embedding(w.word, w.ids, x)) || !(s = ops.embedding(w.position, w.positions, tmp)) ||
      !(s = ops.add(x, tmp, total * H)) || !(s = ops.embedding(w.token_type, w.types, tmp)) ||
      !(s = ops.add(x, tmp, total * H)) ||
      !(s = ops.layernorm(x, static_cast<const float*>(w.ln_w.data), static_cast<const float*>(w.ln_b.data),
                          c.layer_norm_eps, x, total, H))) {
    return s;
  }

  AttentionProblem p;
  p.q_layout = QLayout::packed;
  p.kv_layout = KvLayout::packed;
  p.q = make_contiguous_view(w.q.get(), DType::f32, {total, c.heads, D}, ops.device());
  p.k = make_contiguous_view(w.k.get(), DType::f32, {total, c.heads, D}, ops.device());
  p.v = make_contiguous_view(w.v.get(), DType::f32, {total, c.heads, D}, ops.device());
  p.o = make_contiguous_view(w.att.get(), DType::f32, {total, c.heads, D}, ops.device());
  p.batch = static_cast<int>(sequences.size());
  p.cu_seqlens_q = w.cu_seqlens.data();
  p.cu_seqlens_k = w.cu_seqlens.data();
  p.causal = false;  // every token sees its whole sequence

  const auto vec = [](const ops::WeightMatrix& m) { return static_cast<const float*>(m.data); };
  for (const Weights::Layer& L : w.layers) {
    const ops::MatmulJob qkv[] = {{&L.q, w.q.get(), H}, {&L.k, w.k.get(), H}, {&L.v, w.v.get(), H}};
    if (!(s = ops.matmul_group(qkv, x, total, 0)) || !(s = ops.add_bias(w.q.get(), vec(L.bq), total, H)) ||
        !(s = ops.add_bias(w.k.get(), vec(L.bk), total, H)) || !(s = ops.add_bias(w.v.get(), vec(L.bv), total, H)) ||
        !(s = ops.finish()) || !(s = dispatcher.run(p))) {
      return s;
    }
    // x = LN(x + att Wo + bo); x = LN(x + gelu(x Wi + bi) Wd + bd)
    if (!(s = ops.matmul(L.attn_out, w.att.get(), total, tmp, 0)) ||
        !(s = ops.add_bias(tmp, vec(L.b_attn_out), total, H)) || !(s = ops.add(x, tmp, total * H)) ||
        !(s = ops.layernorm(x, vec(L.ln1_w), vec(L.ln1_b), c.layer_norm_eps, x, total, H)) ||
        !(s = ops.matmul(L.up, x, total, w.up_out.get(), 0)) ||
        !(s = ops.add_bias(w.up_out.get(), vec(L.b_up), total, F)) || !(s = ops.gelu_erf(w.up_out.get(), total * F)) ||
        !(s = ops.matmul(L.down, w.up_out.get(), total, tmp, 0)) || !(s = ops.add_bias(tmp, vec(L.b_down), total, H)) ||
        !(s = ops.add(x, tmp, total * H)) ||
        !(s = ops.layernorm(x, vec(L.ln2_w), vec(L.ln2_b), c.layer_norm_eps, x, total, H))) {
      return s;
    }
  }

  // Pooling on the host: the encoder's last hidden states come down once.
  std::vector<float> hidden(N * static_cast<std::size_t>(H));
  if (!(s = ops.download(hidden.data(), x, hidden.size() * sizeof(float)))) return s;
  out.assign(sequences.size() * static_cast<std::size_t>(H), 0.0f);
  for (std::size_t b = 0; b < sequences.size(); ++b) {
    float* o = out.data() + b * static_cast<std::size_t>(H);
    const auto begin = static_cast<std::size_t>(w.cu_seqlens[b]), end = static_cast<std::size_t>(w.cu_seqlens[b + 1]);
    if (c.pooling == Pooling::cls) {
      std::memcpy(o, hidden.data() + begin * static_cast<std::size_t>(H), static_cast<std::size_t>(H) * sizeof(float));
    } else {
      std::vector<double> sum(static_cast<std::size_t>(H), 0.0);
      for (std::size_t t = begin; t < end; ++t) {
        const float* row = hidden.data() + t * static_cast<std::size_t>(H);
        for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += row[i];
      }
      for (std::size_t i = 0; i < sum.size(); ++i) o[i] = static_cast<float>(sum[i] / double(end - begin));
    }
    if (c.normalize) {
      double norm = 0.0;
      for (std::int64_t i = 0; i < H; ++i) norm += double(o[i]) * o[i];
      // sentence-transformers' Normalize divides by max(norm, 1e-12).
      const auto inv = static_cast<float>(1.0 / std::max(std::sqrt(norm), 1e-12));
      for (std::int64_t i = 0; i < H; ++i) o[i] *= inv;
    }
  }
  return {};
}

}  // namespace kallpa::model
