#include "kallpa/model/llama_model.h"

#include <algorithm>
#include <cstdint>

#include <sys/mman.h>
#include <unistd.h>

#include <fmt/format.h>

#include "model/repack.h"

namespace kallpa::model {

namespace {

// The file's copies of repacked matrices are not read again by this model: drop their pages from
// this process (clean pages of a read-only file mapping; a later read, say by another model on the
// same file, faults them back in), so that resident memory holds the weights once. The embedding
// table stays, as lookups read it from the file.
void release_file_pages(const std::vector<WeightMatrix>& originals, const WeightMatrix& keep) {
  const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto* keep_begin = static_cast<const std::byte*>(keep.data);
  const std::byte* keep_end = keep_begin + static_cast<std::size_t>(keep.rows) * keep.row_bytes;
  for (const WeightMatrix& w : originals) {
    const auto* begin = static_cast<const std::byte*>(w.data);
    const std::byte* end = begin + static_cast<std::size_t>(w.rows) * w.row_bytes;
    if (w.data == keep.data || (begin < keep_end && keep_begin < end)) continue;  // tied to the embedding
    const auto first = (reinterpret_cast<std::uintptr_t>(begin) + page - 1) / page * page;
    const auto last = reinterpret_cast<std::uintptr_t>(end) / page * page;
    if (last > first) (void)madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
  }
}

}  // namespace
namespace {

Result<WeightMatrix> matrix(const TensorView* t) {
  if (t == nullptr) return Status(ErrorCode::internal, "weights", "missing tensor view");
  return as_weight_matrix(*t);
}

template <typename T>
void grow(std::vector<T>& v, std::int64_t n) {
  if (static_cast<std::int64_t>(v.size()) < n) v.resize(static_cast<std::size_t>(n));
}

}  // namespace

Result<std::unique_ptr<LlamaModel>> LlamaModel::load(std::shared_ptr<const GgufFile> file) {
  LlamaWeights w;
  auto config = load_llama_config(*file, &w);
  if (!config) return config.status();
  std::unique_ptr<LlamaModel> m(new LlamaModel());
  m->file_ = std::move(file);
  m->config_ = *config;

  auto take = [](const TensorView* t, WeightMatrix* out) -> Status {
    auto r = matrix(t);
    if (!r) return r.status();
    *out = *r;
    return {};
  };
  Status s;
  if (!(s = take(w.token_embd, &m->token_embd_)) || !(s = take(w.output, &m->output_))) return s;
  m->output_norm_ = static_cast<const float*>(w.output_norm->data);
  for (const LlamaLayerWeights& lw : w.layers) {
    Layer l{};
    l.attn_norm = static_cast<const float*>(lw.attn_norm->data);
    l.ffn_norm = static_cast<const float*>(lw.ffn_norm->data);
    if (!(s = take(lw.attn_q, &l.wq)) || !(s = take(lw.attn_k, &l.wk)) || !(s = take(lw.attn_v, &l.wv)) ||
        !(s = take(lw.attn_output, &l.wo)) || !(s = take(lw.ffn_gate, &l.gate)) || !(s = take(lw.ffn_up, &l.up)) ||
        !(s = take(lw.ffn_down, &l.down))) {
      return s;
    }
    m->layers_.push_back(l);
  }
  auto packed = std::make_shared<RepackedWeights>();
  std::vector<WeightMatrix*> mats{&m->output_};
  for (Layer& l : m->layers_) {
    for (WeightMatrix* p : {&l.wq, &l.wk, &l.wv, &l.wo, &l.gate, &l.up, &l.down}) mats.push_back(p);
  }
  std::vector<WeightMatrix> originals;
  for (const WeightMatrix* mat : mats) originals.push_back(*mat);
  const std::vector<WeightMatrix*> targets = mats;
  if (!(s = packed->repack(std::move(mats)))) return s;
  m->repacked_ = std::move(packed);
  if (m->file_->file_backed()) {
    std::vector<WeightMatrix> replaced;
    for (std::size_t i = 0; i < targets.size(); ++i) {
      if (targets[i]->data != originals[i].data) replaced.push_back(originals[i]);
    }
    release_file_pages(replaced, m->token_embd_);
  }
  return m;
}

Result<std::unique_ptr<runtime::KvCache>> LlamaModel::make_cache(runtime::KvCacheOptions options) const {
  return runtime::KvCache::create(static_cast<std::int32_t>(config_.n_layer), static_cast<std::int32_t>(config_.n_head_kv),
                                  static_cast<std::int32_t>(config_.head_dim), options);
}

Status LlamaModel::forward(std::span<const ForwardItem> given, runtime::KvCache& cache, runtime::Ops& ops,
                           Dispatcher& dispatcher, float* logits) {
  // Prompt chunks first, then single-token decode steps, so that the decode rows form the tail the
  // ops may compute with cheaper activations (runtime/ops.h). A row's kind depends only on its own
  // item, so a sequence gets the same numbers alone or batched.
  order_.resize(given.size());
  for (std::size_t i = 0; i < given.size(); ++i) order_[i] = i;
  std::stable_partition(order_.begin(), order_.end(), [&](std::size_t i) { return given[i].tokens.size() != 1; });
  ordered_.clear();
  for (std::size_t i : order_) ordered_.push_back(given[i]);
  const std::span<const ForwardItem> items(ordered_);
  std::int64_t decode_rows = 0;
  for (const ForwardItem& it : items) decode_rows += it.tokens.size() == 1 ? 1 : 0;

  const std::int64_t embd = config_.n_embd, qd = config_.q_dim(), kvd = config_.kv_dim(), ff = config_.n_ff;
  std::int64_t total = 0;
  for (const ForwardItem& it : items) {
    if (it.tokens.empty()) return Status::invalid("tokens", "a forward item has no tokens");
    if (it.start_pos < 0) return Status::invalid("start_pos", "is negative");
    const std::int64_t end = it.start_pos + static_cast<std::int64_t>(it.tokens.size());
    if (end > config_.context_length) {
      return Status::invalid("tokens", fmt::format("{} positions exceed the model's context length {}", end,
                                                   config_.context_length));
    }
    Status s = cache.reserve(it.seq, end);
    if (!s) return s;
    total += static_cast<std::int64_t>(it.tokens.size());
  }
  if (total == 0) return {};

  grow(x_, total * embd);
  grow(h_, total * embd);
  grow(q_, total * qd);
  grow(k_, total * kvd);
  grow(v_, total * kvd);
  grow(att_, total * qd);
  grow(gate_, total * ff);
  grow(up_, total * ff);
  grow(tmp_, total * std::max(embd, qd));
  tokens_.clear();
  positions_.clear();
  for (const ForwardItem& it : items) {
    for (std::size_t t = 0; t < it.tokens.size(); ++t) {
      tokens_.push_back(it.tokens[t]);
      positions_.push_back(static_cast<std::int32_t>(it.start_pos + static_cast<std::int64_t>(t)));
    }
  }
  plan_attention(items, cache);

  Status s = ops.embedding(token_embd_, tokens_, x_.data());
  if (!s) return s;
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = layers_[l];
    // Attention block.
    ops.rmsnorm(x_.data(), L.attn_norm, config_.rms_norm_eps, h_.data(), total, embd);
    const MatmulJob qkv[] = {{&L.wq, q_.data(), qd}, {&L.wk, k_.data(), kvd}, {&L.wv, v_.data(), kvd}};
    if (!(s = ops.matmul_group(qkv, h_.data(), total, decode_rows))) return s;
    ops.rope(q_.data(), positions_, config_.n_head, config_.head_dim, config_.n_rot, config_.rope_freq_base);
    ops.rope(k_.data(), positions_, config_.n_head_kv, config_.head_dim, config_.n_rot, config_.rope_freq_base);
    for (std::size_t b = 0; b < items.size(); ++b) {
      const ForwardItem& it = items[b];
      const std::int64_t row = cu_q_[b];
      const std::span<const std::int32_t> blocks(block_table_.data() + b * static_cast<std::size_t>(max_blocks_),
                                                 static_cast<std::size_t>(max_blocks_));
      cache.write(static_cast<std::int32_t>(l), blocks, it.start_pos, k_.data() + row * kvd, v_.data() + row * kvd,
                  static_cast<std::int64_t>(it.tokens.size()));
    }
    if (!(s = attention(static_cast<std::int32_t>(l), cache, dispatcher))) return s;
    if (!(s = ops.matmul(L.wo, att_.data(), total, tmp_.data(), decode_rows))) return s;
    ops.add(x_.data(), tmp_.data(), total * embd);
    // Feed-forward block (SwiGLU).
    ops.rmsnorm(x_.data(), L.ffn_norm, config_.rms_norm_eps, h_.data(), total, embd);
    const MatmulJob gate_up[] = {{&L.gate, gate_.data(), ff}, {&L.up, up_.data(), ff}};
    if (!(s = ops.matmul_group(gate_up, h_.data(), total, decode_rows))) return s;
    ops.swiglu(gate_.data(), up_.data(), gate_.data(), total * ff);
    if (!(s = ops.matmul(L.down, gate_.data(), total, tmp_.data(), decode_rows))) return s;
    ops.add(x_.data(), tmp_.data(), total * embd);
  }

