#include "kallpa/model/llama_model.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <set>
#include <tuple>
#include <utility>

#include <sys/mman.h>
#include <unistd.h>

#include <fmt/format.h>

namespace kallpa::model {

namespace {

// A matrix whose copy the ops hold is not read from the file again by this model: its pages leave
// this process (clean pages of a read-only file mapping; a later read, say by another model on the
// same file, faults them back in), as each copy is made, so that resident memory holds the weights
// once and the load never holds the file and the copies whole at the same time.
void release_file_pages(const ops::WeightMatrix& original) {
  const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<std::uintptr_t>(original.data);
  const std::uintptr_t end = begin + static_cast<std::size_t>(original.rows) * original.row_bytes;
  const std::uintptr_t first = (begin + page - 1) / page * page, last = end / page * page;
  if (last > first) (void)madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

}  // namespace
namespace {

Result<ops::WeightMatrix> matrix(const TensorView* t) {
  if (t == nullptr) return Status(ErrorCode::internal, "weights", "missing tensor view");
  return as_weight_matrix(*t);
}

// Rows [first, first + count) of a matrix in the file's row layout: how a fused projection
// (Phi-3's attn_qkv, its gate-up ffn_up) becomes the separate matrices the pass multiplies by.
ops::WeightMatrix row_range(ops::WeightMatrix m, std::int64_t first, std::int64_t count) {
  m.data = static_cast<const std::byte*>(m.data) + static_cast<std::size_t>(first) * m.row_bytes;
  m.rows = count;
  return m;
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
  const ModelConfig& c = m->config_;

  auto take = [](const TensorView* t, ops::WeightMatrix* out) -> Status {
    auto r = matrix(t);
    if (!r) return r.status();
    *out = *r;
    return {};
  };
  // Optional tensors stay empty (data == nullptr) when the file has none.
  auto take_optional = [&](const TensorView* t, ops::WeightMatrix* out) -> Status {
    return t == nullptr ? Status() : take(t, out);
  };
  Status s;
  if (!(s = take(w.token_embd, &m->token_embd_)) || !(s = take(w.output, &m->output_)) ||
      !(s = take(w.output_norm, &m->output_norm_))) {
    return s;
  }
  if (w.rope_freqs != nullptr) {
    const auto* f = static_cast<const float*>(w.rope_freqs->data);
    m->rope_freqs_.assign(f, f + w.rope_freqs->nelements());
  }
  for (const LlamaLayerWeights& lw : w.layers) {
    Layer l{};
    if (!(s = take(lw.attn_norm, &l.attn_norm)) || !(s = take(lw.ffn_norm, &l.ffn_norm)) ||
        !(s = take(lw.attn_output, &l.wo)) || !(s = take(lw.ffn_down, &l.down)) ||
        !(s = take_optional(lw.attn_q_bias, &l.bq)) || !(s = take_optional(lw.attn_k_bias, &l.bk)) ||
        !(s = take_optional(lw.attn_v_bias, &l.bv)) || !(s = take_optional(lw.attn_q_norm, &l.q_norm)) ||
        !(s = take_optional(lw.attn_k_norm, &l.k_norm)) ||
        !(s = take_optional(lw.post_attention_norm, &l.post_attention_norm)) ||
        !(s = take_optional(lw.post_ffw_norm, &l.post_ffw_norm))) {
      return s;
    }
    if (lw.attn_qkv != nullptr) {
      ops::WeightMatrix qkv;
      if (!(s = take(lw.attn_qkv, &qkv))) return s;
      l.wq = row_range(qkv, 0, c.q_dim());
      l.wk = row_range(qkv, c.q_dim(), c.kv_dim());
      l.wv = row_range(qkv, c.q_dim() + c.kv_dim(), c.kv_dim());
    } else if (!(s = take(lw.attn_q, &l.wq)) || !(s = take(lw.attn_k, &l.wk)) || !(s = take(lw.attn_v, &l.wv))) {
      return s;
    }
    if (lw.ffn_gate == nullptr) {
      ops::WeightMatrix gate_up;
      if (!(s = take(lw.ffn_up, &gate_up))) return s;
      l.gate = row_range(gate_up, 0, c.n_ff);
      l.up = row_range(gate_up, c.n_ff, c.n_ff);
    } else if (!(s = take(lw.ffn_gate, &l.gate)) || !(s = take(lw.ffn_up, &l.up))) {
      return s;
    }
    m->layers_.push_back(l);
  }
  std::vector<ops::WeightMatrix*> products{&m->output_}, lookups{&m->token_embd_, &m->output_norm_};
  for (Layer& l : m->layers_) {
    for (ops::WeightMatrix* p : l.products()) products.push_back(p);
    for (ops::WeightMatrix* p : l.vectors()) {
      if (p->data != nullptr) lookups.push_back(p);
    }
  }
  const ops::WeightMatrix embedding_in_file = m->token_embd_;
  const bool tied = m->output_.data == embedding_in_file.data;  // the output head is the embedding table
  ops::Ops::CopiedFn release;
  if (m->file_->file_backed()) release = release_file_pages;
  for (auto [mats, use] :
       {std::pair{&products, ops::Ops::WeightUse::matmul}, std::pair{&lookups, ops::Ops::WeightUse::lookup}}) {
    auto placed = ops.place_weights(*mats, use, release);
    if (!placed) return placed.status();
    m->placed_.push_back(std::move(*placed));
  }
  // Lookups that still read the file's table while the (tied) output head has a copy in host memory
  // read that copy instead (dequantize_rows reads every layout the ops place), so the table is
  // resident once; its file pages went with the output head's.
  if (tied && ops.host_addressable() && m->token_embd_.data == embedding_in_file.data &&
      m->output_.data != embedding_in_file.data) {
    m->token_embd_ = m->output_;
  }
  return m;
}

LlamaModel::~LlamaModel() = default;

double LlamaModel::bytes_read_per_token(std::int64_t context, std::size_t kv_bytes) const noexcept {
  auto bytes = [](const ops::WeightMatrix& w) { return double(w.rows) * double(w.row_bytes); };
  double total = bytes(output_) + double(token_embd_.row_bytes);
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    for (const ops::WeightMatrix* w : layers_[i].products()) total += bytes(*w);
    const std::int64_t window = config_.window_left(static_cast<std::uint32_t>(i));
    const std::int64_t keys = window < 0 ? context : std::min(context, window + 1);
    total += double(keys) * double(config_.kv_dim()) * 2.0 * double(kv_bytes);
  }
  return total;
}

void LlamaModel::memory_regions(std::vector<ops::MemoryRegion>& out) const {
  if (!ops_->host_addressable()) return;
  const std::byte* file_begin = file_->base();
  const std::byte* file_end = file_begin != nullptr ? file_begin + file_->file_size() : nullptr;
  if (file_begin != nullptr) {
    out.push_back({file_->file_backed() ? "model file (mapped)" : "model (in memory)", file_begin,
                   static_cast<std::size_t>(file_->file_size()), file_->file_backed()});
  }
  std::set<const void*> seen;  // a tied matrix counts once
  auto weight = [&](const ops::WeightMatrix& w) {
    if (w.data == nullptr || !seen.insert(w.data).second) return;
    const auto* data = static_cast<const std::byte*>(w.data);
    if (data >= file_begin && data < file_end) return;  // read in place: part of the file's pages
    out.push_back({"weights (copies)", w.data, static_cast<std::size_t>(w.rows) * w.row_bytes});
  };
  for (const ops::WeightMatrix* w : {&token_embd_, &output_, &output_norm_}) weight(*w);
  for (const Layer& l : layers_) {
    for (const ops::WeightMatrix* w : l.products()) weight(*w);
    for (const ops::WeightMatrix* w : l.vectors()) weight(*w);
  }
  for (const ops::Scratch* s : {&x_, &h_, &q_, &k_, &v_, &att_, &gate_, &up_, &tmp_, &logits_}) {
    out.push_back({"activations", s->get(), static_cast<std::size_t>(s->size()) * sizeof(float)});
  }
}

std::int64_t LlamaModel::matmul_weights_per_token() const noexcept {
  auto count = [](const ops::WeightMatrix& w) { return w.rows * w.cols; };
  std::int64_t total = count(output_);
  for (const Layer& l : layers_) {
    for (const ops::WeightMatrix* w : l.products()) total += count(*w);
  }
  return total;
}

Result<std::unique_ptr<ops::KvCache>> LlamaModel::make_cache(ops::KvCacheOptions options) const {
  return ops::KvCache::create(static_cast<std::int32_t>(config_.n_layer), static_cast<std::int32_t>(config_.n_head_kv),
                              static_cast<std::int32_t>(config_.head_dim), options, ops_);
}

Status LlamaModel::reserve_step_buffers(std::int64_t rows) {
  ops::Ops& ops = *ops_;
  const std::int64_t embd = config_.n_embd, qd = config_.q_dim(), kvd = config_.kv_dim(), ff = config_.n_ff;
  for (auto [buffer, floats, what] : {std::tuple{&x_, rows * embd, "x"},
                                      {&h_, rows * embd, "h"},
                                      {&q_, rows * qd, "q"},
                                      {&k_, rows * kvd, "k"},
                                      {&v_, rows * kvd, "v"},
                                      {&att_, rows * qd, "att"},
                                      {&gate_, rows * ff, "gate"},
                                      {&up_, rows * ff, "up"},
                                      {&tmp_, rows * std::max(embd, qd), "tmp"}}) {
    if (Status s = buffer->reserve(ops, floats, what); !s) return s;
  }
  return {};
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

  const std::int64_t embd = config_.n_embd;
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
  if (Status s = reserve_step_buffers(total); !s) return s;
  tokens_.clear();
  positions_.clear();
  for (const ForwardItem& it : items) {
    for (std::size_t t = 0; t < it.tokens.size(); ++t) {
      tokens_.push_back(it.tokens[t]);
      positions_.push_back(static_cast<std::int32_t>(it.start_pos + static_cast<std::int64_t>(t)));
    }
  }
  plan_attention(items, cache);

  float* x = x_.get();
  float* h = h_.get();
  Status s = ops.embedding(token_embd_, tokens_, x);
  if (!s) return s;
  if (config_.embedding_scale != 1.0f && !(s = ops.scale(x, config_.embedding_scale, total * embd))) return s;
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    if (!(s = attention_block(l, cache, dispatcher, total, decode_rows)) || !(s = ffn_block(l, total, decode_rows))) {
      return s;
    }
  }

