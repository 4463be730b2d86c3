// Context parallelism: one sequence's forward passes spread over the ranks of a process group
// (llama_model.h, docs/scale-out.md). The layers are the ones forward() runs (attention_block,
// ffn_block); only the attention step differs, and the process group is all this floor sees of the
// transport.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "kallpa/model/llama_model.h"

namespace kallpa::model {
namespace {

// Keys per block of the gathered prompt K/V (any size works: it is the paged view's page).
constexpr std::int64_t kGatherPage = 16;

// Clears the context-parallel step when a call ends, whichever way it ends.
struct CpScope {
  explicit CpScope(std::function<void()> done) : done_(std::move(done)) {}
  ~CpScope() { done_(); }
  CpScope(const CpScope&) = delete;
  CpScope& operator=(const CpScope&) = delete;
  std::function<void()> done_;
};

// n f32 values into the cache's storage type, rounded as KvCache::write_rows rounds them, so that
// gathered keys are the very values a one-process run reads from its cache.
Status to_storage(DType dtype, const float* src, std::byte* dst, std::int64_t n) {
  switch (dtype) {
    case DType::f32: std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(float)); return {};
    case DType::f16: return ops::quantize_row(ops::GgmlType::f16, src, dst, n);
    case DType::bf16: return ops::quantize_row(ops::GgmlType::bf16, src, dst, n);
  }
  return Status(ErrorCode::unsupported, "kv_cache", fmt::format("storage type {}", dtype_name(dtype)));
}

}  // namespace

Status LlamaModel::check_context_parallel(const ops::KvCache& cache, ops::SeqId seq) const {
  if (!ops_->host_addressable()) {
    return Status(ErrorCode::unsupported, "context parallel",
                  fmt::format("runs on host memory; the model runs on {}", ops_->device_name()));
  }
  if (!cache.has(seq)) return Status(ErrorCode::not_found, "seq", fmt::format("no sequence {} in the cache", seq));
  for (std::uint32_t l = 0; l < config_.n_layer; ++l) {
    if (config_.window_left(l) >= 0) {
      return Status(ErrorCode::unsupported, "context parallel",
                    fmt::format("layer {} attends through a sliding window of {} keys; the shards keep no key "
                                "positions to apply it",
                                l, config_.sliding_window));
    }
  }
  return {};
}

Status LlamaModel::prefill_context_parallel(ops::SeqId seq, std::span<const std::int32_t> prompt, ops::KvCache& cache,
                                            Dispatcher& dispatcher, ProcessGroup& group, float* logits,
                                            std::int64_t* shard_keys) {
  if (Status s = check_context_parallel(cache, seq); !s) return s;
  if (cache.capacity(seq) != 0) {
    return Status::invalid("seq", fmt::format("sequence {} already holds keys; a context-parallel prefill starts "
                                              "an empty one",
                                              seq));
  }
  const auto total = static_cast<std::int64_t>(prompt.size());
  if (total == 0) return Status::invalid("tokens", "the prompt is empty");
  if (total > config_.context_length) {
    return Status::invalid(
        "tokens", fmt::format("{} positions exceed the model's context length {}", total, config_.context_length));
  }
  const int n = group.size(), r = group.rank();
  if (group.rank() == 0 && logits == nullptr) return Status::invalid("logits", "rank 0 needs a buffer for the logits");

  // This rank's rows: chunk r, then chunk 2N-1-r (the prompt's last token is rank 0's last row).
  tokens_.clear();
  positions_.clear();
  for (const int chunk : {r, 2 * n - 1 - r}) {
    const auto [begin, end] = context_parallel_chunk(total, chunk, n);
    for (std::int64_t p = begin; p < end; ++p) {
      tokens_.push_back(prompt[static_cast<std::size_t>(p)]);
      positions_.push_back(static_cast<std::int32_t>(p));
    }
  }
  const auto local = static_cast<std::int64_t>(tokens_.size());
  cp_max_rows_ = 0;
  for (int k = 0; k < n; ++k) {
    const auto [a0, a1] = context_parallel_chunk(total, k, n);
    const auto [b0, b1] = context_parallel_chunk(total, 2 * n - 1 - k, n);
    cp_max_rows_ = std::max(cp_max_rows_, (a1 - a0) + (b1 - b0));
  }
  if (local > 0) {
    if (Status s = cache.reserve(seq, local); !s) return s;
  }
  const std::vector<std::int32_t> table = cache.blocks(seq);
  kv_slots_.clear();
  for (std::int64_t i = 0; i < local; ++i) kv_slots_.push_back(cache.slot(table, i));

  ops::Ops& ops = *ops_;
  const std::int64_t embd = config_.n_embd;
  if (Status s = reserve_step_buffers(std::max<std::int64_t>(local, 1)); !s) return s;
  cp_ = CpStep::prefill;
  group_ = &group;
  cp_prompt_ = total;
  const CpScope scope([this] {
    cp_ = CpStep::none;
    group_ = nullptr;
  });
  Status s;
  if (local > 0) {
    if (!(s = ops.embedding(token_embd_, tokens_, x_.get()))) return s;
    if (config_.embedding_scale != 1.0f && !(s = ops.scale(x_.get(), config_.embedding_scale, local * embd))) return s;
  }
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    // A rank without rows still joins every layer's all-gather.
    s = local > 0 ? attention_block(l, cache, dispatcher, local, 0)
                  : prefill_attention_cp(static_cast<std::int32_t>(l), cache, dispatcher);
    if (!s || (local > 0 && !(s = ffn_block(l, local, 0)))) return s;
  }
  if (shard_keys != nullptr) *shard_keys = local;
  return r == 0 ? output_head(local - 1, false, logits) : Status();
}

