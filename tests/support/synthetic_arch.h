// Tiny synthetic decoders of every architecture kallpa runs (kallpa/model/architecture.h), as
// GGUF writers, for tests of the config reader, the weight binder and the forward pass that need
// no Python. Every matrix is F32 with deterministic values; the tensors written are those the
// architecture's description names (fused projections when `fused`). The vocabulary is `vocab`
// placeholder tokens ("<t0>", ...), without a tokenizer model: these files run through the model
// alone, not the engine.
#pragma once

#include <cstdint>
#include <string>

#include "support/gguf_writer.h"

namespace kallpa::model {

struct SyntheticArchSpec {
  std::string architecture = "gemma3";
  std::uint32_t n_layer = 2;
  std::uint32_t n_embd = 64;
  std::uint32_t n_head = 4;
  std::uint32_t n_head_kv = 2;
  std::uint32_t head_dim = 16;
  std::uint32_t n_ff = 96;
  std::uint32_t vocab = 64;
  std::uint32_t sliding_window = 0;  // written as <arch>.attention.sliding_window when > 0
  bool fused = true;                 // phi3: attn_qkv and the gate-up ffn_up (else split tensors)
  std::uint64_t seed = 7;
};

GgufWriter synthetic_arch_writer(const SyntheticArchSpec& spec);

}  // namespace kallpa::model
