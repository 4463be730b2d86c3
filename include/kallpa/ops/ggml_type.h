// ggml tensor types as GGUF files number them, with their block layout (elements per block, bytes
// per block). The table knows every type ggml defines, so that a file's sizes and offsets can be
// validated even for types kallpa cannot compute with; `is_compute_supported` says which ones the
// engine's kernels handle (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K,
// Q6_K, Q8_K, IQ4_NL).
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace kallpa::ops {

enum class GgmlType : std::uint32_t {
  f32 = 0,
  f16 = 1,
  q4_0 = 2,
  q4_1 = 3,
  q5_0 = 6,
  q5_1 = 7,
  q8_0 = 8,
  q8_1 = 9,
  q2_k = 10,
  q3_k = 11,
  q4_k = 12,
  q5_k = 13,
  q6_k = 14,
  q8_k = 15,
  iq2_xxs = 16,
  iq2_xs = 17,
  iq3_xxs = 18,
  iq1_s = 19,
  iq4_nl = 20,
  iq3_s = 21,
  iq2_s = 22,
  iq4_xs = 23,
  i8 = 24,
  i16 = 25,
  i32 = 26,
  i64 = 27,
  f64 = 28,
  iq1_m = 29,
  bf16 = 30,
  tq1_0 = 34,
  tq2_0 = 35,
  mxfp4 = 39,
};

struct GgmlTypeTraits {
  std::string_view name;    // "Q4_1", as ggml and gguf-py spell it
  std::int64_t block_size;  // elements per block (1 for plain types)
  std::int64_t type_size;   // bytes per block
};

// The traits of a raw type id, or nullopt when ggml defines no such type.
std::optional<GgmlTypeTraits> ggml_type_traits(std::uint32_t type) noexcept;
// "Q4_1"; "type#99" style names are not produced: unknown ids give "unknown".
std::string_view ggml_type_name(GgmlType type) noexcept;
// Whether the engine's dequantisation and matmul kernels handle this type.
bool is_compute_supported(GgmlType type) noexcept;
// The names of the types is_compute_supported accepts, comma-separated ("F32, F16, ..."), for
// error messages that list what a tensor could have been.
std::string_view compute_supported_type_names() noexcept;

}  // namespace kallpa::ops
