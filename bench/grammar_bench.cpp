// What structured output adds to a decode step at SmolLM2's 49152-token vocabulary: the grammar
// matcher's mask and accept per token (replaying a JSON answer token by token), and the sampler
// with that mask beside the sampler without one; also the one-off costs, the vocabulary's
// preparation (once per model) and a schema's compilation (once per schema, then cached).
// Needs models/SmolLM2-135M-Instruct.Q4_1.gguf (or KALLPA_MODEL): only its vocabulary is read.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kallpa/model/gguf.h"
#include "kallpa/model/gguf_tokenizer.h"
#include "kallpa/runtime/grammar.h"
#include "kallpa/runtime/sampler.h"

namespace {

using namespace kallpa;

constexpr const char* kSchema = R"({"type": "object", "properties": {
  "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
  "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
  "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
              "required": ["city", "zip"]}},
  "required": ["name", "age", "tags", "address"]})";
// What the grammar allows (compact separators), as a model would write it.
constexpr const char* kAnswer =
    R"({"name": "Ada Lovelace, Countess of Lovelace", "age": 36, "tags": ["red", "blue"], "address": {"city": "London", "zip": "W1J 7NT"}})";

struct Fixture {
  std::optional<tokenizer::Tokenizer> tok;
  std::unique_ptr<runtime::GrammarCompiler> compiler;
  std::shared_ptr<const runtime::CompiledGrammar> grammar;
  std::vector<std::int32_t> answer;
  std::int64_t vocab = 0;
  double prepare_seconds = 0.0, compile_seconds = 0.0;
  std::string error;
};

const Fixture& fixture() {
  static const Fixture f = [] {
    Fixture out;
    const char* env = std::getenv("KALLPA_MODEL");
    const std::string path = env ? env : "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    auto file = model::GgufFile::open(path);
    if (!file) {
      out.error = path + ": " + file.status().to_string();
      return out;
    }
    auto tok = model::tokenizer_from_gguf(**file);
    if (!tok) {
      out.error = tok.status().to_string();
      return out;
    }
    out.tok.emplace(std::move(*tok));
    out.vocab = static_cast<std::int64_t>(out.tok->vocab_size());
    using clock = std::chrono::steady_clock;
    const auto t0 = clock::now();
    auto compiler = runtime::GrammarCompiler::create(*out.tok, out.vocab);
    const auto t1 = clock::now();
    if (!compiler) {
      out.error = compiler.status().to_string();
      return out;
    }
    out.compiler = std::move(*compiler);
    auto grammar = out.compiler->compile({.kind = runtime::GrammarKind::json_schema, .source = kSchema});
    const auto t2 = clock::now();
    if (!grammar) {
      out.error = grammar.status().to_string();
      return out;
    }
    out.grammar = *grammar;
    out.prepare_seconds = std::chrono::duration<double>(t1 - t0).count();
    out.compile_seconds = std::chrono::duration<double>(t2 - t1).count();
    auto ids = out.tok->encode(kAnswer, {.add_special = false, .parse_special = false});
    if (!ids) {
      out.error = ids.status().to_string();
      return out;
    }
    out.answer = *ids;
    return out;
  }();
  return f;
}

bool ready(benchmark::State& state) {
  if (fixture().error.empty()) return true;
  state.SkipWithError(fixture().error.c_str());
  return false;
}

// The one-off costs, reported as counters (each measured once, at the fixture's construction).
void BM_OneOffCosts(benchmark::State& state) {
  if (!ready(state)) return;
  for (auto _ : state) benchmark::DoNotOptimize(fixture().grammar.get());
  state.counters["prepare_vocab_ms"] = fixture().prepare_seconds * 1e3;
  state.counters["compile_schema_ms"] = fixture().compile_seconds * 1e3;
}
BENCHMARK(BM_OneOffCosts)->Iterations(1);

// Per token: the mask for the next step, then accepting the token (the answer's tokens in turn;
// a fresh matcher when the answer is done, whose construction is counted too).
void BM_MaskAndAcceptPerToken(benchmark::State& state) {
  if (!ready(state)) return;
  const Fixture& f = fixture();
  auto matcher = std::make_unique<runtime::GrammarMatcher>(f.grammar);
  std::size_t i = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(matcher->next_mask().data());
    if (!matcher->accept(f.answer[i]).is_ok()) {
      state.SkipWithError("the answer does not follow the schema");
      return;
    }
    if (++i == f.answer.size()) {
      i = 0;
      matcher = std::make_unique<runtime::GrammarMatcher>(f.grammar);
    }
  }
  state.counters["answer_tokens"] = static_cast<double>(f.answer.size());
}
BENCHMARK(BM_MaskAndAcceptPerToken)->Unit(benchmark::kMicrosecond);

std::vector<float> random_logits(std::int64_t vocab) {
  std::mt19937_64 gen(7);
  std::normal_distribution<float> bulk(0.0f, 2.0f);
  std::vector<float> logits(static_cast<std::size_t>(vocab));
  for (float& l : logits) l = bulk(gen);
  return logits;
}

// The sampler alone (greedy or OpenAI's defaults: temperature 1, no filter), with each of the
// answer's masks in turn (arg 1) or none (arg 0): what the hook adds to a draw.
void BM_Sample(benchmark::State& state) {
  if (!ready(state)) return;
  const Fixture& f = fixture();
  const bool masked = state.range(0) != 0;
  const bool greedy = state.range(1) != 0;
  std::vector<std::vector<std::uint32_t>> masks;
  runtime::GrammarMatcher matcher(f.grammar);
  for (std::int32_t t : f.answer) {
    auto m = matcher.next_mask();
    masks.emplace_back(m.begin(), m.end());
    (void)matcher.accept(t);
  }
  const std::vector<float> base = random_logits(f.vocab);
  std::vector<float> logits = base;
  runtime::Sampler sampler(
      greedy ? runtime::SamplingParams{.temperature = 0.0f}
             : runtime::SamplingParams{.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f});
  std::size_t i = 0;
  for (auto _ : state) {
    state.PauseTiming();
    logits = base;
    state.ResumeTiming();
    benchmark::DoNotOptimize(sampler.sample(
        logits, {}, masked ? std::span<const std::uint32_t>(masks[i]) : std::span<const std::uint32_t>()));
    i = (i + 1) % masks.size();
  }
}
BENCHMARK(BM_Sample)->ArgNames({"masked", "greedy"})->ArgsProduct({{0, 1}, {0, 1}})->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
