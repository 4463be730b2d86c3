// The engine end to end on a synthetic Llama GGUF (and on the real model when it is present):
// chunking and batching do not change results, every CPU attention backend gives the same greedy
// text, sessions and generation follow their rules.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>

#include "kallpa/model/gguf.h"
#include "kallpa/registry.h"
#include "kallpa/runtime/engine.h"
#include "support/host_backends.h"
#include "support/synthetic_llama.h"

namespace kallpa::runtime {
namespace {

std::shared_ptr<const model::GgufFile> synthetic_file(const model::SyntheticLlamaSpec& spec = {}) {
  auto bytes = model::synthetic_llama(spec);
  auto file = model::GgufFile::from_bytes(bytes, "synthetic");
  EXPECT_TRUE(file.is_ok()) << file.status().to_string();
  return *file;
}

std::unique_ptr<Engine> engine_for(std::shared_ptr<const model::GgufFile> file, DispatchOptions attention = {},
                                   std::int64_t chunk = 256) {
  EngineOptions o;
  o.attention = std::move(attention);
  o.prefill_chunk = chunk;
  o.cache.max_tokens = 256;
  auto e = Engine::load(std::move(file), o);
  EXPECT_TRUE(e.is_ok()) << e.status().to_string();
  return std::move(*e);
}

std::vector<std::int32_t> some_tokens(int n) {
  std::vector<std::int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back(3 + (i * 37) % 290);
  return t;
}

GenerateOptions limit(std::int64_t max_tokens, bool stop_at_eos = true, std::vector<std::string> stop = {}) {
  GenerateOptions o;
  o.max_tokens = max_tokens;
  o.stop_at_eos = stop_at_eos;
  o.stop = std::move(stop);
  return o;
}

double max_diff(std::span<const float> a, std::span<const float> b) {
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, double(std::fabs(a[i] - b[i])));
  return m;
}

TEST(Engine, LoadsTheSyntheticModel) {
  auto e = engine_for(synthetic_file());
  EXPECT_EQ(e->config().n_layer, 2u);
  EXPECT_EQ(e->tokenizer().vocab_size(), e->config().vocab_size);
}

TEST(Engine, ChunkedPrefillMatchesOneShotAndTokenByToken) {
  auto file = synthetic_file();
  auto tokens = some_tokens(40);
  std::vector<std::vector<float>> logits;
  for (std::int64_t chunk : {256, 7, 1}) {
    auto e = engine_for(file, {}, chunk);
    Session s(*e, {.temperature = 0});
    ASSERT_TRUE(s.feed(tokens));
    logits.emplace_back(s.logits().begin(), s.logits().end());
  }
  // A prompt's rows take exact activations in chunks of any size, one-token chunks included, so
  // the chunks change only how attention groups its sums: float reordering. (One-token chunks
  // were decode rows until a fuzz target found that the prefix cache then handed other requests
  // K/V that depended on where a prompt's chunks fell.)
  EXPECT_LT(max_diff(logits[0], logits[1]), 1e-3);
  EXPECT_LT(max_diff(logits[0], logits[2]), 1e-3);
  // Fed one call per token, as generation feeds its samples, tokens are decode steps, whose
  // matrix products take 16-bit activations (ops/ops.h): off by the activation rounding,
  // relative to the logits' scale.
  auto e = engine_for(file, {}, 256);
  Session s(*e, {.temperature = 0});
  for (std::int32_t t : tokens) ASSERT_TRUE(s.feed({&t, 1}));
  const std::vector<float> stepwise(s.logits().begin(), s.logits().end());
  double scale = 0;
  for (float v : logits[0]) scale = std::max(scale, double(std::fabs(v)));
  EXPECT_LT(max_diff(logits[0], stepwise), 1e-3 * std::max(1.0, scale));
  EXPECT_NE(stepwise, logits[0]);  // the other activations really were taken
}

TEST(Engine, BatchedForwardMatchesSeparateSequences) {
  auto file = synthetic_file();
  auto e = engine_for(file);
  auto a = some_tokens(9), b = some_tokens(23);
  std::vector<float> alone_a(e->config().vocab_size), alone_b(e->config().vocab_size);
  {
    Session sa(*e, {.temperature = 0}), sb(*e, {.temperature = 0});
    ASSERT_TRUE(sa.feed(a));
    ASSERT_TRUE(sb.feed(b));
    std::copy(sa.logits().begin(), sa.logits().end(), alone_a.begin());
    std::copy(sb.logits().begin(), sb.logits().end(), alone_b.begin());
  }
  auto& cache = e->cache();
  const ops::SeqId s1 = cache.add_sequence(), s2 = cache.add_sequence();
  model::ForwardItem items[2] = {{s1, a, 0, true}, {s2, b, 0, true}};
  ASSERT_TRUE(cache.reserve(s1, static_cast<std::int64_t>(a.size())));
  ASSERT_TRUE(cache.reserve(s2, static_cast<std::int64_t>(b.size())));
  std::vector<float> both(2 * e->config().vocab_size);
  ASSERT_TRUE(e->model().forward(items, cache, e->dispatcher(), both.data()));
  const std::span<const float> all(both);
  EXPECT_LT(max_diff(all.first(alone_a.size()), alone_a), 1e-3);
  EXPECT_LT(max_diff(all.subspan(alone_a.size()), alone_b), 1e-3);
  cache.remove(s1);
  cache.remove(s2);
}

// The caller owns the batch's order and the cache's space (model/llama_model.h): forward() takes
// prompt chunks before decode steps and writes only into reserved positions, rejecting anything
// else before it runs.
TEST(Engine, ForwardTakesPromptChunksFirstIntoReservedPositions) {
  auto file = synthetic_file();
  auto e = engine_for(file);
  auto& cache = e->cache();
  const auto prompt = some_tokens(5);
  const std::int32_t step[] = {7};
  const ops::SeqId s1 = cache.add_sequence(), s2 = cache.add_sequence();
  std::vector<float> logits(2 * e->config().vocab_size);
  model::ForwardItem unreserved[1] = {{s1, prompt, 0, true}};
  EXPECT_EQ(e->model().forward(unreserved, cache, e->dispatcher(), logits.data()).code(), ErrorCode::invalid_argument);
  ASSERT_TRUE(cache.reserve(s1, static_cast<std::int64_t>(prompt.size()) + 1));
  ASSERT_TRUE(cache.reserve(s2, static_cast<std::int64_t>(prompt.size())));
  ASSERT_TRUE(e->model().forward(unreserved, cache, e->dispatcher(), logits.data()));
  model::ForwardItem decode_first[2] = {{s1, step, static_cast<std::int64_t>(prompt.size()), true},
                                        {s2, prompt, 0, true}};
  EXPECT_EQ(e->model().forward(decode_first, cache, e->dispatcher(), logits.data()).code(),
            ErrorCode::invalid_argument);
  model::ForwardItem prompt_first[2] = {decode_first[1], decode_first[0]};
  EXPECT_TRUE(e->model().forward(prompt_first, cache, e->dispatcher(), logits.data()));
  cache.remove(s1);
  cache.remove(s2);
}

TEST(Engine, GreedyTextIsTheSameWithEveryCpuAttentionBackend) {
  auto file = synthetic_file();
  std::vector<std::int32_t> reference_tokens;
  int backends = 0;
  for (const BackendInfo& info : test_support::host_backends_that_run_here(BackendRegistry::global())) {
    ++backends;
    auto e = engine_for(file, {{std::string(info.backend->name())}, true});
    Session s(*e, {.temperature = 0});
    auto r = generate(s, some_tokens(12), limit(24, false));
    ASSERT_TRUE(r.is_ok()) << info.backend->name() << ": " << r.status().to_string();
    std::vector<std::int32_t> generated(s.tokens().begin() + 12, s.tokens().end());
    if (reference_tokens.empty()) {
      reference_tokens = generated;
    } else {
      EXPECT_EQ(generated, reference_tokens) << info.backend->name();
    }
    EXPECT_GT(e->attention_stats().snapshot()[std::string(info.backend->name())].calls, 0u);
  }
  EXPECT_GE(backends, 2);
}

TEST(Engine, HeldBackIsTheLongestSuffixThatMayStartAStopString) {
  EXPECT_EQ(held_back("Hello wor", {"world"}), 3u);
  EXPECT_EQ(held_back("Hello wor", {"or", "world"}), 3u);  // the longest wins
  EXPECT_EQ(held_back("Hello", {"x", "yz"}), 0u);
  EXPECT_EQ(held_back("ab", {"abc"}), 2u);
  EXPECT_EQ(held_back("b", {"b"}), 0u);  // a whole stop string is found, never held
  EXPECT_EQ(held_back("", {"abc"}), 0u);
}

TEST(Engine, RewindForgetsTokensAndFreesTheirBlocks) {
  auto file = synthetic_file();
  auto e = engine_for(file);
  const auto tokens = some_tokens(40);
  // 24 tokens, then one (a decode row, as after the rewind below): the same rows, the same bits.
  Session fresh(*e, {.temperature = 0});
  ASSERT_TRUE(fresh.feed(std::span(tokens).first(24)));
  ASSERT_TRUE(fresh.feed(std::span(tokens).subspan(24, 1)));
  const std::vector<float> expected(fresh.logits().begin(), fresh.logits().end());

  Session s(*e, {.temperature = 0});
  ASSERT_TRUE(s.feed(tokens));
  const std::int64_t used_at_40 = e->cache().used_blocks();
  s.rewind(24);
  EXPECT_EQ(s.position(), 24);
  EXPECT_TRUE(s.logits().empty());
  EXPECT_FALSE(s.sample().is_ok());  // no logits until something is fed
  EXPECT_LT(e->cache().used_blocks(), used_at_40);
  ASSERT_TRUE(s.feed(std::span(tokens).subspan(24, 1)));
  EXPECT_EQ(max_diff(s.logits(), expected), 0.0);
  s.rewind(1000);  // past the end: nothing to forget
  EXPECT_EQ(s.position(), 25);
}

TEST(Engine, SameSeedSameTextAndMaxTokens) {
  auto file = synthetic_file();
  auto run = [&](std::uint64_t seed) {
    auto e = engine_for(file);
    // The synthetic model's logits are sharp; a high temperature makes the draw depend on the seed.
    Session s(*e, {.temperature = 50.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f, .seed = seed});
    auto r = generate(s, some_tokens(5), limit(16, false));
    EXPECT_TRUE(r.is_ok());
    EXPECT_EQ(r->generated_tokens, 16);
    EXPECT_EQ(r->finish_reason, "length");
    return std::vector<std::int32_t>(s.tokens().begin(), s.tokens().end());
  };
  EXPECT_EQ(run(11), run(11));
  EXPECT_NE(run(11), run(12));
}

TEST(Engine, ContextLimitIsAClearError) {
  model::SyntheticLlamaSpec spec;
  spec.context_length = 32;
  auto e = engine_for(synthetic_file(spec));
  Session s(*e, {.temperature = 0});
  auto r = generate(s, some_tokens(40), limit(4));
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().field(), "prompt");
  auto ok = generate(s, some_tokens(20), limit(100, false));
  ASSERT_TRUE(ok.is_ok()) << ok.status().to_string();
  EXPECT_EQ(s.position(), 32);  // generation stops at the context limit
  EXPECT_EQ(ok->finish_reason, "length");
}

