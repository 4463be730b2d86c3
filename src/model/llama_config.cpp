#include <cmath>
#include <limits>

#include <fmt/format.h>

#include "kallpa/model/llama.h"
#include "kallpa/ops/quant.h"

namespace kallpa::model {

namespace {

constexpr std::uint64_t kMaxDim = 1u << 20;  // sanity bound on any width/count hyperparameter

Result<std::uint32_t> get_dim(const GgufFile& f, const std::string& key, std::uint64_t max = kMaxDim) {
  auto v = f.get_uint(key);
  if (!v) return v.status();
  if (*v == 0 || *v > max) {
    return Status(ErrorCode::invalid_argument, key,
                  fmt::format("metadata key '{}' is {}, expected 1..{}", key, *v, max));
  }
  return static_cast<std::uint32_t>(*v);
}

Result<std::uint32_t> get_dim_or(const GgufFile& f, const std::string& key, std::uint32_t dflt) {
  if (!f.has(key)) return dflt;
  return get_dim(f, key);
}

Status bad(const std::string& field, std::string message) {
  return {ErrorCode::invalid_argument, field, std::move(message)};
}

}  // namespace

Result<ModelConfig> read_llama_config(const GgufFile& f) {
  ModelConfig c;
  auto arch = f.get_string("general.architecture");
  if (!arch) return arch.status();
  c.architecture = std::string(*arch);
  if (c.architecture != "llama") {
    return Status(ErrorCode::unsupported, "general.architecture",
                  fmt::format("architecture '{}' is not supported (supported: llama)", c.architecture));
  }
  if (auto name = f.get_string("general.name")) c.name = std::string(*name);
  const std::string p = c.architecture + ".";

  auto ctx = get_dim(f, p + "context_length", std::numeric_limits<std::uint32_t>::max());
  if (!ctx) return ctx.status();
  c.context_length = *ctx;
  auto embd = get_dim(f, p + "embedding_length");
  if (!embd) return embd.status();
  c.n_embd = *embd;
  auto layers = get_dim(f, p + "block_count", 4096);
  if (!layers) return layers.status();
  c.n_layer = *layers;
  auto ff = get_dim(f, p + "feed_forward_length");
  if (!ff) return ff.status();
  c.n_ff = *ff;
  auto heads = get_dim(f, p + "attention.head_count", 4096);
  if (!heads) return heads.status();
  c.n_head = *heads;
  auto heads_kv = get_dim_or(f, p + "attention.head_count_kv", c.n_head);
  if (!heads_kv) return heads_kv.status();
  c.n_head_kv = *heads_kv;
  if (c.n_head % c.n_head_kv != 0) {
    return bad(p + "attention.head_count_kv",
               fmt::format("head_count {} is not a multiple of head_count_kv {}", c.n_head, c.n_head_kv));
  }
  if (f.has(p + "attention.key_length")) {
    auto kl = get_dim(f, p + "attention.key_length");
    if (!kl) return kl.status();
    c.head_dim = *kl;
  } else {
    if (c.n_embd % c.n_head != 0) {
      return bad(p + "attention.head_count",
                 fmt::format("embedding_length {} is not a multiple of head_count {}", c.n_embd, c.n_head));
    }
    c.head_dim = c.n_embd / c.n_head;
  }
  auto vl = get_dim_or(f, p + "attention.value_length", c.head_dim);
  if (!vl) return vl.status();
  if (*vl != c.head_dim) {
    return Status(ErrorCode::unsupported, p + "attention.value_length",
                  fmt::format("value_length {} differs from key_length {}", *vl, c.head_dim));
  }
  if (c.head_dim % 2 != 0) {
    return bad(p + "attention.head_count", fmt::format("head dim {} is odd; RoPE needs pairs", c.head_dim));
  }
  auto rot = get_dim_or(f, p + "rope.dimension_count", c.head_dim);
  if (!rot) return rot.status();
  c.n_rot = *rot;
  if (c.n_rot > c.head_dim || c.n_rot % 2 != 0) {
    return bad(p + "rope.dimension_count",
               fmt::format("rope.dimension_count {} must be even and <= the head dim {}", c.n_rot, c.head_dim));
  }
  if (f.has(p + "rope.freq_base")) {
    auto base = f.get_float(p + "rope.freq_base");
    if (!base) return base.status();
    if (!(*base > 0.0) || !std::isfinite(*base)) {
      return bad(p + "rope.freq_base", fmt::format("rope.freq_base {} must be a positive number", *base));
    }
    c.rope_freq_base = static_cast<float>(*base);
  }
  auto eps = f.get_float(p + "attention.layer_norm_rms_epsilon");
  if (!eps) return eps.status();
  if (!(*eps > 0.0) || !(*eps < 1.0)) {
    return bad(p + "attention.layer_norm_rms_epsilon",
               fmt::format("layer_norm_rms_epsilon {} must be in (0, 1)", *eps));
  }
  c.rms_norm_eps = static_cast<float>(*eps);

  auto tokens = f.get_string_array("tokenizer.ggml.tokens");
  if (!tokens) return tokens.status();
  if (tokens->empty() || tokens->size() > std::numeric_limits<std::int32_t>::max()) {
    return bad("tokenizer.ggml.tokens", fmt::format("vocabulary of {} tokens", tokens->size()));
  }
  c.vocab_size = static_cast<std::uint32_t>(tokens->size());
  if (f.has(p + "vocab_size")) {
    auto vs = f.get_uint(p + "vocab_size");
    if (!vs) return vs.status();
    if (*vs != c.vocab_size) {
      return bad(p + "vocab_size",
                 fmt::format("vocab_size {} differs from the {} tokenizer.ggml.tokens", *vs, c.vocab_size));
    }
  }
  c.tied_embeddings = f.find_tensor("output.weight") == nullptr;
  return c;
}

namespace {

enum class Kind { norm, matrix };

Status check_tensor(const GgufFile& f, const std::string& name, Kind kind, std::vector<std::int64_t> shape,
                    const TensorView** out) {
  auto t = f.tensor(name);
  if (!t) return t.status();
  const TensorView& tv = **t;
  bool same = tv.n_dims == static_cast<int>(shape.size());
  for (std::size_t i = 0; same && i < shape.size(); ++i) same = tv.ne[i] == shape[i];
  if (!same) {
    std::string want = "[";
    for (std::size_t i = 0; i < shape.size(); ++i) want += fmt::format("{}{}", i ? ", " : "", shape[i]);
    want += "]";
    return {ErrorCode::invalid_argument, name,
            fmt::format("tensor '{}' has shape {}, expected {} (ggml order) from the hyperparameters", name,
                        tv.shape_string(), want)};
  }
  if (kind == Kind::norm ? tv.type != ops::GgmlType::f32 : !is_compute_supported(tv.type)) {
    return {ErrorCode::unsupported, name,
            fmt::format("tensor '{}' has type {}, which kallpa does not support here (supported: {})", name,
                        ggml_type_name(tv.type),
                        kind == Kind::norm ? std::string_view("F32") : ops::compute_supported_type_names())};
  }
  // A non-finite block scale would turn every product with that block into inf/NaN.
  if (Status scales = ops::check_block_scales(tv.type, tv.data, tv.nbytes); !scales) {
    return {ErrorCode::invalid_argument, name, fmt::format("tensor '{}': {}", name, scales.message())};
  }
  *out = &tv;
  return {};
}

}  // namespace

Result<LlamaWeights> bind_llama_weights(const GgufFile& f, const ModelConfig& c) {
  LlamaWeights w;
  const std::int64_t e = c.n_embd, v = c.vocab_size, q = c.q_dim(), kv = c.kv_dim(), ff = c.n_ff;
  Status st = check_tensor(f, "token_embd.weight", Kind::matrix, {e, v}, &w.token_embd);
  if (!st) return st;
  st = check_tensor(f, "output_norm.weight", Kind::norm, {e}, &w.output_norm);
  if (!st) return st;
  if (f.find_tensor("output.weight") != nullptr) {
    st = check_tensor(f, "output.weight", Kind::matrix, {e, v}, &w.output);
    if (!st) return st;
  } else {
    w.output = w.token_embd;
  }
  w.layers.resize(c.n_layer);
  for (std::uint32_t i = 0; i < c.n_layer; ++i) {
    LlamaLayerWeights& l = w.layers[i];
    const std::string b = fmt::format("blk.{}.", i);
    struct Item {
      const char* suffix;
      Kind kind;
      std::vector<std::int64_t> shape;
      const TensorView** out;
    };
    const Item items[] = {
        {"attn_norm.weight", Kind::norm, {e}, &l.attn_norm},
        {"attn_q.weight", Kind::matrix, {e, q}, &l.attn_q},
        {"attn_k.weight", Kind::matrix, {e, kv}, &l.attn_k},
        {"attn_v.weight", Kind::matrix, {e, kv}, &l.attn_v},
        {"attn_output.weight", Kind::matrix, {q, e}, &l.attn_output},
        {"ffn_norm.weight", Kind::norm, {e}, &l.ffn_norm},
        {"ffn_gate.weight", Kind::matrix, {e, ff}, &l.ffn_gate},
        {"ffn_up.weight", Kind::matrix, {e, ff}, &l.ffn_up},
        {"ffn_down.weight", Kind::matrix, {ff, e}, &l.ffn_down},
    };
    for (const Item& it : items) {
      st = check_tensor(f, b + it.suffix, it.kind, it.shape, it.out);
      if (!st) return st;
    }
  }
  return w;
}

Result<ModelConfig> load_llama_config(const GgufFile& file, LlamaWeights* weights) {
  auto cfg = read_llama_config(file);
  if (!cfg) return cfg;
  auto w = bind_llama_weights(file, *cfg);
  if (!w) return w.status();
  if (weights != nullptr) *weights = std::move(*w);
  return cfg;
}

}  // namespace kallpa::model
