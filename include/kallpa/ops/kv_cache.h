// A paged key/value cache: one pool of fixed-size blocks per layer, shared by every sequence
// through per-sequence block lists (the same block ids in every layer). Memory is bounded by the
// block count chosen at creation; a sequence that cannot grow gets a typed error and never
// touches another sequence's blocks. Its views plug straight into the attention contract's paged
// layout (k/v [blocks, page, Hkv, D] + block table + KV lengths).
//
// Prefix caching. Full blocks can be published under the tokens they hold (with everything before
// them, as a chain hash), and a new sequence whose tokens start the same way attaches those blocks
// instead of recomputing them: every chat request repeats its system prompt, and a multi-turn chat
// repeats the whole conversation. A block is shared read-only: a sequence only ever writes past
// its attached prefix, and truncating into a shared block copies it first. A published block that
// no sequence holds any more stays cached until the pool needs it (least recently used goes
// first), so it counts as free: cached blocks never make a request wait or fail.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include "kallpa/attention.h"
#include "kallpa/ops/memory_region.h"
#include "kallpa/ops/ops.h"
#include "kallpa/status.h"

namespace kallpa::ops {

struct KvCacheOptions {
  std::int32_t page_size = 16;     // tokens per block
  std::int64_t max_tokens = 8192;  // capacity over all sequences (rounded up to whole blocks)
  DType dtype = DType::f16;        // storage type of K and V
};

using SeqId = std::int32_t;

class KvCache {
 public:
  // `memory`: the device the blocks live on (its ops write and copy them; it must outlive the
  // cache); nullptr or a host-addressable one: host memory on huge pages.
  static Result<std::unique_ptr<KvCache>> create(std::int32_t n_layer, std::int32_t n_head_kv, std::int32_t head_dim,
                                                 KvCacheOptions options, Ops* memory = nullptr);

  const KvCacheOptions& options() const noexcept { return options_; }
  std::int64_t total_blocks() const noexcept { return n_blocks_; }
  // Blocks a sequence may take: never used, or cached and held by no sequence.
  std::int64_t free_blocks() const;
  std::int64_t used_blocks() const { return n_blocks_ - free_blocks(); }
  // Published blocks that no sequence holds (a part of free_blocks()).
  std::int64_t cached_blocks() const;

  SeqId add_sequence();
  // Makes room for positions [0, length): allocates blocks as needed, all or nothing.
  // out_of_memory (field "kv_cache") when the pool cannot hold it.
  Status reserve(SeqId seq, std::int64_t length);
  // Forgets positions >= length and frees the blocks no longer needed. Returns the positions kept:
  // `length` (at most capacity(seq): a length beyond it forgets nothing), or less in the one case
  // where a shared block would have to be copied into a pool with no block left (then the
  // positions of that partial block are dropped too).
  std::int64_t truncate(SeqId seq, std::int64_t length);
  void remove(SeqId seq);
  // A new sequence that continues `from`'s first `length` positions without recomputing them
  // (n samples of one prompt): it shares the full blocks, read-only as attached prefixes are, and
  // gets a private copy of the partial last block, which both will write past `length`.
  // not_found for an unknown sequence; out_of_memory "kv_cache" when no block is left for the copy.
  Result<SeqId> fork(SeqId from, std::int64_t length);

  // For a sequence that holds no blocks yet: attaches the longest chain of published blocks whose
  // tokens begin `tokens` and that ends on a multiple of `granule` positions (and of page_size;
  // granule <= 0: any block), leaving at least one token to compute (its logits are wanted), and
  // returns how many positions they hold (0 when nothing matches). A scheduler that computes
  // prompts in chunks at fixed positions passes its chunk, so that the blocks it attaches were
  // computed in the chunks it would compute itself.
  std::int64_t attach_prefix(SeqId seq, std::span<const std::int32_t> tokens, std::int64_t granule = 0);
  // Publishes the sequence's full blocks among positions [0, tokens.size()), which must all be
  // written (tokens[i] is the token at position i). Blocks already published are skipped, and a
  // block whose content another block already publishes stays private.
  void publish(SeqId seq, std::span<const std::int32_t> tokens);
  bool has(SeqId seq) const;
  std::int64_t capacity(SeqId seq) const;  // positions the sequence's blocks can hold

  // Stores rows [pos, pos + n) of one layer; k and v are n x (n_head_kv * head_dim) f32 rows.
  // `blocks` is the sequence's block list (blocks(seq), taken once per forward pass rather than
  // per layer); the positions must have been reserved.
  Status write(std::int32_t layer, std::span<const std::int32_t> blocks, std::int64_t pos, const float* k,
               const float* v, std::int64_t n);
  // The same for a batch: row i of k and v goes to cache slot slots[i] (block * page_size + offset,
  // see slot()); k and v are in the cache's memory (device addresses on a device).
  Status write_rows(std::int32_t layer, std::span<const std::int64_t> slots, const float* k, const float* v);
  std::int64_t slot(std::span<const std::int32_t> blocks, std::int64_t pos) const noexcept {
    return std::int64_t{blocks[static_cast<std::size_t>(pos / options_.page_size)]} * options_.page_size +
           pos % options_.page_size;
  }

