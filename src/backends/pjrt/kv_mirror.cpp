#include "backends/pjrt/kv_mirror.h"

#include <algorithm>
#include <bit>
#include <cstddef>
#include <utility>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "backends/pjrt/host_copy.h"

namespace kallpa::pjrt {
namespace {

// The pool's geometry, as the page programs see it.
PageUpdateSpec pool_spec(const ValidatedProblem& vp) {
  const AttentionProblem& p = vp.problem();
  PageUpdateSpec s;
  s.kv_dtype = p.k.dtype;
  s.num_blocks = p.k.shape[0];
  s.page_size = p.k.shape[1];
  s.hkv = vp.hkv();
  s.head_dim = vp.head_dim();
  s.head_dim_v = vp.head_dim_v();
  return s;
}

std::uint64_t pool_bytes(const PageUpdateSpec& s) noexcept {
  return static_cast<std::uint64_t>(s.num_blocks) * static_cast<std::uint64_t>(s.page_size) *
         static_cast<std::uint64_t>(s.hkv) * static_cast<std::uint64_t>(s.head_dim + s.head_dim_v) *
         dtype_size(s.kv_dtype);
}

// Copies one block of a paged view ([blocks, page, heads, dim], any strides) into `dst`, dense.
void pack_block(const TensorView& t, std::int64_t block, char* dst) noexcept {
  const std::size_t es = dtype_size(t.dtype);
  const char* base = static_cast<const char*>(t.data);
  const std::int64_t page = t.shape[1], heads = t.shape[2], dim = t.shape[3];
  for (std::int64_t r = 0; r < page; ++r) {
    for (std::int64_t h = 0; h < heads; ++h) {
      const std::int64_t src = block * t.stride[0] + r * t.stride[1] + h * t.stride[2];
      gather_elems(dst + ((r * heads + h) * dim) * static_cast<std::int64_t>(es),
                   base + src * static_cast<std::int64_t>(es), dim, t.stride[3], es);
    }
  }
}

}  // namespace

bool KvMirrors::applies(const ValidatedProblem& vp) const noexcept {
  const AttentionProblem& p = vp.problem();
  return p.kv_layout == KvLayout::paged && p.page_versions != nullptr && p.kv_pool_id != 0 &&
         pool_bytes(pool_spec(vp)) <= capacity_.load(std::memory_order_relaxed);
}

std::shared_ptr<KvMirrors::Mirror> KvMirrors::acquire(const Key& key, std::uint64_t bytes) {
  std::lock_guard lock(mu_);
  auto it = mirrors_.find(key);
  if (it == mirrors_.end()) {
    // Room first: the least recently used go (a run holding one keeps it alive until it ends).
    while (resident_ + bytes > capacity_.load(std::memory_order_relaxed) && !mirrors_.empty()) {
      auto lru = std::min_element(mirrors_.begin(), mirrors_.end(), [](const auto& a, const auto& b) {
        return a.second->last_used < b.second->last_used;
      });
      resident_ -= lru->second->bytes;
      mirrors_.erase(lru);
      ++stats_.evictions;
    }
    auto m = std::make_shared<Mirror>();
    m->bytes = bytes;
    resident_ += bytes;
    it = mirrors_.emplace(key, std::move(m)).first;
  }
  it->second->last_used = ++clock_;
  return it->second;
}

void KvMirrors::drop(const Key& key, const std::shared_ptr<Mirror>& mirror) {
  std::lock_guard lock(mu_);
  auto it = mirrors_.find(key);
  if (it == mirrors_.end() || it->second != mirror) return;
  resident_ -= it->second->bytes;
  mirrors_.erase(it);
}

// Zeros made on the device: no pool's worth of bytes crosses from the host, and every block reads
// as "never uploaded" (version 0 on the device never matches: a block's version 0 is re-read).
Status KvMirrors::start(const Client& client, const PageUpdateSpec& spec, const ProgramCache& programs, Mirror& m) {
  Result<std::shared_ptr<const Executable>> zeros =
      programs(spec.zeros_key(), [&] { return pool_zeros_program(spec); });
  if (!zeros) return zeros.status();
  Result<std::vector<Buffer>> pools = (*zeros)->execute(client.device(), {});
  if (!pools) return pools.status();
  if (pools->size() != 2) {
    return Status(ErrorCode::internal, "pjrt", fmt::format("the pool program returned {} results", pools->size()));
  }
  m.k = std::move((*pools)[0]);
  m.v = std::move((*pools)[1]);
  m.versions.assign(static_cast<std::size_t>(spec.num_blocks), 0);
  m.ready = true;
  std::lock_guard lock(mu_);
  ++stats_.created;
  return {};
}

Status KvMirrors::write_pages(const Client& client, const ValidatedProblem& vp, const PageUpdateSpec& pool,
                              const std::vector<std::int32_t>& blocks, const ProgramCache& programs,
                              std::uint64_t& bytes_up, Mirror& m) {
  const AttentionProblem& p = vp.problem();
  PageUpdateSpec spec = pool;
  spec.pages = static_cast<std::int64_t>(std::bit_ceil(blocks.size()));
  Result<std::shared_ptr<const Executable>> update = programs(spec.key(), [&] { return page_update_program(spec); });
  if (!update) return update.status();

  const std::size_t es = dtype_size(spec.kv_dtype);
  const auto k_page = static_cast<std::size_t>(spec.page_size * spec.hkv * spec.head_dim) * es;
  const auto v_page = static_cast<std::size_t>(spec.page_size * spec.hkv * spec.head_dim_v) * es;
  const auto n = static_cast<std::size_t>(spec.pages);
  std::vector<char> k(n * k_page), v(n * v_page);
  std::vector<std::int32_t> index(n);
  for (std::size_t i = 0; i < n; ++i) {
    // Padding repeats the last page at its own block: the same bytes written twice.
    const std::int32_t block = blocks[std::min(i, blocks.size() - 1)];
    index[i] = block;
    pack_block(p.k, block, k.data() + i * k_page);
    pack_block(p.v, block, v.data() + i * v_page);
  }
  const ElementType t = element_type(spec.kv_dtype);
  Result<Buffer> kb = client.upload(k.data(), t, {spec.pages, spec.page_size, spec.hkv, spec.head_dim});
  if (!kb) return kb.status();
  Result<Buffer> vb = client.upload(v.data(), t, {spec.pages, spec.page_size, spec.hkv, spec.head_dim_v});
  if (!vb) return vb.status();
  Result<Buffer> ib = client.upload(index.data(), ElementType::s32, {spec.pages, 1});
  if (!ib) return ib.status();
  bytes_up += k.size() + v.size() + index.size() * sizeof(std::int32_t);

  // The pools are donated to the program: from here on only its results are the mirror.
  Result<std::vector<Buffer>> out =
      (*update)->execute(client.device(), {m.k.get(), m.v.get(), kb->get(), vb->get(), ib->get()});
  if (!out) return out.status();
  if (out->size() != 2) {
    return Status(ErrorCode::internal, "pjrt", fmt::format("the page update returned {} results", out->size()));
  }
  m.k = std::move((*out)[0]);
  m.v = std::move((*out)[1]);
  for (const std::int32_t block : blocks) m.versions[static_cast<std::size_t>(block)] = p.page_versions[block];
  std::lock_guard lock(mu_);
  stats_.pages_uploaded += blocks.size();
  ++stats_.updates;
  return {};
}

Status KvMirrors::run_with(const Client& client, const ValidatedProblem& vp, const ProgramCache& programs,
                           std::uint64_t& bytes_up, const Use& use) {
  const AttentionProblem& p = vp.problem();
  const PageUpdateSpec pool = pool_spec(vp);
  const Key key{p.kv_pool_id, p.k.data, p.v.data};
  std::shared_ptr<Mirror> m = acquire(key, pool_bytes(pool));
  std::lock_guard hold(m->mu);

  const Status updated = [&]() -> Status {
    if (!m->ready) {
      if (Status s = start(client, pool, programs, *m); !s) return s;
    }
    // The blocks this problem reads whose bytes the device does not hold.
    std::vector<std::int32_t> stale;
    const std::int64_t stride = p.block_table_stride > 0 ? p.block_table_stride : p.max_blocks_per_seq;
    for (std::int32_t b = 0; b < vp.batch(); ++b) {
      const std::int64_t used = (vp.seqlen_k(b) + pool.page_size - 1) / pool.page_size;
      for (std::int64_t j = 0; j < used; ++j) {
        const std::int32_t block = p.block_table[b * stride + j];
        const std::uint64_t version = p.page_versions[block];
        if (version == 0 || version != m->versions[static_cast<std::size_t>(block)]) stale.push_back(block);
      }
    }
    std::sort(stale.begin(), stale.end());
    stale.erase(std::unique(stale.begin(), stale.end()), stale.end());
    for (std::size_t from = 0; from < stale.size(); from += kMaxPagesPerUpdate) {
      const std::size_t to = std::min(stale.size(), from + static_cast<std::size_t>(kMaxPagesPerUpdate));
      const std::vector<std::int32_t> part(stale.begin() + static_cast<std::ptrdiff_t>(from),
                                           stale.begin() + static_cast<std::ptrdiff_t>(to));
      if (Status s = write_pages(client, vp, pool, part, programs, bytes_up, *m); !s) return s;
    }
    return {};
  }();
  if (!updated) {
    // The pools may have been donated to a program that failed: nothing in them can be trusted.
    m->k.reset();
    m->v.reset();
    m->ready = false;
    drop(key, m);
    return updated;
  }
  return use(m->k.get(), m->v.get());
}

MirrorStats KvMirrors::stats() const {
  std::lock_guard lock(mu_);
  MirrorStats s = stats_;
  s.mirrors = mirrors_.size();
  s.bytes = resident_;
  return s;
}

}  // namespace kallpa::pjrt
