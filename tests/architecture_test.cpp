// Architectures as descriptions: what the config reader makes of each architecture's keys (local
// layers, RoPE bases, window, scales, softcaps), the typed errors for what kallpa does not run, and
// forward-pass properties that hold whatever the weights: a fused projection gives the logits of
// the same weights split, and all_logits gives each position the logits a prefix run gives it.
// The logits themselves are checked against NumPy in tests/engine (arch_models.py).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "kallpa/dispatcher.h"
#include "kallpa/model/gguf.h"
#include "kallpa/model/llama.h"
#include "kallpa/model/llama_model.h"
#include "kallpa/ops/ops.h"
#include "support/synthetic_arch.h"

namespace kallpa::model {
namespace {

Result<ModelConfig> config_of(const GgufWriter& w) {
  auto f = GgufFile::from_bytes(w.finish(), "synthetic");
  if (!f) return f.status();
  LlamaWeights weights;
  return load_llama_config(**f, &weights);
}

void expect_error(const GgufWriter& w, ErrorCode code, const std::string& field, const std::string& in_message) {
  auto cfg = config_of(w);
  ASSERT_FALSE(cfg.is_ok()) << "expected an error naming " << field;
  EXPECT_EQ(cfg.status().code(), code) << cfg.status().to_string();
  EXPECT_EQ(cfg.status().field(), field) << cfg.status().to_string();
  EXPECT_NE(cfg.status().message().find(in_message), std::string::npos) << cfg.status().to_string();
}

std::vector<bool> local_layers(const ModelConfig& c) {
  std::vector<bool> out;
  for (std::uint32_t il = 0; il < c.n_layer; ++il) out.push_back(c.is_local(il));
  return out;
}

TEST(ArchitectureConfig, Gemma3HasFiveLocalLayersToOneGlobalWithTheirOwnRopeBase) {
  auto cfg = config_of(synthetic_arch_writer({.architecture = "gemma3", .n_layer = 13, .sliding_window = 8}));
  ASSERT_TRUE(cfg) << cfg.status().to_string();
  EXPECT_EQ(local_layers(*cfg),
            (std::vector<bool>{true, true, true, true, true, false, true, true, true, true, true, false, true}));
  EXPECT_EQ(cfg->rope_base(0), 10000.0f);
  EXPECT_EQ(cfg->rope_base(5), 1e6f);
  EXPECT_EQ(cfg->window_left(0), 7);
  EXPECT_EQ(cfg->window_left(5), -1);
  EXPECT_FLOAT_EQ(cfg->attention_scale, 0.25f);  // 1/sqrt(head_dim 16)
  EXPECT_FLOAT_EQ(cfg->embedding_scale, 8.0f);   // sqrt(n_embd 64)
  EXPECT_EQ(cfg->attn_logit_softcap, 0.0f);
  EXPECT_TRUE(cfg->arch.qk_norm);
  EXPECT_EQ(cfg->arch.rope_style, ops::RopeStyle::halves);
}

TEST(ArchitectureConfig, TheFilesPatternAndLocalBaseOverrideTheDefaults) {
  GgufWriter period = synthetic_arch_writer({.architecture = "gemma3", .n_layer = 4, .sliding_window = 8});
  period.add_u32("gemma3.attention.sliding_window_pattern", 2);
  period.add_f32("gemma3.rope.freq_base_swa", 5000.0f);
  auto cfg = config_of(period);
  ASSERT_TRUE(cfg) << cfg.status().to_string();
  EXPECT_EQ(local_layers(*cfg), (std::vector<bool>{true, false, true, false}));
  EXPECT_EQ(cfg->rope_base(0), 5000.0f);

  GgufWriter flags = synthetic_arch_writer({.architecture = "gemma3", .n_layer = 3, .sliding_window = 8});
  flags.add_array<std::uint8_t>("gemma3.attention.sliding_window_pattern", GgufValueType::boolean, {0, 1, 1});
  cfg = config_of(flags);
  ASSERT_TRUE(cfg) << cfg.status().to_string();
  EXPECT_EQ(local_layers(*cfg), (std::vector<bool>{false, true, true}));

  GgufWriter short_flags = synthetic_arch_writer({.architecture = "gemma3", .n_layer = 3, .sliding_window = 8});
  short_flags.add_array<std::uint8_t>("gemma3.attention.sliding_window_pattern", GgufValueType::boolean, {0, 1});
  expect_error(short_flags, ErrorCode::invalid_argument, "gemma3.attention.sliding_window_pattern", "one per layer");
}

TEST(ArchitectureConfig, Gemma2AlternatesAndReadsItsSoftcaps) {
  GgufWriter w = synthetic_arch_writer({.architecture = "gemma2", .n_layer = 4, .sliding_window = 16});
  w.add_f32("gemma2.attn_logit_softcapping", 50.0f);
  w.add_f32("gemma2.final_logit_softcapping", 30.0f);
  auto cfg = config_of(w);
  ASSERT_TRUE(cfg) << cfg.status().to_string();
  EXPECT_EQ(local_layers(*cfg), (std::vector<bool>{true, false, true, false}));
  EXPECT_EQ(cfg->rope_base(0), cfg->rope_base(1));  // Gemma 2 has one base
  EXPECT_EQ(cfg->attn_logit_softcap, 50.0f);
  EXPECT_EQ(cfg->final_logit_softcap, 30.0f);
  EXPECT_EQ(cfg->arch.ffn, FfnActivation::gelu_tanh);

  GgufWriter negative = synthetic_arch_writer({.architecture = "gemma2"});
  negative.add_f32("gemma2.final_logit_softcapping", -1.0f);
  expect_error(negative, ErrorCode::invalid_argument, "gemma2.final_logit_softcapping", "expected a number >= 0");
}

TEST(ArchitectureConfig, WindowsOnEveryLayerForMistralAndNoneWhereTheArchitectureHasNone) {
  for (const char* arch : {"llama", "mistral"}) {
    auto cfg = config_of(synthetic_arch_writer({.architecture = arch, .n_layer = 3, .sliding_window = 32}));
    ASSERT_TRUE(cfg) << arch << ": " << cfg.status().to_string();
    EXPECT_EQ(local_layers(*cfg), (std::vector<bool>{true, true, true})) << arch;
    EXPECT_EQ(cfg->window_left(2), 31) << arch;
  }
  auto plain = config_of(synthetic_arch_writer({.architecture = "llama", .n_layer = 2}));
  ASSERT_TRUE(plain) << plain.status().to_string();
  EXPECT_EQ(local_layers(*plain), (std::vector<bool>{false, false}));
  // Qwen2 and Phi-3 files may name a window that the models (as llama.cpp runs them) do not use.
  for (const char* arch : {"qwen2", "phi3"}) {
    auto cfg = config_of(synthetic_arch_writer({.architecture = arch, .n_layer = 2, .sliding_window = 32}));
    ASSERT_TRUE(cfg) << arch << ": " << cfg.status().to_string();
    EXPECT_EQ(local_layers(*cfg), (std::vector<bool>{false, false})) << arch;
    EXPECT_EQ(cfg->window_left(0), -1) << arch;
  }
}

TEST(ArchitectureConfig, UnsupportedThingsAreTypedErrorsNamingThem) {
  GgufWriter mamba = synthetic_arch_writer({.architecture = "mamba"});
  expect_error(mamba, ErrorCode::unsupported, "general.architecture", "'mamba' is not supported");
  expect_error(mamba, ErrorCode::unsupported, "general.architecture", "gemma3");

  GgufWriter yarn = synthetic_arch_writer({.architecture = "qwen2"});
  yarn.add_string("qwen2.rope.scaling.type", "yarn");
  expect_error(yarn, ErrorCode::unsupported, "qwen2.rope.scaling.type", "'yarn'");

  GgufWriter longrope = synthetic_arch_writer({.architecture = "phi3"});
  std::vector<std::byte> factors(8 * sizeof(float));
  longrope.add_tensor("rope_factors_long.weight", ops::GgmlType::f32, {8}, factors);
  expect_error(longrope, ErrorCode::unsupported, "rope_factors_long.weight", "LongRoPE");
}

TEST(ArchitectureConfig, AMissingOrMisshapenTensorIsNamed) {
  GgufWriter no_norm = synthetic_arch_writer({.architecture = "qwen3"});
  ASSERT_TRUE(no_norm.remove_tensor("blk.1.attn_k_norm.weight"));
  expect_error(no_norm, ErrorCode::not_found, "blk.1.attn_k_norm.weight", "blk.1.attn_k_norm.weight");

  GgufWriter no_bias = synthetic_arch_writer({.architecture = "qwen2"});
  ASSERT_TRUE(no_bias.remove_tensor("blk.0.attn_v.bias"));
  expect_error(no_bias, ErrorCode::not_found, "blk.0.attn_v.bias", "blk.0.attn_v.bias");

  GgufWriter no_post = synthetic_arch_writer({.architecture = "gemma2"});
  ASSERT_TRUE(no_post.remove_tensor("blk.0.post_ffw_norm.weight"));
  expect_error(no_post, ErrorCode::not_found, "blk.0.post_ffw_norm.weight", "post_ffw_norm");

  // Phi-3's fused q/k/v with a row too few: the shape the hyperparameters imply is [64, 128].
  GgufWriter fused = synthetic_arch_writer({.architecture = "phi3"});
  ASSERT_TRUE(fused.replace_tensor("blk.0.attn_qkv.weight", static_cast<std::uint32_t>(ops::GgmlType::f32), {64, 127},
                                   std::vector<std::byte>(64 * 127 * sizeof(float))));
  expect_error(fused, ErrorCode::invalid_argument, "blk.0.attn_qkv.weight", "expected [64, 128]");

  GgufWriter gate_up = synthetic_arch_writer({.architecture = "phi3"});
  ASSERT_TRUE(gate_up.replace_tensor("blk.1.ffn_up.weight", static_cast<std::uint32_t>(ops::GgmlType::f32), {64, 96},
                                     std::vector<std::byte>(64 * 96 * sizeof(float))));
  expect_error(gate_up, ErrorCode::invalid_argument, "blk.1.ffn_up.weight", "expected [64, 192]");
}

// Every position's logits (all_logits) of one prefill of `ids`.
std::vector<float> all_position_logits(const GgufWriter& w, const std::vector<std::int32_t>& ids,
                                       bool all_logits = true) {
  auto file = GgufFile::from_bytes(w.finish(), "synthetic");
  EXPECT_TRUE(file) << file.status().to_string();
  auto ops = ops::make_cpu_ops();
  auto m = LlamaModel::load(*file, *ops);
  EXPECT_TRUE(m) << m.status().to_string();
  if (!m) return {};
  auto cache = (*m)->make_cache({.page_size = 4, .max_tokens = 64});
  EXPECT_TRUE(cache) << cache.status().to_string();
  Dispatcher dispatcher;
  const ops::SeqId seq = (*cache)->add_sequence();
  EXPECT_TRUE((*cache)->reserve(seq, static_cast<std::int64_t>(ids.size())));
  ForwardItem item{.seq = seq, .tokens = ids, .start_pos = 0, .want_logits = true, .all_logits = all_logits};
  const std::size_t rows = all_logits ? ids.size() : 1;
  std::vector<float> logits(rows * (*m)->config().vocab_size);
  const Status s = (*m)->forward({&item, 1}, **cache, dispatcher, logits.data());
  EXPECT_TRUE(s) << s.to_string();
  return logits;
}

TEST(ArchitectureForward, FusedProjectionsGiveTheLogitsOfTheSameWeightsSplit) {
  const std::vector<std::int32_t> ids{3, 17, 5, 60, 2, 9};
  const auto fused = all_position_logits(synthetic_arch_writer({.architecture = "phi3", .fused = true}), ids);
  // The split file: the fused matrices' rows as separate tensors, in the order the fusion stacks them.
  GgufWriter split = synthetic_arch_writer({.architecture = "phi3", .fused = true});
  auto f = GgufFile::from_bytes(split.finish(), "fused");
  ASSERT_TRUE(f) << f.status().to_string();
  auto rows = [&](const std::string& name, std::int64_t first, std::int64_t count) {
    const TensorView* t = (*f)->find_tensor(name);
    const auto* data = static_cast<const std::byte*>(t->data) + first * t->ne[0] * 4;
    return std::vector<std::byte>(data, data + count * t->ne[0] * 4);
  };
  for (int il = 0; il < 2; ++il) {
    const std::string b = "blk." + std::to_string(il) + ".";
    const auto f32 = static_cast<std::uint32_t>(ops::GgmlType::f32);
    split.add_tensor(b + "attn_q.weight", f32, {64, 64}, rows(b + "attn_qkv.weight", 0, 64));
    split.add_tensor(b + "attn_k.weight", f32, {64, 32}, rows(b + "attn_qkv.weight", 64, 32));
    split.add_tensor(b + "attn_v.weight", f32, {64, 32}, rows(b + "attn_qkv.weight", 96, 32));
    // Phi-3 keeps the fused ffn_up; the fused attention alone is what this file drops.
    ASSERT_TRUE(split.remove_tensor(b + "attn_qkv.weight"));
  }
  const auto unfused = all_position_logits(split, ids);
  ASSERT_EQ(fused.size(), unfused.size());
  ASSERT_FALSE(fused.empty());
  EXPECT_EQ(fused, unfused);
}

TEST(ArchitectureForward, AllLogitsGivesEachPositionWhatAPrefixRunGivesIt) {
  for (const char* arch : {"gemma3", "qwen2", "llama"}) {
    const std::vector<std::int32_t> ids{1, 40, 7, 33, 12, 5, 61, 20, 8, 4};
    const GgufWriter w = synthetic_arch_writer({.architecture = arch, .n_layer = 2, .sliding_window = 4});
    const auto all = all_position_logits(w, ids);
    ASSERT_EQ(all.size(), ids.size() * 64) << arch;
    for (std::size_t t : {std::size_t{0}, std::size_t{4}, ids.size() - 1}) {
      const auto last = all_position_logits(w, {ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(t) + 1}, false);
      ASSERT_EQ(last.size(), 64u);
      double max_diff = 0.0, max_abs = 0.0;
      for (std::size_t i = 0; i < 64; ++i) {
        max_diff = std::max(max_diff, double(std::fabs(all[t * 64 + i] - last[i])));
        max_abs = std::max(max_abs, double(std::fabs(last[i])));
      }
      EXPECT_LE(max_diff, 1e-5 * std::max(max_abs, 1.0)) << arch << " position " << t;
    }
  }
}

}  // namespace
}  // namespace kallpa::model
