// The continuous-batching scheduler on a synthetic Llama: batched requests give the same text as
// solo ones (and as runtime::generate), limits and stop strings, cancellation frees KV blocks,
// bounded queue, KV admission, and chunked prefill that never stalls running streams.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <numeric>

#include "kallpa/model/gguf.h"
#include "kallpa/runtime/engine.h"
#include "kallpa/runtime/scheduler.h"
#include "support/synthetic_llama.h"

namespace kallpa::runtime {
namespace {

std::unique_ptr<Engine> make_engine(std::uint32_t context = 1024, std::int64_t cache_tokens = 1024) {
  model::SyntheticLlamaSpec spec;
  spec.context_length = context;
  auto file = model::GgufFile::from_bytes(model::synthetic_llama(spec), "synthetic");
  EXPECT_TRUE(file.is_ok()) << file.status().to_string();
  EngineOptions o;
  o.prefill_chunk = 8;
  o.cache.max_tokens = cache_tokens;
  auto e = Engine::load(*file, o);
  EXPECT_TRUE(e.is_ok()) << e.status().to_string();
  return std::move(*e);
}

std::vector<std::int32_t> prompt_of(int n, int salt = 0) {
  std::vector<std::int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back(3 + (i * 37 + salt * 11) % 290);
  return t;
}

// A high temperature makes the synthetic model's draws depend on the seed.
SamplingParams hot(std::uint64_t seed) {
  return {.temperature = 50.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f, .seed = seed};
}

// Collects one request's callbacks; waits for its end.
struct Collector {
  std::mutex mu;
  std::condition_variable cv;
  std::string text;
  std::int64_t tokens = 0;
  bool done = false;
  Completion completion;

  RequestCallbacks callbacks() {
    return {.on_token =
                [this](std::string_view t, std::int32_t n) {
                  std::lock_guard lock(mu);
                  text += t;
                  tokens += n;
                  cv.notify_all();
                },
            .on_done =
                [this](const Completion& c) {
                  std::lock_guard lock(mu);
                  completion = c;
                  done = true;
                  cv.notify_all();
                }};
  }
  void wait_done() {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return done; });
  }
  void wait_tokens(std::int64_t n) {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return tokens >= n || done; });
  }
  std::int64_t token_count() {
    std::lock_guard lock(mu);
    return tokens;
  }
};

RequestOptions request(std::vector<std::int32_t> prompt, std::uint64_t seed, std::int64_t max_tokens) {
  RequestOptions r;
  r.prompt = std::move(prompt);
  r.sampling = hot(seed);
  r.max_tokens = max_tokens;
  r.stop_at_eos = false;
  return r;
}

TEST(Scheduler, SoloRequestMatchesGenerate) {
  auto e = make_engine();
  std::string expected;
  {
    Session s(*e, hot(5));
    GenerateOptions g;
    g.max_tokens = 20;
    g.stop_at_eos = false;
    auto r = generate(s, prompt_of(30), g);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    expected = r->text;
  }
  Scheduler sched(*e, {.max_batch_tokens = 16, .prefill_chunk = 8});
  Collector c;
  ASSERT_TRUE(sched.submit(request(prompt_of(30), 5, 20), c.callbacks()).is_ok());
  c.wait_done();
  EXPECT_EQ(c.text, expected);
  EXPECT_EQ(c.completion.finish_reason, "length");
  EXPECT_EQ(c.completion.generated_tokens, 20);
  EXPECT_EQ(c.completion.prompt_tokens, 30);
  EXPECT_TRUE(c.completion.status.is_ok());
}

TEST(Scheduler, BatchedRequestsGiveTheirSoloTextExactly) {
  auto e = make_engine();
  constexpr int kRequests = 10;
  auto req = [](int i) { return request(prompt_of(3 + 7 * i, i), 100 + i, 12 + i); };
  std::vector<std::string> solo(kRequests);
  {
    Scheduler sched(*e, {.max_batch_tokens = 24, .prefill_chunk = 8});
    for (int i = 0; i < kRequests; ++i) {
      Collector c;
      ASSERT_TRUE(sched.submit(req(i), c.callbacks()).is_ok());
      c.wait_done();
      solo[i] = c.text;
    }
  }
  Scheduler sched(*e, {.max_batch_tokens = 24, .prefill_chunk = 8});
  std::vector<Collector> batched(kRequests);
  for (int i = 0; i < kRequests; ++i) ASSERT_TRUE(sched.submit(req(i), batched[i].callbacks()).is_ok());
  for (int i = 0; i < kRequests; ++i) {
    batched[i].wait_done();
    EXPECT_EQ(batched[i].text, solo[i]) << "request " << i;
    EXPECT_EQ(batched[i].completion.generated_tokens, 12 + i);
  }
  const SchedulerStats st = sched.stats();
  EXPECT_GT(st.batch_sequences, st.steps) << "requests never shared a forward pass";
  EXPECT_EQ(st.kv_blocks_used, 0);
  EXPECT_EQ(st.kv_blocks_committed, 0);
  EXPECT_EQ(st.running, 0);
}

