#include "kallpa/runtime/scheduler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include <fmt/format.h>

#include "core/parallel.h"
#include "kallpa/tokenizer/tokenizer.h"

namespace kallpa::runtime {

namespace {

// Choice i of n draws from its own random stream.
SamplingParams for_choice(SamplingParams p, std::size_t index) {
  p.seed += index;
  return p;
}

}  // namespace

void token_logprobs(std::span<const float> logits, std::int32_t token, std::int32_t top, TokenLogprobs& out) {
  // log p(i) = l_i - max - log(sum exp(l - max)), the sum in double over the whole vocabulary.
  float max_logit = -std::numeric_limits<float>::infinity();
  for (float l : logits) {
    if (l > max_logit) max_logit = l;
  }
  double sum = 0.0;
  for (float l : logits) {
    if (!std::isnan(l)) sum += std::exp(double(l) - double(max_logit));
  }
  const double log_z = double(max_logit) + std::log(sum);
  auto logprob = [&](std::int32_t id) {
    const float l = logits[static_cast<std::size_t>(id)];
    return std::isnan(l) ? -std::numeric_limits<float>::infinity() : static_cast<float>(double(l) - log_z);
  };
  out.sampled = {token, logprob(token)};
  out.top.clear();
  if (top <= 0) return;
  // The `top` largest by a bounded insertion: top is at most kMaxLogprobs, the vocabulary large.
  auto before = [&](std::int32_t a, std::int32_t b) {
    const float la = logits[static_cast<std::size_t>(a)], lb = logits[static_cast<std::size_t>(b)];
    return la > lb || (la == lb && a < b);
  };
  std::vector<std::int32_t> best;
  best.reserve(static_cast<std::size_t>(top) + 1);
  for (std::size_t i = 0; i < logits.size(); ++i) {
    const auto id = static_cast<std::int32_t>(i);
    if (std::isnan(logits[i])) continue;
    if (best.size() == static_cast<std::size_t>(top) && !before(id, best.back())) continue;
    best.insert(std::upper_bound(best.begin(), best.end(), id, before), id);
    if (best.size() > static_cast<std::size_t>(top)) best.pop_back();
  }
  for (std::int32_t id : best) out.top.push_back({id, logprob(id)});
}

struct Scheduler::Pending {
  std::shared_ptr<RequestHandle> handle;
  RequestOptions request;
  std::vector<RequestCallbacks> choices;
  std::int64_t limit = 0;         // positions each sequence may reach: min(prompt + max_tokens, context)
  std::int64_t blocks = 0;        // KV blocks of the worst case of all choices together
  std::int64_t first_blocks = 0;  // of them, choice 0's (the prompt's sequence)
  std::int64_t fork_blocks = 0;   // of them, each other choice's (past the shared full prompt blocks)
};

struct Scheduler::Active {
  // A choice that waits for the prompt's sequence to finish its prefill, then forks it.
  struct Follower {
    RequestCallbacks callbacks;
    std::size_t index;
    std::int64_t blocks;
  };
  Active(std::shared_ptr<RequestHandle> h, RequestOptions r, RequestCallbacks cb, std::size_t index, std::int64_t lim,
         std::int64_t blk, ops::SeqId s, const tokenizer::Tokenizer& tok)
      : handle(std::move(h)),
        request(std::move(r)),
        callbacks(std::move(cb)),
        limit(lim),
        blocks(blk),
        seq(s),
        sampler(for_choice(request.sampling, index)),
        decoder(tok, {.skip_special = true}) {
    tokens = request.prompt;
    if (request.grammar) matcher.emplace(request.grammar);
  }
  std::shared_ptr<RequestHandle> handle;
  RequestOptions request;
  RequestCallbacks callbacks;
  std::int64_t limit, blocks;
  std::vector<Follower> followers;  // forked once the prompt is computed
  ops::SeqId seq;
  Sampler sampler;
  tokenizer::StreamDecoder decoder;
  std::optional<GrammarMatcher> matcher;  // structured output
  std::vector<std::int32_t> tokens;       // prompt, then generated tokens
  std::int64_t fed = 0;                   // positions in the KV cache
  std::int64_t cached = 0;                // of them, attached from the prefix cache
  std::int64_t generated = 0;
  std::string held;  // decoded text not yet final (a stop string may be starting)
  bool done = false;

