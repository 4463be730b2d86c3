#include "kallpa/model/architecture.h"

#include <array>

namespace kallpa::model {

namespace {

using ops::RopeStyle;

// The facts follow llama.cpp's reading of each architecture's GGUF files, so that both give the
// same logits for the same file.
constexpr std::array kArchitectures = {
    // Llama 2/3, SmolLM, TinyLlama; llama.cpp also writes Mistral files as "llama", and a window
    // key there means Mistral's sliding window on every layer.
    Architecture{.name = "llama", .window_layers = WindowLayers::all},
    Architecture{.name = "mistral", .window_layers = WindowLayers::all},
    Architecture{.name = "qwen2", .rope_style = RopeStyle::halves, .qkv_bias = true},
    Architecture{.name = "qwen3", .rope_style = RopeStyle::halves, .qk_norm = true},
    // Phi-3's converted files name a sliding window that llama.cpp ignores (its conversion does not
    // carry the layer pattern), and so does kallpa.
    Architecture{.name = "phi3", .rope_style = RopeStyle::halves, .fused_qkv = true, .fused_gate_up = true},
    Architecture{.name = "gemma2",
                 .rope_style = RopeStyle::halves,
                 .post_norms = true,
                 .ffn = FfnActivation::gelu_tanh,
                 .embedding_scale = true,
                 .window_layers = WindowLayers::periodic,
                 .window_period = 2,
                 .scale_by_embd_per_head_at_layers = 46},
    Architecture{.name = "gemma3",
                 .rope_style = RopeStyle::halves,
                 .qk_norm = true,
                 .post_norms = true,
                 .ffn = FfnActivation::gelu_tanh,
                 .embedding_scale = true,
                 .window_layers = WindowLayers::periodic,
                 .window_period = 6,
                 .local_rope_base = 10000.0f,
                 .scale_by_embd_per_head_at_layers = 62},
};

}  // namespace

const Architecture* find_architecture(std::string_view name) noexcept {
  for (const Architecture& a : kArchitectures) {
    if (a.name == name) return &a;
  }
  return nullptr;
}

std::string supported_architecture_names() {
  std::string names;
  for (const Architecture& a : kArchitectures) {
    if (!names.empty()) names += ", ";
    names += a.name;
  }
  return names;
}

}  // namespace kallpa::model
