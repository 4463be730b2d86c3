// The decoder forward pass, written once against the op interface (ops/ops.h) and the attention
// dispatcher, so that it reads top to bottom like the architecture and never names a device or an
// attention backend. Every architecture runs it; what sets one apart is its description
// (architecture.h), which the pass reads at each step that differs.
//
// One forward() call runs a batch of sequence chunks together: every chunk's tokens go through the
// matrix products as one matrix, and attention sees them as one packed (ragged) problem against
// the paged KV cache. A prefill chunk, a decode step and a mix of both are the same call.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kallpa/dispatcher.h"
#include "kallpa/model/gguf.h"
#include "kallpa/model/llama.h"
#include "kallpa/ops/kv_cache.h"
#include "kallpa/ops/ops.h"
#include "kallpa/ops/quant.h"
#include "kallpa/ops/scratch.h"

namespace kallpa::model {

struct ForwardItem {
  ops::SeqId seq = 0;
  std::span<const std::int32_t> tokens;  // the chunk
  std::int64_t start_pos = 0;            // position of tokens[0]; the cache holds [0, start_pos)
  bool want_logits = true;               // logits of the chunk's last token
  // Prompt rows take exact activations, decode steps cheaper ones (ops/ops.h). A chunk of
  // several tokens is always prompt; a one-token chunk is a decode step unless this says it is
  // the last piece of a prompt, whose K/V must not depend on where the chunks fell (the prefix
  // cache hands them to other requests as exact prompt rows).
  bool prompt = false;
  // With want_logits: the logits of every token of the chunk, in order, not only the last one
  // (scoring a text, comparing with another implementation). Costs the output projection for
  // each of them: vocabulary x n_embd multiply-adds a row, as much as a small model's layers.
  bool all_logits = false;
};

inline bool is_decode_step(const ForwardItem& item) noexcept { return item.tokens.size() == 1 && !item.prompt; }

class LlamaModel {
 public:
  // Validates the file's config and weights (typed errors naming the key or tensor) and places the
  // weights on the ops' device. `ops` runs every forward pass and must outlive the model.
  static Result<std::unique_ptr<LlamaModel>> load(std::shared_ptr<const GgufFile> file, ops::Ops& ops);
  ~LlamaModel();
  LlamaModel(const LlamaModel&) = delete;
  LlamaModel& operator=(const LlamaModel&) = delete;

  const ModelConfig& config() const noexcept { return config_; }
  const GgufFile& file() const noexcept { return *file_; }
  // Weights of the matrix products one token goes through (every layer's projections and the
  // output head; not the embedding lookup or the norms): its matmul multiply-adds.
  std::int64_t matmul_weights_per_token() const noexcept;

  // A KV cache shaped for this model, in the memory of its ops' device.
  Result<std::unique_ptr<ops::KvCache>> make_cache(ops::KvCacheOptions options) const;
  ops::Ops& ops() const noexcept { return *ops_; }

  // Runs the items; writes their K/V into `cache` and, for each item with want_logits, the last
  // token's logits (vocab_size floats; every token's with all_logits) into `logits`, in item
  // order. The output projection runs only for those rows. Not reentrant: one forward()
  // at a time per model (it reuses its activation buffers).
  // `logits` is host memory whatever the device.
  // The caller owns the batch's order and the cache's space: prompt chunks come first, then decode
  // steps (is_decode_step), whose rows form the tail the ops compute with cheaper activations; and
  // every item's positions are reserved already (KvCache::reserve up to start_pos + its tokens).
  // Either broken is invalid_argument, before anything runs. Rejected rather than fixed here: a
  // reorder would need its undo for the logits (a copy through host memory on a device), and the
  // order is one decision, the batch builder's.
  Status forward(std::span<const ForwardItem> items, ops::KvCache& cache, Dispatcher& attention, float* logits);

 private:
  struct Layer {
    ops::WeightMatrix attn_norm;       // 1 x n_embd f32
    ops::WeightMatrix wq, wk, wv, wo;  // fused files: row ranges of one matrix
    ops::WeightMatrix ffn_norm;
    ops::WeightMatrix gate, up, down;
    // Optional (data == nullptr when the architecture has none): f32 vectors.
    ops::WeightMatrix bq, bk, bv, q_norm, k_norm, post_attention_norm, post_ffw_norm;
  };
  LlamaModel() = default;
  // The batch's paged-attention geometry (offsets, KV lengths, block table), the same for every
  // layer, so built once per forward pass.
  void plan_attention(std::span<const ForwardItem> items, const ops::KvCache& cache);
  Status attention(std::int32_t layer, const ops::KvCache& cache, Dispatcher& dispatcher);
  Status attention_block(std::size_t layer, ops::KvCache& cache, Dispatcher& dispatcher, std::int64_t total,
                         std::int64_t decode_rows);
  Status ffn_block(std::size_t layer, std::int64_t total, std::int64_t decode_rows);

  std::shared_ptr<const GgufFile> file_;
  ops::Ops* ops_ = nullptr;
  ModelConfig config_;
  // Every weight below is in the ops' memory, as their place_weights() left it (on the CPU: the
  // matrix products' weights repacked for the SIMD kernels, the lookups reading the file).
  ops::WeightMatrix token_embd_, output_, output_norm_;
  std::vector<float> rope_freqs_;  // the file's RoPE frequency divisors (host), or empty
  std::vector<Layer> layers_;
  std::vector<std::shared_ptr<const void>> placed_;  // keeps the device's copies alive

  // Activations: x (residual), h (normed), q/k/v, att, ffn gate/up, tmp, logits of the wanted rows.
  ops::Scratch x_, h_, q_, k_, v_, att_, gate_, up_, tmp_, logits_;
  std::vector<std::int32_t> tokens_, positions_, cu_q_, block_table_, seqlens_k_;
  std::vector<std::int64_t> kv_slots_, wanted_rows_;  // cache slot of each row; rows whose logits are wanted
  std::int32_t max_blocks_ = 0;
};

}  // namespace kallpa::model
