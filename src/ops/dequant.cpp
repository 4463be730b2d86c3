// Dequantisation of rows to f32 (embedding lookup, tests, tools).
#include <vector>

#include <fmt/format.h>

#include "kallpa/ops/quant.h"
#include "ops/quant_kernels.h"

namespace kallpa::ops {

std::uint64_t row_size(GgmlType type, std::int64_t cols) noexcept {
  const auto traits = ggml_type_traits(static_cast<std::uint32_t>(type));
  if (!traits || cols < 0 || cols % traits->block_size != 0) return 0;
  return static_cast<std::uint64_t>(cols / traits->block_size) * static_cast<std::uint64_t>(traits->type_size);
}

Status dequantize_row(GgmlType type, const void* src, float* dst, std::int64_t n) {
  if (!is_compute_supported(type)) {
    return {ErrorCode::unsupported, "type", fmt::format("cannot dequantise {}", ggml_type_name(type))};
  }
  const auto traits = ggml_type_traits(static_cast<std::uint32_t>(type));
  if (n < 0 || n % traits->block_size != 0) {
    return {ErrorCode::invalid_argument, "n",
            fmt::format("{} elements is not a multiple of {}'s block size {}", n, traits->name, traits->block_size)};
  }
  kernels::dequantize_row_scalar(type, src, dst, n);
  return {};
}

Status quantize_row(GgmlType type, const float* src, void* dst, std::int64_t n) {
  if (!is_compute_supported(type)) {
    return {ErrorCode::unsupported, "type", fmt::format("cannot quantise to {}", ggml_type_name(type))};
  }
  const auto traits = ggml_type_traits(static_cast<std::uint32_t>(type));
  if (n < 0 || n % traits->block_size != 0) {
    return {ErrorCode::invalid_argument, "n",
            fmt::format("{} elements is not a multiple of {}'s block size {}", n, traits->name, traits->block_size)};
  }
  if ((type == GgmlType::f16 || type == GgmlType::bf16) && kernels::avx2_available()) {
    kernels::convert_row_half_avx2(type, src, static_cast<std::uint16_t*>(dst), n);
  } else {
    kernels::quantize_row_scalar(type, src, dst, n);
  }
  return {};
}

Status dequantize_rows(const WeightMatrix& w, std::int64_t first, std::int64_t count, float* dst) {
  if (first < 0 || count < 0 || first > w.rows || count > w.rows - first) {
    return {ErrorCode::invalid_argument, "rows",
            fmt::format("rows [{}, {}) out of range for a matrix of {} rows", first, first + count, w.rows)};
  }
  if (w.layout == WeightLayout::rows4 && !kernels::is_quantized(w.type)) {
    return {ErrorCode::invalid_argument, "w.layout", "the rows4 layout needs a quantised type"};
  }
  std::vector<std::byte> row(w.layout == WeightLayout::rows4 ? w.row_bytes : 0);
  for (std::int64_t r = 0; r < count; ++r) {
    const auto* src = static_cast<const std::byte*>(w.data) + static_cast<std::size_t>(first + r) * w.row_bytes;
    if (w.layout == WeightLayout::rows4) {
      kernels::load_row_ggml(w.type, w.layout, static_cast<const std::byte*>(w.data), w.row_bytes, first + r, w.cols,
                             row.data());
      src = row.data();
    }
    Status st = dequantize_row(w.type, src, dst + r * w.cols, w.cols);
    if (!st) return st;
  }
  return {};
}

}  // namespace kallpa::ops