  std::int64_t prompt_size() const { return static_cast<std::int64_t>(request.prompt.size()); }
  bool prefilling() const { return fed < prompt_size(); }
};

Scheduler::Scheduler(Engine& engine, SchedulerOptions options)
    : engine_(engine),
      options_(options),
      total_blocks_(engine.cache().total_blocks()),
      context_(engine.config().context_length) {
  options_.max_batch_tokens = std::max<std::int64_t>(1, options_.max_batch_tokens);
  options_.prefill_chunk = std::max<std::int64_t>(1, options_.prefill_chunk);
  options_.max_running = std::max<std::int32_t>(1, options_.max_running);
  options_.max_queue = std::max<std::int64_t>(0, options_.max_queue);
  thread_ = std::thread([this] { loop(); });
}

Scheduler::~Scheduler() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cancel_all();
  cv_.notify_all();
  thread_.join();
}

std::int64_t Scheduler::blocks_for(std::int64_t positions) const {
  const std::int64_t page = engine_.cache().options().page_size;
  return (positions + page - 1) / page;
}

Result<std::shared_ptr<RequestHandle>> Scheduler::submit(RequestOptions request, RequestCallbacks callbacks) {
  std::vector<RequestCallbacks> choices;
  choices.push_back(std::move(callbacks));
  return submit_choices(std::move(request), std::move(choices));
}

Result<std::shared_ptr<RequestHandle>> Scheduler::submit_choices(RequestOptions request,
                                                                 std::vector<RequestCallbacks> choices) {
  if (choices.empty()) return Status::invalid("n", "no choice to generate");
  if (choices.size() > static_cast<std::size_t>(options_.max_running)) {
    return Status::invalid(
        "n", fmt::format("{} choices; at most {} sequences run at once", choices.size(), options_.max_running));
  }
  if (request.logprobs > kMaxLogprobs) {
    return Status::invalid("logprobs", fmt::format("is {}, must be at most {}", request.logprobs, kMaxLogprobs));
  }
  const auto prompt = static_cast<std::int64_t>(request.prompt.size());
  if (prompt == 0) return Status::invalid("prompt", "is empty");
  if (prompt >= context_) {
    return Status::invalid(
        "prompt", fmt::format("{} tokens leave no room in the model's context of {} tokens", prompt, context_));
  }
  const auto vocab = static_cast<std::int32_t>(engine_.config().vocab_size);
  for (std::size_t i = 0; i < request.prompt.size(); ++i) {
    if (request.prompt[i] < 0 || request.prompt[i] >= vocab) {
      return Status::invalid(fmt::format("prompt[{}]", i),
                             fmt::format("token id {} is outside the vocabulary [0, {})", request.prompt[i], vocab));
    }
  }
  if (request.max_tokens < 1)
    return Status::invalid("max_tokens", fmt::format("is {}, must be >= 1", request.max_tokens));
  for (const std::string& s : request.stop) {
    if (s.empty()) return Status::invalid("stop", "stop strings must not be empty");
  }
  if (Status s = request.sampling.validate(); !s) return s;

  auto pending = std::make_unique<Pending>();
  pending->limit = std::min(prompt + request.max_tokens, context_);
  pending->first_blocks = blocks_for(pending->limit);
  // A fork shares the prompt's full blocks and owns the rest of its worst case.
  pending->fork_blocks = pending->first_blocks - prompt / engine_.cache().options().page_size;
  pending->blocks = pending->first_blocks + static_cast<std::int64_t>(choices.size() - 1) * pending->fork_blocks;
  if (pending->blocks > total_blocks_) {
    return Status(ErrorCode::out_of_memory, "kv_cache",
                  fmt::format("{} prompt tokens + max_tokens {} need {} KV blocks; the cache has {} in all", prompt,
                              request.max_tokens, pending->blocks, total_blocks_));
  }
  std::lock_guard lock(mu_);
  if (stopping_) return Status(ErrorCode::unsupported, "scheduler", "shutting down");
  if (static_cast<std::int64_t>(queue_.size()) >= options_.max_queue) {
    return Status(ErrorCode::out_of_memory, "queue",
                  fmt::format("{} requests already waiting (the limit)", queue_.size()));
  }
  pending->handle.reset(new RequestHandle(next_id_++));
  pending->request = std::move(request);
  pending->choices = std::move(choices);
  auto handle = pending->handle;
  queue_.push_back(std::move(pending));
  n_queued_.store(static_cast<std::int64_t>(queue_.size()));
  cv_.notify_all();
  return handle;
}

