// Strided element copies between the caller's tensor views and the dense arrays PJRT buffers are
// made from.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace kallpa::pjrt {

// Copies `n` elements of `size` bytes from a strided source to a contiguous destination.
inline void gather_elems(char* dst, const char* src, std::int64_t n, std::int64_t stride, std::size_t size) noexcept {
  if (stride == 1) {
    std::memcpy(dst, src, static_cast<std::size_t>(n) * size);
    return;
  }
  for (std::int64_t i = 0; i < n; ++i)
    std::memcpy(dst + i * static_cast<std::int64_t>(size), src + i * stride * static_cast<std::int64_t>(size), size);
}

// Copies `n` contiguous elements of `size` bytes to a strided destination.
inline void scatter_elems(char* dst, const char* src, std::int64_t n, std::int64_t stride, std::size_t size) noexcept {
  if (stride == 1) {
    std::memcpy(dst, src, static_cast<std::size_t>(n) * size);
    return;
  }
  for (std::int64_t i = 0; i < n; ++i)
    std::memcpy(dst + i * stride * static_cast<std::int64_t>(size), src + i * static_cast<std::int64_t>(size), size);
}

}  // namespace kallpa::pjrt
