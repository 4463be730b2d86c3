#include "core/plugin_wire.h"

#include <cstring>

#include <unistd.h>

#include "kallpa/device.h"

namespace kallpa::detail::wire {

void copy_elements(const TensorView& from, const TensorView& to) noexcept {
  if (from.rank == 0 || view_byte_extent(from).second == 0) return;
  const std::size_t size = dtype_size(from.dtype);
  const int rank = from.rank;
  std::array<std::int64_t, kMaxRank> shape{1, 1, 1, 1}, sf{0, 0, 0, 0}, st{0, 0, 0, 0};
  // Right-align into four dimensions; the last one is the inner loop.
  for (int d = 0; d < rank; ++d) {
    const auto at = static_cast<std::size_t>(kMaxRank - rank + d);
    shape[at] = from.shape[static_cast<std::size_t>(d)];
    sf[at] = from.stride[static_cast<std::size_t>(d)];
    st[at] = to.stride[static_cast<std::size_t>(d)];
  }
  const auto* src = static_cast<const unsigned char*>(from.data);
  auto* dst = static_cast<unsigned char*>(to.data);
  const bool rows = sf[3] == 1 && st[3] == 1;
  for (std::int64_t a = 0; a < shape[0]; ++a) {
    for (std::int64_t b = 0; b < shape[1]; ++b) {
      for (std::int64_t c = 0; c < shape[2]; ++c) {
        const std::int64_t f = a * sf[0] + b * sf[1] + c * sf[2];
        const std::int64_t t = a * st[0] + b * st[1] + c * st[2];
        if (rows) {
          std::memcpy(dst + static_cast<std::size_t>(t) * size, src + static_cast<std::size_t>(f) * size,
                      static_cast<std::size_t>(shape[3]) * size);
          continue;
        }
        for (std::int64_t e = 0; e < shape[3]; ++e) {
          std::memcpy(dst + static_cast<std::size_t>(t + e * st[3]) * size,
                      src + static_cast<std::size_t>(f + e * sf[3]) * size, size);
        }
      }
    }
  }
}

std::int64_t page_bytes() noexcept {
  static const std::int64_t page = sysconf(_SC_PAGESIZE);
  return page;
}

Tensor describe(const TensorView& t, std::int64_t offset) noexcept {
  Tensor w;
  w.offset = offset;
  w.rank = t.rank;
  w.dtype = static_cast<std::int32_t>(t.dtype);
  for (int d = 0; d < kMaxRank; ++d) {
    w.shape[d] = t.shape[static_cast<std::size_t>(d)];
    w.stride[d] = t.stride[static_cast<std::size_t>(d)];
  }
  return w;
}

TensorView view_in_arena(const Tensor& t, unsigned char* arena_base) noexcept {
  TensorView v;
  if (t.offset < 0) return v;
  v.data = arena_base + t.offset;
  v.dtype = static_cast<DType>(t.dtype);
  v.rank = t.rank;
  for (int d = 0; d < kMaxRank; ++d) {
    v.shape[static_cast<std::size_t>(d)] = t.shape[d];
    v.stride[static_cast<std::size_t>(d)] = t.stride[d];
  }
  return v;
}

}  // namespace kallpa::detail::wire
