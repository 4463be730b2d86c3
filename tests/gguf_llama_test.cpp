// Llama hyperparameters and tensor binding: the synthetic fixture, each kind of bad model (typed
// error naming the key or tensor), and the real SmolLM2 file when it is present.
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kallpa/model/gguf.h"
#include "kallpa/model/llama.h"
#include "kallpa/ops/quant.h"
#include "support/model_files.h"
#include "support/synthetic_llama.h"

namespace {

using kallpa::ErrorCode;
using kallpa::Status;
using namespace kallpa::model;
using namespace kallpa::ops;

Status load_status(const GgufWriter& w) {
  auto f = GgufFile::from_bytes(w.finish());
  if (!f) return f.status();
  LlamaWeights weights;
  return load_llama_config(**f, &weights).status();
}

void expect_error(const GgufWriter& w, ErrorCode code, const std::string& field, const std::string& in_message = "") {
  const Status st = load_status(w);
  ASSERT_FALSE(st.is_ok()) << "expected an error naming " << field;
  EXPECT_EQ(st.code(), code) << st.to_string();
  EXPECT_EQ(st.field(), field) << st.to_string();
  if (!in_message.empty()) {
    EXPECT_NE(st.message().find(in_message), std::string::npos) << st.to_string();
  }
}

// The hyperparameters that differ between the models checked here (both are tied-embedding llamas
// with rms_norm_eps 1e-5).
struct Hparams {
  std::uint32_t n_layer, n_embd, n_ff, n_head, n_head_kv, head_dim, n_rot, vocab_size, context_length;
  float rope_freq_base;
};

void expect_hparams(const ModelConfig& cfg, const Hparams& want) {
  EXPECT_EQ(cfg.architecture, "llama");
  EXPECT_EQ(cfg.n_layer, want.n_layer);
  EXPECT_EQ(cfg.n_embd, want.n_embd);
  EXPECT_EQ(cfg.n_ff, want.n_ff);
  EXPECT_EQ(cfg.n_head, want.n_head);
  EXPECT_EQ(cfg.n_head_kv, want.n_head_kv);
  EXPECT_EQ(cfg.head_dim, want.head_dim);
  EXPECT_EQ(cfg.n_rot, want.n_rot);
  EXPECT_EQ(cfg.vocab_size, want.vocab_size);
  EXPECT_EQ(cfg.context_length, want.context_length);
  EXPECT_FLOAT_EQ(cfg.rope_freq_base, want.rope_freq_base);
  EXPECT_FLOAT_EQ(cfg.rms_norm_eps, 1e-5f);
  EXPECT_TRUE(cfg.tied_embeddings);
}

// The synthetic model with `key` removed and added again by `add` (another type or value).
template <typename F>
GgufWriter with_kv(std::string_view key, F&& add) {
  GgufWriter w = synthetic_llama_writer();
  EXPECT_TRUE(w.remove_kv(key)) << key;
  add(w, key);
  return w;
}

// The synthetic model with tensor `name` replaced by `bytes` zero bytes of ggml type `type` and
// shape `ne`: loading it fails with `code`, naming the tensor, with `in_message` in the message.
void expect_tensor_error(std::string_view name, std::uint32_t type, std::vector<std::int64_t> ne, std::size_t bytes,
                         ErrorCode code, const std::string& in_message) {
  GgufWriter w = synthetic_llama_writer();
  ASSERT_TRUE(w.replace_tensor(name, type, std::move(ne), std::vector<std::byte>(bytes)));
  expect_error(w, code, std::string(name), in_message);
}

TEST(GgufLlama, SyntheticModelLoads) {
  auto f = GgufFile::from_bytes(synthetic_llama());
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  LlamaWeights w;
  auto cfg = load_llama_config(**f, &w);
  ASSERT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  expect_hparams(*cfg, {.n_layer = 2,
                        .n_embd = 64,
                        .n_ff = 128,
                        .n_head = 4,
                        .n_head_kv = 2,
                        .head_dim = 16,
                        .n_rot = 16,
                        .vocab_size = 299,
                        .context_length = 256,
                        .rope_freq_base = 10000.0f});
  EXPECT_EQ(cfg->q_dim(), 64u);
  EXPECT_EQ(cfg->kv_dim(), 32u);
  ASSERT_EQ(w.layers.size(), 2u);
  EXPECT_EQ(w.output, w.token_embd);
  EXPECT_EQ(w.token_embd->type, GgmlType::q8_0);
  EXPECT_EQ(w.layers[1].ffn_down->type, GgmlType::q4_1);
  EXPECT_EQ(w.layers[1].ffn_down->ne[0], 128);
  EXPECT_EQ(w.layers[1].attn_k->ne[1], 32);
  EXPECT_EQ(w.layers[0].attn_norm->type, GgmlType::f32);

  auto tokens = (*f)->get_string_array("tokenizer.ggml.tokens");
  ASSERT_TRUE(tokens.is_ok());
  EXPECT_EQ((*tokens)[1], "<|im_start|>");
  EXPECT_EQ((*tokens)[3 + ' '], "Ġ");
  EXPECT_EQ((*tokens)[3 + 'a'], "a");
  EXPECT_EQ((*(*f)->get_string_array("tokenizer.ggml.merges"))[4], "Ġt he");
}

TEST(GgufLlama, EveryMatrixTypeAndUntiedOutput) {
  for (GgmlType t : {GgmlType::f32, GgmlType::f16, GgmlType::bf16, GgmlType::q8_0, GgmlType::q4_0, GgmlType::q4_1}) {
    SyntheticLlamaSpec spec;
    spec.matrix_type = t;
    spec.embedding_type = t;
    spec.tied_embeddings = false;
    auto f = GgufFile::from_bytes(synthetic_llama(spec));
    ASSERT_TRUE(f.is_ok()) << f.status().to_string();
    LlamaWeights w;
    auto cfg = load_llama_config(**f, &w);
    ASSERT_TRUE(cfg.is_ok()) << ggml_type_name(t) << ": " << cfg.status().to_string();
    EXPECT_FALSE(cfg->tied_embeddings);
    EXPECT_NE(w.output, w.token_embd);
    EXPECT_EQ(w.layers[0].attn_q->type, t);
  }
}

TEST(GgufLlama, MissingOrMistypedKeys) {
  for (const char* key : {"llama.block_count", "llama.context_length", "llama.embedding_length",
                          "llama.feed_forward_length", "llama.attention.head_count",
                          "llama.attention.layer_norm_rms_epsilon", "tokenizer.ggml.tokens", "general.architecture"}) {
    GgufWriter w = synthetic_llama_writer();
    ASSERT_TRUE(w.remove_kv(key));
    expect_error(w, ErrorCode::not_found, key, "is not in");
  }
  {  // optional keys take their defaults
    GgufWriter w = synthetic_llama_writer();
    w.remove_kv("llama.rope.freq_base");
    w.remove_kv("llama.rope.dimension_count");
    w.remove_kv("llama.attention.head_count_kv");
    w.remove_kv("llama.vocab_size");
    // head_count_kv defaults to head_count, so k/v must then be full width: expect the shape error.
    expect_error(w, ErrorCode::invalid_argument, "blk.0.attn_k.weight", "expected [64, 64]");
  }
  {
    GgufWriter w = synthetic_llama_writer();
    w.remove_kv("llama.rope.freq_base");
    w.remove_kv("llama.rope.dimension_count");
    auto f = GgufFile::from_bytes(w.finish());
    auto cfg = read_llama_config(**f);
    ASSERT_TRUE(cfg.is_ok()) << cfg.status().to_string();
    EXPECT_EQ(cfg->rope_freq_base, 10000.0f);
    EXPECT_EQ(cfg->n_rot, 16u);
  }
  {  // any integer type is accepted
    GgufWriter w = with_kv("llama.block_count", [](GgufWriter& g, std::string_view k) { g.add_u64(k, 2); });
    EXPECT_TRUE(load_status(w).is_ok()) << load_status(w).to_string();
  }
  struct BadValue {
    const char* key;
    std::function<void(GgufWriter&, std::string_view)> add;
    ErrorCode code;
    const char* in_message;
  };
  const auto u32 = [](std::uint32_t v) { return [v](GgufWriter& g, std::string_view k) { g.add_u32(k, v); }; };
  const auto str = [](const char* v) { return [v](GgufWriter& g, std::string_view k) { g.add_string(k, v); }; };
  const BadValue bad[] = {
      {"llama.embedding_length", str("64"), ErrorCode::invalid_argument, "has type string"},
      {"llama.attention.layer_norm_rms_epsilon", u32(1), ErrorCode::invalid_argument, "expected float32"},
      {"llama.block_count", u32(0), ErrorCode::invalid_argument, "expected 1.."},
      {"llama.attention.head_count_kv", u32(3), ErrorCode::invalid_argument, "not a multiple"},
      {"llama.vocab_size", u32(300), ErrorCode::invalid_argument, "differs"},
      {"llama.rope.dimension_count", u32(18), ErrorCode::invalid_argument, ""},
      {"general.architecture", str("gpt2"), ErrorCode::unsupported, "'gpt2' is not supported"},
  };
  for (const BadValue& b : bad) {
    SCOPED_TRACE(b.key);
    expect_error(with_kv(b.key, b.add), b.code, b.key, b.in_message);
  }
}

TEST(GgufLlama, MissingTensorsBadShapesAndTypes) {
  {
    GgufWriter w = synthetic_llama_writer();
    ASSERT_TRUE(w.remove_tensor("blk.1.ffn_down.weight"));
    expect_error(w, ErrorCode::not_found, "blk.1.ffn_down.weight");
  }
  {
    GgufWriter w = synthetic_llama_writer();
    ASSERT_TRUE(w.remove_tensor("output_norm.weight"));
    expect_error(w, ErrorCode::not_found, "output_norm.weight");
  }
  {  // K with 3 kv heads' rows instead of 2
    GgufWriter w = synthetic_llama_writer();
    std::vector<float> v(64 * 48, 0.01f);
    std::vector<std::byte> data(static_cast<std::size_t>(row_size(GgmlType::q4_1, 64) * 48));
    ASSERT_TRUE(quantize_row(GgmlType::q4_1, v.data(), data.data(), 64 * 48).is_ok());
    ASSERT_TRUE(w.replace_tensor("blk.0.attn_k.weight", 3, {64, 48}, data));
    expect_error(w, ErrorCode::invalid_argument, "blk.0.attn_k.weight", "has shape [64, 48], expected [64, 32]");
  }
  // A 3-d norm.
  expect_tensor_error("blk.1.ffn_norm.weight", 0, {64, 1, 1}, 64 * 4, ErrorCode::invalid_argument, "expected [64]");
  // A transposed down projection.
  expect_tensor_error("blk.0.ffn_down.weight", 3, {64, 128},
                      static_cast<std::size_t>(row_size(GgmlType::q4_1, 64) * 128), ErrorCode::invalid_argument,
                      "expected [128, 64]");
  // MXFP4: a type ggml knows (so the file parses) but kallpa has no kernels for.
  expect_tensor_error("blk.1.ffn_up.weight", 39, {64, 128}, 2 * 17 * 128, ErrorCode::unsupported, "has type MXFP4");
  {  // Q5_0 is computed with, but not with an infinite scale: the error names the tensor and block
    GgufWriter w = synthetic_llama_writer();
    std::vector<std::byte> data(2 * 22 * 128, std::byte{0});
    data[5 * 22 + 1] = std::byte{0x7c};  // block 5's f16 d: 0x7c00, +inf
    ASSERT_TRUE(w.replace_tensor("blk.1.ffn_up.weight", 6, {64, 128}, data));
    expect_error(w, ErrorCode::invalid_argument, "blk.1.ffn_up.weight",
                 "Q5_0 block 5 (byte 110) has a non-finite scale d");
    data[5 * 22 + 1] = std::byte{0};
    ASSERT_TRUE(w.replace_tensor("blk.1.ffn_up.weight", 6, {64, 128}, data));
    EXPECT_TRUE(load_status(w).is_ok()) << load_status(w).to_string();
  }
  // Norms must be F32.
  expect_tensor_error("blk.0.attn_norm.weight", 1, {64}, 64 * 2, ErrorCode::unsupported, "has type F16");
  // Vocab rows differ from the tokenizer's vocabulary.
  expect_tensor_error("token_embd.weight", 8, {64, 298}, static_cast<std::size_t>(row_size(GgmlType::q8_0, 64) * 298),
                      ErrorCode::invalid_argument, "expected [64, 299]");
  {  // an unknown tensor type is already a parse error at load
    GgufWriter w = synthetic_llama_writer();
    std::vector<std::byte> data(64 * 4);
    ASSERT_TRUE(w.replace_tensor("output_norm.weight", 77, {64}, data));
    const Status st = load_status(w);
    EXPECT_EQ(st.code(), ErrorCode::parse_error) << st.to_string();
    EXPECT_NE(st.message().find("unknown ggml type 77"), std::string::npos) << st.to_string();
  }
}

TEST(GgufLlama, RealSmolLM2LoadsAndValidates) {
  const std::string path = kallpa::test_support::smollm2_path();
  if (path.empty()) {
    GTEST_SKIP() << "SmolLM2-135M-Instruct.Q4_1.gguf not found (run scripts/fetch_model.sh, or set KALLPA_MODEL)";
  }
  auto f = GgufFile::open(path);
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  EXPECT_EQ((*f)->version(), 3u);
  EXPECT_EQ((*f)->tensors().size(), 272u);
  LlamaWeights w;
  auto cfg = load_llama_config(**f, &w);
  ASSERT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  expect_hparams(*cfg, {.n_layer = 30,
                        .n_embd = 576,
                        .n_ff = 1536,
                        .n_head = 9,
                        .n_head_kv = 3,
                        .head_dim = 64,
                        .n_rot = 64,
                        .vocab_size = 49152,
                        .context_length = 8192,
                        .rope_freq_base = 100000.0f});
  EXPECT_EQ(*(*f)->get_string("tokenizer.ggml.pre"), "smollm");
  // Tensor types found in the file: Q8_0 embeddings, Q4_1 matrices, F32 norms.
  std::map<std::string, int> types;
  for (const auto& t : (*f)->tensors()) ++types[std::string(ggml_type_name(t.type))];
  EXPECT_EQ(types, (std::map<std::string, int>{{"F32", 61}, {"Q4_1", 210}, {"Q8_0", 1}}));
  EXPECT_EQ(w.token_embd->type, GgmlType::q8_0);
  for (const auto& l : w.layers) {
    EXPECT_EQ(l.attn_q->type, GgmlType::q4_1);
    EXPECT_EQ(l.ffn_down->type, GgmlType::q4_1);
  }

  // A real matrix product agrees with the dequantised weights (exact product in double).
  auto wm = as_weight_matrix(*w.layers[3].ffn_down);
  ASSERT_TRUE(wm.is_ok());
  const auto x = synthetic_values(7, static_cast<std::size_t>(wm->cols), 1.0f);
  std::vector<float> y(static_cast<std::size_t>(wm->rows));
  ASSERT_TRUE(matmul(*wm, x.data(), 1, wm->cols, y.data(), wm->rows).is_ok());
  std::vector<float> row(static_cast<std::size_t>(wm->cols));
  double max_err = 0, max_ref = 0;
  for (std::int64_t i = 0; i < wm->rows; ++i) {
    ASSERT_TRUE(dequantize_rows(*wm, i, 1, row.data()).is_ok());
    double ref = 0;
    for (std::int64_t j = 0; j < wm->cols; ++j) ref += static_cast<double>(row[j]) * x[j];
    max_err = std::max(max_err, std::fabs(ref - y[i]));
    max_ref = std::max(max_ref, std::fabs(ref));
  }
  EXPECT_LT(max_err, 0.02 * max_ref) << "max |y| " << max_ref;
  // Embedding rows dequantise to finite values.
  auto embd = as_weight_matrix(*w.token_embd);
  ASSERT_TRUE(embd.is_ok());
  std::vector<float> e(576);
  ASSERT_TRUE(dequantize_rows(*embd, 49151, 1, e.data()).is_ok());
  for (float v : e) EXPECT_TRUE(std::isfinite(v));
}

}  // namespace
