#include "core/output_check.h"

#include <cmath>

#include <fmt/format.h>

#include "kallpa/half.h"

namespace kallpa::detail {
namespace {

bool finite_at(const TensorView& t, std::int64_t index) noexcept {
  return std::isfinite(load_f32(t.dtype, t.data, index));
}

// True when any input that row (b, i) of head h reads is non-finite.
bool row_inputs_non_finite(const ValidatedProblem& vp, std::int32_t b, std::int64_t i, std::int32_t h) noexcept {
  const AttentionProblem& p = vp.problem();
  const int qr = p.q.rank, kr = p.k.rank;
  const std::int64_t q_hs = p.q.stride[static_cast<std::size_t>(qr - 2)],
                     q_ds = p.q.stride[static_cast<std::size_t>(qr - 1)];
  const std::int64_t k_hs = p.k.stride[static_cast<std::size_t>(kr - 2)],
                     k_ds = p.k.stride[static_cast<std::size_t>(kr - 1)];
  const std::int64_t v_hs = p.v.stride[static_cast<std::size_t>(kr - 2)],
                     v_ds = p.v.stride[static_cast<std::size_t>(kr - 1)];
  if (p.alibi_slopes != nullptr && !std::isfinite(p.alibi_slopes[h])) return true;
  const std::int64_t q_base = vp.q_row_offset(b, i) + h * q_hs;
  for (std::int64_t c = 0; c < vp.head_dim(); ++c) {
    if (!finite_at(p.q, q_base + c * q_ds)) return true;
  }
  const std::int64_t kvh = h / vp.group_size();
  const auto keys = vp.visible_keys(b, i);
  for (std::int64_t j = keys.first; j <= keys.last; ++j) {
    const std::int64_t k_base = vp.k_row_offset(b, j) + kvh * k_hs;
    for (std::int64_t c = 0; c < vp.head_dim(); ++c) {
      if (!finite_at(p.k, k_base + c * k_ds)) return true;
    }
    const std::int64_t v_base = vp.v_row_offset(b, j) + kvh * v_hs;
    for (std::int64_t c = 0; c < vp.head_dim_v(); ++c) {
      if (!finite_at(p.v, v_base + c * v_ds)) return true;
    }
  }
  return false;
}

}  // namespace

Status check_outputs_finite(const ValidatedProblem& vp) noexcept {
  const AttentionProblem& p = vp.problem();
  if (p.o.device.kind != DeviceKind::cpu) return {};
  const int orank = p.o.rank;
  const std::int64_t o_hs = p.o.stride[static_cast<std::size_t>(orank - 2)];
  const std::int64_t o_ds = p.o.stride[static_cast<std::size_t>(orank - 1)];
  for (std::int32_t b = 0; b < vp.batch(); ++b) {
    for (std::int64_t i = 0; i < vp.seqlen_q(b); ++i) {
      const std::int64_t base = vp.o_row_offset(b, i);
      for (std::int32_t h = 0; h < vp.hq(); ++h) {
        const char* what = nullptr;
        float value = 0.0f;
        for (std::int64_t c = 0; c < vp.head_dim_v() && what == nullptr; ++c) {
          value = load_f32(p.o.dtype, p.o.data, base + h * o_hs + c * o_ds);
          if (!std::isfinite(value)) what = "o";
        }
        if (what == nullptr && p.lse.present()) {
          value = static_cast<const float*>(p.lse.data)[vp.lse_offset(b, h, i)];
          if (std::isnan(value) || value == INFINITY) what = "lse";
        }
        if (what != nullptr && !row_inputs_non_finite(vp, b, i, h)) {
          return Status(ErrorCode::backend_failure, what,
                        fmt::format("non-finite output {} at b={}, i={}, h={} where every input is finite "
                                    "(paranoid check)",
                                    value, b, i, h));
        }
      }
    }
  }
  return {};
}

}  // namespace kallpa::detail
