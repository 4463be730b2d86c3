// GPT-2's reversible byte <-> Unicode mapping (openai/gpt-2 encoder.py bytes_to_unicode): the
// printable Latin-1 bytes map to themselves, the other 68 bytes to U+0100.. in byte order, so that
// every byte sequence is a string of visible characters ("Ġ" is the space, "Ċ" the newline).
#pragma once

#include <array>
#include <cstdint>

namespace kallpa::tokenizer::detail {

struct ByteLevel {
  std::array<char32_t, 256> byte_to_cp{};
  std::array<std::int16_t, 324> cp_to_byte{};  // -1: not a byte-level code point

  ByteLevel() {
    cp_to_byte.fill(-1);
    auto printable = [](int b) {
      return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    };
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const char32_t cp = printable(b) ? static_cast<char32_t>(b) : next++;
      byte_to_cp[static_cast<std::size_t>(b)] = cp;
      cp_to_byte[cp] = static_cast<std::int16_t>(b);
    }
  }

  static const ByteLevel& get() {
    static const ByteLevel table;
    return table;
  }
};

}  // namespace kallpa::tokenizer::detail
