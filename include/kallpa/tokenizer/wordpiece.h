// BERT's tokenizer: basic tokenization (clean text, split CJK ideographs, lowercase and strip
// accents when the model is uncased, split on whitespace and punctuation) and then WordPiece,
// greedy longest-match-first with "##" continuations, as Hugging Face's BertTokenizer and
// `tokenizers` do. Unicode facts (NFD, general categories, lowercase) come from ICU.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kallpa/status.h"

namespace kallpa::tokenizer {

struct WordPieceOptions {
  bool lowercase = true;                 // tokenizer_config.json's do_lower_case
  bool strip_accents = true;             // null in tokenizer_config.json means: as lowercase says
  bool split_cjk = true;                 // tokenize_chinese_chars
  std::size_t max_chars_per_word = 100;  // a longer word is one [UNK]
};

class WordPieceTokenizer {
 public:
  // vocab.txt: one token per line, its line number its id. invalid_argument naming the line for an
  // empty or duplicate token, not_found naming the special token the vocabulary lacks.
  static Result<WordPieceTokenizer> load(const std::string& vocab_path, const WordPieceOptions& options);
  static Result<WordPieceTokenizer> from_vocabulary(std::vector<std::string> tokens, const WordPieceOptions& options);

  // [CLS] pieces [SEP]; invalid_argument (field "text") for text that is not valid UTF-8.
  Result<std::vector<std::int32_t>> encode(std::string_view text) const;
  // The words basic tokenization gives, before WordPiece (for tests and the cross-check).
  Result<std::vector<std::string>> basic_tokenize(std::string_view text) const;

  std::int32_t cls_id() const noexcept { return cls_; }
  std::int32_t sep_id() const noexcept { return sep_; }
  std::int32_t pad_id() const noexcept { return pad_; }
  std::int32_t unk_id() const noexcept { return unk_; }
  std::size_t vocab_size() const noexcept { return tokens_.size(); }
  const std::string& token(std::int32_t id) const { return tokens_.at(static_cast<std::size_t>(id)); }

 private:
  void word_pieces(const std::string& word, std::vector<std::int32_t>& out) const;

  WordPieceOptions options_;
  std::vector<std::string> tokens_;
  std::unordered_map<std::string, std::int32_t> ids_;
  std::int32_t cls_ = -1, sep_ = -1, pad_ = -1, unk_ = -1;
};

}  // namespace kallpa::tokenizer
