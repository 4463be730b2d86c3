// The text form of a problem: comma-separated key=value items and bare flags. Small enough that a
// split and std::from_chars are the whole parser.
#include "kallpa/problem_spec.h"

#include <charconv>
#include <cmath>
#include <limits>
#include <set>
#include <string>
#include <system_error>

#include <fmt/format.h>

namespace kallpa {
namespace {

Status parse_err(std::string_view key, std::string message) {
  return {ErrorCode::parse_error, std::string(key), std::move(message)};
}

template <typename Int>
Status parse_int(std::string_view key, std::string_view text, Int lo, Int hi, Int* out) {
  std::int64_t v = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec == std::errc::result_out_of_range)
    return Status::invalid(std::string(key), fmt::format("'{}' is out of range", text));
  if (ec != std::errc() || ptr != text.data() + text.size() || text.empty()) {
    return parse_err(key, fmt::format("'{}' is not an integer", text));
  }
  if (v < lo || v > hi) {
    return Status::invalid(std::string(key), fmt::format("{} is out of range [{}, {}]", v, lo, hi));
  }
  *out = static_cast<Int>(v);
  return {};
}

Status parse_float(std::string_view key, std::string_view text, float* out) {
  // from_chars for float is in libstdc++ 11+; it rejects "inf"/"nan" only if we check finiteness.
  float v = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || ptr != text.data() + text.size() || text.empty()) {
    return parse_err(key, fmt::format("'{}' is not a number", text));
  }
  if (!std::isfinite(v)) return Status::invalid(std::string(key), fmt::format("'{}' must be finite", text));
  *out = v;
  return {};
}

Status parse_flag(std::string_view key, std::string_view text, bool has_value, bool* out) {
  if (!has_value || text == "1" || text == "true") {
    *out = true;
  } else if (text == "0" || text == "false") {
    *out = false;
  } else {
    return parse_err(key, fmt::format("'{}' is not 0/1/true/false", text));
  }
  return {};
}

constexpr std::int64_t kMaxLen = std::numeric_limits<std::int32_t>::max();
constexpr std::int32_t kMaxI32 = std::numeric_limits<std::int32_t>::max();

}  // namespace

