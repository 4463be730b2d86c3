#include "support/synthetic_llama.h"

#include <fmt/format.h>

#include "kallpa/ops/quant.h"

namespace kallpa::model {

namespace {

// GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to U+0100 onwards.
std::string byte_token(int b) {
  const bool printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
  std::uint32_t cp = static_cast<std::uint32_t>(b);
  if (!printable) {
    int n = 0;
    for (int c = 0; c < b; ++c) {
      const bool p = (c >= 0x21 && c <= 0x7e) || (c >= 0xa1 && c <= 0xac) || (c >= 0xae && c <= 0xff);
      if (!p) ++n;
    }
    cp = 256u + static_cast<std::uint32_t>(n);
  }
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else {
    s += static_cast<char>(0xc0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3f));
  }
  return s;
}

std::vector<std::byte> encode(ops::GgmlType type, const std::vector<float>& v) {
  std::vector<std::byte> out(static_cast<std::size_t>(row_size(type, static_cast<std::int64_t>(v.size()))));
  (void)quantize_row(type, v.data(), out.data(), static_cast<std::int64_t>(v.size()));
  return out;
}

}  // namespace

std::vector<float> synthetic_values(std::uint64_t seed, std::size_t n, float scale) {
  std::vector<float> out(n);
  std::uint64_t s = seed * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull;
  for (auto& v : out) {
    s += 0x9e3779b97f4a7c15ull;
    std::uint64_t z = s;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    const double u = static_cast<double>(z >> 11) * (1.0 / 9007199254740992.0);  // [0, 1)
    v = static_cast<float>((2.0 * u - 1.0) * scale);
  }
  return out;
}

SyntheticVocab synthetic_vocab() {
  SyntheticVocab v;
  for (const char* special : {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}) {
    v.tokens.push_back(special);
    v.token_types.push_back(3);
  }
  for (int b = 0; b < 256; ++b) {
    v.tokens.push_back(byte_token(b));
    v.token_types.push_back(1);
  }
  static const char* const kMerges[][2] = {
      {"Ġ", "t"},   {"h", "e"},  {"Ġ", "a"},  {"i", "n"}, {"Ġt", "he"}, {"e", "r"}, {"o", "n"}, {"Ġ", "s"},
      {"r", "e"},   {"Ġ", "w"},  {"a", "t"},  {"Ġ", "o"}, {"e", "n"},   {"Ġ", "c"}, {"i", "s"}, {"Ġ", "b"},
      {"o", "r"},   {"e", "s"},  {"Ġ", "f"},  {"a", "n"}, {"Ġ", "p"},   {"Ġ", "m"}, {"i", "t"}, {"l", "l"},
      {"Ġ", "i"},   {"a", "r"},  {"Ġa", "n"}, {"Ġ", "d"}, {"in", "g"},  {"o", "u"}, {"Ġ", "h"}, {"Ġi", "s"},
      {"Ġan", "d"}, {"Ġo", "f"}, {"Ġt", "o"}, {"Ġ", "Ġ"}, {"ĠĠ", "ĠĠ"}, {"Ċ", "Ċ"}, {"1", "2"}, {"Ġw", "or"},
  };
  for (const auto& m : kMerges) {
    v.merges.push_back(std::string(m[0]) + " " + m[1]);
    v.tokens.push_back(std::string(m[0]) + m[1]);
    v.token_types.push_back(1);
  }
  v.bos_id = 1;
  v.eos_id = 2;
  return v;
}

GgufWriter synthetic_llama_writer(const SyntheticLlamaSpec& s) {
  GgufWriter w;
  const SyntheticVocab vocab = synthetic_vocab();
  const auto n_vocab = static_cast<std::int64_t>(vocab.tokens.size());
  w.add_string("general.architecture", "llama");
  w.add_string("general.name", "kallpa synthetic llama");
  w.add_u32("llama.block_count", s.n_layer);
  w.add_u32("llama.context_length", s.context_length);
  w.add_u32("llama.embedding_length", s.n_embd);
  w.add_u32("llama.feed_forward_length", s.n_ff);
  w.add_u32("llama.attention.head_count", s.n_head);
  w.add_u32("llama.attention.head_count_kv", s.n_head_kv);
  w.add_f32("llama.rope.freq_base", s.rope_freq_base);
  w.add_f32("llama.attention.layer_norm_rms_epsilon", s.rms_norm_eps);
  w.add_u32("llama.rope.dimension_count", s.n_embd / s.n_head);
  w.add_u32("llama.vocab_size", static_cast<std::uint32_t>(n_vocab));
  w.add_u32("general.file_type", 3);
  w.add_string("tokenizer.ggml.model", "gpt2");
  w.add_string("tokenizer.ggml.pre", "smollm");
  w.add_string_array("tokenizer.ggml.tokens", vocab.tokens);
  w.add_array("tokenizer.ggml.token_type", GgufValueType::i32, vocab.token_types);
  w.add_string_array("tokenizer.ggml.merges", vocab.merges);
  w.add_u32("tokenizer.ggml.bos_token_id", vocab.bos_id);
  w.add_u32("tokenizer.ggml.eos_token_id", vocab.eos_id);
  w.add_u32("tokenizer.ggml.padding_token_id", vocab.eos_id);
  w.add_bool("tokenizer.ggml.add_bos_token", false);
  w.add_string("tokenizer.chat_template",
               "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
               "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
               "{% endif %}");
  w.add_u32("general.quantization_version", 2);

  std::uint64_t seed = s.seed * 1000;
  auto matrix = [&](const std::string& name, ops::GgmlType type, std::int64_t cols, std::int64_t rows, float scale) {
    const auto v = synthetic_values(++seed, static_cast<std::size_t>(cols * rows), scale);
    w.add_tensor(name, type, {cols, rows}, encode(type, v));
  };
  auto norm = [&](const std::string& name, std::int64_t n) {
    auto v = synthetic_values(++seed, static_cast<std::size_t>(n), 0.2f);
    for (auto& x : v) x += 1.0f;
    w.add_tensor(name, ops::GgmlType::f32, {n}, encode(ops::GgmlType::f32, v));
  };
  const std::int64_t e = s.n_embd, hd = s.n_embd / s.n_head;
  const std::int64_t q = hd * s.n_head, kv = hd * s.n_head_kv, ff = s.n_ff;
  matrix("token_embd.weight", s.embedding_type, e, n_vocab, 1.0f);
  norm("output_norm.weight", e);
  if (!s.tied_embeddings) matrix("output.weight", s.matrix_type, e, n_vocab, 0.2f);
  for (std::uint32_t l = 0; l < s.n_layer; ++l) {
    const std::string b = fmt::format("blk.{}.", l);
    norm(b + "attn_norm.weight", e);
    matrix(b + "attn_q.weight", s.matrix_type, e, q, 0.2f);
    matrix(b + "attn_k.weight", s.matrix_type, e, kv, 0.2f);
    matrix(b + "attn_v.weight", s.matrix_type, e, kv, 0.2f);
    matrix(b + "attn_output.weight", s.matrix_type, q, e, 0.2f);
    norm(b + "ffn_norm.weight", e);
    matrix(b + "ffn_gate.weight", s.matrix_type, e, ff, 0.2f);
    matrix(b + "ffn_up.weight", s.matrix_type, e, ff, 0.2f);
    matrix(b + "ffn_down.weight", s.matrix_type, ff, e, 0.2f);
  }
  return w;
}

std::vector<std::byte> synthetic_llama(const SyntheticLlamaSpec& spec) { return synthetic_llama_writer(spec).finish(); }

}  // namespace kallpa::model
