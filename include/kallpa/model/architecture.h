// The decoder architectures kallpa runs, each as a description of how it differs from the plain
// Llama block, read by the one forward pass (llama_model.cpp) and the one config reader
// (llama_config.cpp). Adding an architecture is adding a row to the table in architecture.cpp,
// not a copy of the forward pass.
//
// The block every architecture shares:
//   x = embedding(tokens) [* sqrt(n_embd)]
//   per layer:  h = rmsnorm(x); q, k, v = h W_q, h W_k, h W_v [+ biases]; [q, k = rmsnorm per head]
//               q, k = rope(q, k); a = attention(q, k, v) [window, softcap, scale]
//               o = a W_o [rmsnorm]; x += o
//               h = rmsnorm(x); f = act(h W_gate) * (h W_up); f = f W_down [rmsnorm]; x += f
//   logits = rmsnorm(x) W_out [softcap]
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "kallpa/ops/ops.h"

namespace kallpa::model {

enum class FfnActivation : std::uint8_t { silu, gelu_tanh };

// Which layers attend through a sliding window when the file names one
// (<arch>.attention.sliding_window).
enum class WindowLayers : std::uint8_t {
  none,      // the architecture has none (a window key in the file is ignored, as llama.cpp does)
  all,       // every layer (Mistral)
  periodic,  // layer il is local when il % window_period < window_period - 1, else global (Gemma)
};

struct Architecture {
  std::string_view name;  // general.architecture
  ops::RopeStyle rope_style = ops::RopeStyle::adjacent;
  bool qkv_bias = false;       // attn_{q,k,v}.bias added after the projections (Qwen2)
  bool qk_norm = false;        // attn_{q,k}_norm: RMSNorm of each head of q and k before RoPE
  bool fused_qkv = false;      // attn_qkv.weight (rows q, then k, then v) may replace attn_{q,k,v}
  bool fused_gate_up = false;  // ffn_up.weight holds gate rows then up rows; no ffn_gate (Phi-3)
  bool post_norms = false;     // post_attention_norm and post_ffw_norm on each block's output
  FfnActivation ffn = FfnActivation::silu;
  bool embedding_scale = false;  // x = embedding * sqrt(n_embd) (Gemma)
  WindowLayers window_layers = WindowLayers::none;
  std::uint32_t window_period = 0;  // periodic: the default pattern (overridden by the file's)
  // RoPE base of the local (sliding-window) layers when the file does not name one
  // (<arch>.rope.freq_base_swa); 0: the same as the global layers.
  float local_rope_base = 0.0f;
  // Gemma scales queries by 1/sqrt(query_pre_attn_scalar), which is the head dim except for the
  // 27B models (n_embd / n_head); the files do not carry it, so it is known by their layer count
  // (llama.cpp does the same). 0: never.
  std::uint32_t scale_by_embd_per_head_at_layers = 0;
};

// The description for a general.architecture value, or nullptr when kallpa has none.
const Architecture* find_architecture(std::string_view name) noexcept;
// "llama, mistral, qwen2, ..." for error messages and docs.
std::string supported_architecture_names();

}  // namespace kallpa::model
