// Decoder hyperparameters and weights from a GGUF file, for every architecture with a description
// in architecture.h (llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3).
//
//   auto file = GgufFile::open(path);
//   auto cfg = read_llama_config(**file);        // keys present, typed, consistent
//   auto w = bind_llama_weights(**file, *cfg);   // every tensor present, right shape, usable type
//
// Errors name the key or tensor in Status::field:
//   not_found         a required key or tensor is missing (field = the key / tensor name)
//   invalid_argument  a key has the wrong type or an impossible value, or a tensor the wrong shape
//   unsupported       an architecture without a description (the message names it and the
//                     supported ones), a RoPE scaling kallpa lacks, or a tensor type the kernels lack
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kallpa/model/architecture.h"
#include "kallpa/model/gguf.h"
#include "kallpa/status.h"

namespace kallpa::model {

struct ModelConfig {
  std::string architecture;  // general.architecture: "llama", "gemma3", ...
  Architecture arch;         // its description
  std::string name;          // general.name, "" when absent
  std::uint32_t context_length = 0;
  std::uint32_t n_embd = 0;      // embedding_length
  std::uint32_t n_layer = 0;     // block_count
  std::uint32_t n_ff = 0;        // feed_forward_length
  std::uint32_t n_head = 0;      // attention.head_count
  std::uint32_t n_head_kv = 0;   // attention.head_count_kv (default n_head)
  std::uint32_t head_dim = 0;    // attention.key_length, default n_embd / n_head
  std::uint32_t n_rot = 0;       // rope.dimension_count, default head_dim
  std::uint32_t vocab_size = 0;  // length of tokenizer.ggml.tokens
  float rope_freq_base = 10000.0f;
  float rms_norm_eps = 1e-5f;    // attention.layer_norm_rms_epsilon
  bool tied_embeddings = false;  // no output.weight: the output projection is token_embd.weight

  // What the description and the file's keys make of each layer and of the attention.
  float rope_freq_scale = 1.0f;      // 1 / rope.scaling.factor for linear scaling (global layers)
  float rope_freq_base_local = 0;    // RoPE base of the sliding-window layers
  std::uint32_t sliding_window = 0;  // attention.sliding_window: keys a local layer sees (0: none)
  std::vector<bool> local_layers;    // n_layer flags: the layer attends through the window
  float attention_scale = 0;         // query scale, 1/sqrt(head_dim) unless the architecture says
  float attn_logit_softcap = 0;      // attn_logit_softcapping (0: off)
  float final_logit_softcap = 0;     // final_logit_softcapping (0: off)
  float embedding_scale = 1.0f;      // sqrt(n_embd) when the architecture scales embeddings

  std::uint32_t q_dim() const noexcept { return n_head * head_dim; }
  std::uint32_t kv_dim() const noexcept { return n_head_kv * head_dim; }
  bool is_local(std::uint32_t layer) const noexcept { return layer < local_layers.size() && local_layers[layer]; }
  float rope_base(std::uint32_t layer) const noexcept {
    return is_local(layer) ? rope_freq_base_local : rope_freq_base;
  }
  float rope_scale(std::uint32_t layer) const noexcept { return is_local(layer) ? 1.0f : rope_freq_scale; }
  // The window_left of the attention contract for a layer: -1 (unbounded) or sliding_window - 1,
  // as a key at distance sliding_window or more from the query is hidden.
  std::int64_t window_left(std::uint32_t layer) const noexcept {
    return is_local(layer) ? std::int64_t{sliding_window} - 1 : -1;
  }
};

// Reads and checks the hyperparameters (keys only; tensors are checked by bind_llama_weights).
Result<ModelConfig> read_llama_config(const GgufFile& file);

// Optional tensors are nullptr when the architecture or the file has none.
struct LlamaLayerWeights {
  const TensorView* attn_norm = nullptr;  // [n_embd], F32
  const TensorView* attn_q = nullptr;     // [n_embd, q_dim]   (ggml order: ne0 = input dim)
  const TensorView* attn_k = nullptr;     // [n_embd, kv_dim]
  const TensorView* attn_v = nullptr;     // [n_embd, kv_dim]
  // fused_qkv files: [n_embd, q_dim + 2 kv_dim] in place of attn_q/k/v (which are then nullptr)
  const TensorView* attn_qkv = nullptr;
  const TensorView* attn_q_bias = nullptr;          // qkv_bias: [q_dim], F32
  const TensorView* attn_k_bias = nullptr;          // [kv_dim], F32
  const TensorView* attn_v_bias = nullptr;          // [kv_dim], F32
  const TensorView* attn_q_norm = nullptr;          // qk_norm: [head_dim], F32
  const TensorView* attn_k_norm = nullptr;          // [head_dim], F32
  const TensorView* attn_output = nullptr;          // [q_dim, n_embd]
  const TensorView* post_attention_norm = nullptr;  // post_norms: [n_embd], F32
  const TensorView* ffn_norm = nullptr;             // [n_embd], F32
  const TensorView* ffn_gate = nullptr;             // [n_embd, n_ff]; nullptr when fused_gate_up
  const TensorView* ffn_up = nullptr;               // [n_embd, n_ff]; fused_gate_up: [n_embd, 2 n_ff]
  const TensorView* ffn_down = nullptr;             // [n_ff, n_embd]
  const TensorView* post_ffw_norm = nullptr;        // post_norms: [n_embd], F32
};

struct LlamaWeights {
  const TensorView* token_embd = nullptr;   // [n_embd, vocab]
  const TensorView* output_norm = nullptr;  // [n_embd], F32
  const TensorView* output = nullptr;       // [n_embd, vocab]; == token_embd when tied
  const TensorView* rope_freqs = nullptr;   // optional [n_rot / 2] F32 frequency divisors (Llama 3.1)
  std::vector<LlamaLayerWeights> layers;
};

// Checks that every expected tensor is present with the shape the config implies and a type the
// kernels support (norm weights must be F32; matrices any type ops::is_compute_supported accepts)
// with finite block scales (ops::check_block_scales), and returns views of them. The views live as
// long as `file`.
Result<LlamaWeights> bind_llama_weights(const GgufFile& file, const ModelConfig& config);

// Both of the above; the usual entry point.
Result<ModelConfig> load_llama_config(const GgufFile& file, LlamaWeights* weights = nullptr);

}  // namespace kallpa::model