// Requests that share a long prefix (a system prompt): later ones attach the earlier prompts'
// KV blocks instead of computing them, and still give exactly the text they give without the cache.
TEST(Scheduler, PrefixCacheReusesSharedPromptsAndKeepsTheText) {
  auto e = make_engine();
  auto req = [](int i) {
    auto p = prompt_of(37);  // shared: its whole KV blocks can be reused
    auto tail = prompt_of(5 + i, i + 1);
    p.insert(p.end(), tail.begin(), tail.end());
    return request(p, 300 + i, 10);
  };
  std::vector<std::string> uncached;
  {
    Scheduler sched(*e, {.max_batch_tokens = 24, .prefill_chunk = 8, .prefix_cache = false});
    for (int i = 0; i < 4; ++i) {
      Collector c;
      ASSERT_TRUE(sched.submit(req(i), c.callbacks()).is_ok());
      c.wait_done();
      uncached.push_back(c.text);
      EXPECT_EQ(c.completion.cached_prompt_tokens, 0);
    }
  }
  // Whole prefill chunks (of 8) that are whole KV blocks.
  const std::int64_t unit = std::lcm<std::int64_t>(e->cache().options().page_size, 8);
  Scheduler sched(*e, {.max_batch_tokens = 24, .prefill_chunk = 8});
  for (int i = 0; i < 4; ++i) {
    Collector c;
    ASSERT_TRUE(sched.submit(req(i), c.callbacks()).is_ok());
    c.wait_done();
    EXPECT_EQ(c.text, uncached[i]) << "request " << i;
    // The first computes everything; the others find the shared whole blocks.
    EXPECT_EQ(c.completion.cached_prompt_tokens, i == 0 ? 0 : 37 / unit * unit) << "request " << i;
  }
  // Batched, all at once: whatever each finds cached, the texts stay the same.
  std::vector<Collector> batched(4);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(sched.submit(req(i), batched[i].callbacks()).is_ok());
  for (int i = 0; i < 4; ++i) {
    batched[i].wait_done();
    EXPECT_EQ(batched[i].text, uncached[i]) << "request " << i;
    EXPECT_GT(batched[i].completion.cached_prompt_tokens, 0);
  }
  const SchedulerStats st = sched.stats();
  EXPECT_EQ(st.prompt_tokens_cached, static_cast<std::uint64_t>(7 * (37 / unit * unit)));
  EXPECT_EQ(st.kv_blocks_used, 0);
  EXPECT_GT(st.kv_blocks_cached, 0);
}

TEST(Scheduler, ChunkedPrefillKeepsRunningStreamsGoing) {
  auto e = make_engine();
  Scheduler sched(*e, {.max_batch_tokens = 16, .prefill_chunk = 8});
  Collector stream, longp;
  ASSERT_TRUE(sched.submit(request(prompt_of(4), 1, 500), stream.callbacks()).is_ok());
  stream.wait_tokens(2);
  const std::int64_t before = stream.token_count();
  ASSERT_TRUE(sched.submit(request(prompt_of(200, 3), 2, 1), longp.callbacks()).is_ok());
  longp.wait_done();
  // 200 prompt tokens in chunks of 8 take 25 steps; the stream gets a token in every one of them.
  EXPECT_GE(stream.token_count() - before, 24);
  sched.cancel_all();
  stream.wait_done();
  EXPECT_EQ(stream.completion.finish_reason, "cancelled");
}

