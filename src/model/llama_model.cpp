#include "kallpa/model/llama_model.h"

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <utility>

#include <sys/mman.h>
#include <unistd.h>

#include <fmt/format.h>

namespace kallpa::model {

namespace {

// The file's copies of repacked matrices are not read again by this model: drop their pages from
// this process (clean pages of a read-only file mapping; a later read, say by another model on the
// same file, faults them back in), so that resident memory holds the weights once. The embedding
// table stays, as lookups read it from the file.
void release_file_pages(const std::vector<ops::WeightMatrix>& originals, const ops::WeightMatrix& keep) {
  const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto* keep_begin = static_cast<const std::byte*>(keep.data);
  const std::byte* keep_end = keep_begin + static_cast<std::size_t>(keep.rows) * keep.row_bytes;
  for (const ops::WeightMatrix& w : originals) {
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

Result<ops::WeightMatrix> matrix(const TensorView* t) {
  if (t == nullptr) return Status(ErrorCode::internal, "weights", "missing tensor view");
  return as_weight_matrix(*t);
}

}  // namespace

Result<std::unique_ptr<LlamaModel>> LlamaModel::load(std::shared_ptr<const GgufFile> file, ops::Ops& ops) {
  LlamaWeights w;
  auto config = load_llama_config(*file, &w);
  if (!config) return config.status();
  std::unique_ptr<LlamaModel> m(new LlamaModel());
  m->file_ = std::move(file);
  m->ops_ = &ops;
  m->config_ = *config;

  auto take = [](const TensorView* t, ops::WeightMatrix* out) -> Status {
    auto r = matrix(t);
    if (!r) return r.status();
    *out = *r;
    return {};
  };
  Status s;
  if (!(s = take(w.token_embd, &m->token_embd_)) || !(s = take(w.output, &m->output_)) ||
      !(s = take(w.output_norm, &m->output_norm_))) {
    return s;
  }
  for (const LlamaLayerWeights& lw : w.layers) {
    Layer l{};
    if (!(s = take(lw.attn_norm, &l.attn_norm)) || !(s = take(lw.ffn_norm, &l.ffn_norm)) ||
        !(s = take(lw.attn_q, &l.wq)) || !(s = take(lw.attn_k, &l.wk)) || !(s = take(lw.attn_v, &l.wv)) ||
        !(s = take(lw.attn_output, &l.wo)) || !(s = take(lw.ffn_gate, &l.gate)) || !(s = take(lw.ffn_up, &l.up)) ||
        !(s = take(lw.ffn_down, &l.down))) {
      return s;
    }
    m->layers_.push_back(l);
  }
  std::vector<ops::WeightMatrix*> products{&m->output_}, lookups{&m->token_embd_, &m->output_norm_};
  for (Layer& l : m->layers_) {
    for (ops::WeightMatrix* p : {&l.wq, &l.wk, &l.wv, &l.wo, &l.gate, &l.up, &l.down}) products.push_back(p);
    lookups.push_back(&l.attn_norm);
    lookups.push_back(&l.ffn_norm);
  }
  std::vector<ops::WeightMatrix*> all = products;
  all.insert(all.end(), lookups.begin(), lookups.end());
  std::vector<ops::WeightMatrix> originals;
  for (const ops::WeightMatrix* mat : all) originals.push_back(*mat);
  for (auto [mats, use] :
       {std::pair{&products, ops::Ops::WeightUse::matmul}, std::pair{&lookups, ops::Ops::WeightUse::lookup}}) {
    auto placed = ops.place_weights(*mats, use);
    if (!placed) return placed.status();
    m->placed_.push_back(std::move(*placed));
  }
  if (m->file_->file_backed()) {
    std::vector<ops::WeightMatrix> replaced;
    for (std::size_t i = 0; i < all.size(); ++i) {
      if (all[i]->data != originals[i].data) replaced.push_back(originals[i]);
    }
    release_file_pages(replaced, m->token_embd_);
  }
  return m;
}

LlamaModel::~LlamaModel() = default;

Status LlamaModel::Scratch::reserve(ops::Ops& ops, std::int64_t floats, const char* what) {
  if (floats <= size_ && ops_ == &ops) return {};
  reset();
  auto p = ops.allocate(static_cast<std::size_t>(floats) * sizeof(float), what);
  if (!p) return p.status();
  ops_ = &ops;
  data_ = static_cast<float*>(*p);
  size_ = floats;
  return {};
}

void LlamaModel::Scratch::reset() noexcept {
  if (ops_ != nullptr) ops_->free(data_);
  data_ = nullptr;
  size_ = 0;
}

std::int64_t LlamaModel::matmul_weights_per_token() const noexcept {
  auto count = [](const ops::WeightMatrix& w) { return w.rows * w.cols; };
  std::int64_t total = count(output_);
  for (const Layer& l : layers_) {
    total += count(l.wq) + count(l.wk) + count(l.wv) + count(l.wo) + count(l.gate) + count(l.up) + count(l.down);
  }
  return total;
}

Result<std::unique_ptr<ops::KvCache>> LlamaModel::make_cache(ops::KvCacheOptions options) const {
  return ops::KvCache::create(static_cast<std::int32_t>(config_.n_layer), static_cast<std::int32_t>(config_.n_head_kv),
                              static_cast<std::int32_t>(config_.head_dim), options, ops_);
}

Status LlamaModel::forward(std::span<const ForwardItem> items, ops::KvCache& cache, Dispatcher& dispatcher,
                           float* logits) {
  ops::Ops& ops = *ops_;
  // The decode rows must form the tail that the ops may compute with cheaper activations
  // (ops/ops.h). Rows stay in the caller's order, so the logits come out in it with no reshuffle;
  // the caller, which knows each item's kind when it builds the batch, puts prompt chunks first.
  // A row's kind depends only on its own item, so a sequence gets the same numbers alone or batched.
  std::int64_t decode_rows = 0;
  for (const ForwardItem& it : items) {
    if (is_decode_step(it)) {
      ++decode_rows;
    } else if (decode_rows > 0) {
      return Status::invalid("items", "a prompt chunk follows a decode step; forward() takes prompt chunks first");
    }
  }

  const std::int64_t embd = config_.n_embd, qd = config_.q_dim(), kvd = config_.kv_dim(), ff = config_.n_ff;
  std::int64_t total = 0;
  for (const ForwardItem& it : items) {
    if (it.tokens.empty()) return Status::invalid("tokens", "a forward item has no tokens");
    if (it.start_pos < 0) return Status::invalid("start_pos", "is negative");
    const std::int64_t end = it.start_pos + static_cast<std::int64_t>(it.tokens.size());
    if (end > config_.context_length) {
      return Status::invalid(
          "tokens", fmt::format("{} positions exceed the model's context length {}", end, config_.context_length));
    }
    if (cache.capacity(it.seq) < end) {
      return Status::invalid("cache", fmt::format("sequence {} holds {} positions, its chunk ends at {}: the caller "
                                                  "reserves them first (ops::KvCache::reserve)",
                                                  it.seq, cache.capacity(it.seq), end));
    }
    total += static_cast<std::int64_t>(it.tokens.size());
  }
  if (total == 0) return {};

  const std::int64_t vocab = config_.vocab_size;
  for (auto [buffer, floats, what] : {std::tuple{&x_, total * embd, "x"},
                                      {&h_, total * embd, "h"},
                                      {&q_, total * qd, "q"},
                                      {&k_, total * kvd, "k"},
                                      {&v_, total * kvd, "v"},
                                      {&att_, total * qd, "att"},
                                      {&gate_, total * ff, "gate"},
                                      {&up_, total * ff, "up"},
                                      {&tmp_, total * std::max(embd, qd), "tmp"}}) {
    if (Status s = buffer->reserve(ops, floats, what); !s) return s;
  }
  tokens_.clear();
  positions_.clear();
  for (const ForwardItem& it : items) {
    for (std::size_t t = 0; t < it.tokens.size(); ++t) {
      tokens_.push_back(it.tokens[t]);
      positions_.push_back(static_cast<std::int32_t>(it.start_pos + static_cast<std::int64_t>(t)));
    }
  }
  plan_attention(items, cache);

  float *x = x_.get(), *h = h_.get(), *q = q_.get(), *k = k_.get(), *v = v_.get(), *gate = gate_.get(), *up = up_.get(),
        *tmp = tmp_.get();
  Status s = ops.embedding(token_embd_, tokens_, x);
  if (!s) return s;
  const float eps = config_.rms_norm_eps;
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = layers_[l];
    // Attention block.
    if (!(s = ops.rmsnorm(x, static_cast<const float*>(L.attn_norm.data), eps, h, total, embd))) return s;
    const ops::MatmulJob qkv[] = {{&L.wq, q, qd}, {&L.wk, k, kvd}, {&L.wv, v, kvd}};
    if (!(s = ops.matmul_group(qkv, h, total, decode_rows))) return s;
    if (!(s = ops.rope(q, positions_, config_.n_head, config_.head_dim, config_.n_rot, config_.rope_freq_base)) ||
        !(s = ops.rope(k, positions_, config_.n_head_kv, config_.head_dim, config_.n_rot, config_.rope_freq_base)) ||
        !(s = cache.write_rows(static_cast<std::int32_t>(l), kv_slots_, k, v)) || !(s = ops.finish()) ||
        !(s = attention(static_cast<std::int32_t>(l), cache, dispatcher)) ||
        !(s = ops.matmul(L.wo, att_.get(), total, tmp, decode_rows)) || !(s = ops.add(x, tmp, total * embd))) {
      return s;
    }
    // Feed-forward block (SwiGLU).
    if (!(s = ops.rmsnorm(x, static_cast<const float*>(L.ffn_norm.data), eps, h, total, embd))) return s;
    const ops::MatmulJob gate_up[] = {{&L.gate, gate, ff}, {&L.up, up, ff}};
    if (!(s = ops.matmul_group(gate_up, h, total, decode_rows)) || !(s = ops.swiglu(gate, up, gate, total * ff)) ||
        !(s = ops.matmul(L.down, gate, total, tmp, decode_rows)) || !(s = ops.add(x, tmp, total * embd))) {
      return s;
    }
  }

  // Output head, only for the rows whose logits are wanted.
  std::int64_t row = 0, wanted_decode = 0;
  wanted_rows_.clear();
  for (std::size_t i = 0; i < items.size(); ++i) {
    const ForwardItem& it = items[i];
    row += static_cast<std::int64_t>(it.tokens.size());
    if (it.want_logits) {
      wanted_rows_.push_back(row - 1);
      wanted_decode += is_decode_step(it) ? 1 : 0;
    }
  }
  const auto wanted = static_cast<std::int64_t>(wanted_rows_.size());
  if (wanted == 0) return {};
  if (!(s = ops.gather_rows(x, wanted_rows_, embd, h)) ||
      !(s = ops.rmsnorm(h, static_cast<const float*>(output_norm_.data), eps, h, wanted, embd))) {
    return s;
  }
  if (ops.host_addressable()) return ops.matmul(output_, h, wanted, logits, wanted_decode);
  if (!(s = logits_.reserve(ops, wanted * vocab, "logits")) ||
      !(s = ops.matmul(output_, h, wanted, logits_.get(), wanted_decode))) {
    return s;
  }
  return ops.download(logits, logits_.get(), static_cast<std::size_t>(wanted * vocab) * sizeof(float));
}

void LlamaModel::plan_attention(std::span<const ForwardItem> items, const ops::KvCache& cache) {
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
  kv_slots_.clear();
  for (std::size_t b = 0; b < items.size(); ++b) {
    std::copy(tables[b].begin(), tables[b].end(), block_table_.begin() + static_cast<std::ptrdiff_t>(b) * max_blocks_);
    const ForwardItem& it = items[b];
    for (std::size_t t = 0; t < it.tokens.size(); ++t) {
      kv_slots_.push_back(cache.slot(tables[b], it.start_pos + static_cast<std::int64_t>(t)));
    }
  }
}

Status LlamaModel::attention(std::int32_t layer, const ops::KvCache& cache, Dispatcher& dispatcher) {
  const auto batch = static_cast<std::int32_t>(seqlens_k_.size());
  const std::int64_t total = cu_q_.back();
  AttentionProblem p;
  p.q_layout = QLayout::packed;
  p.kv_layout = KvLayout::paged;
  p.q = make_contiguous_view(q_.get(), DType::f32, {total, config_.n_head, config_.head_dim}, ops_->device());
  p.o = make_contiguous_view(att_.get(), DType::f32, {total, config_.n_head, config_.head_dim}, ops_->device());
  p.k = cache.k_view(layer);
  p.v = cache.v_view(layer);
  p.batch = batch;
  p.cu_seqlens_q = cu_q_.data();
  p.block_table = block_table_.data();
  p.max_blocks_per_seq = max_blocks_;
  p.seqlens_k = seqlens_k_.data();
  p.page_versions = cache.page_versions(layer);
  p.kv_pool_id = cache.pool_id();
  p.causal = true;
  return dispatcher.run(p);
}

}  // namespace kallpa::model