void Scheduler::cancel_all() {
  std::lock_guard lock(mu_);
  for (auto& p : queue_) p->handle->cancel();
  // running_ belongs to the scheduler thread; its handles are flagged through cancel_all_.
  cancel_all_requested_ = true;
  cv_.notify_all();
}

SchedulerStats Scheduler::stats() const {
  SchedulerStats s;
  s.queued = n_queued_.load();
  s.running = n_running_.load();
  s.kv_blocks_free = engine_.cache().free_blocks();
  s.kv_blocks_used = engine_.cache().total_blocks() - s.kv_blocks_free;
  s.kv_blocks_committed = committed_.load();
  s.kv_blocks_cached = engine_.cache().cached_blocks();
  s.prompt_tokens_cached = prompt_tokens_cached_.load();
  s.steps = steps_.load();
  s.batch_tokens = batch_tokens_.load();
  s.batch_sequences = batch_sequences_.load();
  return s;
}

void Scheduler::finish(Active& a, std::string reason, Status status) {
  if (a.done) return;
  a.done = true;
  engine_.cache().remove(a.seq);
  // Counted out before on_done, so that whoever it wakes sees the freed capacity.
  committed_ -= a.blocks;
  n_running_ -= 1;
  Completion c;
  c.status = std::move(status);
  c.finish_reason = std::move(reason);
  c.prompt_tokens = a.prompt_size();
  c.cached_prompt_tokens = a.cached;
  c.generated_tokens = a.generated;
  // Choices that never forked end with the prompt's sequence, for the same reason.
  std::vector<Active::Follower> followers = std::move(a.followers);
  a.followers.clear();
  for (const Active::Follower& f : followers) committed_ -= f.blocks;
  if (a.callbacks.on_done) a.callbacks.on_done(c);
  for (const Active::Follower& f : followers) {
    Completion fc = c;
    fc.generated_tokens = 0;
    if (f.callbacks.on_done) f.callbacks.on_done(fc);
  }
}

void Scheduler::fork_choices(Active& a) {
  std::vector<Active::Follower> followers = std::move(a.followers);
  a.followers.clear();
  for (Active::Follower& f : followers) {
    auto seq = engine_.cache().fork(a.seq, a.fed);
    auto child = std::make_unique<Active>(a.handle, a.request, std::move(f.callbacks), f.index, a.limit, f.blocks,
                                          seq ? *seq : ops::SeqId{-1}, engine_.tokenizer());
    child->fed = a.fed;
    child->cached = a.cached;
    n_running_ += 1;
    if (!seq) {
      // Admission committed the blocks, so only a cache shared with someone else can run dry.
      child->done = true;  // no sequence to remove
      committed_ -= child->blocks;
      n_running_ -= 1;
      Completion c;
      c.status = seq.status();
      c.finish_reason = "error";
      c.prompt_tokens = child->prompt_size();
      if (child->callbacks.on_done) child->callbacks.on_done(c);
      continue;
    }
    running_.push_back(std::move(child));
  }
}

