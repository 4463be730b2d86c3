// Context-parallel generation (docs/scale-out.md) with ranks as threads (support/thread_group.h):
// each rank its own engine on the same synthetic model, the sequence spread over them, and the
// greedy tokens and rank 0's logits those of one engine alone. The MPI runs of the same path are
// ring.cp_* (tests/ring/context_parallel_test.py).
#include <gtest/gtest.h>

#include <cmath>
#include <thread>
#include <vector>

#include "kallpa/model/gguf.h"
#include "kallpa/runtime/engine.h"
#include "support/synthetic_llama.h"
#include "support/thread_group.h"

namespace kallpa::runtime {
namespace {

std::shared_ptr<const model::GgufFile> synthetic_file() {
  auto bytes = model::synthetic_llama({});
  auto file = model::GgufFile::from_bytes(bytes, "synthetic");
  EXPECT_TRUE(file.is_ok()) << file.status().to_string();
  return *file;
}

std::unique_ptr<Engine> engine_for(std::shared_ptr<const model::GgufFile> file) {
  EngineOptions o;
  o.cache.max_tokens = 256;
  o.prefill_chunk = 16;  // the one-engine reference runs its prompt in several chunks
  auto e = Engine::load(std::move(file), o);
  EXPECT_TRUE(e.is_ok()) << e.status().to_string();
  return std::move(*e);
}

std::vector<std::int32_t> prompt_of(int n) {
  std::vector<std::int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back(3 + (i * 37) % 290);
  return t;
}

struct Outcome {
  std::vector<std::int32_t> tokens;        // the session's, prompt and generated
  std::vector<std::vector<float>> logits;  // at each sampled step (rank 0 only when spread)
  Status status;
};

GenerateOptions greedy_steps(std::int64_t n, std::vector<std::vector<float>>* logits) {
  GenerateOptions o;
  o.max_tokens = n;
  o.stop_at_eos = false;
  o.on_token = [logits](std::int32_t, std::span<const float> l) { logits->emplace_back(l.begin(), l.end()); };
  return o;
}

Outcome alone(const std::shared_ptr<const model::GgufFile>& file, const std::vector<std::int32_t>& prompt,
              std::int64_t steps) {
  auto engine = engine_for(file);
  Session session(*engine, {.temperature = 0});
  Outcome out;
  auto r = generate(session, prompt, greedy_steps(steps, &out.logits));
  out.status = r.status();
  out.tokens = session.tokens();
  return out;
}

std::vector<Outcome> spread(const std::shared_ptr<const model::GgufFile>& file, const std::vector<std::int32_t>& prompt,
                            std::int64_t steps, int ranks) {
  testing::ThreadGroup group(ranks);
  std::vector<std::unique_ptr<Engine>> engines;
  for (int r = 0; r < ranks; ++r) engines.push_back(engine_for(file));
  std::vector<Outcome> out(static_cast<std::size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      Outcome& o = out[static_cast<std::size_t>(r)];
      Session session(*engines[static_cast<std::size_t>(r)], {.temperature = 0}, &group.rank(r));
      auto result = generate(session, prompt, greedy_steps(steps, &o.logits));
      o.status = result.status();
      o.tokens = session.tokens();
    });
  }
  for (std::thread& t : threads) t.join();
  return out;
}

void expect_same_generation(int prompt_tokens, int ranks) {
  auto file = synthetic_file();
  const auto prompt = prompt_of(prompt_tokens);
  const Outcome one = alone(file, prompt, 12);
  ASSERT_TRUE(one.status) << one.status.to_string();
  const std::vector<Outcome> many = spread(file, prompt, 12, ranks);
  for (int r = 0; r < ranks; ++r) {
    const Outcome& o = many[static_cast<std::size_t>(r)];
    ASSERT_TRUE(o.status) << "rank " << r << ": " << o.status.to_string();
    EXPECT_EQ(o.tokens, one.tokens) << "rank " << r;
  }
  // Rank 0's logits at every step: the same numbers up to the summation order of the attention
  // (the shards' partial outputs merge by lse), relative to the logits' scale.
  const Outcome& first = many[0];
  ASSERT_EQ(first.logits.size(), one.logits.size());
  for (std::size_t step = 0; step < one.logits.size(); ++step) {
    ASSERT_EQ(first.logits[step].size(), one.logits[step].size());
    double worst = 0.0, scale = 1.0;
    for (std::size_t i = 0; i < one.logits[step].size(); ++i) {
      worst = std::max(worst, double(std::fabs(first.logits[step][i] - one.logits[step][i])));
      scale = std::max(scale, double(std::fabs(one.logits[step][i])));
    }
    EXPECT_LT(worst, 1e-4 * scale) << "step " << step << ", logits up to " << scale;
  }
}

TEST(ContextParallel, TwoRanksGenerateWhatOneEngineDoes) { expect_same_generation(57, 2); }
TEST(ContextParallel, ThreeRanksGenerateWhatOneEngineDoes) { expect_same_generation(100, 3); }
TEST(ContextParallel, FourRanksGenerateWhatOneEngineDoes) { expect_same_generation(61, 4); }

// Fewer prompt tokens than chunks: some ranks hold no rows of the prompt, join every collective
// all the same, and their shards start empty.
TEST(ContextParallel, APromptShorterThanTheChunksLeavesRanksWithoutRows) { expect_same_generation(3, 4); }

TEST(ContextParallel, ThePromptChunksCoverItOnceAndTheLastIsRankZeros) {
  for (const int ranks : {1, 2, 3, 4}) {
    for (const std::int64_t tokens : {1, 5, 8, 57}) {
      std::vector<int> seen(static_cast<std::size_t>(tokens), 0);
      for (int r = 0; r < ranks; ++r) {
        for (const int chunk : {r, 2 * ranks - 1 - r}) {
          const auto [begin, end] = model::LlamaModel::context_parallel_chunk(tokens, chunk, ranks);
          for (std::int64_t p = begin; p < end; ++p) ++seen[static_cast<std::size_t>(p)];
          if (r == 0 && chunk == 2 * ranks - 1) {
            EXPECT_EQ(end, tokens);
          }
        }
      }
      for (std::int64_t p = 0; p < tokens; ++p) EXPECT_EQ(seen[static_cast<std::size_t>(p)], 1) << p;
    }
  }
}

TEST(ContextParallel, APrefillIntoASequenceThatHoldsKeysIsRefused) {
  auto engine = engine_for(synthetic_file());
  testing::ThreadGroup group(1);
  ops::KvCache& cache = engine->cache();
  const ops::SeqId seq = cache.add_sequence();
  ASSERT_TRUE(cache.reserve(seq, 4));
  std::vector<float> logits(engine->config().vocab_size);
  std::int64_t keys = 0;
  const auto prompt = prompt_of(8);
  const Status s = engine->model().prefill_context_parallel(seq, prompt, cache, engine->dispatcher(), group.rank(0),
                                                            logits.data(), &keys);
  EXPECT_EQ(s.code(), ErrorCode::invalid_argument) << s.to_string();
  EXPECT_EQ(s.field(), "seq");
}

}  // namespace
}  // namespace kallpa::runtime