TEST(Scheduler, NChoicesShareTheComputedPromptAndEachGivesItsSoloText) {
  auto e = make_engine();
  constexpr int kChoices = 3;
  const auto prompt = prompt_of(30);  // 30 = one partial block past the full ones: forks copy it
  std::vector<std::string> solo;
  {
    Scheduler sched(*e, {.max_batch_tokens = 16, .prefill_chunk = 8, .prefix_cache = false});
    for (int i = 0; i < kChoices; ++i) {
      Collector c;
      ASSERT_TRUE(sched.submit(request(prompt, 40 + i, 12), c.callbacks()).is_ok());
      c.wait_done();
      solo.push_back(c.text);
    }
  }
  EXPECT_NE(solo[0], solo[1]);  // the seeds differ, so do the texts
  Scheduler sched(*e, {.max_batch_tokens = 16, .prefill_chunk = 8, .prefix_cache = false});
  std::vector<Collector> choices(kChoices);
  std::vector<RequestCallbacks> callbacks;
  for (Collector& c : choices) callbacks.push_back(c.callbacks());
  ASSERT_TRUE(sched.submit_choices(request(prompt, 40, 12), std::move(callbacks)).is_ok());
  for (int i = 0; i < kChoices; ++i) {
    choices[static_cast<std::size_t>(i)].wait_done();
    EXPECT_EQ(choices[static_cast<std::size_t>(i)].text, solo[static_cast<std::size_t>(i)]) << "choice " << i;
    EXPECT_EQ(choices[static_cast<std::size_t>(i)].completion.generated_tokens, 12);
  }
  // The prompt went through the model once; then each choice fed its 11 sampled tokens.
  EXPECT_EQ(sched.stats().batch_tokens, static_cast<std::uint64_t>(30 + kChoices * 11));
  EXPECT_EQ(sched.stats().kv_blocks_committed, 0);
  EXPECT_EQ(e->cache().used_blocks(), 0);
}

TEST(Scheduler, NChoicesAreRefusedBeyondTheRunningLimitAndCancelTogether) {
  auto e = make_engine();
  Scheduler sched(*e, {.max_running = 4});
  std::vector<RequestCallbacks> five(5);
  auto refused = sched.submit_choices(request(prompt_of(8), 1, 4), std::move(five));
  ASSERT_FALSE(refused.is_ok());
  EXPECT_EQ(refused.status().field(), "n");
  // Cancelled at once (queued or prefilling): every choice still gets its one on_done.
  std::vector<Collector> choices(3);
  std::vector<RequestCallbacks> callbacks;
  for (Collector& c : choices) callbacks.push_back(c.callbacks());
  auto h = sched.submit_choices(request(prompt_of(200), 1, 100), std::move(callbacks));
  ASSERT_TRUE(h.is_ok());
  (*h)->cancel();
  for (Collector& c : choices) {
    c.wait_done();
    EXPECT_EQ(c.completion.finish_reason, "cancelled");
  }
  EXPECT_EQ(sched.stats().kv_blocks_committed, 0);
  EXPECT_EQ(e->cache().used_blocks(), 0);
}