Status LlamaModel::prefill_attention_cp(std::int32_t layer, const ops::KvCache& cache, Dispatcher& dispatcher) {
  const int n = group_->size(), r = group_->rank();
  const DType dtype = cache.options().dtype;
  const std::int64_t kvd = config_.kv_dim();
  const std::size_t row_bytes = static_cast<std::size_t>(kvd) * dtype_size(dtype);
  const std::size_t block = static_cast<std::size_t>(cp_max_rows_) * 2 * row_bytes;
  const auto local = static_cast<std::int64_t>(tokens_.size());

  // Each rank's rows, K then V per row, in the storage type, padded to the largest rank's count.
  cp_send_.resize(block);
  for (std::int64_t i = 0; i < local; ++i) {
    std::byte* row = cp_send_.data() + static_cast<std::size_t>(i) * 2 * row_bytes;
    Status s = to_storage(dtype, k_.get() + i * kvd, row, kvd);
    if (!s || !(s = to_storage(dtype, v_.get() + i * kvd, row + row_bytes, kvd))) return s;
  }
  cp_all_.resize(block * static_cast<std::size_t>(n));
  if (Status s = group_->all_gather(cp_send_.data(), block, cp_all_.data()); !s) return s;
  if (local == 0) return {};

  // Every rank's rows to their positions: the prompt's K and V in order, as pages of a paged view.
  const std::int64_t pages = (cp_prompt_ + kGatherPage - 1) / kGatherPage;
  cp_keys_.resize(static_cast<std::size_t>(pages * kGatherPage) * row_bytes);
  cp_values_.resize(cp_keys_.size());
  for (int k = 0; k < n; ++k) {
    const std::byte* from = cp_all_.data() + static_cast<std::size_t>(k) * block;
    for (const int chunk : {k, 2 * n - 1 - k}) {
      const auto [begin, end] = context_parallel_chunk(cp_prompt_, chunk, n);
      for (std::int64_t p = begin; p < end; ++p, from += 2 * row_bytes) {
        std::memcpy(cp_keys_.data() + static_cast<std::size_t>(p) * row_bytes, from, row_bytes);
        std::memcpy(cp_values_.data() + static_cast<std::size_t>(p) * row_bytes, from + row_bytes, row_bytes);
      }
    }
  }

  // This rank's two chunks are two sequences of one packed problem over the same pages: chunk c's
  // rows see keys [0, end of c), which the contract's bottom-right causal mask turns into each
  // row's own prefix.
  const auto [a0, a1] = context_parallel_chunk(cp_prompt_, r, n);
  const std::int64_t b1 = context_parallel_chunk(cp_prompt_, 2 * n - 1 - r, n).second;
  cp_cu_q_ = {0, static_cast<std::int32_t>(a1 - a0), static_cast<std::int32_t>(local)};
  cp_seqlens_k_ = {static_cast<std::int32_t>(a1), static_cast<std::int32_t>(b1)};
  cp_table_.resize(static_cast<std::size_t>(2 * pages));
  for (std::int64_t i = 0; i < 2 * pages; ++i)
    cp_table_[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i % pages);

  AttentionProblem p;
  p.q_layout = QLayout::packed;
  p.kv_layout = KvLayout::paged;
  p.q = make_contiguous_view(q_.get(), DType::f32, {local, config_.n_head, config_.head_dim}, ops_->device());
  p.o = make_contiguous_view(att_.get(), DType::f32, {local, config_.n_head, config_.head_dim}, ops_->device());
  p.k = make_contiguous_view(cp_keys_.data(), dtype, {pages, kGatherPage, config_.n_head_kv, config_.head_dim},
                             ops_->device());
  p.v = make_contiguous_view(cp_values_.data(), dtype, {pages, kGatherPage, config_.n_head_kv, config_.head_dim},
                             ops_->device());
  p.batch = 2;
  p.cu_seqlens_q = cp_cu_q_.data();
  p.block_table = cp_table_.data();
  p.max_blocks_per_seq = static_cast<std::int32_t>(pages);
  p.seqlens_k = cp_seqlens_k_.data();
  p.causal = true;
  p.scale = config_.attention_scale;
  p.window_left = config_.window_left(static_cast<std::uint32_t>(layer));
  p.softcap = config_.attn_logit_softcap;
  return dispatcher.run(p);
}

