#include "ops/repack.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include <fmt/format.h>

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

Status RepackedWeights::repack(std::vector<WeightMatrix*> matrices) {
  const char* env = std::getenv("KALLPA_REPACK");
  if (env != nullptr && std::string_view(env) == "0") return {};
  std::size_t total = 0;
  for (const WeightMatrix* m : matrices) {
    if (can_repack_rows4(*m)) total += static_cast<std::size_t>(m->rows) * m->row_bytes;
  }
  auto buffer = HugeBuffer::allocate(total, "repack");
  if (!buffer) return buffer.status();
  storage_ = std::move(*buffer);
  std::size_t at = 0;
  for (WeightMatrix* m : matrices) {
    if (!can_repack_rows4(*m)) continue;
    auto r = repack_rows4(*m, storage_.data() + at);
    if (!r) return r.status();
    at += static_cast<std::size_t>(m->rows) * m->row_bytes;
    *m = *r;
  }
  return {};
}

}  // namespace kallpa::ops
