// The bridge from a GGUF file's tokenizer.* metadata to the tokenizer, which knows nothing of GGUF.
#pragma once

#include "kallpa/model/gguf.h"
#include "kallpa/tokenizer/chat.h"
#include "kallpa/tokenizer/tokenizer.h"

namespace kallpa::model {

// Reads tokenizer.ggml.{model,pre,tokens,token_type,merges,*_token_id,add_*_token}; errors name the key.
Result<tokenizer::Tokenizer> tokenizer_from_gguf(const GgufFile& file);

// ChatML options from tokenizer.chat_template when present and ChatML; SmolLM2's defaults otherwise.
tokenizer::ChatMlOptions chat_options_from_gguf(const GgufFile& file);

}  // namespace kallpa::model
