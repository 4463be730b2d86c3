// A byte vocabulary laid out as SmolLM2's (and the synthetic Llama's): ids 0..2 control
// (<|endoftext|>, <|im_start|>, <|im_end|>, the end of generation), then byte b at 3 + b. Small
// enough to compile grammars against in a unit test, and every text has one tokenization.
#pragma once

#include <cstdint>

#include "kallpa/tokenizer/tokenizer.h"

namespace kallpa::test {

tokenizer::Tokenizer byte_tokenizer();
inline std::int32_t byte_token(char c) { return 3 + static_cast<unsigned char>(c); }

}  // namespace kallpa::test
