#include "ops/repack.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <utility>

#include <fmt/format.h>

#include "ops/q16_units.h"
#include "ops/quant_kernels.h"

namespace kallpa::ops {

bool can_repack_rows4(const WeightMatrix& w) noexcept {
  return kernels::is_quantized(w.type) && w.layout == WeightLayout::rows && w.rows % 4 == 0 && w.data != nullptr &&
         w.row_bytes != 0 && w.row_bytes == row_size(w.type, w.cols);
}

Result<WeightMatrix> repack_rows4(const WeightMatrix& w, std::byte* dst) {
  if (!can_repack_rows4(w)) {
    return Status(ErrorCode::invalid_argument, "w",
                  fmt::format("cannot repack a {} matrix of {} rows (needs Q8_0/Q4_0/Q4_1, rows % 4 == 0)",
                              ggml_type_name(w.type), w.rows));
  }
  const kernels::BlockGeom g = kernels::block_geom(w.type);
  const auto* src = static_cast<const std::byte*>(w.data);
  WeightMatrix out = w;
  out.data = dst;
  out.layout = WeightLayout::rows4;
  const std::int64_t nb = w.cols / kQK;
  for (std::int64_t r = 0; r < w.rows; ++r) {
    for (std::int64_t b = 0; b < nb; ++b) {
      const std::byte* blk = src + static_cast<std::size_t>(r) * w.row_bytes + static_cast<std::size_t>(b) * g.bytes;
      const kernels::BlockAt to = kernels::block_at(g, WeightLayout::rows4, w.row_bytes, r, b);
      std::memcpy(dst + to.d, blk, 2);
      if (g.has_m) std::memcpy(dst + to.m, blk + 2, 2);
      std::memcpy(dst + to.qs, blk + (g.has_m ? 4 : 2), g.qs_bytes);
    }
  }
  return out;
}

namespace {

// Block types whose decode kernels read the rows layout (ops/q16_units.h) are copied as they are:
// their products stream them from huge pages rather than the file's 4 KiB ones.
bool copied_as_is(const WeightMatrix& w) noexcept {
  return kernels::has_q16_unit_kernel(w.type) && w.layout == WeightLayout::rows && w.data != nullptr &&
         w.row_bytes != 0 && w.row_bytes == row_size(w.type, w.cols);
}

}  // namespace

Status RepackedWeights::repack(std::vector<WeightMatrix*> matrices,
                               const std::function<void(const WeightMatrix&)>& copied) {
  const char* env = std::getenv("KALLPA_REPACK");
  if (env != nullptr && std::string_view(env) == "0") return {};
  std::size_t total = 0;
  for (const WeightMatrix* m : matrices) {
    if (can_repack_rows4(*m) || copied_as_is(*m)) total += static_cast<std::size_t>(m->rows) * m->row_bytes;
  }
  auto buffer = HugeBuffer::allocate(total, "repack");
  if (!buffer) return buffer.status();
  storage_ = std::move(*buffer);
  std::size_t at = 0;
  // In slices of whole 4-row groups (each group's bytes depend on its rows alone), handing each
  // slice's original to `copied` as soon as it is written: a large matrix (an output head) is then
  // never resident twice while it is copied.
  constexpr std::size_t kSliceBytes = 1u << 20;
  for (WeightMatrix* m : matrices) {
    const bool rows4 = can_repack_rows4(*m);
    if (!rows4 && !copied_as_is(*m)) continue;
    const std::int64_t slice_rows =
        std::max<std::int64_t>(4, static_cast<std::int64_t>(kSliceBytes / m->row_bytes) / 4 * 4);
    std::byte* dst = storage_.data() + at;
    for (std::int64_t first = 0; first < m->rows; first += slice_rows) {
      WeightMatrix slice = *m;
      slice.data = static_cast<const std::byte*>(m->data) + static_cast<std::size_t>(first) * m->row_bytes;
      slice.rows = std::min(slice_rows, m->rows - first);
      std::byte* to = dst + static_cast<std::size_t>(first) * m->row_bytes;
      if (rows4) {
        auto r = repack_rows4(slice, to);
        if (!r) return r.status();
      } else {
        std::memcpy(to, slice.data, static_cast<std::size_t>(slice.rows) * m->row_bytes);
      }
      if (copied) copied(slice);
    }
    at += static_cast<std::size_t>(m->rows) * m->row_bytes;
    m->data = dst;
    if (rows4) m->layout = WeightLayout::rows4;
  }
  return {};
}

}  // namespace kallpa::ops
