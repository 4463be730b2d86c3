// Structured output: the sampler's token-mask hook (masked tokens are never drawn, greedy or
// sampled), the grammar matcher on a small byte vocabulary (its masks step by step, control tokens
// never allowed, end-of-generation only where the grammar is complete), typed compile errors, and
// the scheduler and generate() on a synthetic Llama with random weights, whose constrained output
// must parse and match the schema whatever the weights say.
#include <gtest/gtest.h>

#include <cmath>
#include <condition_variable>
#include <limits>
#include <mutex>
#include <set>

#include <nlohmann/json.hpp>

#include "kallpa/model/gguf.h"
#include "kallpa/runtime/engine.h"
#include "kallpa/runtime/grammar.h"
#include "kallpa/runtime/sampler.h"
#include "kallpa/runtime/scheduler.h"
#include "support/byte_tokenizer.h"
#include "support/synthetic_llama.h"

namespace kallpa::runtime {
namespace {

using nlohmann::json;

std::vector<std::uint32_t> mask_of(std::size_t vocab, const std::set<std::int32_t>& allowed) {
  std::vector<std::uint32_t> m(token_mask_words(static_cast<std::int64_t>(vocab)), 0u);
  for (std::int32_t id : allowed) m[static_cast<std::size_t>(id) / 32] |= 1u << (id % 32);
  return m;
}

bool allowed_in(std::span<const std::uint32_t> mask, std::int32_t id) {
  return (mask[static_cast<std::size_t>(id) / 32] >> (id % 32) & 1u) != 0;
}

TEST(TokenMask, MasksExactlyTheTokensLeftOut) {
  std::vector<float> logits(70);
  for (std::size_t i = 0; i < logits.size(); ++i) logits[i] = static_cast<float>(i) * 0.5f - 10.0f;
  const std::set<std::int32_t> keep = {1, 31, 32, 33, 64, 69};
  const auto original = logits;
  apply_token_mask(logits, mask_of(logits.size(), keep));
  for (std::int32_t i = 0; i < 70; ++i) {
    if (keep.count(i)) {
      EXPECT_EQ(logits[static_cast<std::size_t>(i)], original[static_cast<std::size_t>(i)]) << i;
    } else {
      EXPECT_EQ(logits[static_cast<std::size_t>(i)], -std::numeric_limits<float>::infinity()) << i;
    }
  }
  // A mask shorter than the logits allows nothing past its end.
  std::vector<float> more(40, 1.0f);
  const std::uint32_t one_word[] = {0xffffffffu};
  apply_token_mask(more, one_word);
  for (std::size_t i = 0; i < more.size(); ++i) EXPECT_EQ(std::isinf(more[i]), i >= 32) << i;
}

TEST(TokenMask, SamplerNeverDrawsAMaskedToken) {
  const std::size_t vocab = 300;
  std::vector<float> base(vocab);
  for (std::size_t i = 0; i < vocab; ++i) base[i] = static_cast<float>(std::sin(double(i) * 0.7) * 3.0);
  std::set<std::int32_t> keep;
  for (std::int32_t i = 2; i < static_cast<std::int32_t>(vocab); i += 7) keep.insert(i);
  const auto mask = mask_of(vocab, keep);

  // Greedy: the best allowed token, not the best overall.
  std::int32_t best_allowed = -1;
  for (std::int32_t id : keep) {
    if (best_allowed < 0 || base[static_cast<std::size_t>(id)] > base[static_cast<std::size_t>(best_allowed)]) {
      best_allowed = id;
    }
  }
  Sampler greedy({.temperature = 0.0f});
  auto l = base;
  const std::int32_t unmasked = greedy.sample(l, {});
  ASSERT_FALSE(keep.count(unmasked)) << "the unmasked argmax must be a masked token for this test to mean anything";
  l = base;
  EXPECT_EQ(greedy.sample(l, {}, mask), best_allowed);

  // Sampled, with every filter path: unfiltered, top-k, top-p, min-p, and a repetition penalty.
  const SamplingParams variants[] = {
      {.temperature = 1.5f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f},
      {.temperature = 1.5f, .top_k = 40, .top_p = 1.0f, .min_p = 0.0f},
      {.temperature = 1.5f, .top_k = 0, .top_p = 0.9f, .min_p = 0.0f},
      {.temperature = 1.5f, .top_k = 0, .top_p = 1.0f, .min_p = 0.01f},
      {.temperature = 0.8f, .top_k = 40, .top_p = 0.95f, .min_p = 0.05f, .repetition_penalty = 1.3f},
  };
  for (const SamplingParams& p : variants) {
    Sampler s(p);
    std::set<std::int32_t> drawn;
    const std::vector<std::int32_t> recent = {2, 9, 16, 5};
    for (int i = 0; i < 400; ++i) {
      l = base;
      const std::int32_t t = s.sample(l, recent, mask);
      ASSERT_TRUE(keep.count(t)) << "drew masked token " << t << " (top_k " << p.top_k << ", top_p " << p.top_p << ")";
      drawn.insert(t);
    }
    EXPECT_GT(drawn.size(), 1u) << "the draws should spread over several allowed tokens";
  }
}

using test::byte_token;
using test::byte_tokenizer;

std::string allowed_bytes(std::span<const std::uint32_t> mask) {
  std::string out;
  for (int b = 0; b < 256; ++b) {
    if (allowed_in(mask, byte_token(static_cast<char>(b)))) out += static_cast<char>(b);
  }
  return out;
}

TEST(GrammarMatcher, StepsThroughASchemaOnAByteVocabulary) {
  const auto tok = byte_tokenizer();
  auto compiler = GrammarCompiler::create(tok, static_cast<std::int64_t>(tok.vocab_size()) + 5);
  ASSERT_TRUE(compiler.is_ok()) << compiler.status().to_string();
  auto grammar = (*compiler)->compile(
      {.kind = GrammarKind::json_schema,
       .source = R"({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})"});
  ASSERT_TRUE(grammar.is_ok()) << grammar.status().to_string();
  GrammarMatcher m(*grammar);
  const std::string text = R"({"ok": false})";
  for (std::size_t i = 0; i < text.size(); ++i) {
    auto mask = m.next_mask();
    ASSERT_EQ(mask.size(), token_mask_words(static_cast<std::int64_t>(tok.vocab_size()) + 5));
    for (std::int32_t control = 0; control < 3; ++control) EXPECT_FALSE(allowed_in(mask, control)) << "at " << i;
    for (std::int32_t pad = static_cast<std::int32_t>(tok.vocab_size());
         pad < static_cast<std::int32_t>(tok.vocab_size()) + 5; ++pad) {
      EXPECT_FALSE(allowed_in(mask, pad)) << "padding id " << pad;
    }
    const std::string bytes = allowed_bytes(mask);
    if (i == 7) {
      EXPECT_EQ(bytes, "ft") << "after '{\"ok\": ' only true or false may begin";
    } else if (i != 2 && i != 3) {  // the key's characters: '"o' then 'k' (a key is a string)
      EXPECT_EQ(bytes, std::string(1, text[i])) << "at " << i;
    }
    EXPECT_FALSE(m.finished());
    ASSERT_TRUE(m.accept(byte_token(text[i])).is_ok()) << "at " << i;
  }
  // Complete: only the end of generation may follow, so generation is over.
  EXPECT_TRUE(m.finished());
  EXPECT_EQ(allowed_bytes(m.next_mask()), "");
  EXPECT_TRUE(allowed_in(m.next_mask(), 2));
  EXPECT_TRUE(m.accept(2).is_ok());
  EXPECT_TRUE(m.finished());
  const Status after = m.accept(byte_token(' '));
  EXPECT_EQ(after.code(), ErrorCode::invalid_argument);
  EXPECT_EQ(after.field(), "grammar");
}

TEST(GrammarMatcher, RefusesATokenTheGrammarDoesNotAllow) {
  const auto tok = byte_tokenizer();
  auto compiler = GrammarCompiler::create(tok, static_cast<std::int64_t>(tok.vocab_size()));
  ASSERT_TRUE(compiler.is_ok()) << compiler.status().to_string();
  auto grammar = (*compiler)->compile(GrammarSpec{});  // json: any object
  ASSERT_TRUE(grammar.is_ok()) << grammar.status().to_string();
  GrammarMatcher m(*grammar);
  EXPECT_EQ(allowed_bytes(m.next_mask()), "{") << "json_object: the top level is an object";
  for (std::int32_t bad : {byte_token('['), std::int32_t{2}, std::int32_t{1}, std::int32_t{-1}, std::int32_t{100000}}) {
    const Status s = m.accept(bad);
    EXPECT_EQ(s.code(), ErrorCode::invalid_argument) << bad;
    EXPECT_EQ(s.field(), "grammar") << bad;
  }
  EXPECT_TRUE(m.accept(byte_token('{')).is_ok()) << "a refused token leaves the matcher where it was";
}

TEST(GrammarCompiler, ErrorsNameThePart) {
  const auto tok = byte_tokenizer();
  auto compiler = GrammarCompiler::create(tok, static_cast<std::int64_t>(tok.vocab_size()));
  ASSERT_TRUE(compiler.is_ok()) << compiler.status().to_string();
  auto not_json = (*compiler)->compile({.kind = GrammarKind::json_schema, .source = "{\"type\": "});
  ASSERT_FALSE(not_json.is_ok());
  EXPECT_EQ(not_json.status().code(), ErrorCode::invalid_argument);
  EXPECT_EQ(not_json.status().field(), "schema");
  auto dangling = (*compiler)->compile(
      {.kind = GrammarKind::json_schema,
       .source = R"({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]})"});
  ASSERT_FALSE(dangling.is_ok());
  EXPECT_EQ(dangling.status().field(), "schema");
  EXPECT_NE(dangling.status().message().find("missing"), std::string::npos) << dangling.status().message();
  auto ebnf = (*compiler)->compile({.kind = GrammarKind::ebnf, .source = "root ::= \"a\" undefined_rule"});
  ASSERT_FALSE(ebnf.is_ok());
  EXPECT_EQ(ebnf.status().field(), "grammar");
  auto too_small = GrammarCompiler::create(tok, 10);
  ASSERT_FALSE(too_small.is_ok());
  EXPECT_EQ(too_small.status().field(), "vocab_size");
}

// Bounded everywhere (string lengths, item counts, number ranges), so that even random weights end
// the object well within the token budget.
constexpr const char* kSchema = R"({
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    "ok": {"type": "boolean"},
    "kind": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": -5, "maximum": 5}]},
    "inner": {"type": "object", "properties": {"x": {"type": "number", "minimum": 0, "maximum": 1}},
              "required": ["x"], "additionalProperties": false}
  },
  "required": ["name", "age", "tags", "ok", "kind"],
  "additionalProperties": false
})";

