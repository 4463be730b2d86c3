#include "kallpa/tensor.h"

#include <charconv>
#include <string>

#include <fmt/format.h>

namespace kallpa {

std::size_t dtype_size(DType dtype) noexcept {
  switch (dtype) {
    case DType::f32: return 4;
    case DType::f16: return 2;
    case DType::bf16: return 2;
  }
  return 0;
}

std::string_view dtype_name(DType dtype) noexcept {
  switch (dtype) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
  }
  return "unknown";
}

bool parse_dtype(std::string_view text, DType* out) noexcept {
  if (text == "f32" || text == "fp32" || text == "float32") {
    *out = DType::f32;
  } else if (text == "f16" || text == "fp16" || text == "float16" || text == "half") {
    *out = DType::f16;
  } else if (text == "bf16" || text == "bfloat16") {
    *out = DType::bf16;
  } else {
    return false;
  }
  return true;
}

std::string_view device_kind_name(DeviceKind kind) noexcept {
  switch (kind) {
    case DeviceKind::cpu: return "cpu";
    case DeviceKind::cuda: return "cuda";
    case DeviceKind::opencl: return "opencl";
    case DeviceKind::plugin: return "plugin";
  }
  return "unknown";
}

std::string Device::to_string() const {
  std::string out(device_kind_name(kind));
  if (kind != DeviceKind::cpu || index != 0) {
    out += ':';
    out += std::to_string(index);
  }
  return out;
}

std::int64_t TensorView::numel() const noexcept {
  std::int64_t n = 1;
  for (int i = 0; i < rank; ++i) n *= shape[static_cast<std::size_t>(i)];
  return n;
}

bool TensorView::is_contiguous() const noexcept {
  std::int64_t expected = 1;
  for (int i = rank - 1; i >= 0; --i) {
    const auto d = static_cast<std::size_t>(i);
    if (shape[d] != 1 && stride[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

TensorView make_contiguous_view(void* data, DType dtype, std::initializer_list<std::int64_t> shape, Device device) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  // A rank above kMaxRank is kept as given (only the first dims stored) so validate() refuses it.
  t.rank = static_cast<int>(shape.size());
  std::size_t i = 0;
  for (std::int64_t extent : shape) {
    if (i >= static_cast<std::size_t>(kMaxRank)) break;
    t.shape[i++] = extent;
  }
  if (t.rank > kMaxRank) return t;
  std::int64_t stride = 1;
  for (int d = t.rank - 1; d >= 0; --d) {
    t.stride[static_cast<std::size_t>(d)] = stride;
    stride *= t.shape[static_cast<std::size_t>(d)];
  }
  return t;
}

Status parse_device(std::string_view text, Device* out) {
  const auto colon = text.find(':');
  const std::string_view kind = text.substr(0, colon);
  Device dev;
  if (kind == "cpu") dev.kind = DeviceKind::cpu;
  else if (kind == "cuda") dev.kind = DeviceKind::cuda;
  else if (kind == "opencl") dev.kind = DeviceKind::opencl;
  else if (kind == "plugin") dev.kind = DeviceKind::plugin;
  else return Status(ErrorCode::parse_error, "device", fmt::format("unknown device '{}'", text));
  if (colon != std::string_view::npos) {
    const std::string_view digits = text.substr(colon + 1);
    std::int64_t v = 0;
    const auto [ptr, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), v);
    if (ec == std::errc::result_out_of_range)
      return Status::invalid("device", fmt::format("'{}' is out of range", digits));
    if (ec != std::errc() || ptr != digits.data() + digits.size() || digits.empty()) {
      return Status(ErrorCode::parse_error, "device", fmt::format("'{}' is not an integer", digits));
    }
    constexpr std::int64_t kMaxIndex = 1 << 20;
    if (v < 0 || v > kMaxIndex) {
      return Status::invalid("device", fmt::format("{} is out of range [0, {}]", v, kMaxIndex));
    }
    dev.index = static_cast<int>(v);
  }
  *out = dev;
  return {};
}

}  // namespace kallpa
