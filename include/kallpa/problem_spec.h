// A compact text form of an attention problem, for the command line and benchmarks:
//
//   b=1,sq=4096,skv=4096,hq=32,hkv=8,d=128,causal,dtype=bf16
//
// Keys: b, sq, skv, hq, hkv (default hq), d, dv (default d), dtype (q/k/v/o; default f32),
// kv_dtype (default dtype), q=dense|packed, kv=dense|packed|paged, page (paged; default 16),
// causal, window=L:R (either side may be -1), softcap=F, alibi, lse, scale=F, device=cpu|cuda:N|...
// Flags (causal, alibi, lse) may also be written flag=0|1.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "kallpa/attention.h"
#include "kallpa/status.h"

namespace kallpa {

struct ProblemSpec {
  std::int64_t batch = 1;
  std::int64_t seqlen_q = 1;
  std::int64_t seqlen_k = 1;
  std::int32_t hq = 1;
  std::int32_t hkv = 0;  // 0: same as hq
  std::int32_t head_dim = 64;
  std::int32_t head_dim_v = 0;  // 0: same as head_dim
  DType dtype = DType::f32;
  std::optional<DType> kv_dtype;
  QLayout q_layout = QLayout::dense;
  KvLayout kv_layout = KvLayout::dense;
  std::int32_t page_size = 16;
  bool causal = false;
  std::int64_t window_left = -1;
  std::int64_t window_right = -1;
  float softcap = 0.0f;
  bool alibi = false;
  bool lse = false;
  std::optional<float> scale;
  Device device = Device::cpu();

  std::int32_t effective_hkv() const noexcept { return hkv ? hkv : hq; }
  std::int32_t effective_dv() const noexcept { return head_dim_v ? head_dim_v : head_dim; }
  DType effective_kv_dtype() const noexcept { return kv_dtype.value_or(dtype); }
  ProblemSignature signature() const;
  std::string to_string() const;  // canonical spec text; parse_problem_spec(to_string()) round-trips
};

// Errors are parse_error (unknown key, bad number, duplicate key, missing '=') or invalid_argument
// (a value out of range, hq not a multiple of hkv); the field names the key.
Result<ProblemSpec> parse_problem_spec(std::string_view text);

}  // namespace kallpa
