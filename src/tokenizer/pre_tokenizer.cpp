#include "tokenizer/pre_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <array>

namespace kallpa::tokenizer::detail {
namespace {

// GPT-2's expression (openai/gpt-2 encoder.py; Hugging Face ByteLevel(use_regex=True)).
constexpr std::string_view kGpt2 = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
// Every digit on its own (Hugging Face Digits(individual_digits=True); llama.cpp's "\p{N}").
constexpr std::string_view kDigits = R"(\p{N})";
// Llama 3 and Qwen2 (as in their tokenizer.json; (?i:...) written out as llama.cpp does).
constexpr std::string_view kLlama3 =
    R"((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kQwen2 =
    R"((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

struct Definition {
  std::string_view name;
  std::vector<std::string_view> exprs;
};

const std::vector<Definition>& definitions() {
  // llama.cpp (llama-vocab.cpp) gives "smollm" the same expressions as starcoder, refact,
  // command-r, codeshell, exaone and minerva: \p{N}, then GPT-2's pattern.
  static const std::vector<Definition> defs = {
      {"smollm", {kDigits, kGpt2}},
      {"starcoder", {kDigits, kGpt2}},
      {"refact", {kDigits, kGpt2}},
      {"command-r", {kDigits, kGpt2}},
      {"codeshell", {kDigits, kGpt2}},
      {"exaone", {kDigits, kGpt2}},
      {"minerva-7b", {kDigits, kGpt2}},
      {"gpt2", {kGpt2}},
      {"default", {kGpt2}},
      {"llama3", {kLlama3}},
      {"llama-bpe", {kLlama3}},
      {"qwen2", {kQwen2}},
  };
  return defs;
}

std::string pcre2_message(int code) {
  std::array<PCRE2_UCHAR, 256> buf{};
  const int n = pcre2_get_error_message(code, buf.data(), buf.size());
  if (n < 0) return "PCRE2 error " + std::to_string(code);
  return std::string(reinterpret_cast<const char*>(buf.data()), static_cast<std::size_t>(n));
}

}  // namespace

struct PreTokenizer::Regex {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Regex() { pcre2_code_free(code); }
};

PreTokenizer::PreTokenizer(PreTokenizer&&) noexcept = default;
PreTokenizer& PreTokenizer::operator=(PreTokenizer&&) noexcept = default;
PreTokenizer::~PreTokenizer() = default;

std::vector<std::string> PreTokenizer::known_names() {
  std::vector<std::string> names;
  for (const auto& d : definitions()) names.emplace_back(d.name);
  return names;
}

Result<PreTokenizer> PreTokenizer::create(std::string_view name) {
  const Definition* def = nullptr;
  for (const auto& d : definitions()) {
    if (d.name == name) def = &d;
  }
  if (def == nullptr) {
    std::string known;
    for (const auto& d : definitions()) known += (known.empty() ? "" : ", ") + std::string(d.name);
    return Status(ErrorCode::unsupported, "tokenizer.ggml.pre",
                  "unknown pre-tokenizer '" + std::string(name) + "' (known: " + known + ")");
  }
  PreTokenizer pt;
  pt.name_ = std::string(name);
  for (std::string_view expr : def->exprs) {
    int err = 0;
    PCRE2_SIZE err_off = 0;
    auto rx = std::make_unique<Regex>();
    rx->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(expr.data()), expr.size(), PCRE2_UTF | PCRE2_UCP, &err,
                             &err_off, nullptr);
    if (rx->code == nullptr) {
      return Status(ErrorCode::internal, "tokenizer.ggml.pre",
                    "cannot compile expression at offset " + std::to_string(err_off) + ": " + pcre2_message(err));
    }
    rx->jit = pcre2_jit_compile(rx->code, PCRE2_JIT_COMPLETE) == 0;  // interpreter if no JIT
    pt.regexes_.push_back(std::move(rx));
  }
  return pt;
}

bool PreTokenizer::jit() const noexcept {
  for (const auto& rx : regexes_) {
    if (!rx->jit) return false;
  }
  return !regexes_.empty();
}

namespace {

struct MatchData {
  pcre2_match_data* md = nullptr;
  explicit MatchData(const pcre2_code* code) : md(pcre2_match_data_create_from_pattern(code, nullptr)) {}
  ~MatchData() { pcre2_match_data_free(md); }
  MatchData(const MatchData&) = delete;
  MatchData& operator=(const MatchData&) = delete;
};

std::size_t utf8_char_len(unsigned char b) {
  if (b < 0x80) return 1;
  if (b >= 0xF0) return 4;
  if (b >= 0xE0) return 3;
  return 2;
}

}  // namespace

Status PreTokenizer::split(std::string_view text, Span range, std::vector<Span>& out) const {
  std::vector<Span> cur{range}, next;
  for (const auto& rx : regexes_) {
    MatchData data(rx->code);
    if (data.md == nullptr) return Status(ErrorCode::out_of_memory, "pre_tokenize", "pcre2 match data");
    next.clear();
    for (const Span piece : cur) {
      const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data() + piece.begin);
      const std::size_t len = piece.end - piece.begin;
      std::size_t start = 0, last = 0;
      while (start < len) {
        // The whole text was checked to be valid UTF-8 and pieces end on code point boundaries.
        int rc = pcre2_match(rx->code, subject, len, start, PCRE2_NO_UTF_CHECK, data.md, nullptr);
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
          rc = pcre2_match(rx->code, subject, len, start, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, data.md, nullptr);
        }
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
          return Status(ErrorCode::internal, "pre_tokenize",
                        "regex match failed at byte " + std::to_string(piece.begin + start) + ": " + pcre2_message(rc));
        }
        const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(data.md);
        const std::size_t mb = ov[0], me = ov[1];
        if (me == mb) {  // empty match (none of our expressions has one): step over a code point
          if (mb >= len) break;
          start = mb + utf8_char_len(static_cast<unsigned char>(text[piece.begin + mb]));
          continue;
        }
        if (mb > last) next.push_back({piece.begin + last, piece.begin + mb});
        next.push_back({piece.begin + mb, piece.begin + me});
        last = me;
        start = me;
      }
      if (last < len) next.push_back({piece.begin + last, piece.end});
    }
    cur.swap(next);
  }
  out.insert(out.end(), cur.begin(), cur.end());
  return {};
}

}  // namespace kallpa::tokenizer::detail