Status LlamaModel::decode_context_parallel(ops::SeqId seq, std::int32_t token, std::int64_t position,
                                           ops::KvCache& cache, Dispatcher& dispatcher, ProcessGroup& group,
                                           float* logits, std::int64_t* shard_keys) {
  if (Status s = check_context_parallel(cache, seq); !s) return s;
  if (shard_keys == nullptr || *shard_keys < 0) return Status::invalid("shard_keys", "the shard's key count is needed");
  if (position < 0 || position >= config_.context_length) {
    return Status::invalid(
        "position", fmt::format("{} is outside the model's context of {} positions", position, config_.context_length));
  }
  if (token < 0 || static_cast<std::uint32_t>(token) >= config_.vocab_size) {
    return Status::invalid("token", fmt::format("{} is not in the vocabulary of {}", token, config_.vocab_size));
  }
  if (group.rank() == 0 && logits == nullptr) return Status::invalid("logits", "rank 0 needs a buffer for the logits");
  const bool keeps = context_parallel_owner(position, group.size()) == group.rank();
  const std::int64_t keys = *shard_keys + (keeps ? 1 : 0);
  if (keeps) {
    if (Status s = cache.reserve(seq, keys); !s) return s;
  }
  const std::vector<std::int32_t> table = cache.blocks(seq);
  kv_slots_.clear();
  if (keeps) kv_slots_.push_back(cache.slot(table, *shard_keys));
  tokens_.assign(1, token);
  positions_.assign(1, static_cast<std::int32_t>(position));
  // The shard as a one-row paged problem: its single query row comes after every key it holds.
  cu_q_ = {0, 1};
  seqlens_k_.assign(1, static_cast<std::int32_t>(keys));
  max_blocks_ = static_cast<std::int32_t>(table.size());
  block_table_ = table;

  ops::Ops& ops = *ops_;
  const std::int64_t embd = config_.n_embd, qd = config_.q_dim(), kvd = config_.kv_dim(), ff = config_.n_ff;
  for (auto [buffer, floats, what] : {std::tuple{&x_, embd, "x"},
                                      {&h_, embd, "h"},
                                      {&q_, qd, "q"},
                                      {&k_, kvd, "k"},
                                      {&v_, kvd, "v"},
                                      {&att_, qd, "att"},
                                      {&gate_, ff, "gate"},
                                      {&up_, ff, "up"},
                                      {&tmp_, std::max(embd, qd), "tmp"}}) {
    if (Status s = buffer->reserve(ops, floats, what); !s) return s;
  }
  cp_ = CpStep::decode;
  group_ = &group;
  const CpScope scope([this] {
    cp_ = CpStep::none;
    group_ = nullptr;
  });
  Status s = ops.embedding(token_embd_, tokens_, x_.get());
  if (!s) return s;
  if (config_.embedding_scale != 1.0f && !(s = ops.scale(x_.get(), config_.embedding_scale, embd))) return s;
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    if (!(s = attention_block(l, cache, dispatcher, 1, 1)) || !(s = ffn_block(l, 1, 1))) return s;
  }
  *shard_keys = keys;
  return group.rank() == 0 ? output_head(0, true, logits) : Status();
}

