// A paged key/value cache: one pool of fixed-size blocks per layer, shared by every sequence
// through per-sequence block lists (the same block ids in every layer). Memory is bounded by the
// block count chosen at creation; a sequence that cannot grow gets a typed error and never
// touches another sequence's blocks. Its views plug straight into the attention contract's paged
// layout (k/v [blocks, page, Hkv, D] + block table + KV lengths).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "kallpa/attention.h"
#include "kallpa/status.h"

namespace kallpa::runtime {

struct KvCacheOptions {
  std::int32_t page_size = 16;       // tokens per block
  std::int64_t max_tokens = 8192;    // capacity over all sequences (rounded up to whole blocks)
  DType dtype = DType::f16;          // storage type of K and V
};

using SeqId = std::int32_t;

class KvCache {
 public:
  static Result<std::unique_ptr<KvCache>> create(std::int32_t n_layer, std::int32_t n_head_kv,
                                                 std::int32_t head_dim, KvCacheOptions options);

  const KvCacheOptions& options() const noexcept { return options_; }
  std::int64_t total_blocks() const noexcept { return n_blocks_; }
  std::int64_t free_blocks() const;
  std::int64_t used_blocks() const { return n_blocks_ - free_blocks(); }

  SeqId add_sequence();
  // Makes room for positions [0, length): allocates blocks as needed, all or nothing.
  // out_of_memory (field "kv_cache") when the pool cannot hold it.
  Status reserve(SeqId seq, std::int64_t length);
  // Forgets positions >= length and frees the blocks no longer needed.
  void truncate(SeqId seq, std::int64_t length);
  void remove(SeqId seq);
  bool has(SeqId seq) const;
  std::int64_t capacity(SeqId seq) const;  // positions the sequence's blocks can hold

  // Stores rows [pos, pos + n) of one layer; k and v are n x (n_head_kv * head_dim) f32 rows.
  // `blocks` is the sequence's block list (blocks(seq), taken once per forward pass rather than
  // per layer); the positions must have been reserved.
  void write(std::int32_t layer, std::span<const std::int32_t> blocks, std::int64_t pos, const float* k,
             const float* v, std::int64_t n);

  TensorView k_view(std::int32_t layer) const;
  TensorView v_view(std::int32_t layer) const;
  // The sequence's block ids, in order (valid until the next reserve/truncate/remove).
  std::vector<std::int32_t> blocks(SeqId seq) const;

 private:
  KvCache() = default;
  struct Sequence {
    SeqId id;
    std::vector<std::int32_t> blocks;
  };
  Sequence* find(SeqId seq);
  const Sequence* find(SeqId seq) const;

  KvCacheOptions options_;
  std::int32_t n_layer_ = 0, n_head_kv_ = 0, head_dim_ = 0;
  std::int64_t n_blocks_ = 0;
  // Layer l's K at storage_ + 2l * layer_bytes_, its V right after: [blocks, page, hkv, hd] each.
  std::shared_ptr<std::byte> storage_;
  std::size_t layer_bytes_ = 0;
  std::byte* k_data(std::int32_t layer) const noexcept {
    return storage_.get() + 2 * static_cast<std::size_t>(layer) * layer_bytes_;
  }
  std::byte* v_data(std::int32_t layer) const noexcept { return k_data(layer) + layer_bytes_; }
  mutable std::mutex mu_;
  std::vector<std::int32_t> free_;  // free block ids (a stack)
  std::vector<Sequence> seqs_;
  SeqId next_id_ = 0;
};

}  // namespace kallpa::runtime
