// GGUF model files (the llama.cpp ecosystem's format), memory-mapped read-only and validated in full
// before anything is handed out.
//
//   auto file = kallpa::model::GgufFile::open("models/SmolLM2-135M-Instruct.Q4_1.gguf");
//   if (!file) { std::cerr << file.status().to_string() << "\n"; return 1; }
//   auto layers = (*file)->get_u32("llama.block_count");          // Result<std::uint32_t>
//   auto tokens = (*file)->get_string_array("tokenizer.ggml.tokens");
//   auto embd = (*file)->tensor("token_embd.weight");              // Result<const TensorView*>
//
// Versions 2 and 3 are read (little-endian only). Validation covers the magic, version, counts
// against the file size, every string and array length (array nesting at most 16 deep), duplicate
// keys, general.alignment (a power of two, default 32), tensor names (unique), dims (1..4, each
// >= 0, element count and byte size without overflow, ne[0] a multiple of the type's block size),
// known tensor types, and every tensor's data offset (aligned, inside the file, no overlap). A bad
// file yields ErrorCode::parse_error whose field names the place ("header.tensor_count",
// "kv[3].value", "tensor_infos[12].offset") and whose message names the byte offset in the file.
// No read ever goes past the mapping. Everything handed out (string views, tensor data) points into
// the mapping and lives as long as the GgufFile.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kallpa/ops/ggml_type.h"
#include "kallpa/ops/quant.h"
#include "kallpa/status.h"

namespace kallpa::model {

enum class GgufValueType : std::uint32_t {
  u8 = 0,
  i8 = 1,
  u16 = 2,
  i16 = 3,
  u32 = 4,
  i32 = 5,
  f32 = 6,
  boolean = 7,
  string = 8,
  array = 9,
  u64 = 10,
  i64 = 11,
  f64 = 12,
};

// "uint32", "string", "array" ...
std::string_view gguf_value_type_name(GgufValueType type) noexcept;

// One metadata value. Scalars are decoded on access from the mapped bytes; arrays of numbers and
// bools stay in the mapping (read element by element, they may be unaligned); arrays of strings
// are views; arrays of arrays hold their items.
class GgufValue {
 public:
  GgufValueType type() const noexcept { return type_; }
  bool is_array() const noexcept { return type_ == GgufValueType::array; }
  bool is_integer() const noexcept;  // u8..i64 (not bool)
  bool is_float() const noexcept { return type_ == GgufValueType::f32 || type_ == GgufValueType::f64; }

  // Scalars. Each requires the exact type (checked by GgufFile's getters; here it is the caller's
  // job, and a wrong type returns 0 / empty).
  std::uint64_t as_u64() const noexcept;  // any unsigned type, zero-extended
  std::int64_t as_i64() const noexcept;   // any signed type, sign-extended
  double as_f64() const noexcept;         // f32 or f64
  bool as_bool() const noexcept;
  std::string_view as_string() const noexcept { return str_; }

  // Arrays.
  GgufValueType element_type() const noexcept { return elem_type_; }
  std::uint64_t size() const noexcept { return count_; }  // element count (arrays), 1 (scalars)
  std::span<const std::string_view> strings() const noexcept { return strings_; }  // array of string
  std::span<const GgufValue> items() const noexcept { return items_; }             // array of array
  // Raw little-endian element bytes of an array of numbers/bools (size() * element size bytes).
  const std::byte* raw() const noexcept { return raw_; }

  // A readable rendering for diagnostics ("[49152 x string]", "576", "\"llama\"").
  std::string to_string() const;

 private:
  friend class GgufParser;
  GgufValueType type_ = GgufValueType::u8;
  GgufValueType elem_type_ = GgufValueType::u8;
  const std::byte* raw_ = nullptr;  // scalar bytes, or the first element of a numeric array
  std::uint64_t count_ = 1;
  std::string_view str_;
  std::vector<std::string_view> strings_;
  std::vector<GgufValue> items_;
};

struct GgufKeyValue {
  std::string_view key;
  GgufValue value;
  std::uint64_t file_offset = 0;  // where the key/value pair starts in the file
};

// A tensor's info and a view of its data in the mapping.
struct TensorView {
  std::string_view name;
  ops::GgmlType type = ops::GgmlType::f32;
  int n_dims = 0;
  // ggml order: ne[0] is the contiguous dimension (a row's length), ne[1] the number of rows of a
  // matrix; dimensions past n_dims are 1. A GGUF matrix W[n][k] has ne = {k, n, 1, 1}.
  std::array<std::int64_t, 4> ne{1, 1, 1, 1};
  const void* data = nullptr;  // aligned to the file's alignment
  std::uint64_t nbytes = 0;
  std::uint64_t offset = 0;       // relative to the data section, as stored in the file
  std::uint64_t file_offset = 0;  // absolute byte offset of the data in the file

