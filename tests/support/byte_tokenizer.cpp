#include "support/byte_tokenizer.h"

#include <stdexcept>
#include <string>

#include "tokenizer/byte_level.h"
#include "tokenizer/utf8.h"

namespace kallpa::test {

tokenizer::Tokenizer byte_tokenizer() {
  tokenizer::TokenizerData d;
  d.pre = "smollm";
  for (const char* c : {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}) {
    d.tokens.emplace_back(c);
    d.token_types.push_back(static_cast<std::int32_t>(tokenizer::TokenType::control));
  }
  for (int b = 0; b < 256; ++b) {
    std::string s;
    tokenizer::detail::append_utf8(s, tokenizer::detail::ByteLevel::get().byte_to_cp[b]);
    d.tokens.push_back(s);
    d.token_types.push_back(static_cast<std::int32_t>(tokenizer::TokenType::normal));
  }
  d.bos_id = 1;
  d.eos_id = 2;
  auto t = tokenizer::Tokenizer::create(d);
  if (!t) throw std::runtime_error("byte_tokenizer: " + t.status().to_string());
  return std::move(t).value();
}

}  // namespace kallpa::test