  // Output head, only for the rows whose logits are wanted, written back in the caller's item order.
  std::int64_t row = 0, wanted = 0, wanted_decode = 0;
  bool reordered = false;
  for (std::size_t i = 0; i < items.size(); ++i) {
    const ForwardItem& it = items[i];
    row += static_cast<std::int64_t>(it.tokens.size());
    if (it.want_logits) {
      std::copy_n(x_.data() + (row - 1) * embd, embd, h_.data() + wanted * embd);
      ++wanted;
      wanted_decode += it.tokens.size() == 1 ? 1 : 0;
    }
    reordered = reordered || order_[i] != i;
  }
  if (wanted == 0) return {};
  ops.rmsnorm(h_.data(), output_norm_, config_.rms_norm_eps, h_.data(), wanted, embd);
  const std::int64_t vocab = config_.vocab_size;
  if (!reordered) return ops.matmul(output_, h_.data(), wanted, logits, wanted_decode);
  grow(logits_, wanted * vocab);
  if (!(s = ops.matmul(output_, h_.data(), wanted, logits_.data(), wanted_decode))) return s;
  // The caller's rank of each wanted item: its slot in `logits`.
  std::vector<std::int64_t> slot(given.size(), -1);
  for (std::size_t i = 0, n = 0; i < given.size(); ++i) {
    if (given[i].want_logits) slot[i] = static_cast<std::int64_t>(n++);
  }
  for (std::size_t i = 0, w = 0; i < items.size(); ++i) {
    if (!items[i].want_logits) continue;
    std::copy_n(logits_.data() + static_cast<std::int64_t>(w++) * vocab, vocab, logits + slot[order_[i]] * vocab);
  }
  return {};
}

