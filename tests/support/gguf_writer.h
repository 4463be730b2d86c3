// A small GGUF writer (version 3 by default): builds a complete file image in memory. Used by the
// tests to make synthetic models and corrupt variants of them (layout() tells where every field
// sits, for byte-level surgery), and by tools that need a GGUF without Python.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "kallpa/model/gguf.h"
#include "kallpa/ops/ggml_type.h"
#include "kallpa/status.h"

namespace kallpa::model {

class GgufWriter {
 public:
  struct TensorLayout {
    std::uint64_t info_at = 0;  // start of the tensor info (name length)
    std::uint64_t n_dims_at = 0;
    std::uint64_t dims_at = 0;  // first dimension
    std::uint64_t type_at = 0;
    std::uint64_t offset_at = 0;  // the uint64 data offset field
    std::uint64_t data_at = 0;    // absolute position of the data
  };
  struct Layout {
    std::uint64_t version_at = 4, tensor_count_at = 8, kv_count_at = 16;
    std::vector<std::uint64_t> kv_at;        // start of each key/value pair (key length)
    std::vector<std::uint64_t> kv_value_at;  // start of each value (after its type)
    std::vector<TensorLayout> tensors;
    std::uint64_t data_at = 0;  // start of the data section
  };

  explicit GgufWriter(std::uint32_t version = 3) : version_(version) {}

  // Alignment of the data section and of every tensor (default 32). When not 32 the caller should
  // also add "general.alignment" (u32) so that readers agree; set_alignment does not add it.
  void set_alignment(std::uint64_t alignment) { alignment_ = alignment; }

  // Metadata. Scalars and arrays of numbers take the GGUF type from T.
  void add_u8(std::string_view key, std::uint8_t v) { add_scalar(key, GgufValueType::u8, v); }
  void add_i8(std::string_view key, std::int8_t v) { add_scalar(key, GgufValueType::i8, v); }
  void add_u16(std::string_view key, std::uint16_t v) { add_scalar(key, GgufValueType::u16, v); }
  void add_i16(std::string_view key, std::int16_t v) { add_scalar(key, GgufValueType::i16, v); }
  void add_u32(std::string_view key, std::uint32_t v) { add_scalar(key, GgufValueType::u32, v); }
  void add_i32(std::string_view key, std::int32_t v) { add_scalar(key, GgufValueType::i32, v); }
  void add_u64(std::string_view key, std::uint64_t v) { add_scalar(key, GgufValueType::u64, v); }
  void add_i64(std::string_view key, std::int64_t v) { add_scalar(key, GgufValueType::i64, v); }
  void add_f32(std::string_view key, float v) { add_scalar(key, GgufValueType::f32, v); }
  void add_f64(std::string_view key, double v) { add_scalar(key, GgufValueType::f64, v); }
  void add_bool(std::string_view key, bool v) { add_scalar(key, GgufValueType::boolean, static_cast<std::uint8_t>(v)); }
  void add_string(std::string_view key, std::string_view v);
  void add_string_array(std::string_view key, const std::vector<std::string>& v);
  template <typename T>
  void add_array(std::string_view key, GgufValueType elem, const std::vector<T>& v) {
    std::vector<std::byte> raw;
    put(raw, static_cast<std::uint32_t>(elem));
    put(raw, static_cast<std::uint64_t>(v.size()));
    for (const T& x : v) put(raw, x);
    add_raw(key, GgufValueType::array, raw);
  }
  // A value already encoded (everything after the type field), e.g. nested arrays.
  void add_raw(std::string_view key, GgufValueType type, std::vector<std::byte> value_bytes);

  // Tensors: ne in ggml order (ne[0] contiguous); data must be exactly the tensor's byte size for
  // known types (other bytes are accepted as given, for corrupt fixtures).
  void add_tensor(std::string_view name, std::uint32_t type, std::vector<std::int64_t> ne, std::vector<std::byte> data);
  void add_tensor(std::string_view name, ops::GgmlType type, std::vector<std::int64_t> ne,
                  std::vector<std::byte> data) {
    add_tensor(name, static_cast<std::uint32_t>(type), std::move(ne), std::move(data));
  }

  // Removes a key / tensor added earlier (fixtures missing something); false if absent.
  bool remove_kv(std::string_view key);
  bool remove_tensor(std::string_view name);
  // Replaces a tensor's type, shape and data (fixtures with a wrong shape or type).
  bool replace_tensor(std::string_view name, std::uint32_t type, std::vector<std::int64_t> ne,
                      std::vector<std::byte> data);

  // The whole file image, and where each field went.
  std::vector<std::byte> finish(Layout* layout = nullptr) const;
  Status write_file(const std::string& path) const;

  // Encoding helpers (little-endian), public for tests building raw values.
  template <typename T>
  static void put(std::vector<std::byte>& out, const T& v) {
    const std::size_t at = out.size();
    out.resize(at + sizeof(T));
    std::memcpy(out.data() + at, &v, sizeof(T));
  }
  static void put_string(std::vector<std::byte>& out, std::string_view s);

 private:
  template <typename T>
  void add_scalar(std::string_view key, GgufValueType type, T v) {
    std::vector<std::byte> raw;
    put(raw, v);
    add_raw(key, type, std::move(raw));
  }

  struct Kv {
    std::string key;
    GgufValueType type;
    std::vector<std::byte> value;
  };
  struct Tensor {
    std::string name;
    std::uint32_t type;
    std::vector<std::int64_t> ne;
    std::vector<std::byte> data;
  };
  std::uint32_t version_;
  std::uint64_t alignment_ = 32;
  std::vector<Kv> kvs_;
  std::vector<Tensor> tensors_;
};

}  // namespace kallpa::model
