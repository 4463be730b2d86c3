// Pre-tokenizers: a sequence of PCRE2 expressions (UTF + Unicode properties, JIT when available),
// each splitting every piece the previous one produced into its matches and the text between
// them (both kept), as llama.cpp's unicode_regex_split and Hugging Face's Split(Isolated) do.
// Each piece is matched as its own subject, so lookaheads stop at piece boundaries.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kallpa/status.h"

namespace kallpa::tokenizer::detail {

struct Span {
  std::size_t begin;
  std::size_t end;
};

class PreTokenizer {
 public:
  // unsupported (field "tokenizer.ggml.pre") for an unknown name.
  static Result<PreTokenizer> create(std::string_view name);
  static std::vector<std::string> known_names();

  PreTokenizer(PreTokenizer&&) noexcept;
  PreTokenizer& operator=(PreTokenizer&&) noexcept;
  ~PreTokenizer();

  // Splits text[range] (valid UTF-8, which the caller has checked) and appends the pieces.
  Status split(std::string_view text, Span range, std::vector<Span>& out) const;

  const std::string& name() const noexcept { return name_; }
  bool jit() const noexcept;

 private:
  struct Regex;
  PreTokenizer() = default;
  std::string name_;
  std::vector<std::unique_ptr<Regex>> regexes_;
};

}  // namespace kallpa::tokenizer::detail