  // The views of one layer's pool. Writes through them by anyone but this cache are outside the
  // page-version promise below: such a writer must not pass page_versions with them.
  TensorView k_view(std::int32_t layer) const;
  TensorView v_view(std::int32_t layer) const;
  // One version per block of the layer (the attention contract's page_versions), and the id of
  // this cache's storage (its kv_pool_id). Every path that changes a block's bytes in the layer
  // (write, write_rows, copy_block, handing a block out) gives it a new version first, drawn from
  // a process-wide sequence; versions are read by attention calls that never overlap a write to
  // the blocks they read (a forward pass writes a layer's rows, then runs its attention).
  const std::uint64_t* page_versions(std::int32_t layer) const noexcept {
    return versions_.data() + static_cast<std::size_t>(layer) * static_cast<std::size_t>(n_blocks_);
  }
  std::uint64_t pool_id() const noexcept { return pool_id_; }
  // The sequence's block ids, in order (valid until the next reserve/truncate/remove).
  std::vector<std::int32_t> blocks(SeqId seq) const;
  // Its storage, when in host memory (none on a device).
  void memory_regions(std::vector<MemoryRegion>& out) const;

 private:
  KvCache() = default;
  struct Sequence {
    SeqId id;
    std::vector<std::int32_t> blocks;
    // Chain hashes of the leading blocks that are attached or published (chain.size() of them).
    std::vector<std::uint64_t> chain;
  };
  // A published block: its chain hash, the hash before it, and its tokens (checked on attach).
  struct Published {
    bool live = false;
    std::uint64_t hash = 0, parent = 0;
    std::vector<std::int32_t> tokens;
    std::uint64_t idle_since = 0;  // key in idle_ while no sequence holds it
  };
  Sequence* find(SeqId seq);
  const Sequence* find(SeqId seq) const;
  // Under mu_.
  std::int32_t take_block();
  void release_block(std::int32_t block);
  void unpublish(std::int32_t block);
  void copy_block(std::int32_t from, std::int32_t to);
  void bump_block(std::int32_t block) noexcept;  // a new version in every layer
  std::uint64_t chain_hash(std::uint64_t parent, std::span<const std::int32_t> tokens) const;

  KvCacheOptions options_;
  Ops* device_ = nullptr;  // set when the blocks are in a device's memory
  std::int32_t n_layer_ = 0, n_head_kv_ = 0, head_dim_ = 0;
  std::int64_t n_blocks_ = 0;
  // One block of one layer's K or V is block_bytes_ ([page, hkv, hd]). In host memory the pool is
  // block-major, [block][layer][K, V]: the first blocks of every layer lie together, so a run that
  // uses few blocks commits only the huge pages they fill (a layer-major pool would touch a page
  // in every layer's stretch). On a device each layer's K, then V, is one dense [blocks, ...]
  // stretch, as its ops' row scatters expect. block_stride_ is the bytes from a block to the next
  // within one layer's K (or V).
  std::shared_ptr<std::byte> storage_;
  std::size_t block_bytes_ = 0, block_stride_ = 0;
  std::byte* k_data(std::int32_t layer) const noexcept { return kv_data(layer, 0); }
  std::byte* v_data(std::int32_t layer) const noexcept { return kv_data(layer, 1); }
  std::byte* kv_data(std::int32_t layer, int kv) const noexcept {
    const auto l = static_cast<std::size_t>(layer), which = static_cast<std::size_t>(kv);
    return storage_.get() + (device_ == nullptr ? (2 * l + which) * block_bytes_
                                                : (2 * l + which) * block_bytes_ * static_cast<std::size_t>(n_blocks_));
  }
  TensorView view(std::int32_t layer, int kv) const;
  std::vector<std::uint64_t> versions_;  // [layer][block]; see page_versions()
  std::uint64_t pool_id_ = 0;
  mutable std::mutex mu_;
  std::vector<std::int32_t> free_;                         // never-used or dropped block ids (a stack)
  std::vector<std::int32_t> refs_;                         // sequences holding each block
  std::vector<Published> published_;                       // by block id
  std::unordered_map<std::uint64_t, std::int32_t> index_;  // chain hash -> published block
  std::map<std::uint64_t, std::int32_t> idle_;             // cached, unheld blocks by age (LRU first)
  std::uint64_t clock_ = 0;
  std::vector<Sequence> seqs_;
  SeqId next_id_ = 0;
};

}  // namespace kallpa::ops
