// The attention contract as a StableHLO program (MLIR text), for any PJRT compiler to compile.
// A pure function of a ProgramSpec: no plugin, no I/O, so every feature's text is unit-tested.
//
// The program sees a padded dense batch (the host packs varlen rows into it) or, for paged KV, the
// pages and the block table themselves, with each sequence's true lengths as inputs; everything
// past a length is masked in the program. Arguments, in order:
//
//   q        [B, S, Hq, D]     in_dtype
//   k        [B, N, Hkv, D]    kv_dtype      paged: [blocks, page, Hkv, D]
//   v        [B, N, Hkv, Dv]   kv_dtype      paged: [blocks, page, Hkv, Dv]
//   seqlen_q [B] i32, seqlen_k [B] i32
//   scale, softcap: f32 scalars; window_left, window_right: i32 scalars (>= 0; "unbounded" is a
//     bound past any position)
//   block_table [B, max_blocks] i32   (paged only)
//   alibi_slopes [Hq] f32             (alibi only)
//
// Results: o [B, S, Hq, Dv] in out_dtype, then lse [B, Hq, S] f32 when asked for.
//
// The keys are walked `chunk` at a time in a stablehlo.while loop that carries the running max,
// sum and f32 accumulator of every query row (online softmax), so the compiled program's temporary
// memory grows with the chunk, not with N. Paged KV is gathered over the block table inside the
// loop, one chunk of blocks per step. Scores and softmax are f32 whatever the input dtype.
#pragma once

#include <cstdint>
#include <string>

#include "kallpa/status.h"
#include "kallpa/tensor.h"

namespace kallpa::pjrt {

struct ProgramSpec {
  DType in_dtype = DType::f32;   // q
  DType kv_dtype = DType::f32;   // k, v
  DType out_dtype = DType::f32;  // o
  std::int64_t batch = 1;        // B
  std::int64_t seq_q = 1;        // S
  std::int64_t hq = 1;
  std::int64_t hkv = 1;
  std::int64_t head_dim = 1;    // D
  std::int64_t head_dim_v = 1;  // Dv
  // Dense: keys per sequence (N). Paged: the key span of one block-table row, max_blocks * page.
  std::int64_t seq_k = 1;
  bool paged = false;
  std::int64_t num_blocks = 0;  // paged: blocks in the k/v page arrays
  std::int64_t page_size = 0;   // paged
  std::int64_t chunk = 1;       // keys per loop step; divides seq_k (paged: a multiple of page_size)
  bool causal = false;
  bool window = false;
  bool softcap = false;
  bool alibi = false;
  bool lse = false;

  std::int64_t max_blocks() const noexcept { return paged && page_size > 0 ? seq_k / page_size : 0; }
  // Compact and unique per program text: the executable cache's key.
  std::string key() const;
};

// invalid_argument naming the field when the spec cannot describe a program (a non-positive
// extent, hq not a multiple of hkv, a chunk that does not divide the keys, ...).
Status check_spec(const ProgramSpec& spec);

// The program's MLIR text; check_spec(spec) must hold.
std::string attention_program(const ProgramSpec& spec);

// The program that writes changed pages into the device's copy of a paged K/V pool (the backend's
// KV mirror), so that a decode step uploads the pages written since the last step, not the pool.
// Arguments, in order:
//
//   k_pool  [blocks, page, Hkv, D]   kv_dtype   donated: result 0 aliases it
//   v_pool  [blocks, page, Hkv, Dv]  kv_dtype   donated: result 1 aliases it
//   k_pages [n, page, Hkv, D], v_pages [n, page, Hkv, Dv]   kv_dtype
//   index   [n, 1] i32: the block page i goes to, in [0, blocks)
//
// Results: the two pools with the pages written. The caller pads n to a bucket by repeating a
// page and its index (a scatter writing identical bytes twice), never with an index out of range,
// whose handling StableHLO leaves to the implementation.
struct PageUpdateSpec {
  DType kv_dtype = DType::f32;
  std::int64_t num_blocks = 1;
  std::int64_t page_size = 1;
  std::int64_t hkv = 1;
  std::int64_t head_dim = 1;
  std::int64_t head_dim_v = 1;
  std::int64_t pages = 1;  // n

  std::string key() const;
  std::string zeros_key() const;  // pool_zeros_program's (pages plays no part in it)
};

Status check_spec(const PageUpdateSpec& spec);
std::string page_update_program(const PageUpdateSpec& spec);
// A program with no arguments whose results are the two pools, zero: how a mirror starts on the
// device without a pool's worth of zeros crossing from the host.
std::string pool_zeros_program(const PageUpdateSpec& spec);

}  // namespace kallpa::pjrt