TEST(Engine, KvBlocksAreReturnedWhenASessionEnds) {
  auto e = engine_for(synthetic_file());
  const std::int64_t free_before = e->cache().free_blocks();
  {
    Session s(*e, {.temperature = 0});
    ASSERT_TRUE(s.feed(some_tokens(50)));
    EXPECT_LT(e->cache().free_blocks(), free_before);
    s.reset();
    EXPECT_EQ(e->cache().free_blocks(), free_before);
    ASSERT_TRUE(s.feed(some_tokens(10)));
  }
  EXPECT_EQ(e->cache().free_blocks(), free_before);
}

TEST(Engine, StopStringsEndGenerationAndAreNotEmitted) {
  auto file = synthetic_file();
  auto e = engine_for(file);
  Session probe(*e, {.temperature = 0});
  auto full = generate(probe, some_tokens(8), limit(20, false));
  ASSERT_TRUE(full.is_ok());
  ASSERT_GE(full->text.size(), 4u);
  const std::string stop = full->text.substr(2, 2);
  Session s(*e, {.temperature = 0});
  std::string streamed;
  auto r = generate(s, some_tokens(8), limit(20, false, {stop}), [&](std::string_view t) { streamed += t; });
  ASSERT_TRUE(r.is_ok());
  EXPECT_EQ(r->finish_reason, "stop");
  EXPECT_EQ(r->text, full->text.substr(0, full->text.find(stop)));
  EXPECT_EQ(streamed, r->text);
}