// Under mu_: moves requests from the queue into running_ while a sequence slot is free and the
// KV cache can hold the head's worst case on top of what running requests may still need. FIFO:
// a large request at the head is not overtaken (it would starve otherwise).
void Scheduler::admit() {
  // Cancelled requests leave the queue wherever they are, so they never hold a place in it. They
  // are counted out before their on_done, as finish() does, so that whoever it wakes sees them gone.
  // (Rebuilt only when one is cancelled: this runs every step.)
  std::vector<std::unique_ptr<Pending>> cancelled;
  if (std::any_of(queue_.begin(), queue_.end(), [](const auto& p) { return p->handle->cancelled(); })) {
    std::deque<std::unique_ptr<Pending>> kept;
    for (auto& p : queue_) {
      if (p->handle->cancelled()) {
        cancelled.push_back(std::move(p));
      } else {
        kept.push_back(std::move(p));
      }
    }
    queue_ = std::move(kept);
  }
  n_queued_.store(static_cast<std::int64_t>(queue_.size()));
  for (const auto& p : cancelled) {
    Completion c;
    c.finish_reason = "cancelled";
    c.prompt_tokens = static_cast<std::int64_t>(p->request.prompt.size());
    for (const RequestCallbacks& cb : p->choices) {
      if (cb.on_done) cb.on_done(c);
    }
  }
  while (!queue_.empty()) {
    Pending& head = *queue_.front();
    // The running sequences, counting the choices still to fork from them.
    std::size_t sequences = running_.size();
    for (const auto& a : running_) sequences += a->followers.size();
    if (sequences + head.choices.size() > static_cast<std::size_t>(options_.max_running)) break;
    if (committed_.load() + head.blocks > total_blocks_) break;
    std::unique_ptr<Pending> p = std::move(queue_.front());
    queue_.pop_front();
    committed_ += p->blocks;
    const ops::SeqId seq = engine_.cache().add_sequence();
    auto active = std::make_unique<Active>(std::move(p->handle), std::move(p->request), std::move(p->choices[0]), 0,
                                           p->limit, p->first_blocks, seq, engine_.tokenizer());
    for (std::size_t i = 1; i < p->choices.size(); ++i) {
      active->followers.push_back({std::move(p->choices[i]), i, p->fork_blocks});
    }
    if (options_.prefix_cache) {
      // Whole prefill chunks only: a cached block computed in the chunk this request would compute
      // it in holds the same bits (include/kallpa/runtime/scheduler.h).
      active->fed = active->cached = engine_.cache().attach_prefix(seq, active->request.prompt, options_.prefill_chunk);
      prompt_tokens_cached_ += static_cast<std::uint64_t>(active->cached);
    }
    running_.push_back(std::move(active));
    n_running_ += 1;
  }
  n_queued_.store(static_cast<std::int64_t>(queue_.size()));
}

// Drops finished and cancelled requests; their blocks go back to the pool now.
void Scheduler::reap_cancelled() {
  for (auto& a : running_) {
    if (!a->done && a->handle->cancelled()) finish(*a, "cancelled");
  }
  std::erase_if(running_, [](const std::unique_ptr<Active>& a) { return a->done; });
}

void Scheduler::loop() {
  while (true) {
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || cancel_all_requested_ || !queue_.empty() || !running_.empty(); });
      if (cancel_all_requested_) {
        for (auto& a : running_) a->handle->cancel();
        cancel_all_requested_ = false;
      }
      reap_cancelled();
      admit();
      if (stopping_ && queue_.empty() && running_.empty()) return;
    }
    if (!step()) {
      std::unique_lock lock(mu_);
      if (stopping_ && queue_.empty() && running_.empty()) return;
    }
    reap_cancelled();
  }
}

