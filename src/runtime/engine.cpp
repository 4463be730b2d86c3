#include "kallpa/runtime/engine.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "kallpa/model/gguf_tokenizer.h"
#include "ops/fallback_ops.h"

namespace kallpa::runtime {

namespace {

// Reads the weights into the page cache, so that the disk reads happen here, with progress shown,
// rather than as page faults spread over the first forward passes (which would make the first
// tokens look slow and the load look instant). It reads with pread, not through the mapping, so
// that the pages enter this process only when something reads them: a matrix the ops copy
// (repacked, or uploaded to a device) then never has its file pages and its copy resident at once.
void page_in_weights(const std::string& path, const model::GgufFile& file,
                     const std::function<void(const LoadProgress&)>& on_progress) {
  const std::uint64_t begin = file.data_offset();
  const std::uint64_t total = file.file_size() > begin ? file.file_size() - begin : 0;
  if (total == 0) return;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;                       // the mapping still reads the file, only without the progress
  constexpr std::size_t kChunk = 1u << 20;  // small: it counts towards the process's peak
  std::vector<std::byte> buffer(kChunk);
  for (std::uint64_t done = 0; done < total;) {
    const auto want = static_cast<std::size_t>(std::min<std::uint64_t>(total - done, kChunk));
    const ssize_t got = ::pread(fd, buffer.data(), want, static_cast<off_t>(begin + done));
    if (got <= 0) break;
    done += static_cast<std::uint64_t>(got);
    if (on_progress) on_progress({done, total});
  }
  ::close(fd);
}

}  // namespace

Result<std::unique_ptr<Engine>> Engine::load(const EngineOptions& options) {
  auto file = model::GgufFile::open(options.model_path);
  if (!file) return file.status();
  page_in_weights(options.model_path, **file, options.on_progress);
  return load(*file, options);
}

Result<std::unique_ptr<Engine>> Engine::load(std::shared_ptr<const model::GgufFile> file,
                                             const EngineOptions& options) {
  std::unique_ptr<Engine> e(new Engine());
  e->options_ = options;
  auto ops = ops::make_ops(options.device);
  if (!ops) return ops.status();
  if ((*ops)->host_addressable()) {
    e->ops_ = std::move(*ops);
  } else {
    e->ops_ = std::make_unique<ops::FallbackOps>(std::move(*ops), options.strict_device);
  }
  auto model = model::LlamaModel::load(file, *e->ops_);
  if (!model) return model.status();
  e->model_ = std::move(*model);
  auto tok = model::tokenizer_from_gguf(*file);
  if (!tok) return tok.status();
  e->tokenizer_.emplace(std::move(*tok));
  e->chat_ = model::chat_options_from_gguf(*file);
  e->chat_format_ = model::chat_format_from_gguf(*file, *e->tokenizer_);
  if (e->chat_format_.kind == tokenizer::ChatFormatKind::file_template) {
    spdlog::debug("chat format: {}", e->chat_format_.description);
  } else {
    spdlog::info("chat format: {}", e->chat_format_.description);
  }
  if (e->tokenizer_->vocab_size() != e->model_->config().vocab_size) {
    return Status::invalid("tokenizer.ggml.tokens",
                           fmt::format("{} tokens, but the model's output has {} rows", e->tokenizer_->vocab_size(),
                                       e->model_->config().vocab_size));
  }
  // The cache's capacity is shared by every sequence, so it is not capped at the model's context
  // length: that limit applies per sequence (generate() and the scheduler check it).
  auto kv = e->model_->make_cache(options.cache);
  if (!kv) return kv.status();
  e->cache_ = std::move(*kv);
  e->dispatcher_ = std::make_unique<Dispatcher>(options.attention);
  e->stats_ = std::make_shared<StatsObserver>();
  e->dispatcher_->add_observer(e->stats_);
  return e;
}

std::map<std::string, std::uint64_t> Engine::op_fallbacks() const {
  const auto* fallback = dynamic_cast<const ops::FallbackOps*>(ops_.get());
  return fallback != nullptr ? fallback->fallbacks() : std::map<std::string, std::uint64_t>{};
}

std::vector<ops::MemoryRegion> Engine::memory_regions() const {
  std::vector<ops::MemoryRegion> out;
  model_->memory_regions(out);
  cache_->memory_regions(out);
  return out;
}

Session::Session(Engine& engine, SamplingParams sampling, ProcessGroup* context_parallel)
    : engine_(&engine),
      sampler_(sampling),
      seq_(engine.cache().add_sequence()),
      group_(context_parallel != nullptr && context_parallel->size() > 1 ? context_parallel : nullptr) {}

Session::~Session() { engine_->cache().remove(seq_); }

void Session::reset() {
  engine_->cache().truncate(seq_, 0);
  shard_keys_ = 0;
  tokens_.clear();
  logits_.clear();
  sampler_.reset();
}

void Session::rewind(std::int64_t position) {
  position = std::clamp<std::int64_t>(position, 0, this->position());
  if (group_ != nullptr && position < this->position()) {
    // A shard holds keys of scattered positions: only the start is a place to cut every shard alike.
    engine_->cache().truncate(seq_, 0);
    shard_keys_ = 0;
    tokens_.clear();
    logits_.clear();
    return;
  }
  position = engine_->cache().truncate(seq_, position);
  tokens_.resize(static_cast<std::size_t>(position));
  logits_.clear();
}

Status Session::feed_context_parallel(std::span<const std::int32_t> tokens) {
  model::LlamaModel& model = engine_->model();
  const bool rank0 = group_->rank() == 0;
  logits_.resize(rank0 ? static_cast<std::size_t>(engine_->config().vocab_size) : 0);
  float* logits = rank0 ? logits_.data() : nullptr;
  std::size_t done = 0;
  if (position() == 0 && !tokens.empty()) {
    Status s = model.prefill_context_parallel(seq_, tokens, engine_->cache(), engine_->dispatcher(), *group_, logits,
                                              &shard_keys_);
    if (!s) {
      engine_->cache().truncate(seq_, 0);
      shard_keys_ = 0;
      logits_.clear();
      return s;
    }
    tokens_.assign(tokens.begin(), tokens.end());
    done = tokens.size();
  }
  for (; done < tokens.size(); ++done) {
    Status s = model.decode_context_parallel(seq_, tokens[done], position(), engine_->cache(), engine_->dispatcher(),
                                             *group_, logits, &shard_keys_);
    if (!s) {
      engine_->cache().truncate(seq_, shard_keys_);  // the failed step never happened
      logits_.clear();
      return s;
    }
    tokens_.push_back(tokens[done]);
  }
  return {};
}

Status Session::feed(std::span<const std::int32_t> tokens) {
  if (group_ != nullptr) return feed_context_parallel(tokens);
  const std::int64_t chunk = std::max<std::int64_t>(1, engine_->options().prefill_chunk);
  const std::int64_t vocab = engine_->config().vocab_size;
  for (std::size_t done = 0; done < tokens.size();) {
    const std::size_t n = std::min<std::size_t>(static_cast<std::size_t>(chunk), tokens.size() - done);
    model::ForwardItem item;
    item.seq = seq_;
    item.tokens = tokens.subspan(done, n);
    item.start_pos = position();
    item.want_logits = done + n == tokens.size();
    item.prompt = tokens.size() > 1;  // a prompt's one-token last chunk is still a prompt row
    logits_.resize(static_cast<std::size_t>(vocab));
    // The session owns its sequence's space in the cache; forward() writes into it. A chunk past the
    // model's context is not reserved for: forward() rejects it as such.
    const std::int64_t end = item.start_pos + static_cast<std::int64_t>(n);
    Status s;
    if (end <= engine_->config().context_length) s = engine_->cache().reserve(seq_, end);
    if (s) s = engine_->model().forward({&item, 1}, engine_->cache(), engine_->dispatcher(), logits_.data());
    if (!s) {
      engine_->cache().truncate(seq_, position());  // the failed chunk never happened
      return s;
    }
    tokens_.insert(tokens_.end(), item.tokens.begin(), item.tokens.end());
    done += n;
  }
  return {};
}

Result<std::int32_t> Session::sample(std::span<const std::uint32_t> allowed) {
  if (group_ != nullptr && group_->rank() != 0) {
    // Rank 0 samples; every other rank takes its token (-1: rank 0 failed, and says why itself).
    std::int32_t token = -1;
    if (Status s = group_->broadcast(&token, sizeof token, 0); !s) return s;
    if (token < 0) return Status(ErrorCode::backend_failure, "session", "rank 0 could not sample the next token");
    return token;
  }
  Result<std::int32_t> next = Status(ErrorCode::invalid_argument, "session", "no logits yet: feed a prompt first");
  if (!logits_.empty()) {
    scratch_ = logits_;  // the repetition penalty and the mask edit their input
    next = sampler_.sample(scratch_, tokens_, allowed);
  }
  if (group_ != nullptr) {
    std::int32_t token = next ? *next : -1;
    if (Status s = group_->broadcast(&token, sizeof token, 0); !s) return s;
  }
  return next;
}

std::size_t held_back(std::string_view text, const std::vector<std::string>& stops) {
  std::size_t hold = 0;
  for (const std::string& stop : stops) {
    for (std::size_t n = std::min(stop.size() - 1, text.size()); n > hold; --n) {
      if (text.substr(text.size() - n) == std::string_view(stop).substr(0, n)) {
        hold = n;
        break;
      }
    }
  }
  return hold;
}

Result<GenerateResult> generate(Session& session, std::span<const std::int32_t> prompt, const GenerateOptions& options,
                                const std::function<void(std::string_view)>& on_text) {
  using clock = std::chrono::steady_clock;
  Engine& engine = session.engine();
  const std::int64_t context = engine.config().context_length;
  GenerateResult result;
  result.prompt_tokens = static_cast<std::int64_t>(prompt.size());
  if (prompt.empty() && session.position() == 0) return Status::invalid("prompt", "is empty");
  if (session.position() + static_cast<std::int64_t>(prompt.size()) >= context) {
    return Status::invalid("prompt", fmt::format("{} tokens (with {} already in context) leave no room in the "
                                                 "model's context of {}",
                                                 prompt.size(), session.position(), context));
  }
  for (const std::string& s : options.stop) {
    if (s.empty()) return Status::invalid("stop", "stop strings must not be empty");
  }

  const auto t0 = clock::now();
  if (Status s = session.feed(prompt); !s) return s;
  const auto t1 = clock::now();
  result.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();

  tokenizer::StreamDecoder decoder(engine.tokenizer(), {.skip_special = true});
  std::string pending;  // decoded, not yet emitted
  auto emit = [&](std::string_view text) {
    result.text += text;
    if (on_text && !text.empty()) on_text(text);
  };
  std::optional<GrammarMatcher> matcher;
  if (options.grammar) matcher.emplace(options.grammar);
  result.finish_reason = "length";
  while (result.generated_tokens < options.max_tokens) {
    if (session.position() >= context) break;
    auto next = session.sample(matcher ? matcher->next_mask() : std::span<const std::uint32_t>());
    if (!next) return next.status();
    if (options.on_token) options.on_token(*next, session.logits());
    if (matcher) {
      if (Status s = matcher->accept(*next); !s) return s;
    }
    if ((options.stop_at_eos || matcher) && engine.tokenizer().is_eog(*next)) {
      result.finish_reason = "stop";
      break;
    }
    ++result.generated_tokens;
    auto piece = decoder.push(*next);
    if (!piece) return piece.status();
    pending += *piece;
    bool stopped = false;
    for (const std::string& stop : options.stop) {
      if (auto at = pending.find(stop); at != std::string::npos) {
        pending.resize(at);
        stopped = true;
      }
    }
    if (stopped) {
      emit(pending);
      pending.clear();
      result.finish_reason = "stop";
      break;
    }
    const std::size_t hold = held_back(pending, options.stop);
    emit(std::string_view(pending).substr(0, pending.size() - hold));
    pending.erase(0, pending.size() - hold);
    if (matcher && matcher->finished()) {  // nothing but an end-of-generation token could follow
      pending += decoder.flush();
      emit(pending);
      result.finish_reason = "stop";
      break;
    }
    if (result.generated_tokens == options.max_tokens) break;  // no need to feed the last token
    const std::int32_t token = *next;
    if (Status s = session.feed({&token, 1}); !s) return s;
  }
  if (result.finish_reason != "stop") {
    pending += decoder.flush();
    emit(pending);
  }
  result.decode_seconds = std::chrono::duration<double>(clock::now() - t1).count();
  return result;
}

}  // namespace kallpa::runtime