std::size_t code_points(const std::string& s) {
  std::size_t n = 0;
  for (char c : s) n += (static_cast<unsigned char>(c) & 0xc0) != 0x80;
  return n;
}

void expect_matches_schema(const std::string& text) {
  const json v = json::parse(text, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(v.is_discarded()) << "not JSON: " << text;
  ASSERT_TRUE(v.is_object()) << text;
  const std::set<std::string> known = {"name", "age", "tags", "ok", "kind", "inner"};
  for (const auto& [key, value] : v.items()) EXPECT_TRUE(known.count(key)) << "unknown key " << key << ": " << text;
  ASSERT_TRUE(v.contains("name") && v["name"].is_string()) << text;
  EXPECT_LE(code_points(v["name"].get<std::string>()), 6u) << text;
  ASSERT_TRUE(v.contains("age") && v["age"].is_number_integer()) << text;
  EXPECT_GE(v["age"].get<std::int64_t>(), 0) << text;
  EXPECT_LE(v["age"].get<std::int64_t>(), 120) << text;
  ASSERT_TRUE(v.contains("tags") && v["tags"].is_array()) << text;
  EXPECT_LE(v["tags"].size(), 3u) << text;
  for (const json& t : v["tags"]) EXPECT_TRUE(t == "red" || t == "green" || t == "blue") << text;
  ASSERT_TRUE(v.contains("ok") && v["ok"].is_boolean()) << text;
  ASSERT_TRUE(v.contains("kind")) << text;
  const json& kind = v["kind"];
  EXPECT_TRUE(kind.is_null() || (kind.is_number_integer() && kind.get<int>() >= -5 && kind.get<int>() <= 5)) << text;
  if (v.contains("inner")) {
    const json& inner = v["inner"];
    ASSERT_TRUE(inner.is_object() && inner.size() == 1 && inner.contains("x") && inner["x"].is_number()) << text;
    EXPECT_GE(inner["x"].get<double>(), 0.0) << text;
    EXPECT_LE(inner["x"].get<double>(), 1.0) << text;
  }
}

std::unique_ptr<Engine> synthetic_engine() {
  model::SyntheticLlamaSpec spec;
  spec.context_length = 1024;
  auto file = model::GgufFile::from_bytes(model::synthetic_llama(spec), "synthetic");
  EXPECT_TRUE(file.is_ok()) << file.status().to_string();
  EngineOptions o;
  o.cache.max_tokens = 8192;
  auto e = Engine::load(*file, o);
  EXPECT_TRUE(e.is_ok()) << e.status().to_string();
  return std::move(*e);
}

TEST(StructuredOutput, RandomWeightsStillGiveValidJsonThroughTheScheduler) {
  auto engine = synthetic_engine();
  auto compiler = GrammarCompiler::create(engine->tokenizer(), engine->config().vocab_size);
  ASSERT_TRUE(compiler.is_ok()) << compiler.status().to_string();
  auto grammar = (*compiler)->compile({.kind = GrammarKind::json_schema, .source = kSchema, .strict = true});
  ASSERT_TRUE(grammar.is_ok()) << grammar.status().to_string();

  struct Result {
    std::mutex mu;
    std::condition_variable cv;
    std::string text;
    bool done = false;
    Completion completion;
  };
  constexpr int kRequests = 6;
  std::vector<Result> results(kRequests);
  {
    Scheduler sched(*engine, {});
    for (int i = 0; i < kRequests; ++i) {
      RequestOptions r;
      r.prompt = {1, 3 + 'h', 3 + 'i', 3 + static_cast<int>('0' + i)};
      // Greedy once, then hot draws that wander all over the grammar.
      r.sampling = i == 0 ? SamplingParams{.temperature = 0.0f}
                          : SamplingParams{.temperature = 3.0f,
                                           .top_k = 0,
                                           .top_p = 1.0f,
                                           .min_p = 0.0f,
                                           .seed = static_cast<std::uint64_t>(i)};
      r.max_tokens = 600;
      r.grammar = *grammar;
      Result& res = results[static_cast<std::size_t>(i)];
      RequestCallbacks cb;
      cb.on_token = [&res](std::string_view t, std::int32_t) {
        std::lock_guard lock(res.mu);
        res.text += t;
      };
      cb.on_done = [&res](const Completion& c) {
        std::lock_guard lock(res.mu);
        res.completion = c;
        res.done = true;
        res.cv.notify_all();
      };
      auto handle = sched.submit(std::move(r), std::move(cb));
      ASSERT_TRUE(handle.is_ok()) << handle.status().to_string();
    }
    for (Result& res : results) {
      std::unique_lock lock(res.mu);
      res.cv.wait(lock, [&] { return res.done; });
    }
  }
  for (Result& res : results) {
    EXPECT_EQ(res.completion.finish_reason, "stop") << res.completion.status.to_string() << ": " << res.text;
    expect_matches_schema(res.text);
  }
}

TEST(StructuredOutput, GenerateStopsWhenTheGrammarIsComplete) {
  auto engine = synthetic_engine();
  auto compiler = GrammarCompiler::create(engine->tokenizer(), engine->config().vocab_size);
  ASSERT_TRUE(compiler.is_ok()) << compiler.status().to_string();
  auto grammar = (*compiler)->compile({.kind = GrammarKind::json_schema, .source = kSchema});
  ASSERT_TRUE(grammar.is_ok()) << grammar.status().to_string();
  for (std::uint64_t seed : {0u, 1u, 2u}) {
    Session session(*engine,
                    {.temperature = seed == 0 ? 0.0f : 2.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f, .seed = seed});
    const std::vector<std::int32_t> prompt = {1, 3 + 'x'};
    std::string streamed;
    GenerateOptions options;
    options.max_tokens = 600;
    options.grammar = *grammar;
    auto r = generate(session, prompt, options, [&](std::string_view t) { streamed += t; });
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    EXPECT_EQ(r->finish_reason, "stop") << r->text;
    EXPECT_EQ(streamed, r->text);
    expect_matches_schema(r->text);
  }
}

}  // namespace
}  // namespace kallpa::runtime