void Scheduler::emit_token(Active& a, std::int32_t token, const TokenLogprobs* logprobs) {
  auto emit = [&](std::string_view text, std::int32_t tokens) {
    if (a.callbacks.on_token) a.callbacks.on_token(text, tokens);
  };
  auto flush = [&] {
    a.held += a.decoder.flush();
    if (!a.held.empty()) emit(a.held, 0);
    a.held.clear();
  };
  if (a.matcher) {
    if (Status s = a.matcher->accept(token); !s) {
      finish(a, "error", s);
      return;
    }
  }
  if ((a.request.stop_at_eos || a.matcher) && engine_.tokenizer().is_eog(token)) {
    flush();
    finish(a, "stop");
    return;
  }
  ++a.generated;
  a.tokens.push_back(token);
  if (logprobs != nullptr && a.callbacks.on_logprobs) a.callbacks.on_logprobs(*logprobs);
  auto piece = a.decoder.push(token);
  if (!piece) {
    finish(a, "error", piece.status());
    return;
  }
  a.held += *piece;
  std::size_t cut = std::string::npos;
  for (const std::string& stop : a.request.stop) cut = std::min(cut, a.held.find(stop));
  if (cut != std::string::npos) {
    a.held.resize(cut);
    emit(a.held, 1);
    a.held.clear();
    finish(a, "stop");
    return;
  }
  const std::size_t hold = held_back(a.held, a.request.stop);
  emit(std::string_view(a.held).substr(0, a.held.size() - hold), 1);
  a.held.erase(0, a.held.size() - hold);
  if (a.matcher && a.matcher->finished()) {  // nothing but an end-of-generation token could follow
    flush();
    finish(a, "stop");
    return;
  }
  // The sampled token is fed by the next step, unless it is the last one allowed.
  if (static_cast<std::int64_t>(a.tokens.size()) >= a.limit || a.generated >= a.request.max_tokens) {
    flush();
    finish(a, "length");
  }
}

