// The sampler's cost per draw at SmolLM2's 49152-token vocabulary, unfiltered (the server's
// OpenAI defaults: every token weighed, no sort) beside the filtered paths that sort lazily.
// Logits follow a model-like shape: a normal bulk and a few dozen tokens well above it.
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "kallpa/runtime/sampler.h"

namespace {

using kallpa::runtime::Sampler;
using kallpa::runtime::SamplingParams;

std::vector<float> model_like_logits(float spread) {
  std::mt19937_64 gen(7);
  std::normal_distribution<float> bulk(0.0f, spread);
  std::vector<float> logits(49152);
  for (float& l : logits) l = bulk(gen);
  for (int i = 0; i < 40; ++i) logits[static_cast<std::size_t>(gen() % logits.size())] += 12.0f - 0.25f * static_cast<float>(i);
  return logits;
}

void run(benchmark::State& state, SamplingParams params, float spread) {
  const std::vector<float> base = model_like_logits(spread);
  std::vector<float> logits = base;
  Sampler sampler(params);
  for (auto _ : state) {
    state.PauseTiming();
    logits = base;
    state.ResumeTiming();
    benchmark::DoNotOptimize(sampler.sample(logits, {}));
  }
}

// spread 2: a peaked distribution (the usual case); spread 0.1: nearly flat, the worst case for
// a walk from the most likely down.
void BM_unfiltered_peaked(benchmark::State& s) { run(s, {.temperature = 0.8f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f}, 2.0f); }
void BM_unfiltered_flat(benchmark::State& s) { run(s, {.temperature = 0.8f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f}, 0.1f); }
void BM_top_p_peaked(benchmark::State& s) { run(s, {.temperature = 0.8f, .top_k = 0, .top_p = 0.95f, .min_p = 0.0f}, 2.0f); }
void BM_top_p_flat(benchmark::State& s) { run(s, {.temperature = 0.8f, .top_k = 0, .top_p = 0.95f, .min_p = 0.0f}, 0.1f); }
void BM_cli_defaults_peaked(benchmark::State& s) { run(s, SamplingParams{}, 2.0f); }

}  // namespace

BENCHMARK(BM_unfiltered_peaked);
BENCHMARK(BM_unfiltered_flat);
BENCHMARK(BM_top_p_peaked);
BENCHMARK(BM_top_p_flat);
BENCHMARK(BM_cli_defaults_peaked);
BENCHMARK_MAIN();