  // Output head, only for the rows whose logits are wanted.
  std::int64_t row = 0, wanted_decode = 0;
  wanted_rows_.clear();
  for (const ForwardItem& it : items) {
    const auto n = static_cast<std::int64_t>(it.tokens.size());
    if (it.want_logits) {
      for (std::int64_t r = it.all_logits ? row : row + n - 1; r < row + n; ++r) wanted_rows_.push_back(r);
      wanted_decode += is_decode_step(it) ? 1 : 0;
    }
    row += n;
  }
  const auto wanted = static_cast<std::int64_t>(wanted_rows_.size());
  if (wanted == 0) return {};
  const float eps = config_.rms_norm_eps;
  if (!(s = ops.gather_rows(x, wanted_rows_, embd, h)) ||
      !(s = ops.rmsnorm(h, static_cast<const float*>(output_norm_.data), eps, h, wanted, embd))) {
    return s;
  }
  if (ops.host_addressable()) {
    if (!(s = ops.matmul(output_, h, wanted, logits, wanted_decode))) return s;
  } else if (!(s = logits_.reserve(ops, wanted * vocab, "logits")) ||
             !(s = ops.matmul(output_, h, wanted, logits_.get(), wanted_decode)) ||
             !(s = ops.download(logits, logits_.get(), static_cast<std::size_t>(wanted * vocab) * sizeof(float)))) {
    return s;
  }
  // The final softcap (Gemma 2) on the host logits: a pass over vocab floats per wanted row.
  if (const float cap = config_.final_logit_softcap; cap > 0.0f) {
    for (std::int64_t i = 0; i < wanted * vocab; ++i) logits[i] = cap * std::tanh(logits[i] / cap);
  }
  return {};
}

Status LlamaModel::attention_block(std::size_t l, ops::KvCache& cache, Dispatcher& dispatcher, std::int64_t total,
                                   std::int64_t decode_rows) {
  ops::Ops& ops = *ops_;
  const ModelConfig& c = config_;
  const Layer& L = layers_[l];
  const auto layer = static_cast<std::uint32_t>(l);
  const std::int64_t embd = c.n_embd, qd = c.q_dim(), kvd = c.kv_dim();
  float *x = x_.get(), *h = h_.get(), *q = q_.get(), *k = k_.get(), *v = v_.get(), *tmp = tmp_.get();
  const float eps = c.rms_norm_eps;
  Status s;
  if (!(s = ops.rmsnorm(x, static_cast<const float*>(L.attn_norm.data), eps, h, total, embd))) return s;
  const ops::MatmulJob qkv[] = {{&L.wq, q, qd}, {&L.wk, k, kvd}, {&L.wv, v, kvd}};
  if (!(s = ops.matmul_group(qkv, h, total, decode_rows))) return s;
  if (L.bq.data != nullptr && (!(s = ops.add_bias(q, static_cast<const float*>(L.bq.data), total, qd)) ||
                               !(s = ops.add_bias(k, static_cast<const float*>(L.bk.data), total, kvd)) ||
                               !(s = ops.add_bias(v, static_cast<const float*>(L.bv.data), total, kvd)))) {
    return s;
  }
  // Per-head norms: each head's head_dim values are one row.
  if (L.q_norm.data != nullptr &&
      (!(s = ops.rmsnorm(q, static_cast<const float*>(L.q_norm.data), eps, q, total * c.n_head, c.head_dim)) ||
       !(s = ops.rmsnorm(k, static_cast<const float*>(L.k_norm.data), eps, k, total * c.n_head_kv, c.head_dim)))) {
    return s;
  }
  const ops::RopeParams rope{.style = c.arch.rope_style,
                             .theta = c.rope_base(layer),
                             .freq_scale = c.rope_scale(layer),
                             .freq_factors = rope_freqs_};
  if (!(s = ops.rope_ext(q, positions_, c.n_head, c.head_dim, c.n_rot, rope)) ||
      !(s = ops.rope_ext(k, positions_, c.n_head_kv, c.head_dim, c.n_rot, rope)) ||
      !(s = cache.write_rows(static_cast<std::int32_t>(l), kv_slots_, k, v)) || !(s = ops.finish()) ||
      !(s = cp_ == CpStep::prefill  ? prefill_attention_cp(static_cast<std::int32_t>(l), cache, dispatcher)
            : cp_ == CpStep::decode ? decode_attention_cp(static_cast<std::int32_t>(l), cache, dispatcher)
                                    : attention(static_cast<std::int32_t>(l), cache, dispatcher)) ||
      !(s = ops.matmul(L.wo, att_.get(), total, tmp, decode_rows))) {
    return s;
  }
  if (L.post_attention_norm.data != nullptr &&
      !(s = ops.rmsnorm(tmp, static_cast<const float*>(L.post_attention_norm.data), eps, tmp, total, embd))) {
    return s;
  }
  return ops.add(x, tmp, total * embd);
}

Status LlamaModel::ffn_block(std::size_t l, std::int64_t total, std::int64_t decode_rows) {
  ops::Ops& ops = *ops_;
  const ModelConfig& c = config_;
  const Layer& L = layers_[l];
  const std::int64_t embd = c.n_embd, ff = c.n_ff;
  float *x = x_.get(), *h = h_.get(), *gate = gate_.get(), *up = up_.get(), *tmp = tmp_.get();
  const float eps = c.rms_norm_eps;
  Status s;
  if (!(s = ops.rmsnorm(x, static_cast<const float*>(L.ffn_norm.data), eps, h, total, embd))) return s;
  const ops::MatmulJob gate_up[] = {{&L.gate, gate, ff}, {&L.up, up, ff}};
  if (!(s = ops.matmul_group(gate_up, h, total, decode_rows))) return s;
  s = c.arch.ffn == FfnActivation::gelu_tanh ? ops.geglu(gate, up, gate, total * ff)
                                             : ops.swiglu(gate, up, gate, total * ff);
  if (!s || !(s = ops.matmul(L.down, gate, total, tmp, decode_rows))) return s;
  if (L.post_ffw_norm.data != nullptr &&
      !(s = ops.rmsnorm(tmp, static_cast<const float*>(L.post_ffw_norm.data), eps, tmp, total, embd))) {
    return s;
  }
  return ops.add(x, tmp, total * embd);
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
  p.scale = config_.attention_scale;
  p.window_left = config_.window_left(static_cast<std::uint32_t>(layer));
  p.softcap = config_.attn_logit_softcap;
  return dispatcher.run(p);
}

}  // namespace kallpa::model
