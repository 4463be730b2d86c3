// The bridge from a GGUF file's tokenizer.* metadata to the tokenizer, which knows nothing of GGUF.
#pragma once

#include "kallpa/model/gguf.h"
#include "kallpa/tokenizer/chat.h"
#include "kallpa/tokenizer/chat_template.h"
#include "kallpa/tokenizer/tokenizer.h"

namespace kallpa::model {

// Reads tokenizer.ggml.{model,pre,tokens,token_type,scores,merges,*_token_id,add_*_token,
// add_space_prefix}; errors name the key.
Result<tokenizer::Tokenizer> tokenizer_from_gguf(const GgufFile& file);

// ChatML options from tokenizer.chat_template when present and ChatML; SmolLM2's defaults otherwise.
tokenizer::ChatMlOptions chat_options_from_gguf(const GgufFile& file);

// The chat format for the file (tokenizer::choose_chat_format): its tokenizer.chat_template when it
// has one, else a built-in format chosen by general.architecture and the vocabulary.
tokenizer::ChatFormat chat_format_from_gguf(const GgufFile& file, const tokenizer::Tokenizer& tokenizer);

}  // namespace kallpa::model
