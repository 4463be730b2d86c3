#include <string>

#include <fmt/format.h>

#include "kallpa/attention.h"

namespace kallpa {

std::string_view q_layout_name(QLayout layout) noexcept { return layout == QLayout::packed ? "packed" : "dense"; }

std::string_view kv_layout_name(KvLayout layout) noexcept {
  switch (layout) {
    case KvLayout::dense: return "dense";
    case KvLayout::packed: return "packed";
    case KvLayout::paged: return "paged";
  }
  return "unknown";
}

std::size_t ProblemSignature::hash() const noexcept {
  // FNV-1a over the fields; the signature is small and hashed once per dispatch.
  std::uint64_t h = 1469598103934665603ull;
  auto mix = [&h](std::uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xffu;
      h *= 1099511628211ull;
    }
  };
  mix(static_cast<std::uint64_t>(device.kind) | (static_cast<std::uint64_t>(device.index) << 8));
  mix(static_cast<std::uint64_t>(q_dtype) | static_cast<std::uint64_t>(kv_dtype) << 8 |
      static_cast<std::uint64_t>(o_dtype) << 16 | static_cast<std::uint64_t>(q_layout) << 24 |
      static_cast<std::uint64_t>(kv_layout) << 32);
  mix(static_cast<std::uint64_t>(static_cast<std::uint32_t>(hq)) |
      static_cast<std::uint64_t>(static_cast<std::uint32_t>(hkv)) << 32);
  mix(static_cast<std::uint64_t>(static_cast<std::uint32_t>(head_dim)) |
      static_cast<std::uint64_t>(static_cast<std::uint32_t>(head_dim_v)) << 32);
  mix(static_cast<std::uint64_t>(static_cast<std::uint32_t>(page_size)) | static_cast<std::uint64_t>(causal) << 32 |
      static_cast<std::uint64_t>(window) << 33 | static_cast<std::uint64_t>(softcap) << 34 |
      static_cast<std::uint64_t>(alibi) << 35 | static_cast<std::uint64_t>(lse) << 36 |
      static_cast<std::uint64_t>(unit_stride_last_dim) << 37);
  return static_cast<std::size_t>(h);
}

std::string ProblemSignature::to_string() const {
  std::string out = fmt::format("dtype={}", dtype_name(q_dtype));
  if (kv_dtype != q_dtype) out += fmt::format(",kv_dtype={}", dtype_name(kv_dtype));
  if (o_dtype != q_dtype) out += fmt::format(",o_dtype={}", dtype_name(o_dtype));
  out += fmt::format(",hq={},hkv={},d={}", hq, hkv, head_dim);
  if (head_dim_v != head_dim) out += fmt::format(",dv={}", head_dim_v);
  if (q_layout != QLayout::dense) out += ",q=packed";
  if (kv_layout != KvLayout::dense) out += fmt::format(",kv={}", kv_layout_name(kv_layout));
  if (kv_layout == KvLayout::paged) out += fmt::format(",page={}", page_size);
  if (causal) out += ",causal";
  if (window) out += ",window";
  if (softcap) out += ",softcap";
  if (alibi) out += ",alibi";
  if (lse) out += ",lse";
  if (!unit_stride_last_dim) out += ",strided";
  if (!(device == Device::cpu())) out += ",device=" + device.to_string();
  return out;
}

}  // namespace kallpa
