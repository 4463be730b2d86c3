// The sampler's cost per draw at SmolLM2's 49152-token vocabulary, unfiltered (the server's
// OpenAI defaults: every token weighed, no sort) beside the filtered paths that sort lazily.
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "kallpa/runtime/sampler.h"

namespace {

using kallpa::runtime::Sampler;
using kallpa::runtime::SamplingParams;

// A normal bulk of the given spread, and with `head` a few dozen tokens well above it.
std::vector<float> logits_of(float spread, bool head) {
  std::mt19937_64 gen(7);
  std::normal_distribution<float> bulk(0.0f, spread);
  std::vector<float> logits(49152);
  for (float& l : logits) l = bulk(gen);
  for (int i = 0; head && i < 40; ++i) {
    logits[static_cast<std::size_t>(gen() % logits.size())] += 12.0f - 0.25f * static_cast<float>(i);
  }
  return logits;
}

void run(benchmark::State& state, SamplingParams params, bool peaked) {
  const std::vector<float> base = peaked ? logits_of(2.0f, true) : logits_of(0.1f, false);
  std::vector<float> logits = base;
  Sampler sampler(params);
  for (auto _ : state) {
    state.PauseTiming();
    logits = base;
    state.ResumeTiming();
    benchmark::DoNotOptimize(sampler.sample(logits, {}));
  }
}

// peaked: a head of likely tokens (the usual case); flat: a spread of 0.1 and no head, the worst
// case for a walk from the most likely down.
constexpr SamplingParams kUnfiltered{.temperature = 0.8f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f};
constexpr SamplingParams kTopP{.temperature = 0.8f, .top_k = 0, .top_p = 0.95f, .min_p = 0.0f};
void BM_unfiltered_peaked(benchmark::State& s) { run(s, kUnfiltered, true); }
void BM_unfiltered_flat(benchmark::State& s) { run(s, kUnfiltered, false); }
void BM_top_p_peaked(benchmark::State& s) { run(s, kTopP, true); }
void BM_top_p_flat(benchmark::State& s) { run(s, kTopP, false); }
void BM_cli_defaults_peaked(benchmark::State& s) { run(s, SamplingParams{}, true); }

}  // namespace

BENCHMARK(BM_unfiltered_peaked);
BENCHMARK(BM_unfiltered_flat);
BENCHMARK(BM_top_p_peaked);
BENCHMARK(BM_top_p_flat);
BENCHMARK(BM_cli_defaults_peaked);
BENCHMARK_MAIN();
