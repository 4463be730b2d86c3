// Continuous batching: many requests share the engine's forward passes.
//
// One scheduler thread owns the model. Each step it builds one batch for LlamaModel::forward:
// first one decode token for every running sequence (so a long prompt never stalls the streams
// already running), then prefill chunks of waiting prompts while the step's token budget lasts.
// Requests are admitted from a bounded FIFO queue between steps, as soon as the KV cache can hold
// their worst case (prompt + max_tokens, capped by the context): admission never over-commits the
// cache, so a running sequence never runs out of KV blocks and never touches another's.
//
//   Scheduler sched(engine, {});
//   auto handle = sched.submit({.prompt = ids, .sampling = {...}, .max_tokens = 64},
//                              {.on_text = ..., .on_done = ...});
//   handle->cancel();   // e.g. the client went away: its KV blocks are freed at the next step
//
// Batching guarantee: a request's logits are the same bits alone or batched, and its sampling
// (sampler, seed, stop, limits) is its own, so the same seed gives the same text alone or batched.
// Each floor keeps its part. The scheduler: prefill chunk boundaries are fixed positions
// (multiples of prefill_chunk) whatever else is in the batch. The forward pass: every op but
// attention is row-wise (quantised matmul whose numerics depend only on the row and its kind,
// ops/ops.h; norms, RoPE). Attention: cpu-flash, the default CPU backend, plans each sequence from
// that sequence's own shape (its path, its key chunks and splits, its kernel), never from the
// other sequences or the thread count (docs/cpu-flash.md), and the reference backend computes
// every row alone. A backend that splits a sequence's keys by what else is in the call keeps the
// logits only up to float reordering, and a draw near a boundary can then tip. tests/scheduler_test.cpp and
// tests/server (SmolLM2 at temperature 0.8, 12 concurrent requests against each alone, the solo
// runs attaching cached prompt chunks) check it.
//
// The prefix cache holds only prompt positions, the K/V of the same tokens at the same positions,
// and a request attaches them in whole prefill chunks only (KvCache::attach_prefix with the
// chunk): the blocks it attaches were computed in the chunks it would compute itself, and it goes
// on from a chunk boundary, so its logits are the bits of a run from scratch. (Attention's result
// for a prompt row depends on the rows of its chunk: cpu-flash's path, tiles and splits follow the
// chunk's length. Attaching up to any block boundary would start the rest of the prompt in a
// chunk of another length.) A shared prompt shorter than one chunk is therefore computed by every
// request; --prefill-chunk sets the granule.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "kallpa/runtime/engine.h"
#include "kallpa/runtime/grammar.h"
#include "kallpa/runtime/sampler.h"
#include "kallpa/status.h"

namespace kallpa::runtime {

struct SchedulerOptions {
  // Tokens per forward pass (decode tokens + prefill chunks). A step may exceed it by one chunk
  // when nothing else would let a waiting prompt progress.
  std::int64_t max_batch_tokens = 512;
  // Prompt tokens per prefill chunk; chunks always start at multiples of it.
  std::int64_t prefill_chunk = 256;
  std::int32_t max_running = 32;  // sequences admitted at once
  std::int64_t max_queue = 64;    // requests waiting for admission; more are refused
  // Reuse the KV blocks of earlier requests' prompts (and texts) that begin the same way
  // (KvCache::attach_prefix): a shared system prompt or a chat's history is computed once.
  bool prefix_cache = true;
};

struct RequestOptions {
  std::vector<std::int32_t> prompt;
  SamplingParams sampling;
  std::int64_t max_tokens = 128;  // also capped by the model's context
  std::vector<std::string> stop;  // stop strings: end generation, never emitted
  bool stop_at_eos = true;
  // Per generated token, report its log-probability and this many most likely alternatives
  // (RequestCallbacks::on_logprobs); -1: off. Log-probabilities are the log-softmax of the model's
  // logits before bias, penalties, temperature and filters, as vLLM and llama.cpp report them (the
  // CLI's generate --logits-top prints the same values).
  std::int32_t logprobs = -1;
  // Structured output: every token is one the grammar allows, and generation stops ("stop") once
  // the grammar is complete and allows nothing more, or at an end-of-generation token it allows
  // (whatever stop_at_eos says). Null: unconstrained.
  std::shared_ptr<const CompiledGrammar> grammar;
};

// The most alternatives a request may ask for (OpenAI's top_logprobs limit).
inline constexpr std::int32_t kMaxLogprobs = 20;

struct TokenLogprob {
  std::int32_t id = 0;
  float logprob = 0.0f;
};

// One generated token's log-probability and the most likely tokens at its step (highest first,
// ties by id).
struct TokenLogprobs {
  TokenLogprob sampled;
  std::vector<TokenLogprob> top;
};

// Fills `out` from one step's logits: the log-softmax at `token` and the `top` most likely ids.
void token_logprobs(std::span<const float> logits, std::int32_t token, std::int32_t top, TokenLogprobs& out);

struct Completion {
  Status status;              // not ok when finish_reason is "error"
  std::string finish_reason;  // "stop" (EOS or stop string), "length", "cancelled" or "error"
  std::int64_t prompt_tokens = 0;
  std::int64_t cached_prompt_tokens = 0;  // of prompt_tokens, found in the prefix cache
  std::int64_t generated_tokens = 0;
};

// Called on the scheduler thread: keep them short, never block, never throw, never submit(). on_token runs once
// per generated token (text: what became final with it, often empty while a stop string or a
// UTF-8 sequence is incomplete) and once more with tokens = 0 for text flushed at the end.
// on_done runs exactly once, last, for every accepted request.
// on_logprobs (when RequestOptions::logprobs >= 0) runs just before on_token for each generated
// token.
struct RequestCallbacks {
  std::function<void(std::string_view text, std::int32_t tokens)> on_token;
  std::function<void(const Completion&)> on_done;
  std::function<void(const TokenLogprobs&)> on_logprobs = {};
};

class RequestHandle {
 public:
  // Ends the request at the next step boundary (at most one forward pass away): its sequence and
  // KV blocks are freed and on_done reports "cancelled". Safe from any thread, any number of times.
  void cancel() noexcept { cancelled_.store(true, std::memory_order_relaxed); }
  bool cancelled() const noexcept { return cancelled_.load(std::memory_order_relaxed); }
  std::uint64_t id() const noexcept { return id_; }

