// The attention contract, version 1.
//
//   o = softmax(mask(alibi + softcap(scale * q k^T))) v        (+ optional lse, f32)
//
// Shapes follow FlashAttention so that callers can map their code one to one:
//
//   q      dense  [B, Sq, Hq, D]        packed  [Tq, Hq, D]   + cu_seqlens_q[B+1]
//   k, v   dense  [B, Skv, Hkv, D|Dv]   packed  [Tkv, Hkv, D|Dv] + cu_seqlens_k[B+1]
//          paged  [blocks, page, Hkv, D|Dv] + block_table[B, max_blocks] + seqlens_k[B]
//   o      like q, with Dv in place of D
//   lse    dense  [B, Hq, Sq]           packed  [Hq, Tq]     (f32, optional)
//
// Semantics, for query row i of a sequence with Sq queries and Skv keys:
//  * Hq must be a multiple of Hkv; query head h reads KV head h / (Hq / Hkv).
//  * s_ij = scale * <q_i, k_j>  (scale defaults to 1/sqrt(D));
//    if softcap > 0: s_ij = softcap * tanh(s_ij / softcap);
//    with ALiBi:     s_ij -= slope[h] * |p_i - j|,  where p_i = i + Skv - Sq.
//  * Masks are aligned bottom-right: query i sits at key position p_i = i + Skv - Sq, which makes
//    decode and chunked prefill the same case. Key j is visible iff 0 <= j < Skv and
//      causal:        j <= p_i
//      window_left:   j >= p_i - window_left     (-1 = unbounded)
//      window_right:  j <= p_i + window_right    (-1 = unbounded)
//  * A row with no visible key, or whose visible scores are all -inf, gives o = 0 and lse = -inf,
//    never NaN. Masked keys are never read, so NaN/Inf stored there has no effect.
//  * NaN in a visible q, k score or v propagates (IEEE arithmetic); no backend hides it.
//  * lse_i = log(sum_j exp(s_ij)) over visible keys (natural log, after softcap and ALiBi).
//  * Index arrays (cu_seqlens_*, block_table, seqlens_k) live in host memory in v1.
//
// Degenerate shapes are ordinary problems with one answer, the same from every backend:
//  * Empty batch (B = 0; dense q with shape[0] = 0, or batch = 0 with packed q / packed or paged
//    kv): nothing is read and nothing is written; run() succeeds. Index arrays may be null.
//  * A sequence with Sq = 0 has no output rows: nothing of it is written. A packed batch may hold
//    any number of them, anywhere (cu_seqlens_q[b + 1] == cu_seqlens_q[b]).
//  * A sequence with Skv = 0 (any layout) has no visible key for any row: its rows are o = 0 and
//    lse = -inf. Its keys, values and block-table row are never read.
//  * Zero blocks (paged k/v with shape[0] = 0, or max_blocks_per_seq = 0): valid when every
//    seqlens_k[b] is 0; then every row is o = 0, lse = -inf, and block_table may be null.
//  * Zero heads or a zero head dimension are not problems: validate() rejects them, naming the field.
//  * Windows: any value in [-1, INT64_MAX]; below -1 is rejected. A bound >= Sq + Skv hides nothing
//    more than Sq + Skv does, so window_left = window_right = INT64_MAX is the same problem as
//    -1/-1, and window 0:0 leaves each row at most its own position. Backends must not overflow
//    on p_i - window_left or p_i + window_right: ValidatedProblem::window_left()/window_right()
//    give the bounds saturated to a width that cannot.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "kallpa/status.h"
#include "kallpa/tensor.h"

namespace kallpa {

inline constexpr int kAttentionContractVersion = 1;

enum class QLayout : std::uint8_t { dense = 0, packed = 1 };
enum class KvLayout : std::uint8_t { dense = 0, packed = 1, paged = 2 };

std::string_view q_layout_name(QLayout layout) noexcept;
std::string_view kv_layout_name(KvLayout layout) noexcept;

struct AttentionProblem {
  int contract_version = kAttentionContractVersion;

  QLayout q_layout = QLayout::dense;
  KvLayout kv_layout = KvLayout::dense;

  TensorView q;
  TensorView k;
  TensorView v;
  TensorView o;    // written by the backend
  TensorView lse;  // optional (data == nullptr: not wanted); f32

  // Packed layouts: B+1 non-decreasing offsets starting at 0. `batch` is B.
  int batch = 0;  // required for packed q or packed/paged kv; ignored (taken from q) when all dense
  const std::int32_t* cu_seqlens_q = nullptr;
  const std::int32_t* cu_seqlens_k = nullptr;

  // Paged KV: block_table[b * block_table_stride + n] is the block holding keys
  // [n * page, (n + 1) * page) of sequence b; seqlens_k[b] is its KV length.
  const std::int32_t* block_table = nullptr;
  std::int64_t block_table_stride = 0;  // entries between rows; 0 means max_blocks_per_seq
  std::int32_t max_blocks_per_seq = 0;
  const std::int32_t* seqlens_k = nullptr;

  // Paged KV, optional (both set or neither): what lets a backend on another device keep pages
  // there between calls and copy only those that changed. page_versions[n] (host memory, one per
  // block of k) is block n's version; kv_pool_id names the storage k and v view: unique in the
  // process for that storage's life and never reused (a freed pool allocated again at the same
  // address gets a new id). The promise: when block n's version equals one seen earlier for the
  // same pool id and the same k/v data pointers, block n's K and V bytes are exactly what they were
  // then. Version 0 means unknown: the block must be read afresh. A backend may ignore both.
  const std::uint64_t* page_versions = nullptr;
  std::uint64_t kv_pool_id = 0;