  std::int64_t nelements() const noexcept { return ne[0] * ne[1] * ne[2] * ne[3]; }
  std::int64_t nrows() const noexcept { return ne[1] * ne[2] * ne[3]; }
  std::uint64_t row_bytes() const noexcept { return nrows() == 0 ? 0 : nbytes / static_cast<std::uint64_t>(nrows()); }
  // "[576, 49152]"
  std::string shape_string() const;
};

// The 2-D view of a tensor (ne = {cols, rows}); invalid_argument (field = tensor name) if it has
// more than two non-trivial dims, unsupported if its type has no kernels.
Result<ops::WeightMatrix> as_weight_matrix(const TensorView& t);

class GgufFile {
 public:
  // Maps and validates a file. Errors: not_found (no such file), invalid_argument (not a regular
  // file, empty), internal (I/O), parse_error (the file is malformed; field and byte offset named).
  static Result<std::shared_ptr<const GgufFile>> open(const std::string& path);
  // Validates a copy of an in-memory image (tests, tools). The copy is 64-byte aligned.
  static Result<std::shared_ptr<const GgufFile>> from_bytes(std::span<const std::byte> bytes,
                                                            std::string name = "<memory>");

  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  const std::string& path() const noexcept { return path_; }
  std::uint32_t version() const noexcept { return version_; }
  std::uint64_t alignment() const noexcept { return alignment_; }
  std::uint64_t data_offset() const noexcept { return data_offset_; }  // start of the data section
  std::uint64_t file_size() const noexcept { return size_; }
  const std::byte* base() const noexcept { return base_; }
  // True when the data is a read-only mapping of a file (open()), whose pages can be dropped and
  // read back; false for from_bytes()'s heap copy.
  bool file_backed() const noexcept { return map_ != nullptr; }

  // Metadata in file order.
  const std::vector<GgufKeyValue>& metadata() const noexcept { return kvs_; }
  const GgufValue* find(std::string_view key) const noexcept;
  bool has(std::string_view key) const noexcept { return find(key) != nullptr; }
  // not_found (field = key) when absent.
  Result<const GgufValue*> get(std::string_view key) const;

  // Typed getters: not_found (field = key) when absent, invalid_argument (field = key) when the
  // stored type is not exactly the requested one.
  Result<std::uint8_t> get_u8(std::string_view key) const;
  Result<std::int8_t> get_i8(std::string_view key) const;
  Result<std::uint16_t> get_u16(std::string_view key) const;
  Result<std::int16_t> get_i16(std::string_view key) const;
  Result<std::uint32_t> get_u32(std::string_view key) const;
  Result<std::int32_t> get_i32(std::string_view key) const;
  Result<std::uint64_t> get_u64(std::string_view key) const;
  Result<std::int64_t> get_i64(std::string_view key) const;
  Result<float> get_f32(std::string_view key) const;
  Result<double> get_f64(std::string_view key) const;
  Result<bool> get_bool(std::string_view key) const;
  Result<std::string_view> get_string(std::string_view key) const;
  // Lenient: any integer type whose value is >= 0 (and fits), resp. any float type.
  Result<std::uint64_t> get_uint(std::string_view key) const;
  Result<double> get_float(std::string_view key) const;

  // Arrays: any array (the value), an array of strings, or a copy of an array of numbers whose
  // element type is exactly T (T one of uint8..int64, float, double, bool).
  Result<const GgufValue*> get_array(std::string_view key) const;
  Result<std::span<const std::string_view>> get_string_array(std::string_view key) const;
  template <typename T>
  Result<std::vector<T>> get_numeric_array(std::string_view key) const;

  // Tensors in file order, and by name.
  const std::vector<TensorView>& tensors() const noexcept { return tensors_; }
  const TensorView* find_tensor(std::string_view name) const noexcept;
  // not_found (field = name) when absent.
  Result<const TensorView*> tensor(std::string_view name) const;

 private:
  friend class GgufParser;
  GgufFile() = default;

  std::string path_;
  const std::byte* base_ = nullptr;
  std::uint64_t size_ = 0;
  void* map_ = nullptr;         // mmap'd region (open), or nullptr
  std::byte* owned_ = nullptr;  // aligned heap copy (from_bytes), or nullptr

  std::uint32_t version_ = 0;
  std::uint64_t alignment_ = 32;
  std::uint64_t data_offset_ = 0;
  std::vector<GgufKeyValue> kvs_;
  std::vector<TensorView> tensors_;
  std::unordered_map<std::string_view, std::size_t> kv_index_;
  std::unordered_map<std::string_view, std::size_t> tensor_index_;
};

}  // namespace kallpa::model
