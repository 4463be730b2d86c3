// A safetensors file (Hugging Face's weight format), mapped read-only: an 8-byte little-endian
// header length, a JSON header naming each tensor's dtype, shape and byte range, then the bytes.
//
// open() checks everything a reader relies on before handing out a byte: the header length fits
// the file, the header is a JSON object, every tensor has a known dtype, a shape of non-negative
// dimensions and a byte range inside the data whose size is exactly the shape's, and no two
// tensors overlap. A malformed file gets parse_error naming the tensor and the field.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kallpa/status.h"

namespace kallpa::model {

enum class SafetensorsDType : std::uint8_t { f32, f16, bf16, f64, i64, i32, i16, i8, u8, boolean };

std::string_view safetensors_dtype_name(SafetensorsDType dtype) noexcept;
std::size_t safetensors_dtype_size(SafetensorsDType dtype) noexcept;

struct SafetensorsTensor {
  std::string name;
  SafetensorsDType dtype = SafetensorsDType::f32;
  std::vector<std::int64_t> shape;
  const std::byte* data = nullptr;
  std::uint64_t bytes = 0;
  std::int64_t elements() const noexcept;
};

class SafetensorsFile {
 public:
  // not_found when the path does not exist; parse_error (field: the tensor, or "header") for a
  // malformed file.
  static Result<std::shared_ptr<const SafetensorsFile>> open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const noexcept { return path_; }
  const SafetensorsTensor* find(std::string_view name) const noexcept;
  const std::map<std::string, SafetensorsTensor, std::less<>>& tensors() const noexcept { return tensors_; }
  // The header's "__metadata__" strings (empty when it has none).
  const std::map<std::string, std::string, std::less<>>& metadata() const noexcept { return metadata_; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* map_ = nullptr;
  std::uint64_t size_ = 0;
  std::map<std::string, SafetensorsTensor, std::less<>> tensors_;
  std::map<std::string, std::string, std::less<>> metadata_;
};

}  // namespace kallpa::model
