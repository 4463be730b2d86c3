// A model file from untrusted bytes, through everything that reads it: the GGUF parser, the Llama
// hyperparameters and tensor table, the tokenizer and chat template, the engine's load (weights
// placed and repacked, KV cache sized) and one short generation. Each stage accepts the file or
// returns a typed error; an accepted file's tensors lie inside it, and a model that loads runs.
#include <span>
#include <vector>

#include "fuzz_target.h"
#include "kallpa/model/gguf.h"
#include "kallpa/model/gguf_tokenizer.h"
#include "kallpa/model/llama.h"
#include "kallpa/runtime/engine.h"

namespace {

// Every typed error names where; an error that says nothing is a finding too.
void check_error(const kallpa::Status& s) {
  FUZZ_CHECK(!s.is_ok(), "not an error");
  FUZZ_CHECK(!s.field().empty() || !s.message().empty(), "an error that names nothing");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  auto file = kallpa::model::GgufFile::from_bytes(bytes, "fuzz.gguf");
  if (!file) {
    check_error(file.status());
    return 0;
  }
  const auto& f = **file;
  for (const auto& t : f.tensors()) {
    FUZZ_CHECK(t.file_offset <= f.file_size() && t.nbytes <= f.file_size() - t.file_offset,
               "a tensor lies outside the file");
    (void)t.shape_string();
  }
  if (auto config = kallpa::model::load_llama_config(f); !config) check_error(config.status());
  if (auto tok = kallpa::model::tokenizer_from_gguf(f); tok) {
    (void)tok->encode("Hello, world! 123 <|im_start|>");
  } else {
    check_error(tok.status());
  }
  (void)kallpa::model::chat_options_from_gguf(f);

  kallpa::runtime::EngineOptions options;
  options.cache.max_tokens = 64;
  options.prefill_chunk = 4;
  auto engine = kallpa::runtime::Engine::load(*file, options);
  if (!engine) {
    check_error(engine.status());
    return 0;
  }
  // A model that loads must run: a short prompt (in two chunks) and a few sampled tokens.
  kallpa::runtime::Session session(**engine, {.temperature = 0});
  const auto vocab = static_cast<std::int32_t>((*engine)->config().vocab_size);
  std::vector<std::int32_t> prompt;
  for (std::int32_t i = 0; i < 6; ++i) prompt.push_back(i % vocab);
  if (kallpa::Status s = session.feed(prompt); !s) {
    check_error(s);
    return 0;
  }
  for (int i = 0; i < 3; ++i) {
    auto next = session.sample();
    FUZZ_CHECK(next.is_ok(), "sampling after a successful forward failed");
    FUZZ_CHECK(*next >= 0 && *next < vocab, "a sampled token outside the vocabulary");
    if (kallpa::Status s = session.feed({&*next, 1}); !s) {
      check_error(s);
      return 0;
    }
  }
  return 0;
}
