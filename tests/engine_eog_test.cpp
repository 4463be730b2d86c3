// Generation ends at every end-of-generation token the file names (Tokenizer::is_eog), not only
// at EOS: a synthetic model whose file names, as its eot token, the token greedy decoding picks
// first stops before emitting it. GenerateOptions::on_token sees each sampled token with the
// logits it was sampled from.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "kallpa/model/gguf.h"
#include "kallpa/runtime/engine.h"
#include "support/synthetic_llama.h"

namespace kallpa::runtime {
namespace {

std::unique_ptr<Engine> engine_from(const model::GgufWriter& writer) {
  auto file = model::GgufFile::from_bytes(writer.finish(), "synthetic");
  EXPECT_TRUE(file.is_ok()) << file.status().to_string();
  EngineOptions o;
  o.cache.max_tokens = 256;
  auto e = Engine::load(*file, o);
  EXPECT_TRUE(e.is_ok()) << e.status().to_string();
  return e.is_ok() ? std::move(*e) : nullptr;
}

TEST(EngineEndOfGeneration, StopsAtTheEotTokenTheFileNames) {
  const std::vector<std::int32_t> prompt = {3, 40, 77, 120, 9};
  auto plain = engine_from(model::synthetic_llama_writer());
  ASSERT_NE(plain, nullptr);
  std::vector<std::int32_t> seen;
  GenerateOptions o;
  o.max_tokens = 4;
  o.stop_at_eos = false;
  o.on_token = [&](std::int32_t token, std::span<const float> logits) {
    seen.push_back(token);
    ASSERT_EQ(logits.size(), plain->tokenizer().vocab_size());
    EXPECT_EQ(std::max_element(logits.begin(), logits.end()) - logits.begin(), token);  // greedy
  };
  Session s(*plain, {.temperature = 0});
  auto r = generate(s, prompt, o);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  ASSERT_EQ(seen.size(), 4u);
  const std::int32_t first = seen.front();
  ASSERT_FALSE(plain->tokenizer().is_eog(first)) << "the synthetic model's first token is already an end";

  model::GgufWriter w = model::synthetic_llama_writer();
  w.add_u32("tokenizer.ggml.eot_token_id", static_cast<std::uint32_t>(first));
  auto with_eot = engine_from(w);
  ASSERT_NE(with_eot, nullptr);
  EXPECT_TRUE(with_eot->tokenizer().is_eog(first));
  Session s2(*with_eot, {.temperature = 0});
  GenerateOptions stop;
  stop.max_tokens = 4;
  auto stopped = generate(s2, prompt, stop);
  ASSERT_TRUE(stopped.is_ok()) << stopped.status().to_string();
  EXPECT_EQ(stopped->finish_reason, "stop");
  EXPECT_EQ(stopped->generated_tokens, 0);
  EXPECT_EQ(stopped->text, "");
  // With stop_at_eos off the same file runs on to the limit.
  Session s3(*with_eot, {.temperature = 0});
  auto on = generate(s3, prompt, o);
  ASSERT_TRUE(on.is_ok());
  EXPECT_EQ(on->generated_tokens, 4);
  EXPECT_EQ(on->finish_reason, "length");
}

}  // namespace
}  // namespace kallpa::runtime
