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

Result<float> get_nonnegative(const GgufFile& f, const std::string& key, float dflt) {
  if (!f.has(key)) return dflt;
  auto v = f.get_float(key);
  if (!v) return v.status();
  if (!(*v >= 0.0) || !std::isfinite(*v)) return bad(key, fmt::format("'{}' is {}, expected a number >= 0", key, *v));
  return static_cast<float>(*v);
}

// Which layers are local: the file's attention.sliding_window_pattern (a period, or one bool per
// layer) when it has one, else the architecture's default period.
Status read_window_layers(const GgufFile& f, const std::string& p, ModelConfig& c) {
  c.local_layers.assign(c.n_layer, false);
  if (c.sliding_window == 0 || c.arch.window_layers == WindowLayers::none) return {};
  if (c.arch.window_layers == WindowLayers::all) {
    c.local_layers.assign(c.n_layer, true);
    return {};
  }
  const std::string key = p + "attention.sliding_window_pattern";
  std::uint64_t period = c.arch.window_period;
  if (auto v = f.get(key); v) {
    const GgufValue& value = **v;
    if (value.is_array()) {
      if (value.element_type() != GgufValueType::boolean || value.size() != c.n_layer) {
        return bad(key, fmt::format("'{}' is {}, expected a period or {} bools (one per layer)", key, value.to_string(),
                                    c.n_layer));
      }
      for (std::uint32_t il = 0; il < c.n_layer; ++il) c.local_layers[il] = value.raw()[il] != std::byte{0};
      return {};
    }
    auto n = f.get_uint(key);
    if (!n) return n.status();
    period = *n;
  }
  for (std::uint32_t il = 0; il < c.n_layer; ++il) c.local_layers[il] = period == 0 || il % period < period - 1;
  return {};
}

// The keys an architecture's description makes the forward pass read beyond Llama's.
Status read_architecture_keys(const GgufFile& f, const std::string& p, ModelConfig& c) {
  const std::string scaling = p + "rope.scaling.type";
  if (f.has(scaling)) {
    auto type = f.get_string(scaling);
    if (!type) return type.status();
    if (*type == "linear") {
      auto factor = f.get_float(p + "rope.scaling.factor");
      if (!factor) return factor.status();
      if (!(*factor > 0.0) || !std::isfinite(*factor)) {
        return bad(p + "rope.scaling.factor", fmt::format("rope.scaling.factor {} must be positive", *factor));
      }
      c.rope_freq_scale = static_cast<float>(1.0 / *factor);
    } else if (*type != "none") {
      return Status(ErrorCode::unsupported, scaling,
                    fmt::format("RoPE scaling '{}' is not supported (supported: none, linear)", *type));
    }
  }
  c.rope_freq_base_local = c.arch.local_rope_base > 0.0f ? c.arch.local_rope_base : c.rope_freq_base;
  if (f.has(p + "rope.freq_base_swa")) {
    auto base = f.get_float(p + "rope.freq_base_swa");
    if (!base) return base.status();
    if (!(*base > 0.0) || !std::isfinite(*base)) {
      return bad(p + "rope.freq_base_swa", fmt::format("rope.freq_base_swa {} must be a positive number", *base));
    }
    c.rope_freq_base_local = static_cast<float>(*base);
  }
  if (c.arch.window_layers != WindowLayers::none && f.has(p + "attention.sliding_window")) {
    auto window = get_dim(f, p + "attention.sliding_window", std::numeric_limits<std::uint32_t>::max());
    if (!window) return window.status();
    c.sliding_window = *window;
  }
  if (Status st = read_window_layers(f, p, c); !st) return st;

  std::uint32_t pre_attn_scalar = c.head_dim;
  if (c.arch.scale_by_embd_per_head_at_layers != 0 && c.n_layer == c.arch.scale_by_embd_per_head_at_layers) {
    pre_attn_scalar = c.n_embd / c.n_head;
  }
  c.attention_scale = 1.0f / std::sqrt(static_cast<float>(pre_attn_scalar));
  auto attn_cap = get_nonnegative(f, p + "attn_logit_softcapping", 0.0f);
  if (!attn_cap) return attn_cap.status();
  c.attn_logit_softcap = *attn_cap;
  auto final_cap = get_nonnegative(f, p + "final_logit_softcapping", 0.0f);
  if (!final_cap) return final_cap.status();
  c.final_logit_softcap = *final_cap;
  c.embedding_scale = c.arch.embedding_scale ? std::sqrt(static_cast<float>(c.n_embd)) : 1.0f;
  return {};
}

}  // namespace

