// Llama-family hyperparameters and weights from a GGUF file (general.architecture = "llama").
//
//   auto file = GgufFile::open(path);
//   auto cfg = read_llama_config(**file);        // keys present, typed, consistent
//   auto w = bind_llama_weights(**file, *cfg);   // every tensor present, right shape, usable type
//
// Errors name the key or tensor in Status::field:
//   not_found         a required key or tensor is missing (field = the key / tensor name)
//   invalid_argument  a key has the wrong type or an impossible value, or a tensor the wrong shape
//   unsupported       an architecture other than llama, or a tensor type the kernels lack
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kallpa/model/gguf.h"
#include "kallpa/status.h"

namespace kallpa::model {

struct ModelConfig {
  std::string architecture;  // "llama"
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

  std::uint32_t q_dim() const noexcept { return n_head * head_dim; }
  std::uint32_t kv_dim() const noexcept { return n_head_kv * head_dim; }
};

// Reads and checks the hyperparameters (keys only; tensors are checked by bind_llama_weights).
Result<ModelConfig> read_llama_config(const GgufFile& file);

struct LlamaLayerWeights {
  const TensorView* attn_norm = nullptr;    // [n_embd], F32
  const TensorView* attn_q = nullptr;       // [n_embd, q_dim]   (ggml order: ne0 = input dim)
  const TensorView* attn_k = nullptr;       // [n_embd, kv_dim]
  const TensorView* attn_v = nullptr;       // [n_embd, kv_dim]
  const TensorView* attn_output = nullptr;  // [q_dim, n_embd]
  const TensorView* ffn_norm = nullptr;     // [n_embd], F32
  const TensorView* ffn_gate = nullptr;     // [n_embd, n_ff]
  const TensorView* ffn_up = nullptr;       // [n_embd, n_ff]
  const TensorView* ffn_down = nullptr;     // [n_ff, n_embd]
};

struct LlamaWeights {
  const TensorView* token_embd = nullptr;   // [n_embd, vocab]
  const TensorView* output_norm = nullptr;  // [n_embd], F32
  const TensorView* output = nullptr;       // [n_embd, vocab]; == token_embd when tied
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
