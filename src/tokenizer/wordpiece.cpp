#include "kallpa/tokenizer/wordpiece.h"

#include <unicode/locid.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>

#include <fstream>
#include <utility>

#include <fmt/format.h>

#include "tokenizer/utf8.h"

namespace kallpa::tokenizer {
namespace {

using detail::first_invalid_utf8;
using detail::utf8_step;

// BERT's whitespace: tab, newline, carriage return and every White_Space code point.
bool is_whitespace(UChar32 c) { return c == '\t' || c == '\n' || c == '\r' || u_isUWhiteSpace(c); }

// Control characters are dropped, except the whitespace ones above.
bool is_control(UChar32 c) {
  if (c == '\t' || c == '\n' || c == '\r') return false;
  const auto type = static_cast<UCharCategory>(u_charType(c));
  return type == U_CONTROL_CHAR || type == U_FORMAT_CHAR || type == U_PRIVATE_USE_CHAR || type == U_SURROGATE ||
         type == U_UNASSIGNED;
}

// ASCII non-alphanumerics count as punctuation even where Unicode says symbol ("$", "^", "`").
bool is_punctuation(UChar32 c) {
  if ((c >= 33 && c <= 47) || (c >= 58 && c <= 64) || (c >= 91 && c <= 96) || (c >= 123 && c <= 126)) return true;
  return (U_GET_GC_MASK(c) & U_GC_P_MASK) != 0;
}

// The CJK Unified Ideographs blocks BERT isolates (not Japanese kana or Hangul, which are words).
bool is_cjk(UChar32 c) {
  return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) || (c >= 0x20000 && c <= 0x2A6DF) ||
         (c >= 0x2A700 && c <= 0x2B73F) || (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B820 && c <= 0x2CEAF) ||
         (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

std::string to_utf8(const icu::UnicodeString& s) {
  std::string out;
  s.toUTF8String(out);
  return out;
}

}  // namespace

Result<WordPieceTokenizer> WordPieceTokenizer::load(const std::string& vocab_path, const WordPieceOptions& options) {
  std::ifstream in(vocab_path);
  if (!in) return Status(ErrorCode::not_found, "vocab", fmt::format("cannot open vocabulary '{}'", vocab_path));
  std::vector<std::string> tokens;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    tokens.push_back(std::move(line));
  }
  return from_vocabulary(std::move(tokens), options);
}

Result<WordPieceTokenizer> WordPieceTokenizer::from_vocabulary(std::vector<std::string> tokens,
                                                               const WordPieceOptions& options) {
  WordPieceTokenizer t;
  t.options_ = options;
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i].empty()) {
      return Status(ErrorCode::invalid_argument, "vocab", fmt::format("line {} is an empty token", i + 1));
    }
    if (first_invalid_utf8(tokens[i])) {
      return Status(ErrorCode::invalid_argument, "vocab", fmt::format("line {} is not valid UTF-8", i + 1));
    }
    if (!t.ids_.emplace(tokens[i], static_cast<std::int32_t>(i)).second) {
      return Status(ErrorCode::invalid_argument, "vocab", fmt::format("line {} repeats token '{}'", i + 1, tokens[i]));
    }
  }
  t.tokens_ = std::move(tokens);
  const auto special = [&t](std::string_view name, std::int32_t& id) -> Status {
    auto it = t.ids_.find(std::string(name));
    if (it == t.ids_.end()) {
      return Status(ErrorCode::not_found, "vocab", fmt::format("the vocabulary has no {} token", name));
    }
    id = it->second;
    return {};
  };
  for (auto [name, id] : {std::pair<std::string_view, std::int32_t*>{"[CLS]", &t.cls_},
                          {"[SEP]", &t.sep_},
                          {"[PAD]", &t.pad_},
                          {"[UNK]", &t.unk_}}) {
    if (Status s = special(name, *id); !s) return s;
  }
  return t;
}