// The real model, when the setup step has fetched it.
std::string real_model_path() {
  if (const char* p = std::getenv("KALLPA_MODEL")) return p;
  for (const char* p : {"models/SmolLM2-135M-Instruct.Q4_1.gguf", "../models/SmolLM2-135M-Instruct.Q4_1.gguf",
                        "../../models/SmolLM2-135M-Instruct.Q4_1.gguf"}) {
    if (std::filesystem::exists(p)) return p;
  }
  return {};
}

TEST(EngineRealModel, AnswersASimpleQuestion) {
  const std::string path = real_model_path();
  if (path.empty())
    GTEST_SKIP() << "SmolLM2-135M-Instruct.Q4_1.gguf not found (run scripts/fetch_model.sh or set KALLPA_MODEL)";
  EngineOptions o;
  o.model_path = path;
  o.cache.max_tokens = 512;
  auto e = Engine::load(o);
  ASSERT_TRUE(e.is_ok()) << e.status().to_string();
  Session s(**e, {.temperature = 0});
  std::vector<tokenizer::ChatMessage> msgs{{"user", "What is the capital of France?"}};
  auto prompt = tokenizer::encode_chatml((*e)->tokenizer(), msgs, (*e)->chat_options());
  ASSERT_TRUE(prompt.is_ok());
  auto r = generate(s, *prompt, limit(32));
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_NE(r->text.find("Paris"), std::string::npos) << r->text;
}

