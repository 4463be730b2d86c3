// The engine: a model file made runnable — weights, tokenizer, KV cache, device ops and the
// attention dispatcher — and sessions that generate text with it.
//
//   auto engine = Engine::load({.model_path = "models/SmolLM2-135M-Instruct.Q4_1.gguf"});
//   Session session(**engine, {.temperature = 0});
//   auto result = generate(session, prompt_ids, {.max_tokens = 64}, [](std::string_view t) { ... });
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kallpa/dispatcher.h"
#include "kallpa/model/llama_model.h"
#include "kallpa/observer.h"
#include "kallpa/ops/kv_cache.h"
#include "kallpa/ops/ops.h"
#include "kallpa/process_group.h"
#include "kallpa/runtime/grammar.h"
#include "kallpa/runtime/sampler.h"
#include "kallpa/tokenizer/chat.h"
#include "kallpa/tokenizer/chat_template.h"
#include "kallpa/tokenizer/tokenizer.h"

namespace kallpa::runtime {

// How far a load has come, for a progress indicator: `done` of `total` bytes of weights paged in.
struct LoadProgress {
  std::uint64_t done = 0;
  std::uint64_t total = 0;
};

struct EngineOptions {
  std::string model_path;
  // Called from the loading thread as weights are paged in (never after load returns).
  std::function<void(const LoadProgress&)> on_progress;
  // Where the model runs: "cpu", "opencl[:N]", "cuda[:N]" (ops/ops.h). On a device, an op it
  // lacks runs on the CPU with copies (counted: Engine::op_fallbacks()) unless strict_device.
  std::string device = "cpu";
  bool strict_device = false;
  DispatchOptions attention;         // which attention backends; default: automatic
  ops::KvCacheOptions cache;         // capacity over all sessions
  std::int64_t prefill_chunk = 256;  // prompt tokens per forward pass
};

class Engine {
 public:
  static Result<std::unique_ptr<Engine>> load(const EngineOptions& options);
  // From a file already opened (tests, tools); options.model_path is ignored.
  static Result<std::unique_ptr<Engine>> load(std::shared_ptr<const model::GgufFile> file,
                                              const EngineOptions& options);

  const EngineOptions& options() const noexcept { return options_; }
  const model::ModelConfig& config() const noexcept { return model_->config(); }
  model::LlamaModel& model() noexcept { return *model_; }
  ops::KvCache& cache() noexcept { return *cache_; }
  ops::Ops& ops() noexcept { return *ops_; }
  Dispatcher& dispatcher() noexcept { return *dispatcher_; }
  const tokenizer::Tokenizer& tokenizer() const noexcept { return *tokenizer_; }
  const tokenizer::ChatMlOptions& chat_options() const noexcept { return chat_; }
  // How chat prompts are made: the file's template, or a built-in format when it has none (logged
  // at load).
  const tokenizer::ChatFormat& chat_format() const noexcept { return chat_format_; }
  // Per-backend attention calls and latency since load.
  const StatsObserver& attention_stats() const noexcept { return *stats_; }
  // Ops the device lacked that ran on the CPU since load, by op name (empty on the CPU).
  std::map<std::string, std::uint64_t> op_fallbacks() const;
  // Where the model, its activations and the KV cache keep their host memory (none of it when
  // they live on a device), for accounting.
  std::vector<ops::MemoryRegion> memory_regions() const;

