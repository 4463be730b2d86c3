#include "tokenizer/utf8.h"

#include <cstdint>

namespace kallpa::tokenizer::detail {

Utf8Step utf8_step(std::string_view s, std::size_t i) noexcept {
  const auto b0 = static_cast<std::uint8_t>(s[i]);
  if (b0 < 0x80) return {Utf8Kind::ok, 1};
  std::size_t len = 0;
  std::uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    len = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    len = 3;
    if (b0 == 0xE0) lo = 0xA0;  // no overlongs
    if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    len = 4;
    if (b0 == 0xF0) lo = 0x90;  // no overlongs
    if (b0 == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
  } else {
    return {Utf8Kind::invalid, 1};  // continuation byte, C0, C1, F5..FF
  }
  for (std::size_t k = 1; k < len; ++k) {
    if (i + k >= s.size()) return {Utf8Kind::truncated, s.size() - i};
    const auto b = static_cast<std::uint8_t>(s[i + k]);
    const std::uint8_t l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (b < l || b > h) return {Utf8Kind::invalid, k};
  }
  return {Utf8Kind::ok, len};
}

std::size_t utf8_sanitize(std::string_view s, std::string& out, bool final) {
  std::size_t i = 0;
  while (i < s.size()) {
    // Fast path for ASCII runs.
    std::size_t j = i;
    while (j < s.size() && static_cast<std::uint8_t>(s[j]) < 0x80) ++j;
    out.append(s.substr(i, j - i));
    i = j;
    if (i == s.size()) break;
    const Utf8Step st = utf8_step(s, i);
    switch (st.kind) {
      case Utf8Kind::ok: out.append(s.substr(i, st.len)); break;
      case Utf8Kind::invalid: out.append(kReplacementChar); break;
      case Utf8Kind::truncated:
        if (!final) return i;
        out.append(kReplacementChar);
        break;
    }
    i += st.len;
  }
  return s.size();
}

std::optional<std::size_t> first_invalid_utf8(std::string_view s) noexcept {
  std::size_t i = 0;
  while (i < s.size()) {
    if (static_cast<std::uint8_t>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const Utf8Step st = utf8_step(s, i);
    if (st.kind != Utf8Kind::ok) return i;
    i += st.len;
  }
  return std::nullopt;
}

void append_utf8(std::string& out, char32_t cp) {
  const auto c = static_cast<std::uint32_t>(cp);
  if (c < 0x80) {
    out.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (c >> 6)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (c >> 12)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (c >> 18)));
    out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

}  // namespace kallpa::tokenizer::detail
