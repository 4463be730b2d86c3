// Tiny synthetic Llama models as GGUF images, for tests and benchmarks (no Python needed).
// Deterministic: the same spec gives the same bytes. The vocabulary is GPT-2 byte-level, laid out
// like SmolLM2's: ids 0..2 are the control tokens <|endoftext|>, <|im_start|> (bos), <|im_end|>
// (eos); then the 256 byte tokens (GPT-2's bytes_to_unicode spelling, in byte order); then one token
// per merge (40 merges: "Ġ t", "h e", "Ġt he", ...): 299 tokens. tokenizer.ggml.model = "gpt2",
// tokenizer.ggml.pre = "smollm". tools/gguf/make_fixtures.py writes the same vocabulary.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kallpa/ops/ggml_type.h"
#include "support/gguf_writer.h"

namespace kallpa::model {

struct SyntheticLlamaSpec {
  std::uint32_t n_layer = 2;
  std::uint32_t n_embd = 64;
  std::uint32_t n_head = 4;
  std::uint32_t n_head_kv = 2;
  std::uint32_t n_ff = 128;
  std::uint32_t context_length = 256;
  float rope_freq_base = 10000.0f;
  float rms_norm_eps = 1e-5f;
  ops::GgmlType matrix_type = ops::GgmlType::q4_1;     // attn_* and ffn_* weights
  ops::GgmlType embedding_type = ops::GgmlType::q8_0;  // token_embd.weight
  bool tied_embeddings = true;                         // false: also write output.weight (same type as matrices)
  std::uint64_t seed = 1;
};

struct SyntheticVocab {
  std::vector<std::string> tokens;
  std::vector<std::int32_t> token_types;  // 1 normal, 3 control
  std::vector<std::string> merges;        // "a b"
  std::uint32_t bos_id = 0, eos_id = 0;
};
SyntheticVocab synthetic_vocab();

// A writer holding the whole model; tests may add keys or tensors before finish().
GgufWriter synthetic_llama_writer(const SyntheticLlamaSpec& spec = {});
std::vector<std::byte> synthetic_llama(const SyntheticLlamaSpec& spec = {});

// Deterministic pseudo-random floats in [-scale, scale] (splitmix64).
std::vector<float> synthetic_values(std::uint64_t seed, std::size_t n, float scale);

}  // namespace kallpa::model