 private:
  Engine() = default;
  EngineOptions options_;
  // Declared first, destroyed last: the model's weights and the cache live in its memory.
  std::unique_ptr<ops::Ops> ops_;
  std::unique_ptr<model::LlamaModel> model_;
  std::unique_ptr<ops::KvCache> cache_;
  std::unique_ptr<Dispatcher> dispatcher_;
  std::shared_ptr<StatsObserver> stats_;
  std::optional<tokenizer::Tokenizer> tokenizer_;
  tokenizer::ChatMlOptions chat_;
  tokenizer::ChatFormat chat_format_;
};

// One conversation's state: a sequence in the engine's KV cache, the tokens so far, the sampler
// and the logits of the last token. One thread at a time.
//
// Context parallelism (docs/scale-out.md): given a process group of more than one rank, the
// session's sequence is spread over the ranks. Every rank makes the same calls in the same order.
// A prompt fed to an empty session is split over the ranks (LlamaModel::prefill_context_parallel);
// every later token, and every token of a later feed, is a decode step whose K/V one rank keeps
// (decode_context_parallel). Only rank 0 has logits: it samples, and sample() hands its token to
// every rank. rewind() goes back to the start, as the shards keep no positions to cut at.
class Session {
 public:
  Session(Engine& engine, SamplingParams sampling, ProcessGroup* context_parallel = nullptr);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // Runs tokens through the model (in chunks), after what is already there. Several tokens are a
  // prompt (exact activations in every chunk); one token is a decode step (ops/ops.h).
  Status feed(std::span<const std::int32_t> tokens);
  // Picks the next token from the last logits (does not feed it), among the tokens `allowed`
  // when it is not empty (a token bitmask: Sampler::sample).
  Result<std::int32_t> sample(std::span<const std::uint32_t> allowed = {});
  // Empties the context and restarts the sampler's random stream.
  void reset();
  // Forgets every token from `position` on (clamped to [0, position()]) and frees their KV blocks;
  // the logits are gone too, so feed at least one token before sampling again. position() then
  // tells where it stands (lower than asked only as KvCache::truncate describes).
  void rewind(std::int64_t position);

  std::int64_t position() const noexcept { return static_cast<std::int64_t>(tokens_.size()); }
  const std::vector<std::int32_t>& tokens() const noexcept { return tokens_; }
  // Empty on ranks other than 0 of a context-parallel session.
  std::span<const float> logits() const noexcept { return logits_; }
  // The group the sequence is spread over (null: this process alone).
  ProcessGroup* context_parallel() const noexcept { return group_; }
  Engine& engine() noexcept { return *engine_; }
  // The session's sequence in the engine's KV cache, for callers that batch several sessions'
  // tokens into one LlamaModel::forward themselves (feed() and sample() then no longer apply).
  ops::SeqId seq() const noexcept { return seq_; }

 private:
  Status feed_context_parallel(std::span<const std::int32_t> tokens);

  Engine* engine_;
  Sampler sampler_;
  ops::SeqId seq_;
  ProcessGroup* group_ = nullptr;  // set only for a group of more than one rank
  std::int64_t shard_keys_ = 0;    // keys this rank's shard holds
  std::vector<std::int32_t> tokens_;
  std::vector<float> logits_;
  std::vector<float> scratch_;
};

struct GenerateOptions {
  std::int64_t max_tokens = 128;
  std::vector<std::string> stop;  // stop strings (not included in the text)
  bool stop_at_eos = true;        // stop at every end-of-generation token (Tokenizer::is_eog)
  // Structured output (runtime/grammar.h): only tokens the grammar allows; stops ("stop") when it
  // is complete and allows nothing more, or at an end-of-generation token. Null: unconstrained.
  std::shared_ptr<const CompiledGrammar> grammar;
  // Called after each sampled token, before it is fed, with the logits it was sampled from.
  std::function<void(std::int32_t token, std::span<const float> logits)> on_token;
};

struct GenerateResult {
  std::string text;
  std::int64_t prompt_tokens = 0;
  std::int64_t generated_tokens = 0;
  std::string finish_reason;  // "stop" (an end-of-generation token or a stop string) or "length"
  double prefill_seconds = 0.0;
  double decode_seconds = 0.0;
};

// Length of the longest suffix of `text` that is a proper prefix of some stop string: that much
// streamed text must be held back, since the next token may complete the stop string.
std::size_t held_back(std::string_view text, const std::vector<std::string>& stops);

// Feeds the prompt, then samples and feeds until an end-of-generation token, a stop string, max_tokens or the context
// limit (an error when even the prompt does not fit). on_text receives text as it becomes final
// (never text that could still turn out to be part of a stop string).
Result<GenerateResult> generate(Session& session, std::span<const std::int32_t> prompt, const GenerateOptions& options,
                                const std::function<void(std::string_view)>& on_text = {});

}  // namespace kallpa::runtime