TEST(Scheduler, LogprobsAreTheLogSoftmaxOfTheLogitsSampledFrom) {
  auto e = make_engine();
  constexpr std::int32_t kTop = 3;
  // What generate() saw: the logits of each step, turned into log-probabilities here.
  std::vector<TokenLogprobs> expected;
  {
    Session s(*e, {.temperature = 0.0f});
    GenerateOptions g;
    g.max_tokens = 8;
    g.stop_at_eos = false;
    g.on_token = [&](std::int32_t token, std::span<const float> logits) {
      double z = 0.0;
      const float m = *std::max_element(logits.begin(), logits.end());
      for (float l : logits) z += std::exp(double(l) - m);
      TokenLogprobs t;
      t.sampled = {token, static_cast<float>(logits[static_cast<std::size_t>(token)] - m - std::log(z))};
      std::vector<std::int32_t> ids(logits.size());
      std::iota(ids.begin(), ids.end(), 0);
      std::stable_sort(ids.begin(), ids.end(), [&](std::int32_t a, std::int32_t b) {
        return logits[static_cast<std::size_t>(a)] > logits[static_cast<std::size_t>(b)];
      });
      for (int k = 0; k < kTop; ++k) {
        const std::int32_t id = ids[static_cast<std::size_t>(k)];
        t.top.push_back({id, static_cast<float>(logits[static_cast<std::size_t>(id)] - m - std::log(z))});
      }
      expected.push_back(t);
    };
    ASSERT_TRUE(generate(s, prompt_of(20), g).is_ok());
  }
  Scheduler sched(*e, {.max_batch_tokens = 16, .prefill_chunk = 8});
  Collector c;
  std::vector<TokenLogprobs> got;
  RequestCallbacks cb = c.callbacks();
  cb.on_logprobs = [&](const TokenLogprobs& t) { got.push_back(t); };  // on the scheduler thread, before on_token
  RequestOptions r = request(prompt_of(20), 1, 8);
  r.sampling = {.temperature = 0.0f, .presence_penalty = 2.0f};  // edits what is drawn, never the logprobs
  r.logprobs = kTop;
  ASSERT_TRUE(sched.submit(std::move(r), std::move(cb)).is_ok());
  c.wait_done();
  ASSERT_GE(got.size(), 1u);
  // The first step is the same whatever the penalty: the same token and values.
  EXPECT_EQ(got[0].sampled.id, expected[0].sampled.id);
  for (std::size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i].top.size(), static_cast<std::size_t>(kTop));
    for (std::size_t k = 1; k < got[i].top.size(); ++k) EXPECT_GE(got[i].top[k - 1].logprob, got[i].top[k].logprob);
    EXPECT_LE(got[i].sampled.logprob, 0.0f);
  }
  EXPECT_NEAR(got[0].sampled.logprob, expected[0].sampled.logprob, 1e-4);
  for (int k = 0; k < kTop; ++k) {
    EXPECT_EQ(got[0].top[static_cast<std::size_t>(k)].id, expected[0].top[static_cast<std::size_t>(k)].id);
    EXPECT_NEAR(got[0].top[static_cast<std::size_t>(k)].logprob, expected[0].top[static_cast<std::size_t>(k)].logprob,
                1e-4);
  }
  // Without penalties every step matches generate()'s.
  Collector plain;
  std::vector<TokenLogprobs> all;
  RequestCallbacks cb2 = plain.callbacks();
  cb2.on_logprobs = [&](const TokenLogprobs& t) { all.push_back(t); };
  RequestOptions r2 = request(prompt_of(20), 1, 8);
  r2.sampling = {.temperature = 0.0f};
  r2.logprobs = 0;
  ASSERT_TRUE(sched.submit(std::move(r2), std::move(cb2)).is_ok());
  plain.wait_done();
  ASSERT_EQ(all.size(), expected.size());
  for (std::size_t i = 0; i < all.size(); ++i) {
    EXPECT_EQ(all[i].sampled.id, expected[i].sampled.id) << i;
    EXPECT_NEAR(all[i].sampled.logprob, expected[i].sampled.logprob, 1e-3) << i;
    EXPECT_TRUE(all[i].top.empty());
  }
}

TEST(Scheduler, StopStringEndsTheRequestAndIsNotEmitted) {
  auto e = make_engine();
  Scheduler sched(*e, {});
  Collector full;
  ASSERT_TRUE(sched.submit(request(prompt_of(8), 9, 24), full.callbacks()).is_ok());
  full.wait_done();
  ASSERT_GE(full.text.size(), 6u);
  const std::string stop = full.text.substr(3, 2);
  RequestOptions r = request(prompt_of(8), 9, 24);
  r.stop = {"never-in-the-output-zzz", stop};
  Collector c;
  ASSERT_TRUE(sched.submit(r, c.callbacks()).is_ok());
  c.wait_done();
  EXPECT_EQ(c.completion.finish_reason, "stop");
  EXPECT_EQ(c.text, full.text.substr(0, full.text.find(stop)));
  EXPECT_LT(c.completion.generated_tokens, 24);
}

TEST(Scheduler, CancelFreesTheSequenceAndItsKvBlocks) {
  auto e = make_engine();
  Scheduler sched(*e, {});
  Collector c;
  auto h = sched.submit(request(prompt_of(40), 1, 800), c.callbacks());
  ASSERT_TRUE(h.is_ok());
  c.wait_tokens(3);
  EXPECT_GT(sched.stats().kv_blocks_used, 0);
  (*h)->cancel();
  c.wait_done();
  EXPECT_EQ(c.completion.finish_reason, "cancelled");
  EXPECT_LT(c.completion.generated_tokens, 800);
  EXPECT_EQ(e->cache().used_blocks(), 0);  // on_done runs after the blocks are freed
}

