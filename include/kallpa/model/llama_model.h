// The decoder forward pass, written once against the op interface (ops/ops.h) and the attention
// dispatcher, so that it reads top to bottom like the architecture and never names a device or an
// attention backend. Every architecture runs it; what sets one apart is its description
// (architecture.h), which the pass reads at each step that differs.
//
// One forward() call runs a batch of sequence chunks together: every chunk's tokens go through the
// matrix products as one matrix, and attention sees them as one packed (ragged) problem against
// the paged KV cache. A prefill chunk, a decode step and a mix of both are the same call.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "kallpa/dispatcher.h"
#include "kallpa/model/gguf.h"
#include "kallpa/model/llama.h"
#include "kallpa/ops/kv_cache.h"
#include "kallpa/ops/memory_region.h"
#include "kallpa/ops/ops.h"
#include "kallpa/ops/quant.h"
#include "kallpa/ops/scratch.h"
#include "kallpa/process_group.h"

namespace kallpa::model {

struct ForwardItem {
  ops::SeqId seq = 0;
  std::span<const std::int32_t> tokens;  // the chunk
  std::int64_t start_pos = 0;            // position of tokens[0]; the cache holds [0, start_pos)
  bool want_logits = true;               // logits of the chunk's last token
  // A device may compute prompt rows and decode steps differently (ops/ops.h). A chunk of
  // several tokens is always prompt; a one-token chunk is a decode step unless this says it is
  // the last piece of a prompt, whose K/V must not depend on where the chunks fell (the prefix
  // cache hands them to other requests as prompt rows).
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
  // Bytes a decode step reads at `context` tokens of context, with K/V stored as `kv_bytes` bytes
  // per value: every matrix product's weights, one embedding row, and each layer's visible keys'
  // K and V rows (a sliding-window layer's window at most). Against the machine's read bandwidth
  // it bounds generation's tokens per second.
  double bytes_read_per_token(std::int64_t context, std::size_t kv_bytes) const noexcept;
  // Where its host memory is (weights, activations); nothing when its ops' memory is a device's.
  void memory_regions(std::vector<ops::MemoryRegion>& out) const;

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

  // Context parallelism (docs/scale-out.md): one sequence spread over the ranks of `group`. Each
  // rank's cache sequence `seq` holds its shard of the keys, in the order it stored them: a key's
  // position lives only in the rotation already applied to it, which is all causal attention needs
  // once the rows see the right keys. Both calls are collective: every rank makes them alike, in
  // the same order, and each reserves its own shard's room in `cache` (out_of_memory "kv_cache"
  // when it has none left). The model needs no window (a sliding window would need the shards'
  // positions): unsupported otherwise.
  //
  // The prompt (the same on every rank, positions [0, prompt.size())) in 2N chunks: rank r runs
  // chunks r and 2N-1-r through every layer (the matrix products split N ways; the pairs even out
  // the causal attention's work), and the K/V of every rank's rows reach every rank by an
  // all-gather per layer, in the cache's storage type, for its rows' attention. Each rank keeps
  // its own rows' K/V. The cache sequence must be empty. Rank 0, which holds the last chunk,
  // writes the last token's logits (vocab_size floats) to `logits`; other ranks may pass null.
  // `*shard_keys` receives how many keys this rank's shard holds.
  Status prefill_context_parallel(ops::SeqId seq, std::span<const std::int32_t> prompt, ops::KvCache& cache,
                                  Dispatcher& attention, ProcessGroup& group, float* logits, std::int64_t* shard_keys);
  // One decode step at `position` (the tokens before it went through prefill_context_parallel and
  // this call): every rank computes the token's q/k/v (one row, replicated), the rank
  // context_parallel_owner() names stores its K/V, each rank attends over its shard, and the
  // partial outputs merge by log-sum-exp (an all-gather of rows x heads x (Dv + 1) floats per
  // layer, merged in rank order, so every rank gets the same numbers). Rank 0 writes the logits.
  // `*shard_keys`: the keys this rank's shard holds, before the call and (updated) after it.
  Status decode_context_parallel(ops::SeqId seq, std::int32_t token, std::int64_t position, ops::KvCache& cache,
                                 Dispatcher& attention, ProcessGroup& group, float* logits, std::int64_t* shard_keys);
  // The rank that keeps the K/V of a decode step at `position`, round-robin so that the shards
  // grow evenly.
  static int context_parallel_owner(std::int64_t position, int ranks) noexcept {
    return static_cast<int>(position % ranks);
  }
  // Rows [begin, end) of the prompt's chunk `chunk` of 2 * ranks.
  static std::pair<std::int64_t, std::int64_t> context_parallel_chunk(std::int64_t prompt_tokens, int chunk,
                                                                      int ranks) noexcept {
    const std::int64_t parts = 2 * std::int64_t{ranks};
    return {prompt_tokens * chunk / parts, prompt_tokens * (chunk + 1) / parts};
  }

