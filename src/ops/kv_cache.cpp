#include "kallpa/ops/kv_cache.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <new>
#include <numeric>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "kallpa/ops/quant.h"
#include "ops/huge_buffer.h"

namespace kallpa::ops {
namespace {

// Page versions and pool ids come from process-wide sequences, so that neither is ever reused:
// a backend that saw version v of a page can trust that v still means the same bytes.
std::atomic<std::uint64_t> g_page_version{0};
std::atomic<std::uint64_t> g_pool_id{0};

std::uint64_t next_page_version() noexcept { return g_page_version.fetch_add(1, std::memory_order_relaxed) + 1; }

}  // namespace

Result<std::unique_ptr<KvCache>> KvCache::create(std::int32_t n_layer, std::int32_t n_head_kv, std::int32_t head_dim,
                                                 KvCacheOptions options, Ops* memory) {
  if (n_layer < 1 || n_head_kv < 1 || head_dim < 1)
    return Status::invalid("kv_cache", "layers, heads and head dim must be >= 1");
  if (options.page_size < 1) return Status::invalid("page_size", fmt::format("is {}, must be >= 1", options.page_size));
  if (options.max_tokens < 1)
    return Status::invalid("max_tokens", fmt::format("is {}, must be >= 1", options.max_tokens));
  std::unique_ptr<KvCache> cache(new KvCache());
  cache->options_ = options;
  cache->n_layer_ = n_layer;
  cache->n_head_kv_ = n_head_kv;
  cache->head_dim_ = head_dim;
  cache->n_blocks_ = (options.max_tokens + options.page_size - 1) / options.page_size;
  cache->block_bytes_ = static_cast<std::size_t>(options.page_size) * static_cast<std::size_t>(n_head_kv) *
                        static_cast<std::size_t>(head_dim) * dtype_size(options.dtype);
  // One allocation for every layer's K and V.
  const std::size_t total =
      cache->block_bytes_ * static_cast<std::size_t>(cache->n_blocks_) * 2 * static_cast<std::size_t>(n_layer);
  const bool on_device = memory != nullptr && !memory->host_addressable();
  cache->block_stride_ = on_device ? cache->block_bytes_ : cache->block_bytes_ * 2 * static_cast<std::size_t>(n_layer);
  if (on_device) {
    auto device = memory->allocate(total, "kv_cache");
    if (!device) return device.status();
    cache->device_ = memory;
    cache->storage_ =
        std::shared_ptr<std::byte>(static_cast<std::byte*>(*device), [memory](std::byte* p) { memory->free(p); });
  } else {
    // On huge pages, committed as blocks are first written.
    auto buffer = HugeBuffer::allocate(total, "kv_cache");
    if (!buffer) {
      return Status(
          ErrorCode::out_of_memory, "kv_cache",
          fmt::format("cannot allocate {} MiB for {} tokens", double(total) / double(1 << 20), options.max_tokens));
    }
    auto holder = std::make_shared<HugeBuffer>(std::move(*buffer));
    cache->storage_ = std::shared_ptr<std::byte>(holder, holder->data());
  }
  // Hand out low block ids first: a fresh cache then looks like a dense one, which helps caches.
  for (std::int64_t b = cache->n_blocks_ - 1; b >= 0; --b) cache->free_.push_back(static_cast<std::int32_t>(b));
  cache->refs_.assign(static_cast<std::size_t>(cache->n_blocks_), 0);
  cache->published_.resize(static_cast<std::size_t>(cache->n_blocks_));
  cache->versions_.assign(static_cast<std::size_t>(cache->n_blocks_) * static_cast<std::size_t>(n_layer), 0);
  cache->pool_id_ = g_pool_id.fetch_add(1, std::memory_order_relaxed) + 1;
  return cache;
}

std::int64_t KvCache::free_blocks() const {
  std::lock_guard lock(mu_);
  return static_cast<std::int64_t>(free_.size() + idle_.size());
}

std::int64_t KvCache::cached_blocks() const {
  std::lock_guard lock(mu_);
  return static_cast<std::int64_t>(idle_.size());
}

// A never-used block if there is one, else the cached block idle the longest (it is forgotten).
std::int32_t KvCache::take_block() {
  std::int32_t b;
  if (!free_.empty()) {
    b = free_.back();
    free_.pop_back();
  } else {
    b = idle_.begin()->second;
    idle_.erase(idle_.begin());
    unpublish(b);
  }
  refs_[static_cast<std::size_t>(b)] = 1;
  bump_block(b);
  return b;
}

void KvCache::release_block(std::int32_t b) {
  const auto i = static_cast<std::size_t>(b);
  if (--refs_[i] > 0) return;
  if (published_[i].live) {
    published_[i].idle_since = ++clock_;
    idle_.emplace(clock_, b);
  } else {
    free_.push_back(b);
  }
}

void KvCache::unpublish(std::int32_t b) {
  Published& p = published_[static_cast<std::size_t>(b)];
  if (!p.live) return;
  index_.erase(p.hash);
  p = Published{};
}

// 64-bit chain hash (splitmix64 finaliser per token). A collision would need two different
// prefixes with equal 64-bit chains *and* equal last-block tokens (checked on attach).
std::uint64_t KvCache::chain_hash(std::uint64_t parent, std::span<const std::int32_t> tokens) const {
  auto mix = [](std::uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  };
  std::uint64_t h = mix(parent + 0x9e3779b97f4a7c15ULL);
  for (std::int32_t t : tokens)
    h = mix(h ^ (static_cast<std::uint64_t>(static_cast<std::uint32_t>(t)) + 0x9e3779b97f4a7c15ULL));
  return h;
}

void KvCache::bump_block(std::int32_t block) noexcept {
  for (std::int32_t l = 0; l < n_layer_; ++l) {
    versions_[static_cast<std::size_t>(l) * static_cast<std::size_t>(n_blocks_) + static_cast<std::size_t>(block)] =
        next_page_version();
  }
}

void KvCache::copy_block(std::int32_t from, std::int32_t to) {
  bump_block(to);
  const std::size_t bytes = block_bytes_;
  for (std::int32_t l = 0; l < n_layer_; ++l) {
    for (std::byte* base : {k_data(l), v_data(l)}) {
      std::byte* dst = base + static_cast<std::size_t>(to) * block_stride_;
      const std::byte* src = base + static_cast<std::size_t>(from) * block_stride_;
      if (device_ == nullptr) {
        std::memcpy(dst, src, bytes);
      } else if (Status s = device_->copy(dst, src, bytes); !s) {
        // Only reached by truncate() into a shared block; the sequence then reads what the device has.
        spdlog::error("kv_cache: block copy on {} failed: {}", device_->device_name(), s.to_string());
      }
    }
  }
}

std::int64_t KvCache::attach_prefix(SeqId seq, std::span<const std::int32_t> tokens, std::int64_t granule) {
  std::lock_guard lock(mu_);
  Sequence* s = find(seq);
  if (!s || !s->blocks.empty() || tokens.empty()) return 0;
  const auto page = static_cast<std::size_t>(options_.page_size);
  const std::size_t max_blocks = (tokens.size() - 1) / page;
  // The chain of published blocks that matches, then as much of it as ends on a multiple of
  // lcm(granule, page) positions.
  std::vector<std::int32_t> matched;
  std::vector<std::uint64_t> hashes;
  std::uint64_t parent = 0;
  for (std::size_t i = 0; i < max_blocks; ++i) {
    const auto block_tokens = tokens.subspan(i * page, page);
    const std::uint64_t h = chain_hash(parent, block_tokens);
    auto it = index_.find(h);
    if (it == index_.end()) break;
    const std::int32_t b = it->second;
    const Published& p = published_[static_cast<std::size_t>(b)];
    if (p.parent != parent || !std::equal(block_tokens.begin(), block_tokens.end(), p.tokens.begin(), p.tokens.end()))
      break;
    matched.push_back(b);
    hashes.push_back(h);
    parent = h;
  }
  const std::size_t unit = granule > 0 ? std::lcm(page, static_cast<std::size_t>(granule)) : page;
  const std::size_t kept = matched.size() * page / unit * unit / page;
  for (std::size_t i = 0; i < kept; ++i) {
    const std::int32_t b = matched[i];
    if (refs_[static_cast<std::size_t>(b)]++ == 0) idle_.erase(published_[static_cast<std::size_t>(b)].idle_since);
    s->blocks.push_back(b);
    s->chain.push_back(hashes[i]);
  }
  return static_cast<std::int64_t>(kept * page);
}

void KvCache::publish(SeqId seq, std::span<const std::int32_t> tokens) {
  std::lock_guard lock(mu_);
  Sequence* s = find(seq);
  if (!s) return;
  const auto page = static_cast<std::size_t>(options_.page_size);
  const std::size_t full = std::min(tokens.size() / page, s->blocks.size());
  for (std::size_t i = s->chain.size(); i < full; ++i) {
    const std::uint64_t parent = i == 0 ? 0 : s->chain[i - 1];
    const auto block_tokens = tokens.subspan(i * page, page);
    const std::uint64_t h = chain_hash(parent, block_tokens);
    s->chain.push_back(h);
    if (index_.contains(h)) continue;  // the same content is published already: ours stays private
    const std::int32_t b = s->blocks[i];
    Published& p = published_[static_cast<std::size_t>(b)];
    p.live = true;
    p.hash = h;
    p.parent = parent;
    p.tokens.assign(block_tokens.begin(), block_tokens.end());
    index_.emplace(h, b);
  }
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
  seqs_.push_back({next_id_, {}, {}});
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
  const std::size_t available = free_.size() + idle_.size();
  if (need - have > static_cast<std::int64_t>(available)) {
    return Status(ErrorCode::out_of_memory, "kv_cache",
                  fmt::format("{} tokens need {} more blocks of {}, only {} of {} are free", length, need - have,
                              options_.page_size, available, n_blocks_));
  }
  for (std::int64_t n = have; n < need; ++n) s->blocks.push_back(take_block());
  return {};
}

std::int64_t KvCache::truncate(SeqId seq, std::int64_t length) {
  std::lock_guard lock(mu_);
  Sequence* s = find(seq);
  if (!s) return 0;
  // Past the blocks it holds there is nothing to forget (and no last block to make private).
  length = std::clamp<std::int64_t>(length, 0, static_cast<std::int64_t>(s->blocks.size()) * options_.page_size);
  const auto keep = static_cast<std::size_t>((length + options_.page_size - 1) / options_.page_size);
  while (s->blocks.size() > keep) {
    release_block(s->blocks.back());
    s->blocks.pop_back();
  }
  // Positions from `length` on will be written again: the block holding them must be private
  // and unpublished, since its published tokens no longer describe it.
  const auto full = static_cast<std::size_t>(length / options_.page_size);
  if (s->chain.size() > full) s->chain.resize(full);
  if (keep > full) {
    std::int32_t& last = s->blocks.back();
    if (refs_[static_cast<std::size_t>(last)] > 1) {
      // Shared: the sequence continues in a copy. When every block of the pool is held, it
      // gives up the partial block instead (and says so).
      if (free_.empty() && idle_.empty()) {
        release_block(last);
        s->blocks.pop_back();
        return static_cast<std::int64_t>(full) * options_.page_size;
      }
      const std::int32_t copy = take_block();
      copy_block(last, copy);
      release_block(last);
      last = copy;
    } else {
      unpublish(last);
    }
  }
  return length;
}

void KvCache::remove(SeqId seq) {
  truncate(seq, 0);
  std::lock_guard lock(mu_);
  seqs_.erase(std::remove_if(seqs_.begin(), seqs_.end(), [&](const Sequence& s) { return s.id == seq; }), seqs_.end());
}

Result<SeqId> KvCache::fork(SeqId from, std::int64_t length) {
  std::lock_guard lock(mu_);
  const Sequence* s = find(from);
  if (!s) return Status(ErrorCode::not_found, "sequence", fmt::format("no sequence {}", from));
  const auto page = static_cast<std::int64_t>(options_.page_size);
  length = std::clamp<std::int64_t>(length, 0, static_cast<std::int64_t>(s->blocks.size()) * page);
  const auto full = static_cast<std::size_t>(length / page);
  const bool partial = length % page != 0;
  if (partial && free_.empty() && idle_.empty()) {
    return Status(ErrorCode::out_of_memory, "kv_cache",
                  fmt::format("no free block for the copy of a forked sequence's last block (of {})", n_blocks_));
  }
  Sequence child{next_id_, {}, {}};
  child.blocks.assign(s->blocks.begin(), s->blocks.begin() + static_cast<std::ptrdiff_t>(full));
  child.chain.assign(s->chain.begin(), s->chain.begin() + static_cast<std::ptrdiff_t>(std::min(full, s->chain.size())));
  for (std::int32_t b : child.blocks) ++refs_[static_cast<std::size_t>(b)];
  if (partial) {
    const std::int32_t copy = take_block();
    copy_block(s->blocks[full], copy);
    child.blocks.push_back(copy);
  }
  seqs_.push_back(std::move(child));  // `s` is not used past this point: the push may move it
  return next_id_++;
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

Status KvCache::write(std::int32_t layer, std::span<const std::int32_t> table, std::int64_t pos, const float* k,
                      const float* v, std::int64_t n) {
  std::vector<std::int64_t> slots(static_cast<std::size_t>(n));
  for (std::int64_t t = 0; t < n; ++t) slots[static_cast<std::size_t>(t)] = slot(table, pos + t);
  return write_rows(layer, slots, k, v);
}

Status KvCache::write_rows(std::int32_t layer, std::span<const std::int64_t> slots, const float* k, const float* v) {
  const std::int64_t row = std::int64_t{n_head_kv_} * head_dim_;
  // Before the bytes change, so that a version never describes bytes it does not hold once the
  // write returns (a failed write leaves a new version over whatever landed: still never stale).
  std::uint64_t* versions = &versions_[static_cast<std::size_t>(layer) * static_cast<std::size_t>(n_blocks_)];
  for (const std::int64_t s : slots) versions[s / options_.page_size] = next_page_version();
  if (device_ != nullptr) {
    Status s = device_->scatter_rows(k, row, k_data(layer), options_.dtype, slots);
    return s ? device_->scatter_rows(v, row, v_data(layer), options_.dtype, slots) : s;
  }
  const std::size_t esize = dtype_size(options_.dtype);
  std::byte* kbase = k_data(layer);
  std::byte* vbase = v_data(layer);
  const auto page = static_cast<std::size_t>(options_.page_size);
  for (std::size_t t = 0; t < slots.size(); ++t) {
    const auto slot = static_cast<std::size_t>(slots[t]);
    const std::size_t at = slot / page * block_stride_ + slot % page * static_cast<std::size_t>(row) * esize;
    std::byte* kd = kbase + at;
    std::byte* vd = vbase + at;
    const float* ks = k + static_cast<std::int64_t>(t) * row;
    const float* vs = v + static_cast<std::int64_t>(t) * row;
    switch (options_.dtype) {
      case DType::f32:
        std::memcpy(kd, ks, static_cast<std::size_t>(row) * 4);
        std::memcpy(vd, vs, static_cast<std::size_t>(row) * 4);
        break;
      case DType::f16:
      case DType::bf16: {
        // F16/BF16 rounding of quantize_row: vectorised where the CPU allows (model/convert_half_avx2.cpp).
        const auto type = options_.dtype == DType::f16 ? GgmlType::f16 : GgmlType::bf16;
        if (Status s = quantize_row(type, ks, kd, row); !s) return s;
        if (Status s = quantize_row(type, vs, vd, row); !s) return s;
        break;
      }
    }
  }
  return {};
}

void KvCache::memory_regions(std::vector<MemoryRegion>& out) const {
  if (device_ != nullptr) return;
  out.push_back({fmt::format("KV cache ({}, {} tokens)", dtype_name(options_.dtype), n_blocks_ * options_.page_size),
                 storage_.get(),
                 block_bytes_ * static_cast<std::size_t>(n_blocks_) * 2 * static_cast<std::size_t>(n_layer_)});
}

TensorView KvCache::view(std::int32_t layer, int kv) const {
  TensorView t =
      make_contiguous_view(kv_data(layer, kv), options_.dtype, {n_blocks_, options_.page_size, n_head_kv_, head_dim_},
                           device_ != nullptr ? device_->device() : Device::cpu());
  t.stride[0] = static_cast<std::int64_t>(block_stride_ / dtype_size(options_.dtype));
  return t;
}

TensorView KvCache::k_view(std::int32_t layer) const { return view(layer, 0); }

TensorView KvCache::v_view(std::int32_t layer) const { return view(layer, 1); }

}  // namespace kallpa::ops