// One forward pass over every running sequence's next piece of work; false when there was none.
bool Scheduler::step() {
  struct Planned {
    Active* active;
    model::ForwardItem item;
  };
  std::vector<Planned> plan;
  std::int64_t budget = options_.max_batch_tokens;
  // Decode first: every sequence past its prompt feeds its last sampled token.
  for (auto& a : running_) {
    if (a->done || a->prefilling()) continue;
    model::ForwardItem it;
    it.seq = a->seq;
    it.tokens = std::span<const std::int32_t>(a->tokens).subspan(static_cast<std::size_t>(a->fed), 1);
    it.start_pos = a->fed;
    it.want_logits = true;
    plan.push_back({a.get(), it});
    --budget;
  }
  // Then prefill chunks, oldest request first, one chunk per sequence per step.
  bool any_prefill = false;
  for (auto& a : running_) {
    if (a->done || !a->prefilling()) continue;
    const std::int64_t chunk_end =
        std::min(a->prompt_size(), (a->fed / options_.prefill_chunk + 1) * options_.prefill_chunk);
    const std::int64_t n = chunk_end - a->fed;
    if (n > budget && any_prefill) continue;  // a shorter chunk further on may still fit
    model::ForwardItem it;
    it.seq = a->seq;
    it.tokens =
        std::span<const std::int32_t>(a->tokens).subspan(static_cast<std::size_t>(a->fed), static_cast<std::size_t>(n));
    it.start_pos = a->fed;
    it.want_logits = chunk_end == a->prompt_size();
    it.prompt = true;
    plan.push_back({a.get(), it});
    any_prefill = true;
    budget -= n;
  }
  if (plan.empty()) return false;

  // The scheduler owns the cache's space (forward() only writes into it). Reserve per item, so that
  // a failure ends only its own request (admission makes it rare: only a cache shared with someone
  // else can run dry).
  std::vector<model::ForwardItem> items;
  std::vector<Active*> owners;
  std::int64_t tokens = 0, with_logits = 0;
  for (Planned& p : plan) {
    const std::int64_t end = p.item.start_pos + static_cast<std::int64_t>(p.item.tokens.size());
    if (Status s = engine_.cache().reserve(p.item.seq, end); !s) {
      finish(*p.active, "error", s);
      continue;
    }
    items.push_back(p.item);
    owners.push_back(p.active);
    tokens += static_cast<std::int64_t>(p.item.tokens.size());
    if (p.item.want_logits) ++with_logits;
  }
  if (items.empty()) return true;
  // The batch's order is decided here, once: prompt chunks first, then decode steps, as forward()
  // requires (model/llama_model.h); the logits come back in this order.
  std::vector<std::size_t> order(items.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_partition(order.begin(), order.end(), [&](std::size_t i) { return !model::is_decode_step(items[i]); });
  {
    std::vector<model::ForwardItem> sorted_items;
    std::vector<Active*> sorted_owners;
    for (std::size_t i : order) {
      sorted_items.push_back(items[i]);
      sorted_owners.push_back(owners[i]);
    }
    items = std::move(sorted_items);
    owners = std::move(sorted_owners);
  }
  logits_.resize(static_cast<std::size_t>(with_logits * engine_.config().vocab_size));
  Status s = engine_.model().forward(items, engine_.cache(), engine_.dispatcher(), logits_.data());
  steps_.fetch_add(1);
  batch_tokens_.fetch_add(static_cast<std::uint64_t>(tokens));
  batch_sequences_.fetch_add(items.size());
  if (!s) {
    for (Active* a : owners) finish(*a, "error", s);
    return true;
  }
  const auto vocab = static_cast<std::size_t>(engine_.config().vocab_size);
  std::vector<Active*> sampling;
  std::vector<std::size_t> rows;
  std::size_t row = 0;
  for (std::size_t i = 0; i < items.size(); ++i) {
    Active& a = *owners[i];
    a.fed += static_cast<std::int64_t>(items[i].tokens.size());
    // Only prompt positions: their K/V come from prompt rows, which a later request's prompt
    // would compute identically; generated positions were decode rows (ops/ops.h).
    if (options_.prefix_cache) {
      const auto written = static_cast<std::size_t>(std::min(a.fed, a.prompt_size()));
      engine_.cache().publish(a.seq, std::span<const std::int32_t>(a.request.prompt).first(written));
    }
    if (!items[i].want_logits) continue;
    if (!a.handle->cancelled()) {  // a cancelled one is reaped right after this step
      // The prompt is done: the other choices start here, from the same logits.
      const std::size_t first_fork = running_.size();
      if (!a.followers.empty()) fork_choices(a);
      sampling.push_back(&a);
      rows.push_back(row);
      for (std::size_t f = first_fork; f < running_.size(); ++f) {
        sampling.push_back(running_[f].get());
        rows.push_back(row);
      }
    }
    ++row;
  }
  // Each sequence samples from its own sampler and random stream, so the draws can run in
  // parallel; the text is then emitted in order on this thread.
  std::vector<std::int32_t> drawn(sampling.size());
  logprobs_.resize(sampling.size());
  parallel::ThreadPool::global().parallel_for(static_cast<std::int64_t>(sampling.size()), [&](std::int64_t i, int) {
    thread_local std::vector<float> scratch;
    const auto n = static_cast<std::size_t>(i);
    Active& a = *sampling[n];
    const float* l = logits_.data() + rows[n] * vocab;
    scratch.assign(l, l + vocab);  // the mask, the bias and the penalties edit their input
    const auto generated = std::span<const std::int32_t>(a.tokens).subspan(a.request.prompt.size());
    drawn[n] = a.sampler.sample(scratch, a.tokens, generated,
                                a.matcher ? a.matcher->next_mask() : std::span<const std::uint32_t>());
    if (a.request.logprobs >= 0) {
      token_logprobs(std::span<const float>(l, vocab), drawn[n], a.request.logprobs, logprobs_[n]);
    }
  });
  for (std::size_t i = 0; i < sampling.size(); ++i) {
    emit_token(*sampling[i], drawn[i], sampling[i]->request.logprobs >= 0 ? &logprobs_[i] : nullptr);
  }
  return true;
}

}  // namespace kallpa::runtime
