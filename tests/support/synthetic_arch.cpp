#include "support/synthetic_arch.h"

#include <cmath>
#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "kallpa/model/architecture.h"
#include "support/synthetic_llama.h"

namespace kallpa::model {

namespace {

std::vector<std::byte> bytes(const std::vector<float>& v) {
  std::vector<std::byte> out(v.size() * sizeof(float));
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

}  // namespace

GgufWriter synthetic_arch_writer(const SyntheticArchSpec& s) {
  Architecture a;
  if (const Architecture* found = find_architecture(s.architecture); found != nullptr) a = *found;
  GgufWriter w;
  const std::string p = s.architecture + ".";
  w.add_string("general.architecture", s.architecture);
  w.add_u32(p + "context_length", 256);
  w.add_u32(p + "embedding_length", s.n_embd);
  w.add_u32(p + "block_count", s.n_layer);
  w.add_u32(p + "feed_forward_length", s.n_ff);
  w.add_u32(p + "attention.head_count", s.n_head);
  w.add_u32(p + "attention.head_count_kv", s.n_head_kv);
  w.add_u32(p + "attention.key_length", s.head_dim);
  w.add_u32(p + "attention.value_length", s.head_dim);
  w.add_f32(p + "attention.layer_norm_rms_epsilon", 1e-6f);
  w.add_f32(p + "rope.freq_base", 1e6f);
  if (s.sliding_window > 0) w.add_u32(p + "attention.sliding_window", s.sliding_window);
  std::vector<std::string> tokens;
  for (std::uint32_t i = 0; i < s.vocab; ++i) tokens.push_back(fmt::format("<t{}>", i));
  w.add_string_array("tokenizer.ggml.tokens", tokens);

  std::uint64_t seed = s.seed;
  auto matrix = [&](const std::string& name, std::int64_t rows, std::int64_t cols, float scale) {
    w.add_tensor(name, ops::GgmlType::f32, {cols, rows},
                 bytes(synthetic_values(seed++, static_cast<std::size_t>(rows * cols), scale)));
  };
  auto vector = [&](const std::string& name, std::int64_t n, float center) {
    std::vector<float> v = synthetic_values(seed++, static_cast<std::size_t>(n), 0.2f);
    for (float& x : v) x += center;
    w.add_tensor(name, ops::GgmlType::f32, {n}, bytes(v));
  };
  const std::int64_t e = s.n_embd, q = std::int64_t{s.n_head} * s.head_dim, kv = std::int64_t{s.n_head_kv} * s.head_dim,
                     ff = s.n_ff;
  const float in_scale = 1.0f / std::sqrt(static_cast<float>(e));
  matrix("token_embd.weight", s.vocab, e, 1.0f);
  vector("output_norm.weight", e, 1.0f);
  for (std::uint32_t il = 0; il < s.n_layer; ++il) {
    const std::string b = fmt::format("blk.{}.", il);
    vector(b + "attn_norm.weight", e, 1.0f);
    if (a.fused_qkv && s.fused) {
      matrix(b + "attn_qkv.weight", q + 2 * kv, e, in_scale);
    } else {
      matrix(b + "attn_q.weight", q, e, in_scale);
      matrix(b + "attn_k.weight", kv, e, in_scale);
      matrix(b + "attn_v.weight", kv, e, in_scale);
    }
    if (a.qkv_bias) {
      vector(b + "attn_q.bias", q, 0.0f);
      vector(b + "attn_k.bias", kv, 0.0f);
      vector(b + "attn_v.bias", kv, 0.0f);
    }
    if (a.qk_norm) {
      vector(b + "attn_q_norm.weight", s.head_dim, 1.0f);
      vector(b + "attn_k_norm.weight", s.head_dim, 1.0f);
    }
    matrix(b + "attn_output.weight", e, q, 1.0f / std::sqrt(static_cast<float>(q)));
    if (a.post_norms) {
      vector(b + "post_attention_norm.weight", e, 1.0f);
      vector(b + "post_ffw_norm.weight", e, 1.0f);
    }
    vector(b + "ffn_norm.weight", e, 1.0f);
    if (a.fused_gate_up && s.fused) {
      matrix(b + "ffn_up.weight", 2 * ff, e, in_scale);
    } else {
      matrix(b + "ffn_gate.weight", ff, e, in_scale);
      matrix(b + "ffn_up.weight", ff, e, in_scale);
    }
    matrix(b + "ffn_down.weight", e, ff, 1.0f / std::sqrt(static_cast<float>(ff)));
  }
  return w;
}

}  // namespace kallpa::model
