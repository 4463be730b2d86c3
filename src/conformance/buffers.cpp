#include "conformance/buffers.h"

#include <bit>
#include <cstring>
#include <new>

#include <fmt/format.h>

#include "kallpa/half.h"

namespace kallpa::conformance::detail {

double load_element(const void* base, DType dtype, std::int64_t index) noexcept {
  switch (dtype) {
    case DType::f32: return static_cast<const float*>(base)[index];
    case DType::f16: return f16_to_f32(static_cast<const std::uint16_t*>(base)[index]);
    case DType::bf16: return bf16_to_f32(static_cast<const std::uint16_t*>(base)[index]);
  }
  return 0.0;
}

void store_element(void* base, DType dtype, std::int64_t index, float value) noexcept {
  switch (dtype) {
    case DType::f32: static_cast<float*>(base)[index] = value; break;
    case DType::f16: static_cast<std::uint16_t*>(base)[index] = f32_to_f16(value); break;
    case DType::bf16: static_cast<std::uint16_t*>(base)[index] = f32_to_bf16(value); break;
  }
}

std::uint32_t element_bits(const void* base, DType dtype, std::int64_t index) noexcept {
  if (dtype == DType::f32) return static_cast<const std::uint32_t*>(base)[index];
  return static_cast<const std::uint16_t*>(base)[index];
}

void store_element_bits(void* base, DType dtype, std::int64_t index, std::uint32_t bits) noexcept {
  if (dtype == DType::f32) {
    static_cast<std::uint32_t*>(base)[index] = bits;
  } else {
    static_cast<std::uint16_t*>(base)[index] = static_cast<std::uint16_t>(bits);
  }
}

float round_to(DType dtype, float value) noexcept {
  switch (dtype) {
    case DType::f32: return value;
    case DType::f16: return f16_to_f32(f32_to_f16(value));
    case DType::bf16: return bf16_to_f32(f32_to_bf16(value));
  }
  return value;
}

std::uint32_t poison_bits(DType dtype) noexcept {
  switch (dtype) {
    case DType::f32: return 0x7fe5a5a5u;
    case DType::f16: return 0x7e5au;
    case DType::bf16: return 0x7fe5u;
  }
  return 0;
}

std::uint32_t quiet_nan_bits(DType dtype) noexcept {
  switch (dtype) {
    case DType::f32: return 0x7fc00000u;
    case DType::f16: return 0x7e00u;
    case DType::bf16: return 0x7fc0u;
  }
  return 0;
}

void GuardedBuffer::Free::operator()(std::byte* p) const noexcept { ::operator delete[](p, std::align_val_t{64}); }

GuardedBuffer::GuardedBuffer(DType dtype, int rank, const std::array<std::int64_t, kMaxRank>& shape,
                             const std::array<std::int64_t, kMaxRank>& stride)
    : dtype_(dtype), rank_(rank), shape_(shape), stride_(stride), esize_(dtype_size(dtype)) {
  bool empty = false;
  std::int64_t last = 0;
  for (int d = 0; d < rank; ++d) {
    const auto u = static_cast<std::size_t>(d);
    if (shape[u] == 0) empty = true;
    last += (shape[u] - 1) * stride[u];
  }
  span_ = empty ? 0 : last + 1;
  is_element_.assign(static_cast<std::size_t>(span_), 0);
  if (!empty) {
    // Odometer over the multi-index: views here have at most a few million elements.
    std::array<std::int64_t, kMaxRank> idx{};
    std::int64_t offset = 0;
    for (;;) {
      is_element_[static_cast<std::size_t>(offset)] = 1;
      int d = rank - 1;
      for (; d >= 0; --d) {
        const auto u = static_cast<std::size_t>(d);
        if (++idx[u] < shape[u]) {
          offset += stride[u];
          break;
        }
        offset -= (shape[u] - 1) * stride[u];
        idx[u] = 0;
      }
      if (d < 0) break;
    }
  }
  bytes_ = 2 * kGuardBytes + static_cast<std::size_t>(span_) * esize_;
  storage_.reset(static_cast<std::byte*>(::operator new[](bytes_, std::align_val_t{64})));
  data_ = storage_.get() + kGuardBytes;
}

TensorView GuardedBuffer::view() const noexcept {
  TensorView t;
  t.data = data_;
  t.dtype = dtype_;
  t.rank = rank_;
  t.shape = shape_;
  t.stride = stride_;
  return t;
}

std::byte GuardedBuffer::pattern(std::size_t position) noexcept {
  // Position-dependent, so that even a copy of one guard byte onto another is seen.
  return static_cast<std::byte>(0xa5u ^ ((position * 0x3bu) & 0xffu));
}

void GuardedBuffer::reset_output(std::uint32_t element_bits_value) noexcept {
  std::byte* p = storage_.get();
  for (std::size_t i = 0; i < bytes_; ++i) p[i] = pattern(i);
  for (std::int64_t e = 0; e < span_; ++e) {
    if (is_element_[static_cast<std::size_t>(e)]) store_element_bits(data_, dtype_, e, element_bits_value);
  }
}

void GuardedBuffer::fill_outside_with_nan() noexcept {
  // The guards are whole elements because kGuardBytes is a multiple of every element size.
  const std::uint32_t nan = quiet_nan_bits(dtype_);
  const auto guard_elems = static_cast<std::int64_t>(kGuardBytes / esize_);
  for (std::int64_t e = -guard_elems; e < span_ + guard_elems; ++e) {
    if (e < 0 || e >= span_ || !is_element_[static_cast<std::size_t>(e)]) {
      store_element_bits(data_, dtype_, e, nan);
    }
  }
}

std::string GuardedBuffer::describe_byte(std::size_t position) const {
  const std::size_t view_end = kGuardBytes + static_cast<std::size_t>(span_) * esize_;
  if (position < kGuardBytes) {
    return fmt::format("guard before the view, {} bytes before its start", kGuardBytes - position);
  }
  if (position >= view_end) {
    return fmt::format("guard after the view, {} bytes past its last element (element +{})", position - view_end,
                       (position - view_end) / esize_);
  }
  return fmt::format("stride gap at element offset {} (padding between rows/heads)", (position - kGuardBytes) / esize_);
}

std::optional<std::string> GuardedBuffer::find_stray_write() const {
  const std::byte* p = storage_.get();
  for (std::size_t i = 0; i < bytes_; ++i) {
    if (i >= kGuardBytes) {
      const std::size_t e = (i - kGuardBytes) / esize_;
      if (e < static_cast<std::size_t>(span_) && is_element_[e]) continue;
    }
    if (p[i] != pattern(i)) return describe_byte(i);
  }
  return std::nullopt;
}

std::vector<std::byte> GuardedBuffer::snapshot() const { return {storage_.get(), storage_.get() + bytes_}; }

void GuardedBuffer::restore(const std::vector<std::byte>& before) noexcept {
  if (before.size() == bytes_) std::memcpy(storage_.get(), before.data(), bytes_);
}

std::optional<std::string> GuardedBuffer::find_change(const std::vector<std::byte>& before) const {
  const std::byte* p = storage_.get();
  if (before.size() != bytes_ || std::memcmp(p, before.data(), bytes_) == 0) return std::nullopt;
  for (std::size_t i = 0; i < bytes_; ++i) {
    if (p[i] != before[i]) {
      if (i >= kGuardBytes && i < kGuardBytes + static_cast<std::size_t>(span_) * esize_ &&
          is_element_[(i - kGuardBytes) / esize_]) {
        return fmt::format("element offset {}", (i - kGuardBytes) / esize_);
      }
      return describe_byte(i);
    }
  }
  return std::nullopt;
}

}  // namespace kallpa::conformance::detail