void LlamaModel::plan_attention(std::span<const ForwardItem> items, const runtime::KvCache& cache) {
  cu_q_.assign(1, 0);
  seqlens_k_.clear();
  std::vector<std::vector<std::int32_t>> tables;
  max_blocks_ = 1;
  for (const ForwardItem& it : items) {
    cu_q_.push_back(cu_q_.back() + static_cast<std::int32_t>(it.tokens.size()));
    seqlens_k_.push_back(static_cast<std::int32_t>(it.start_pos + static_cast<std::int64_t>(it.tokens.size())));
    tables.push_back(cache.blocks(it.seq));
    max_blocks_ = std::max(max_blocks_, static_cast<std::int32_t>(tables.back().size()));
  }
  block_table_.assign(items.size() * static_cast<std::size_t>(max_blocks_), 0);
  for (std::size_t b = 0; b < items.size(); ++b) {
    std::copy(tables[b].begin(), tables[b].end(),
              block_table_.begin() + static_cast<std::ptrdiff_t>(b) * max_blocks_);
  }
}

Status LlamaModel::attention(std::int32_t layer, const runtime::KvCache& cache, Dispatcher& dispatcher) {
  const auto batch = static_cast<std::int32_t>(seqlens_k_.size());
  const std::int64_t total = cu_q_.back();
  AttentionProblem p;
  p.q_layout = QLayout::packed;
  p.kv_layout = KvLayout::paged;
  p.q = make_contiguous_view(q_.data(), DType::f32, {total, config_.n_head, config_.head_dim});
  p.o = make_contiguous_view(att_.data(), DType::f32, {total, config_.n_head, config_.head_dim});
  p.k = cache.k_view(layer);
  p.v = cache.v_view(layer);
  p.batch = batch;
  p.cu_seqlens_q = cu_q_.data();
  p.block_table = block_table_.data();
  p.max_blocks_per_seq = max_blocks_;
  p.seqlens_k = seqlens_k_.data();
  p.causal = true;
  return dispatcher.run(p);
}

}  // namespace kallpa::model