Result<ProblemSpec> parse_problem_spec(std::string_view text) {
  ProblemSpec spec;
  if (text.empty()) return parse_err("spec", "is empty");
  std::set<std::string, std::less<>> seen;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    const std::size_t comma = std::min(text.find(',', pos), text.size());
    const std::string_view item = text.substr(pos, comma - pos);
    pos = comma + 1;
    if (item.empty()) return parse_err("spec", fmt::format("empty item at offset {}", comma));
    const std::size_t eq = item.find('=');
    const std::string_view key = item.substr(0, eq);
    const bool has_value = eq != std::string_view::npos;
    const std::string_view value = has_value ? item.substr(eq + 1) : std::string_view{};
    if (key.empty()) return parse_err("spec", fmt::format("item '{}' has no key", item));
    if (!seen.insert(std::string(key)).second) return parse_err(key, "is given twice");
    auto need_value = [&]() -> Status {
      if (!has_value || value.empty()) return parse_err(key, "needs a value (key=value)");
      return {};
    };

    Status s;
    if (key == "causal" || key == "alibi" || key == "lse") {
      bool* flag = key == "causal" ? &spec.causal : key == "alibi" ? &spec.alibi : &spec.lse;
      s = parse_flag(key, value, has_value, flag);
    } else if (!(s = need_value())) {
      return s;
    } else if (key == "b") {
      s = parse_int<std::int64_t>(key, value, 0, kMaxLen, &spec.batch);
    } else if (key == "sq") {
      s = parse_int<std::int64_t>(key, value, 0, kMaxLen, &spec.seqlen_q);
    } else if (key == "skv") {
      s = parse_int<std::int64_t>(key, value, 0, kMaxLen, &spec.seqlen_k);
    } else if (key == "hq") {
      s = parse_int<std::int32_t>(key, value, 1, kMaxI32, &spec.hq);
    } else if (key == "hkv") {
      s = parse_int<std::int32_t>(key, value, 1, kMaxI32, &spec.hkv);
    } else if (key == "d") {
      s = parse_int<std::int32_t>(key, value, 1, kMaxI32, &spec.head_dim);
    } else if (key == "dv") {
      s = parse_int<std::int32_t>(key, value, 1, kMaxI32, &spec.head_dim_v);
    } else if (key == "page") {
      s = parse_int<std::int32_t>(key, value, 1, kMaxI32, &spec.page_size);
    } else if (key == "dtype" || key == "kv_dtype") {
      DType dt;
      if (!parse_dtype(value, &dt)) return parse_err(key, fmt::format("unknown dtype '{}' (f32, f16, bf16)", value));
      if (key == "dtype") spec.dtype = dt;
      else spec.kv_dtype = dt;
    } else if (key == "q") {
      if (value == "dense") spec.q_layout = QLayout::dense;
      else if (value == "packed") spec.q_layout = QLayout::packed;
      else return parse_err(key, fmt::format("unknown q layout '{}' (dense, packed)", value));
    } else if (key == "kv") {
      if (value == "dense") spec.kv_layout = KvLayout::dense;
      else if (value == "packed") spec.kv_layout = KvLayout::packed;
      else if (value == "paged") spec.kv_layout = KvLayout::paged;
      else return parse_err(key, fmt::format("unknown kv layout '{}' (dense, packed, paged)", value));
    } else if (key == "window") {
      const std::size_t colon = value.find(':');
      if (colon == std::string_view::npos) return parse_err(key, "expects L:R, e.g. window=128:0 or window=-1:0");
      s = parse_int<std::int64_t>("window", value.substr(0, colon), -1, kMaxLen, &spec.window_left);
      if (s) s = parse_int<std::int64_t>("window", value.substr(colon + 1), -1, kMaxLen, &spec.window_right);
    } else if (key == "softcap") {
      s = parse_float(key, value, &spec.softcap);
      if (s && spec.softcap < 0) s = Status::invalid("softcap", "must be >= 0");
    } else if (key == "scale") {
      float v = 0;
      s = parse_float(key, value, &v);
      if (s) spec.scale = v;
    } else if (key == "device") {
      s = parse_device(value, &spec.device);
    } else {
      return parse_err(key,
                       "unknown key (b, sq, skv, hq, hkv, d, dv, dtype, kv_dtype, q, kv, page, "
                       "causal, window, softcap, alibi, lse, scale, device)");
    }
    if (!s) return s;
    if (comma == text.size()) break;
  }
  if (spec.hq % spec.effective_hkv() != 0) {
    return Status::invalid(
        "hkv", fmt::format("query heads {} are not a multiple of kv heads {}", spec.hq, spec.effective_hkv()));
  }
  return spec;
}

ProblemSignature ProblemSpec::signature() const {
  ProblemSignature s;
  s.device = device;
  s.q_dtype = dtype;
  s.kv_dtype = effective_kv_dtype();
  s.o_dtype = dtype;
  s.q_layout = q_layout;
  s.kv_layout = kv_layout;
  s.hq = hq;
  s.hkv = effective_hkv();
  s.head_dim = head_dim;
  s.head_dim_v = effective_dv();
  s.page_size = kv_layout == KvLayout::paged ? page_size : 0;
  s.causal = causal;
  s.window = window_left >= 0 || window_right >= 0;
  s.softcap = softcap > 0.0f;
  s.alibi = alibi;
  s.lse = lse;
  s.unit_stride_last_dim = true;
  return s;
}

std::string ProblemSpec::to_string() const {
  std::string out =
      fmt::format("b={},sq={},skv={},hq={},hkv={},d={}", batch, seqlen_q, seqlen_k, hq, effective_hkv(), head_dim);
  if (effective_dv() != head_dim) out += fmt::format(",dv={}", effective_dv());
  out += fmt::format(",dtype={}", dtype_name(dtype));
  if (kv_dtype) out += fmt::format(",kv_dtype={}", dtype_name(*kv_dtype));
  if (q_layout != QLayout::dense) out += ",q=packed";
  if (kv_layout != KvLayout::dense) out += fmt::format(",kv={}", kv_layout_name(kv_layout));
  if (kv_layout == KvLayout::paged) out += fmt::format(",page={}", page_size);
  if (causal) out += ",causal";
  if (window_left >= 0 || window_right >= 0) out += fmt::format(",window={}:{}", window_left, window_right);
  if (softcap > 0) out += fmt::format(",softcap={}", softcap);
  if (alibi) out += ",alibi";
  if (lse) out += ",lse";
  if (scale) out += fmt::format(",scale={}", *scale);
  if (!(device == Device::cpu())) out += ",device=" + device.to_string();
  return out;
}

}  // namespace kallpa