Result<std::vector<std::string>> WordPieceTokenizer::basic_tokenize(std::string_view text) const {
  if (auto bad = first_invalid_utf8(text)) {
    return Status(ErrorCode::invalid_argument, "text", fmt::format("invalid UTF-8 at byte {}", *bad));
  }
  const icu::UnicodeString input =
      icu::UnicodeString::fromUTF8(icu::StringPiece(text.data(), static_cast<int32_t>(text.size())));
  // Clean, and put spaces around CJK ideographs so that each is a word of its own.
  icu::UnicodeString cleaned;
  for (int32_t i = 0; i < input.length();) {
    const UChar32 c = input.char32At(i);
    i += U16_LENGTH(c);
    if (c == 0 || c == 0xFFFD || is_control(c)) continue;
    if (is_whitespace(c)) {
      cleaned.append(static_cast<UChar>(' '));
    } else if (options_.split_cjk && is_cjk(c)) {
      cleaned.append(static_cast<UChar>(' ')).append(c).append(static_cast<UChar>(' '));
    } else {
      cleaned.append(c);
    }
  }
  if (options_.strip_accents) {
    UErrorCode err = U_ZERO_ERROR;
    const icu::Normalizer2* nfd = icu::Normalizer2::getNFDInstance(err);
    if (U_FAILURE(err)) return Status(ErrorCode::internal, "icu", u_errorName(err));
    icu::UnicodeString decomposed = nfd->normalize(cleaned, err);
    if (U_FAILURE(err)) return Status(ErrorCode::internal, "icu", u_errorName(err));
    cleaned.remove();
    for (int32_t i = 0; i < decomposed.length();) {
      const UChar32 c = decomposed.char32At(i);
      i += U16_LENGTH(c);
      if (u_charType(c) != U_NON_SPACING_MARK) cleaned.append(c);
    }
  }
  if (options_.lowercase) {
    // Code point by code point, as BERT's reference tokenizers do: no context rules (a final
    // capital sigma lowercases to σ, not ς).
    icu::UnicodeString lower;
    for (int32_t i = 0; i < cleaned.length();) {
      const UChar32 c = cleaned.char32At(i);
      i += U16_LENGTH(c);
      if (c < 0x80) {
        lower.append(static_cast<UChar>(c >= 'A' && c <= 'Z' ? c + ('a' - 'A') : c));
      } else {
        lower.append(icu::UnicodeString(c).toLower(icu::Locale::getRoot()));
      }
    }
    cleaned = std::move(lower);
  }

  // Words split on whitespace, then every punctuation character a word of its own.
  std::vector<std::string> words;
  icu::UnicodeString word;
  const auto flush = [&] {
    if (!word.isEmpty()) words.push_back(to_utf8(word));
    word.remove();
  };
  for (int32_t i = 0; i < cleaned.length();) {
    const UChar32 c = cleaned.char32At(i);
    i += U16_LENGTH(c);
    if (is_whitespace(c)) {
      flush();
    } else if (is_punctuation(c)) {
      flush();
      words.push_back(to_utf8(icu::UnicodeString(c)));
    } else {
      word.append(c);
    }
  }
  flush();
  return words;
}

void WordPieceTokenizer::word_pieces(const std::string& word, std::vector<std::int32_t>& out) const {
  std::size_t chars = 0;
  for (std::size_t i = 0; i < word.size(); i += utf8_step(word, i).len) ++chars;
  if (chars > options_.max_chars_per_word) {
    out.push_back(unk_);
    return;
  }
  const std::size_t first = out.size();
  std::size_t start = 0;
  std::string candidate;
  while (start < word.size()) {
    // The longest vocabulary entry that starts here, shrinking a character at a time.
    std::size_t end = word.size();
    std::int32_t found = -1;
    while (end > start) {
      candidate.assign(start > 0 ? "##" : "");
      candidate.append(word, start, end - start);
      if (auto it = ids_.find(candidate); it != ids_.end()) {
        found = it->second;
        break;
      }
      do {
        --end;
      } while (end > start && (static_cast<unsigned char>(word[end]) & 0xC0) == 0x80);
    }
    if (found < 0) {
      out.resize(first);
      out.push_back(unk_);
      return;
    }
    out.push_back(found);
    start = end;
  }
}

Result<std::vector<std::int32_t>> WordPieceTokenizer::encode(std::string_view text) const {
  Result<std::vector<std::string>> words = basic_tokenize(text);
  if (!words) return words.status();
  std::vector<std::int32_t> ids{cls_};
  for (const std::string& word : *words) word_pieces(word, ids);
  ids.push_back(sep_);
  return ids;
}

}  // namespace kallpa::tokenizer
