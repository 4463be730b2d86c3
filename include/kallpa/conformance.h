// The conformance suite: generated attention problems that every backend must solve like the
// reference (double-precision oracle), with tolerances by dtype, sentinel guard regions around the
// outputs to catch stray writes, and NaN/Inf rules from the contract. It is a product: the
// `kallpa conformance` command and the GoogleTest suite both run it, and so can a plugin's author.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kallpa/attention.h"
#include "kallpa/backend.h"

namespace kallpa::conformance {

// Special inputs that probe the contract's edge rules.
enum class Edge : std::uint8_t {
  none = 0,
  all_masked,        // window/lengths such that some rows see no key: o = 0, lse = -inf
  huge_logits,       // scale ~1e4: softmax saturates; must not overflow to NaN
  neg_inf_keys,      // some keys score -inf (k = -inf against q > 0): they get weight 0
  all_neg_inf_row,   // every visible key scores -inf: o = 0, lse = -inf
  nan_in_q,          // a NaN in one q row: that row's outputs are NaN, others unaffected
  nan_in_masked_kv,  // NaN/Inf stored in keys/values no query can see: no effect
};

struct CaseSpec {
  DType dtype = DType::f32;             // q, k, v and o
  std::vector<std::int32_t> seqlens_q;  // one per sequence (size = batch)
  std::vector<std::int32_t> seqlens_k;
  std::int32_t hq = 1;
  std::int32_t hkv = 1;
  std::int32_t head_dim = 64;
  std::int32_t head_dim_v = 64;
  QLayout q_layout = QLayout::dense;     // dense requires equal seqlens_q
  KvLayout kv_layout = KvLayout::dense;  // dense requires equal seqlens_k
  std::int32_t page_size = 0;            // paged only
  bool permute_blocks = true;            // paged: block table is a random permutation
  bool padded_strides = false;           // non-contiguous views (row padding between heads/tokens)
  std::int32_t q_tail_rows = 0;          // packed q: rows after the last sequence (o there: untouched)
  std::int32_t kv_tail_rows = 0;         // packed kv: rows after the last sequence (never read)
  std::int32_t table_stride_pad = 0;     // paged: block_table_stride - max_blocks_per_seq
  std::int32_t spare_blocks = 2;         // paged: pool blocks no sequence uses (0 + empty seqs: zero blocks)
  bool causal = false;
  std::int64_t window_left = -1;
  std::int64_t window_right = -1;
  float softcap = 0.0f;
  bool alibi = false;
  bool lse = false;
  std::optional<float> scale;
  Edge edge = Edge::none;
  std::uint64_t seed = 0;
  // 0: every output row is judged. N > 0: only N (sequence, query, head) rows, drawn from the seed
  // and always including each sequence's first and last query and the rows where the causal and
  // window bounds start and stop cutting; the reference (AttentionOracle::compute_rows) and the
  // same-dtype yardstick are computed for those rows alone, which is what makes 128k-key cases
  // affordable. Every output element is still checked for having been written.
  std::int32_t sampled_rows = 0;
};

struct Case {
  std::string name;  // unique, stable, human-readable: "f16/d80/sq65_skv129/causal/gqa3/paged7/lse"
  CaseSpec spec;
};

// Tolerances by input dtype; see anchors.md "How we judge numerics".
struct Tolerance {
  double atol;
  double rtol;
  double naive_multiple;  // error may grow to this multiple of same-dtype naive attention's error
};
Tolerance tolerance_for(DType dtype) noexcept;

// How much of the suite to run (docs/conformance.md has what each covers and costs):
//  * quick:  the pairwise covering matrix once, the edge rules, the degenerate shapes and window
//            limits, a few 1k-2k-key cases. For CI under sanitizers.
//  * normal: the matrix in six rounds plus every size-bucket boundary the backends and the
//            dispatcher use (both sides of 1k, 2k, 4k and 8k keys, split/tiling/chunk thresholds),
//            prefill and decode; the large cases judged on sampled rows. `kallpa conformance`'s
//            default and the ctest suite's.
//  * full:   normal plus 32k- and 128k-key decode and paged decode (GQA, windows) and long
//            prefill (4k-8k queries over 32k keys), on sampled rows. Run by hand.
enum class Tier : std::uint8_t { quick = 0, normal = 1, full = 2 };
std::string_view tier_name(Tier tier) noexcept;

// The cases of a tier. Deterministic: the same names, in the same order, with the same data on
// every platform; each tier contains the one below it.
std::vector<Case> generate_cases(Tier tier);
// Kept for callers of the two-tier API: true is Tier::quick, false Tier::normal.
inline std::vector<Case> generate_cases(bool quick) { return generate_cases(quick ? Tier::quick : Tier::normal); }

// The health check's canaries: eight small cases over every dtype and KV layout, GQA, decode,
// Dv != D, softcap + ALiBi, a window, and the edge rules a broken kernel most often breaks (rows
// with no visible key, NaN in masked keys, saturating logits). Deterministic, like the suite.
std::vector<Case> canary_cases();

struct CaseResult {
  std::string backend;
  std::string case_name;
  bool skipped = false;  // backend does not support the case's signature
  std::string skip_reason;
  bool passed = false;
  double max_abs_error = 0.0;  // over o (and lse when requested)
  double allowed_error = 0.0;  // the absolute tolerance o was held to (atol_eff; + rtol * |ref|)
  std::string failure;         // first problem found: element index, values, or the status
  bool lost = false;           // run() returned ErrorCode::backend_lost (status.h)
};

// Builds the case's tensors (inputs, outputs with guard regions), runs `backend` directly (not
// through the dispatcher) and judges it against the reference. A case fails when run() returns an
// error, an input (tensor, index array, slopes) changed, a byte outside o/lse or past the
// workspace changed, an output element was never written, a packed row after the last sequence
// was written, or an element is out of tolerance or breaks the NaN/Inf rules.
// A backend on another device is run on its device: each buffer, guards included, is mirrored
// there through its device_memory() (device.h) and downloaded back before judging, so every check
// above holds on the device too; a device backend without device memory gets the case skipped.
// The reference values come from `oracle`, or when it is null from the global registry's oracle
// (BackendRegistry::oracle()); without one every case fails, saying so.
CaseResult run_case(AttentionBackend& backend, const Case& c, const AttentionOracle* oracle = nullptr);

struct Report {
  std::string backend;
  std::vector<CaseResult> results;
  // A backend lost on a case (CaseResult::lost) runs no later case: its process or a peer is gone,
  // and each further call would fail the same way. not_run counts the cases it was not given.
  std::size_t not_run = 0;
  std::size_t passed() const;
  std::size_t failed() const;
  std::size_t skipped() const;
  double max_abs_error() const;
};

// Runs every case; `progress` (optional) is called after each one.
Report run_suite(AttentionBackend& backend, const std::vector<Case>& cases,
                 const std::function<void(const CaseResult&)>& progress = {}, const AttentionOracle* oracle = nullptr);

// Runs every case on each backend (one Report per backend, in the given order). Each case's inputs
// and double-precision reference are built once and shared by all backends, which is what makes
// running the full matrix over many backends affordable. A lost backend's remaining cases are left
// out (Report::not_run); once every backend is lost the run ends.
std::vector<Report> run_suites(const std::vector<AttentionBackend*>& backends, const std::vector<Case>& cases,
                               const std::function<void(const CaseResult&)>& progress = {},
                               const AttentionOracle* oracle = nullptr);

}  // namespace kallpa::conformance
