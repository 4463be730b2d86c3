// Tensor views: kallpa never owns caller memory. A view is a pointer, a dtype, a shape and strides
// in elements (not bytes, so a view stays valid when the dtype is known), and the device it lives on.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "kallpa/status.h"

namespace kallpa {

enum class DType : std::uint8_t { f32 = 0, f16 = 1, bf16 = 2 };

std::size_t dtype_size(DType dtype) noexcept;
std::string_view dtype_name(DType dtype) noexcept;
// Parses "f32" / "fp32" / "float32", "f16" / "fp16" / "half", "bf16"; false when unknown.
bool parse_dtype(std::string_view text, DType* out) noexcept;

enum class DeviceKind : std::uint8_t { cpu = 0, cuda = 1, opencl = 2, plugin = 3 };

std::string_view device_kind_name(DeviceKind kind) noexcept;

struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;

  static constexpr Device cpu() { return {DeviceKind::cpu, 0}; }
  friend constexpr bool operator==(const Device&, const Device&) = default;
  std::string to_string() const;  // "cpu", "cuda:1"
};

// Parses "cpu", "cuda", "opencl:1", "plugin:0" (index 0 when absent). parse_error (field "device")
// for an unknown kind or a malformed index, invalid_argument for an index out of [0, 2^20].
Status parse_device(std::string_view text, Device* out);

inline constexpr int kMaxRank = 4;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  int rank = 0;
  std::array<std::int64_t, kMaxRank> shape{};
  std::array<std::int64_t, kMaxRank> stride{};  // in elements
  Device device = Device::cpu();

  bool present() const noexcept { return data != nullptr; }
  std::int64_t numel() const noexcept;
  // True when the last dimension is unit-stride and the others are packed row-major.
  bool is_contiguous() const noexcept;
};

// A row-major contiguous view over `data` with the given shape.
TensorView make_contiguous_view(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                                Device device = Device::cpu());

}  // namespace kallpa
