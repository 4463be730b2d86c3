// Dequantisation of rows to f32 (embedding lookup, tests, tools).
#include <cstring>
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
  if (kernels::is_block_dequant(type) && kernels::avx2_available()) {
    kernels::dequant_blocks_avx2(type)(static_cast<const std::byte*>(src), dst, n / traits->block_size);
  } else {
    kernels::dequantize_row_scalar(type, src, dst, n);
  }
  return {};
}

namespace {

// Where a block type keeps its scales: up to two f16 fields (d, then dmin or m), or Q8_K's f32 d.
struct ScaleFields {
  std::size_t at[2];
  const char* name[2];
  int count;
  bool f32;
};
ScaleFields scale_fields(GgmlType type) noexcept {
  switch (type) {
    case GgmlType::q8_0:
    case GgmlType::q4_0:
    case GgmlType::q5_0:
    case GgmlType::iq4_nl: return {{0, 0}, {"d", ""}, 1, false};
    case GgmlType::q4_1:
    case GgmlType::q5_1: return {{0, 2}, {"d", "m"}, 2, false};
    case GgmlType::q4_k:
    case GgmlType::q5_k: return {{0, 2}, {"d", "dmin"}, 2, false};
    case GgmlType::q2_k: return {{80, 82}, {"d", "dmin"}, 2, false};
    case GgmlType::q3_k: return {{108, 0}, {"d", ""}, 1, false};
    case GgmlType::q6_k: return {{208, 0}, {"d", ""}, 1, false};
    case GgmlType::q8_k: return {{0, 0}, {"d", ""}, 1, true};
    default: return {{0, 0}, {"", ""}, 0, false};
  }
}

}  // namespace

Status check_block_scales(GgmlType type, const void* data, std::uint64_t bytes) {
  const auto traits = ggml_type_traits(static_cast<std::uint32_t>(type));
  if (!traits) return {ErrorCode::unsupported, "type", fmt::format("unknown ggml type {}", static_cast<int>(type))};
  const auto block = static_cast<std::uint64_t>(traits->type_size);
  if (bytes % block != 0) {
    return {ErrorCode::invalid_argument, "bytes",
            fmt::format("{} bytes is not a whole number of {} blocks ({} bytes each)", bytes, traits->name, block)};
  }
  const ScaleFields f = scale_fields(type);
  if (f.count == 0) return {};
  const auto* p = static_cast<const std::byte*>(data);
  for (std::uint64_t b = 0; b < bytes / block; ++b) {
    for (int i = 0; i < f.count; ++i) {
      const std::byte* at = p + b * block + f.at[i];
      bool finite;
      std::uint32_t raw;
      if (f.f32) {
        std::memcpy(&raw, at, 4);
        finite = (raw & 0x7f800000u) != 0x7f800000u;
      } else {
        std::uint16_t h;
        std::memcpy(&h, at, 2);
        raw = h;
        finite = (h & 0x7c00u) != 0x7c00u;
      }
      if (!finite) {
        return {ErrorCode::invalid_argument, "data",
                fmt::format("{} block {} (byte {}) has a non-finite scale {} ({} bits 0x{:x})", traits->name, b,
                            b * block + f.at[i], f.name[i], f.f32 ? "f32" : "f16", raw)};
      }
    }
  }
  return {};
}

Status quantize_row(GgmlType type, const float* src, void* dst, std::int64_t n) {
  if (!is_compute_supported(type) || kernels::is_block_dequant(type)) {
    return {ErrorCode::unsupported, "type",
            fmt::format("cannot quantise to {} (kallpa quantises to F32, F16, BF16, Q8_0, Q4_0, Q4_1)",
                        ggml_type_name(type))};
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