 private:
  friend class Scheduler;
  explicit RequestHandle(std::uint64_t id) : id_(id) {}
  std::uint64_t id_;
  std::atomic<bool> cancelled_{false};
};

struct SchedulerStats {
  std::int64_t queued = 0;
  std::int64_t running = 0;
  std::int64_t kv_blocks_used = 0;
  std::int64_t kv_blocks_free = 0;
  std::int64_t kv_blocks_committed = 0;    // worst case of the running requests
  std::int64_t kv_blocks_cached = 0;       // prefix-cache blocks no sequence holds (part of free)
  std::uint64_t prompt_tokens_cached = 0;  // prompt tokens taken from the prefix cache
  std::uint64_t steps = 0;                 // forward passes
  std::uint64_t batch_tokens = 0;          // tokens over all forward passes
  std::uint64_t batch_sequences = 0;       // sequences over all forward passes
};

class Scheduler {
 public:
  // Starts the scheduler thread. The engine must outlive the scheduler, and nothing else may run
  // the engine's model while it lives.
  Scheduler(Engine& engine, SchedulerOptions options);
  // Cancels whatever is queued or running (each gets on_done) and joins the thread.
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queues a request. Errors (nothing is queued, no callback runs):
  //   invalid_argument "prompt" (empty, or no room left in the context), "max_tokens" (< 1),
  //     "stop" (an empty string), or a sampling field (SamplingParams::validate);
  //   out_of_memory "kv_cache": its worst case can never fit the KV cache (ask for fewer tokens);
  //   out_of_memory "queue": the queue is full (try again later);
  //   unsupported "scheduler": it is shutting down.
  Result<std::shared_ptr<RequestHandle>> submit(RequestOptions request, RequestCallbacks callbacks);
  // n = choices.size() samples of one prompt (OpenAI's n), choice i with seed sampling.seed + i and
  // its own callbacks (each gets its own on_done). The prompt is computed once: when its last
  // chunk is done, choices 1.. fork its sequence (KvCache::fork), sharing its KV blocks, and all
  // sample from its logits. One handle cancels them all. Admission counts all n: the prompt's
  // blocks once, each choice's own. Besides submit()'s errors: invalid_argument "n" (no choice,
  // or more than max_running).
  Result<std::shared_ptr<RequestHandle>> submit_choices(RequestOptions request, std::vector<RequestCallbacks> choices);

  // Cancels every queued and running request.
  void cancel_all();
  SchedulerStats stats() const;
  const SchedulerOptions& options() const noexcept { return options_; }

 private:
  struct Active;
  struct Pending;

  void loop();
  void admit();
  void reap_cancelled();
  bool step();
  void finish(Active& a, std::string reason, Status status = {});
  // Appends a sampled token to a's text (stop strings, EOS, limits) and calls its callbacks.
  void emit_token(Active& a, std::int32_t token, const TokenLogprobs* logprobs);
  // Starts choices 1.. of a request whose prompt `a` has just computed.
  void fork_choices(Active& a);
  std::int64_t blocks_for(std::int64_t positions) const;

  Engine& engine_;
  SchedulerOptions options_;
  std::int64_t total_blocks_ = 0;
  std::int64_t context_ = 0;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Pending>> queue_;  // guarded by mu_
  bool stopping_ = false;                       // guarded by mu_
  bool cancel_all_requested_ = false;           // guarded by mu_
  std::uint64_t next_id_ = 1;                   // guarded by mu_

  // Owned by the scheduler thread.
  std::vector<std::unique_ptr<Active>> running_;
  std::vector<float> logits_;
  std::vector<TokenLogprobs> logprobs_;  // per sampled row of a step

  std::atomic<std::int64_t> n_queued_{0}, n_running_{0}, committed_{0};
  std::atomic<std::uint64_t> steps_{0}, batch_tokens_{0}, batch_sequences_{0}, prompt_tokens_cached_{0};

  std::thread thread_;  // last: starts after everything above is constructed
};

}  // namespace kallpa::runtime
