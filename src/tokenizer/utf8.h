// UTF-8 helpers for the tokenizer: well-formedness per the Unicode standard (Table 3-7: no
// overlongs, no surrogates, nothing above U+10FFFF) and U+FFFD substitution of maximal subparts,
// which is what Python's bytes.decode("utf-8", errors="replace") and WHATWG decoders do.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace kallpa::tokenizer::detail {

inline constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";  // U+FFFD

enum class Utf8Kind { ok, invalid, truncated };

struct Utf8Step {
  Utf8Kind kind;
  std::size_t len;  // ok: the code point's length; invalid: the maximal subpart to replace (>= 1);
                    // truncated: the bytes left (a valid prefix cut by the end of the input)
};

// Classifies the sequence that starts at s[i] (i < s.size()).
Utf8Step utf8_step(std::string_view s, std::size_t i) noexcept;

// Appends s to out with ill-formed sequences replaced by U+FFFD. When !final, a truncated tail is
// not consumed; returns the number of bytes consumed (s.size() when final).
std::size_t utf8_sanitize(std::string_view s, std::string& out, bool final);

// Offset of the first ill-formed (or truncated) sequence, nullopt if s is valid UTF-8.
std::optional<std::size_t> first_invalid_utf8(std::string_view s) noexcept;

void append_utf8(std::string& out, char32_t cp);

}  // namespace kallpa::tokenizer::detail