 private:
  struct Layer {
    ops::WeightMatrix attn_norm;       // 1 x n_embd f32
    ops::WeightMatrix wq, wk, wv, wo;  // fused files: row ranges of one matrix
    ops::WeightMatrix ffn_norm;
    ops::WeightMatrix gate, up, down;
    // Optional (data == nullptr when the architecture has none): f32 vectors.
    ops::WeightMatrix bq, bk, bv, q_norm, k_norm, post_attention_norm, post_ffw_norm;

    // The matrices a token is multiplied by, and the f32 vectors (norms, biases; some may be empty).
    std::array<ops::WeightMatrix*, 7> products() { return {&wq, &wk, &wv, &wo, &gate, &up, &down}; }
    std::array<const ops::WeightMatrix*, 7> products() const { return {&wq, &wk, &wv, &wo, &gate, &up, &down}; }
    std::array<ops::WeightMatrix*, 9> vectors() {
      return {&attn_norm, &ffn_norm, &bq, &bk, &bv, &q_norm, &k_norm, &post_attention_norm, &post_ffw_norm};
    }
    std::array<const ops::WeightMatrix*, 9> vectors() const {
      return {&attn_norm, &ffn_norm, &bq, &bk, &bv, &q_norm, &k_norm, &post_attention_norm, &post_ffw_norm};
    }
  };
  LlamaModel() = default;
  // The batch's paged-attention geometry (offsets, KV lengths, block table), the same for every
  // layer, so built once per forward pass.
  void plan_attention(std::span<const ForwardItem> items, const ops::KvCache& cache);
  Status attention(std::int32_t layer, const ops::KvCache& cache, Dispatcher& dispatcher);
  // The context-parallel attention steps (context_parallel.cpp), run by attention_block in place
  // of attention() while cp_ is set.
  enum class CpStep { none, prefill, decode };
  Status check_context_parallel(const ops::KvCache& cache, ops::SeqId seq) const;
  Status prefill_attention_cp(std::int32_t layer, const ops::KvCache& cache, Dispatcher& dispatcher);
  // Sizes the per-step buffers (x_ ... tmp_) for `rows` token rows.
  Status reserve_step_buffers(std::int64_t rows);
  Status decode_attention_cp(std::int32_t layer, const ops::KvCache& cache, Dispatcher& dispatcher);
  // The logits of one row of x (`decode`: a decode step's row, with its cheaper activations).
  Status output_head(std::int64_t row, bool decode, float* logits);
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

  // Context parallelism: the step under way, its group and geometry, and its buffers.
  CpStep cp_ = CpStep::none;
  ProcessGroup* group_ = nullptr;
  std::int64_t cp_prompt_ = 0;    // prefill: prompt tokens
  std::int64_t cp_max_rows_ = 0;  // prefill: the most rows any rank holds (all-gather's stride)
  std::vector<std::byte> cp_send_, cp_all_, cp_keys_, cp_values_;  // storage-type K/V rows
  std::vector<float> cp_partial_, cp_partials_, lse_;
  std::vector<std::int32_t> cp_cu_q_, cp_seqlens_k_, cp_table_;
};

}  // namespace kallpa::model