  std::optional<float> scale;  // default 1/sqrt(D)
  bool causal = false;
  std::int64_t window_left = -1;
  std::int64_t window_right = -1;
  float softcap = 0.0f;                 // 0 = off
  const float* alibi_slopes = nullptr;  // [Hq], host memory, optional
};

// The facts of a problem that a backend may base its verdict on (AttentionBackend::supports takes
// only this, so the dispatcher can cache verdicts per signature).
struct ProblemSignature {
  Device device;
  DType q_dtype = DType::f32;
  DType kv_dtype = DType::f32;
  DType o_dtype = DType::f32;
  QLayout q_layout = QLayout::dense;
  KvLayout kv_layout = KvLayout::dense;
  std::int32_t hq = 0;
  std::int32_t hkv = 0;
  std::int32_t head_dim = 0;
  std::int32_t head_dim_v = 0;
  std::int32_t page_size = 0;  // paged only
  bool causal = false;
  bool window = false;  // any finite window bound
  bool softcap = false;
  bool alibi = false;
  bool lse = false;
  bool unit_stride_last_dim = true;  // q, k, v, o all have stride 1 along the head dim

  friend bool operator==(const ProblemSignature&, const ProblemSignature&) = default;
  std::size_t hash() const noexcept;
  // Compact text with the keys of the problem spec grammar (problem_spec.h) and bare flags for
  // features, e.g. "dtype=bf16,hq=32,hkv=8,d=128,kv=paged,page=16,causal,window"
  std::string to_string() const;
};

class ValidatedProblem;

// Checks everything a backend relies on: contract version, ranks and shapes, strides, dtypes,
// devices, null pointers, index arrays (monotone offsets, block ids in range, lengths that fit),
// overflow of every extent, and that o/lse do not alias the inputs. The error names the field.
Result<ValidatedProblem> validate(const AttentionProblem& problem);

// A problem that passed validate(), with its derived dimensions. Backends only ever receive these.
class ValidatedProblem {
 public:
  const AttentionProblem& problem() const noexcept { return p_; }
  const ProblemSignature& signature() const noexcept { return sig_; }

  std::int32_t batch() const noexcept { return batch_; }
  std::int32_t hq() const noexcept { return sig_.hq; }
  std::int32_t hkv() const noexcept { return sig_.hkv; }
  std::int32_t group_size() const noexcept { return sig_.hq / sig_.hkv; }  // query heads per KV head
  std::int32_t head_dim() const noexcept { return sig_.head_dim; }
  std::int32_t head_dim_v() const noexcept { return sig_.head_dim_v; }
  float scale() const noexcept { return scale_; }
  std::int64_t total_q() const noexcept { return total_q_; }  // sum of Sq over the batch
  std::int64_t max_seqlen_q() const noexcept { return max_sq_; }
  std::int64_t max_seqlen_k() const noexcept { return max_skv_; }
  // Sum over the batch of Sq_b * Skv_b (unmasked work upper bound), for FLOP counts.
  double query_key_pairs() const noexcept { return pairs_; }

  // Per-sequence geometry (b in [0, batch)).
  std::int64_t seqlen_q(std::int32_t b) const noexcept;
  std::int64_t seqlen_k(std::int32_t b) const noexcept;
  // Element offset of q/o row (b, i) at head 0, dim 0.
  std::int64_t q_row_offset(std::int32_t b, std::int64_t i) const noexcept;
  std::int64_t o_row_offset(std::int32_t b, std::int64_t i) const noexcept;
  // Element offset of k/v row (b, j) at head 0, dim 0 (resolves packed and paged layouts).
  std::int64_t k_row_offset(std::int32_t b, std::int64_t j) const noexcept;
  std::int64_t v_row_offset(std::int32_t b, std::int64_t j) const noexcept;
  // Element offset of lse for (b, h, i).
  std::int64_t lse_offset(std::int32_t b, std::int32_t h, std::int64_t i) const noexcept;

  // Visible key range [first, last] for query i of sequence b (empty when first > last).
  struct KeyRange {
    std::int64_t first;
    std::int64_t last;
  };
  KeyRange visible_keys(std::int32_t b, std::int64_t i) const noexcept;

  // The window bounds as a backend should compute with them: -1 (unbounded) stays -1, any other
  // bound is saturated at max_seqlen_q() + max_seqlen_k(), beyond which a window hides nothing
  // more. p_i - window_left() and p_i + window_right() therefore never overflow, even for
  // windows at INT64_MAX; a backend that does its own key-range arithmetic (a device kernel, a
  // generated program) takes these instead of problem().window_left/right.
  std::int64_t window_left() const noexcept { return window_left_; }
  std::int64_t window_right() const noexcept { return window_right_; }

 private:
  friend Result<ValidatedProblem> validate(const AttentionProblem& problem);
  ValidatedProblem() = default;

  std::int64_t kv_row(const TensorView& t, std::int32_t b, std::int64_t j) const noexcept;

  AttentionProblem p_;
  ProblemSignature sig_;
  std::int32_t batch_ = 0;
  float scale_ = 1.0f;
  std::int64_t total_q_ = 0;
  std::int64_t max_sq_ = 0;
  std::int64_t max_skv_ = 0;
  std::int64_t dense_sq_ = 0;   // dense q: Sq
  std::int64_t dense_skv_ = 0;  // dense kv: Skv
  std::int64_t window_left_ = -1;
  std::int64_t window_right_ = -1;
  double pairs_ = 0.0;
};

}  // namespace kallpa