Status LlamaModel::decode_attention_cp(std::int32_t layer, const ops::KvCache& cache, Dispatcher& dispatcher) {
  const std::int64_t heads = config_.n_head, dim = config_.head_dim;
  lse_.resize(static_cast<std::size_t>(heads));
  AttentionProblem p;
  p.q_layout = QLayout::packed;
  p.kv_layout = KvLayout::paged;
  p.q = make_contiguous_view(q_.get(), DType::f32, {1, heads, dim}, ops_->device());
  p.o = make_contiguous_view(att_.get(), DType::f32, {1, heads, dim}, ops_->device());
  p.lse = make_contiguous_view(lse_.data(), DType::f32, {heads, 1}, ops_->device());
  p.k = cache.k_view(layer);
  p.v = cache.v_view(layer);
  p.batch = 1;
  p.cu_seqlens_q = cu_q_.data();
  p.block_table = max_blocks_ > 0 ? block_table_.data() : nullptr;
  p.max_blocks_per_seq = max_blocks_;
  p.seqlens_k = seqlens_k_.data();
  p.page_versions = cache.page_versions(layer);
  p.kv_pool_id = cache.pool_id();
  p.causal = true;
  p.scale = config_.attention_scale;
  p.softcap = config_.attn_logit_softcap;
  if (Status s = dispatcher.run(p); !s) return s;

  // Every rank's (o, lse) of its shard, merged by log-sum-exp in rank order.
  const std::size_t width = static_cast<std::size_t>(heads * dim + heads);
  cp_partial_.resize(width);
  std::memcpy(cp_partial_.data(), att_.get(), static_cast<std::size_t>(heads * dim) * sizeof(float));
  std::memcpy(cp_partial_.data() + heads * dim, lse_.data(), static_cast<std::size_t>(heads) * sizeof(float));
  const int n = group_->size();
  cp_partials_.resize(width * static_cast<std::size_t>(n));
  if (Status s = group_->all_gather(cp_partial_.data(), width * sizeof(float), cp_partials_.data()); !s) return s;
  float* o = att_.get();
  for (std::int64_t h = 0; h < heads; ++h) {
    auto lse_of = [&](int k) { return cp_partials_[static_cast<std::size_t>(k) * width + heads * dim + h]; };
    float top = -std::numeric_limits<float>::infinity();
    for (int k = 0; k < n; ++k) top = std::max(top, lse_of(k));
    float* out = o + h * dim;
    std::fill(out, out + dim, 0.0f);
    if (top == -std::numeric_limits<float>::infinity()) continue;  // no key anywhere: o = 0, as the contract says
    float weight_sum = 0.0f;
    for (int k = 0; k < n; ++k) {
      const float weight = std::exp(lse_of(k) - top);
      if (weight == 0.0f) continue;
      const float* part = cp_partials_.data() + static_cast<std::size_t>(k) * width + h * dim;
      for (std::int64_t d = 0; d < dim; ++d) out[d] += weight * part[d];
      weight_sum += weight;
    }
    for (std::int64_t d = 0; d < dim; ++d) out[d] /= weight_sum;
  }
  return {};
}

Status LlamaModel::output_head(std::int64_t row, bool decode, float* logits) {
  ops::Ops& ops = *ops_;
  const std::int64_t embd = config_.n_embd, vocab = config_.vocab_size;
  wanted_rows_.assign(1, row);
  Status s;
  if (!(s = ops.gather_rows(x_.get(), wanted_rows_, embd, h_.get())) ||
      !(s = ops.rmsnorm(h_.get(), static_cast<const float*>(output_norm_.data), config_.rms_norm_eps, h_.get(), 1,
                        embd)) ||
      !(s = ops.matmul(output_, h_.get(), 1, logits, decode ? 1 : 0))) {
    return s;
  }
  if (const float cap = config_.final_logit_softcap; cap > 0.0f) {
    for (std::int64_t i = 0; i < vocab; ++i) logits[i] = cap * std::tanh(logits[i] / cap);
  }
  return {};
}

}  // namespace kallpa::model