TEST(Scheduler, FullQueueIsRefusedWithATypedError) {
  auto e = make_engine();
  Scheduler sched(*e, {.max_running = 1, .max_queue = 1});
  Collector running, queued;
  auto a = sched.submit(request(prompt_of(4), 1, 900), running.callbacks());
  ASSERT_TRUE(a.is_ok());
  running.wait_tokens(1);  // admitted: the queue is empty again
  ASSERT_TRUE(sched.submit(request(prompt_of(4), 2, 4), queued.callbacks()).is_ok());
  EXPECT_EQ(sched.stats().queued, 1);
  auto refused = sched.submit(request(prompt_of(4), 3, 4), {});
  ASSERT_FALSE(refused.is_ok());
  EXPECT_EQ(refused.status().code(), ErrorCode::out_of_memory);
  EXPECT_EQ(refused.status().field(), "queue");
  (*a)->cancel();
  queued.wait_done();
  EXPECT_EQ(queued.completion.finish_reason, "length");
  EXPECT_EQ(queued.completion.generated_tokens, 4);
}

TEST(Scheduler, KvAdmissionWaitsForRoomAndRefusesWhatCanNeverFit) {
  auto e = make_engine(/*context=*/256, /*cache_tokens=*/128);  // 8 blocks of 16
  Scheduler sched(*e, {});
  for (auto [prompt, max_tokens] : {std::pair{10, 200}, std::pair{130, 1}}) {
    auto refused = sched.submit(request(prompt_of(prompt), 1, max_tokens), {});
    ASSERT_FALSE(refused.is_ok());
    EXPECT_EQ(refused.status().code(), ErrorCode::out_of_memory);
    EXPECT_EQ(refused.status().field(), "kv_cache") << refused.status().to_string();
  }

  // Each request's worst case is 5 blocks (10 + 70 positions): the second waits for the first.
  // Checked where it happens, not by polling (a loaded machine can finish the first request
  // before a poll runs): when the second emits its first token, the first must be done.
  Collector first, second;
  auto a = sched.submit(request(prompt_of(10), 1, 70), first.callbacks());
  ASSERT_TRUE(a.is_ok());
  first.wait_tokens(1);
  std::atomic<int> tokens_before_first_done{0};
  RequestCallbacks cb = second.callbacks();
  cb.on_token = [&, inner = cb.on_token](std::string_view t, std::int32_t n) {
    {
      std::lock_guard lock(first.mu);
      if (!first.done) ++tokens_before_first_done;
    }
    inner(t, n);
  };
  ASSERT_TRUE(sched.submit(request(prompt_of(10, 1), 2, 70), cb).is_ok());
  first.wait_done();
  second.wait_done();
  EXPECT_EQ(first.completion.generated_tokens, 70);
  EXPECT_EQ(second.completion.generated_tokens, 70);
  EXPECT_EQ(tokens_before_first_done.load(), 0) << "the second request ran while the first held its blocks";
  EXPECT_EQ(e->cache().used_blocks(), 0);
}

TEST(Scheduler, InvalidRequestsNameTheField) {
  auto e = make_engine(/*context=*/64, 64);
  Scheduler sched(*e, {});
  auto field_of = [&](RequestOptions r) {
    auto h = sched.submit(std::move(r), {});
    return h.is_ok() ? std::string("ok") : h.status().field();
  };
  EXPECT_EQ(field_of(request({}, 1, 4)), "prompt");
  EXPECT_EQ(field_of(request(prompt_of(64), 1, 4)), "prompt");
  EXPECT_EQ(field_of(request({3, 100000}, 1, 4)), "prompt[1]");
  EXPECT_EQ(field_of(request(prompt_of(4), 1, 0)), "max_tokens");
  RequestOptions r = request(prompt_of(4), 1, 4);
  r.stop = {""};
  EXPECT_EQ(field_of(r), "stop");
  r = request(prompt_of(4), 1, 4);
  r.sampling.temperature = -1;
  EXPECT_EQ(field_of(r), "temperature");
}

TEST(Scheduler, DestructionCancelsWhatIsLeft) {
  auto e = make_engine();
  Collector a, b;
  {
    Scheduler sched(*e, {.max_running = 1});
    ASSERT_TRUE(sched.submit(request(prompt_of(4), 1, 900), a.callbacks()).is_ok());
    ASSERT_TRUE(sched.submit(request(prompt_of(4), 2, 900), b.callbacks()).is_ok());
    a.wait_tokens(1);
  }
  EXPECT_TRUE(a.done);
  EXPECT_TRUE(b.done);
  EXPECT_EQ(b.completion.finish_reason, "cancelled");
  EXPECT_EQ(e->cache().used_blocks(), 0);
}

}  // namespace
}  // namespace kallpa::runtime