Result<ModelConfig> read_llama_config(const GgufFile& f) {
  ModelConfig c;
  auto arch = f.get_string("general.architecture");
  if (!arch) return arch.status();
  c.architecture = std::string(*arch);
  const Architecture* description = find_architecture(c.architecture);
  if (description == nullptr) {
    return Status(ErrorCode::unsupported, "general.architecture",
                  fmt::format("architecture '{}' is not supported (supported: {})", c.architecture,
                              supported_architecture_names()));
  }
  c.arch = *description;
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
  if (Status st = read_architecture_keys(f, p, c); !st) return st;
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
  const Architecture& a = c.arch;
  const std::int64_t e = c.n_embd, v = c.vocab_size, q = c.q_dim(), kv = c.kv_dim(), ff = c.n_ff, hd = c.head_dim;
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
  if (f.find_tensor("rope_freqs.weight") != nullptr) {
    st = check_tensor(f, "rope_freqs.weight", Kind::norm, {c.n_rot / 2}, &w.rope_freqs);
    if (!st) return st;
    const auto* factors = static_cast<const float*>(w.rope_freqs->data);
    for (std::int64_t i = 0; i < w.rope_freqs->nelements(); ++i) {
      if (!(factors[i] > 0.0f) || !std::isfinite(factors[i])) {
        return Status(
            ErrorCode::invalid_argument, "rope_freqs.weight",
            fmt::format("tensor 'rope_freqs.weight': factor {} is {}, expected a positive number", i, factors[i]));
      }
    }
  }
  // Per-frequency RoPE factors that depend on the context length (Phi-3's LongRoPE) need a
  // choice kallpa does not make; refusing beats answering with the wrong rotation.
  for (const char* name : {"rope_factors_long.weight", "rope_factors_short.weight"}) {
    if (f.find_tensor(name) != nullptr) {
      return Status(ErrorCode::unsupported, name,
                    fmt::format("tensor '{}': context-dependent RoPE factors (LongRoPE) are not supported", name));
    }
  }
  const bool fused_qkv = a.fused_qkv && f.find_tensor("blk.0.attn_qkv.weight") != nullptr;
  w.layers.resize(c.n_layer);
  for (std::uint32_t i = 0; i < c.n_layer; ++i) {
    LlamaLayerWeights& l = w.layers[i];
    const std::string b = fmt::format("blk.{}.", i);
    struct Item {
      const char* suffix;
      Kind kind;
      std::vector<std::int64_t> shape;
      const TensorView** out;
      bool wanted;
    };
    const Item items[] = {
        {"attn_norm.weight", Kind::norm, {e}, &l.attn_norm, true},
        {"attn_qkv.weight", Kind::matrix, {e, q + 2 * kv}, &l.attn_qkv, fused_qkv},
        {"attn_q.weight", Kind::matrix, {e, q}, &l.attn_q, !fused_qkv},
        {"attn_k.weight", Kind::matrix, {e, kv}, &l.attn_k, !fused_qkv},
        {"attn_v.weight", Kind::matrix, {e, kv}, &l.attn_v, !fused_qkv},
        {"attn_q.bias", Kind::norm, {q}, &l.attn_q_bias, a.qkv_bias},
        {"attn_k.bias", Kind::norm, {kv}, &l.attn_k_bias, a.qkv_bias},
        {"attn_v.bias", Kind::norm, {kv}, &l.attn_v_bias, a.qkv_bias},
        {"attn_q_norm.weight", Kind::norm, {hd}, &l.attn_q_norm, a.qk_norm},
        {"attn_k_norm.weight", Kind::norm, {hd}, &l.attn_k_norm, a.qk_norm},
        {"attn_output.weight", Kind::matrix, {q, e}, &l.attn_output, true},
        {"post_attention_norm.weight", Kind::norm, {e}, &l.post_attention_norm, a.post_norms},
        {"ffn_norm.weight", Kind::norm, {e}, &l.ffn_norm, true},
        {"ffn_gate.weight", Kind::matrix, {e, ff}, &l.ffn_gate, !a.fused_gate_up},
        {"ffn_up.weight", Kind::matrix, {e, a.fused_gate_up ? 2 * ff : ff}, &l.ffn_up, true},
        {"ffn_down.weight", Kind::matrix, {ff, e}, &l.ffn_down, true},
        {"post_ffw_norm.weight", Kind::norm, {e}, &l.post_ffw_norm, a.post_norms},
    };
    for (const Item& it : items) {
      if (!it.wanted) continue;
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