TEST(EngineRealModel, GreedyTextIsTheSameWithEveryCpuAttentionBackend) {
  const std::string path = real_model_path();
  if (path.empty())
    GTEST_SKIP() << "SmolLM2-135M-Instruct.Q4_1.gguf not found (run scripts/fetch_model.sh or set KALLPA_MODEL)";
  auto file = model::GgufFile::open(path);
  ASSERT_TRUE(file.is_ok()) << file.status().to_string();
  std::string first_text;
  std::vector<std::string> names;
  for (const BackendInfo& info : test_support::host_backends_that_run_here(BackendRegistry::global())) {
    EngineOptions o;
    o.attention = {{std::string(info.backend->name())}, true};
    o.cache.max_tokens = 256;
    auto e = Engine::load(*file, o);
    ASSERT_TRUE(e.is_ok()) << e.status().to_string();
    Session s(**e, {.temperature = 0});
    std::vector<tokenizer::ChatMessage> msgs{{"user", "Name three colours and say why the sky is blue."}};
    auto prompt = tokenizer::encode_chatml((*e)->tokenizer(), msgs, (*e)->chat_options());
    ASSERT_TRUE(prompt.is_ok());
    auto r = generate(s, *prompt, limit(48, false));
    ASSERT_TRUE(r.is_ok()) << info.backend->name() << ": " << r.status().to_string();
    EXPECT_GT((*e)->attention_stats().snapshot()[std::string(info.backend->name())].calls, 0u);
    if (names.empty()) {
      first_text = r->text;
    } else {
      EXPECT_EQ(r->text, first_text) << info.backend->name() << " vs " << names.front();
    }
    names.emplace_back(info.backend->name());
  }
  EXPECT_GE(names.size(), 3u) << "reference, cpu-flash and cpu-gemm at least";
}

}  // namespace
}  // namespace kallpa::runtime
