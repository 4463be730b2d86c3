#include "kallpa/runtime/kv_cache.h"

#include <algorithm>
#include <cstring>
#include <new>

#include <fmt/format.h>

#include "kallpa/half.h"
#include "model/huge_buffer.h"

namespace kallpa::runtime {

Result<std::unique_ptr<KvCache>> KvCache::create(std::int32_t n_layer, std::int32_t n_head_kv, std::int32_t head_dim,
                                                 KvCacheOptions options) {
  if (n_layer < 1 || n_head_kv < 1 || head_dim < 1) return Status::invalid("kv_cache", "layers, heads and head dim must be >= 1");
  if (options.page_size < 1) return Status::invalid("page_size", fmt::format("is {}, must be >= 1", options.page_size));
  if (options.max_tokens < 1) return Status::invalid("max_tokens", fmt::format("is {}, must be >= 1", options.max_tokens));
  std::unique_ptr<KvCache> cache(new KvCache());
  cache->options_ = options;
  cache->n_layer_ = n_layer;
  cache->n_head_kv_ = n_head_kv;
  cache->head_dim_ = head_dim;
  cache->n_blocks_ = (options.max_tokens + options.page_size - 1) / options.page_size;
  const auto bytes = static_cast<std::size_t>(cache->n_blocks_) * static_cast<std::size_t>(options.page_size) *
                     static_cast<std::size_t>(n_head_kv) * static_cast<std::size_t>(head_dim) * dtype_size(options.dtype);
  // One mapping for every layer's K and V, on huge pages, committed as blocks are first written.
  cache->layer_bytes_ = (bytes + 63) / 64 * 64;
  auto buffer = model::HugeBuffer::allocate(cache->layer_bytes_ * 2 * static_cast<std::size_t>(n_layer), "kv_cache");
  if (!buffer) {
    return Status(ErrorCode::out_of_memory, "kv_cache",
                  fmt::format("cannot allocate {} MiB for {} tokens", 2.0 * double(bytes) * n_layer / double(1 << 20),
                              options.max_tokens));
  }
  auto holder = std::make_shared<model::HugeBuffer>(std::move(*buffer));
  cache->storage_ = std::shared_ptr<std::byte>(holder, holder->data());
  // Hand out low block ids first: a fresh cache then looks like a dense one, which helps caches.
  for (std::int64_t b = cache->n_blocks_ - 1; b >= 0; --b) cache->free_.push_back(static_cast<std::int32_t>(b));
  return cache;
}

std::int64_t KvCache::free_blocks() const {
  std::lock_guard lock(mu_);
  return static_cast<std::int64_t>(free_.size());
}

KvCache::Sequence* KvCache::find(SeqId seq) {
  auto it = std::find_if(seqs_.begin(), seqs_.end(), [&](const Sequence& s) { return s.id == seq; });
  return it == seqs_.end() ? nullptr : &*it;
}

const KvCache::Sequence* KvCache::find(SeqId seq) const {
  auto it = std::find_if(seqs_.begin(), seqs_.end(), [&](const Sequence& s) { return s.id == seq; });
  return it == seqs_.end() ? nullptr : &*it;
}

SeqId KvCache::add_sequence() {
  std::lock_guard lock(mu_);
  seqs_.push_back({next_id_, {}});
  return next_id_++;
}

bool KvCache::has(SeqId seq) const {
  std::lock_guard lock(mu_);
  return find(seq) != nullptr;
}

Status KvCache::reserve(SeqId seq, std::int64_t length) {
  std::lock_guard lock(mu_);
  Sequence* s = find(seq);
  if (!s) return Status(ErrorCode::not_found, "sequence", fmt::format("no sequence {}", seq));
  const std::int64_t need = (length + options_.page_size - 1) / options_.page_size;
  const auto have = static_cast<std::int64_t>(s->blocks.size());
  if (need <= have) return {};
  if (need - have > static_cast<std::int64_t>(free_.size())) {
    return Status(ErrorCode::out_of_memory, "kv_cache",
                  fmt::format("{} tokens need {} more blocks of {}, only {} of {} are free", length, need - have,
                              options_.page_size, free_.size(), n_blocks_));
  }
  for (std::int64_t n = have; n < need; ++n) {
    s->blocks.push_back(free_.back());
    free_.pop_back();
  }
  return {};
}

void KvCache::truncate(SeqId seq, std::int64_t length) {
  std::lock_guard lock(mu_);
  Sequence* s = find(seq);
  if (!s) return;
  const auto keep = static_cast<std::size_t>(std::max<std::int64_t>(0, (length + options_.page_size - 1) / options_.page_size));
  while (s->blocks.size() > keep) {
    free_.push_back(s->blocks.back());
    s->blocks.pop_back();
  }
}

void KvCache::remove(SeqId seq) {
  truncate(seq, 0);
  std::lock_guard lock(mu_);
  seqs_.erase(std::remove_if(seqs_.begin(), seqs_.end(), [&](const Sequence& s) { return s.id == seq; }), seqs_.end());
}

std::int64_t KvCache::capacity(SeqId seq) const {
  std::lock_guard lock(mu_);
  const Sequence* s = find(seq);
  return s ? static_cast<std::int64_t>(s->blocks.size()) * options_.page_size : 0;
}

std::vector<std::int32_t> KvCache::blocks(SeqId seq) const {
  std::lock_guard lock(mu_);
  const Sequence* s = find(seq);
  return s ? s->blocks : std::vector<std::int32_t>{};
}

void KvCache::write(std::int32_t layer, std::span<const std::int32_t> table, std::int64_t pos, const float* k,
                    const float* v, std::int64_t n) {
  const std::int64_t row = std::int64_t{n_head_kv_} * head_dim_;
  const std::size_t esize = dtype_size(options_.dtype);
  std::byte* kbase = k_data(layer);
  std::byte* vbase = v_data(layer);
  for (std::int64_t t = 0; t < n; ++t) {
    const std::int64_t p = pos + t;
    const std::int64_t slot = std::int64_t{table[static_cast<std::size_t>(p / options_.page_size)]} * options_.page_size +
                              p % options_.page_size;
    std::byte* kd = kbase + static_cast<std::size_t>(slot * row) * esize;
    std::byte* vd = vbase + static_cast<std::size_t>(slot * row) * esize;
    const float* ks = k + t * row;
    const float* vs = v + t * row;
    switch (options_.dtype) {
      case DType::f32:
        std::memcpy(kd, ks, static_cast<std::size_t>(row) * 4);
        std::memcpy(vd, vs, static_cast<std::size_t>(row) * 4);
        break;
      case DType::f16:
        for (std::int64_t e = 0; e < row; ++e) {
          reinterpret_cast<std::uint16_t*>(kd)[e] = f32_to_f16(ks[e]);
          reinterpret_cast<std::uint16_t*>(vd)[e] = f32_to_f16(vs[e]);
        }
        break;
      case DType::bf16:
        for (std::int64_t e = 0; e < row; ++e) {
          reinterpret_cast<std::uint16_t*>(kd)[e] = f32_to_bf16(ks[e]);
          reinterpret_cast<std::uint16_t*>(vd)[e] = f32_to_bf16(vs[e]);
        }
        break;
    }
  }
}

TensorView KvCache::k_view(std::int32_t layer) const {
  return make_contiguous_view(k_data(layer), options_.dtype,
                              {n_blocks_, options_.page_size, n_head_kv_, head_dim_});
}

TensorView KvCache::v_view(std::int32_t layer) const {
  return make_contiguous_view(v_data(layer), options_.dtype,
                              {n_blocks_, options_.page_size, n_head_kv_, head_dim_});
}

}  // namespace kallpa::runtime
