#include "kallpa/tokenizer/tokenizer.h"

#include <algorithm>
#include <array>
#include <functional>
#include <limits>

#include "tokenizer/byte_level.h"
#include "tokenizer/pre_tokenizer.h"
#include "tokenizer/utf8.h"

namespace kallpa::tokenizer {

using detail::ByteLevel;
using detail::PreTokenizer;
using detail::Span;

namespace {

std::uint64_t pair_key(TokenId a, TokenId b) {
  return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) | static_cast<std::uint32_t>(b);
}

// "<0xNN>" -> NN, or -1.
int parse_byte_token(std::string_view s) {
  if (s.size() != 6 || s.substr(0, 3) != "<0x" || s[5] != '>') return -1;
  auto hex = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  const int hi = hex(s[3]), lo = hex(s[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

// The bytes a NORMAL token's byte-level text stands for. A code point outside the byte-level
// alphabet (not produced by GPT-2 vocabularies) is kept as its UTF-8 text, as llama.cpp does.
std::string byte_level_decode(std::string_view text) {
  const ByteLevel& bl = ByteLevel::get();
  std::string out;
  out.reserve(text.size());
  std::size_t i = 0;
  while (i < text.size()) {
    const detail::Utf8Step st = detail::utf8_step(text, i);
    if (st.kind != detail::Utf8Kind::ok) {  // not UTF-8 at all: keep the raw byte
      out.push_back(text[i]);
      ++i;
      continue;
    }
    char32_t cp = 0;
    const auto b0 = static_cast<std::uint8_t>(text[i]);
    if (st.len == 1) {
      cp = b0;
    } else {
      cp = static_cast<char32_t>(b0 & (0xFF >> (st.len + 1)));
      for (std::size_t k = 1; k < st.len; ++k) cp = (cp << 6) | (static_cast<std::uint8_t>(text[i + k]) & 0x3F);
    }
    if (cp < bl.cp_to_byte.size() && bl.cp_to_byte[cp] >= 0) {
      out.push_back(static_cast<char>(bl.cp_to_byte[cp]));
    } else {
      out.append(text.substr(i, st.len));
    }
    i += st.len;
  }
  return out;
}

// A SentencePiece NORMAL token's text with its U+2581 marks turned back into spaces.
std::string spm_decode(std::string_view text) {
  constexpr std::string_view mark = "\xE2\x96\x81";
  std::string out;
  out.reserve(text.size());
  for (std::size_t i = 0; i < text.size();) {
    if (text.substr(i, mark.size()) == mark) {
      out.push_back(' ');
      i += mark.size();
    } else {
      out.push_back(text[i++]);
    }
  }
  return out;
}

struct Merge {
  std::int32_t rank;
  TokenId result;
};

// Merge table: open addressing, linear probing, keyed by the (left, right) id pair. Far fewer
// cache misses than std::unordered_map's nodes; the lookup is the BPE loop's hot spot.
class MergeTable {
 public:
  void reserve(std::size_t n) {
    std::size_t cap = 16;
    int bits = 4;
    while (cap < 2 * n) {
      cap <<= 1;
      ++bits;
    }
    slots_.assign(cap, Slot{kEmptyKey, {0, 0}});
    mask_ = cap - 1;
    shift_ = 64 - bits;
  }
  // Keeps the first value of a key; returns false if the key was already there.
  bool insert(std::uint64_t key, Merge m) {
    for (std::size_t i = index(key);; i = (i + 1) & mask_) {
      if (slots_[i].key == kEmptyKey) {
        slots_[i] = {key, m};
        return true;
      }
      if (slots_[i].key == key) return false;
    }
  }
  const Merge* find(std::uint64_t key) const {
    if (slots_.empty()) return nullptr;
    for (std::size_t i = index(key);; i = (i + 1) & mask_) {
      if (slots_[i].key == key) return &slots_[i].value;
      if (slots_[i].key == kEmptyKey) return nullptr;
    }
  }

 private:
  static constexpr std::uint64_t kEmptyKey = ~std::uint64_t{0};  // ids are < 2^31: never a real key
  struct Slot {
    std::uint64_t key;
    Merge value;
  };
  std::size_t index(std::uint64_t key) const {
    key ^= key >> 29;
    key *= 0x9E3779B97F4A7C15ULL;  // Fibonacci hashing: the top bits are well mixed
    return static_cast<std::size_t>(key >> shift_);
  }
  std::vector<Slot> slots_;
  std::size_t mask_ = 0;
  int shift_ = 60;
};

// Text -> id over the vocabulary: open addressing on (hash, id) pairs, comparing against the
// vocabulary's own strings: one allocation for the whole vocabulary instead of a node per token
// (bench/results/tokenizer-spm.md), and a lookup (the SentencePiece merge loop's hot spot) reads
// one slot before the string itself.
class TokenIndex {
 public:
  // Indexes every non-empty token; of equal texts the last one wins (as HF and llama.cpp).
  void build(const std::vector<std::string>& tokens) {
    tokens_ = &tokens;
    std::size_t cap = 16;
    while (cap < 2 * tokens.size()) cap <<= 1;
    slots_.assign(cap, Slot{0, -1});
    mask_ = cap - 1;
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      if (tokens[i].empty()) continue;
      const std::uint64_t h = hash(tokens[i]);
      for (std::size_t k = h & mask_;; k = (k + 1) & mask_) {
        Slot& slot = slots_[k];
        if (slot.id < 0 || (slot.hash == static_cast<std::uint32_t>(h >> 32) &&
                            (*tokens_)[static_cast<std::size_t>(slot.id)] == tokens[i])) {
          slot = {static_cast<std::uint32_t>(h >> 32), static_cast<TokenId>(i)};
          break;
        }
      }
    }
  }
  // The token whose text is s, or -1.
  TokenId find(std::string_view s) const {
    if (slots_.empty()) return -1;
    const std::uint64_t h = hash(s);
    for (std::size_t k = h & mask_;; k = (k + 1) & mask_) {
      const Slot& slot = slots_[k];
      if (slot.id < 0) return -1;
      if (slot.hash == static_cast<std::uint32_t>(h >> 32) && (*tokens_)[static_cast<std::size_t>(slot.id)] == s) {
        return slot.id;
      }
    }
  }

 private:
  struct Slot {
    std::uint32_t hash;  // the hash's high half: most mismatches end here, without the string
    TokenId id;          // -1: empty
  };
  static std::uint64_t hash(std::string_view s) { return std::hash<std::string_view>{}(s)*0x9E3779B97F4A7C15ULL; }
  const std::vector<std::string>* tokens_ = nullptr;
  std::vector<Slot> slots_;
  std::size_t mask_ = 0;
};

struct Special {
  std::string text;
  TokenId id;
  bool always;  // USER_DEFINED: matched even when !parse_special
};

}  // namespace

struct Tokenizer::Impl {
  std::string model;
  bool spm = false;  // SentencePiece BPE by scores ("llama"), else byte-level BPE by merges
  bool add_space_prefix = false;
  std::vector<float> scores;  // spm only
  std::vector<TokenId> eog;   // sorted
  std::vector<std::string> tokens;
  std::vector<TokenType> types;
  std::vector<std::string> bytes;  // what each token decodes to
  TokenIndex token_to_id;
  std::array<TokenId, 256> byte_token{};     // token of each byte's byte-level symbol, or -1
  std::array<TokenId, 256> byte_fallback{};  // <0xNN> BYTE token, or -1
  MergeTable merges;
  std::array<std::vector<Special>, 256> specials;  // by first byte, longest first
  std::optional<PreTokenizer> pre;
  std::optional<TokenId> bos, eos, unk, pad, eot, eom;
  bool add_bos = false, add_eos = false;

  std::optional<std::pair<std::size_t, TokenId>> match_special(std::string_view s, std::size_t i,
                                                               bool parse_special) const {
    for (const Special& sp : specials[static_cast<std::uint8_t>(s[i])]) {
      if (!sp.always && !parse_special) continue;
      if (s.size() - i >= sp.text.size() && s.compare(i, sp.text.size(), sp.text) == 0) {
        return std::make_pair(sp.text.size(), sp.id);
      }
    }
    return std::nullopt;
  }

  Status bpe(std::string_view piece, MissingByte missing, std::vector<TokenId>& out) const;
  Status encode_fragment(std::string_view text, Span range, MissingByte missing, std::vector<TokenId>& out) const;
  Status spm_fragment(std::string_view fragment, bool space_prefix, MissingByte missing,
                      std::vector<TokenId>& out) const;
  Status missing_bytes(std::string_view bytes, MissingByte missing, std::vector<TokenId>& out) const;
};

namespace {

struct Symbol {
  TokenId id;  // -1: a byte with no token of its own (never merged)
  std::int32_t prev, next;
  std::uint32_t pos;  // byte offset of the symbol in the piece (for the fallback of unknown bytes)
};

struct Candidate {
  std::int32_t rank;
  std::int32_t left;
  TokenId left_id, right_id, result;
  // Lowest rank first; among equal ranks, leftmost first (as Hugging Face and llama.cpp do).
  bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
};

}  // namespace

Status Tokenizer::Impl::bpe(std::string_view piece, MissingByte missing, std::vector<TokenId>& out) const {
  thread_local std::vector<Symbol> syms;
  thread_local std::vector<Candidate> heap;
  syms.clear();
  for (std::size_t i = 0; i < piece.size(); ++i) {
    const auto n = static_cast<std::int32_t>(i);
    syms.push_back({byte_token[static_cast<std::uint8_t>(piece[i])], n - 1, n + 1, static_cast<std::uint32_t>(i)});
  }
  if (!syms.empty()) syms.back().next = -1;

  heap.clear();  // a binary min-heap (std::greater) on (rank, position)
  auto try_push = [&](std::int32_t left) {
    if (left < 0) return;
    const std::int32_t right = syms[static_cast<std::size_t>(left)].next;
    if (right < 0) return;
    const TokenId a = syms[static_cast<std::size_t>(left)].id, b = syms[static_cast<std::size_t>(right)].id;
    if (a < 0 || b < 0) return;
    const Merge* m = merges.find(pair_key(a, b));
    if (m == nullptr) return;
    heap.push_back({m->rank, left, a, b, m->result});
    std::push_heap(heap.begin(), heap.end(), std::greater<>{});
  };
  for (std::int32_t i = 0; i + 1 < static_cast<std::int32_t>(syms.size()); ++i) try_push(i);

  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<>{});
    const Candidate c = heap.back();
    heap.pop_back();
    Symbol& l = syms[static_cast<std::size_t>(c.left)];
    if (l.id != c.left_id || l.next < 0) continue;  // stale: the left symbol changed or was absorbed
    Symbol& r = syms[static_cast<std::size_t>(l.next)];
    if (r.id != c.right_id) continue;  // stale: the right neighbour changed
    l.id = c.result;
    l.next = r.next;
    if (r.next >= 0) syms[static_cast<std::size_t>(r.next)].prev = c.left;
    r.id = -2;  // absorbed
    r.next = -1;
    try_push(l.prev);
    try_push(c.left);
  }

  for (std::int32_t i = syms.empty() ? -1 : 0; i >= 0; i = syms[static_cast<std::size_t>(i)].next) {
    const Symbol& s = syms[static_cast<std::size_t>(i)];
    if (s.id >= 0) {
      out.push_back(s.id);
      continue;
    }
    if (Status st = missing_bytes(piece.substr(s.pos, 1), missing, out); !st) return st;
  }
  return {};
}

// Bytes with no token of their own: their <0xNN> tokens, else as the policy says.
Status Tokenizer::Impl::missing_bytes(std::string_view bytes_in, MissingByte missing, std::vector<TokenId>& out) const {
  for (const char c : bytes_in) {
    const auto byte = static_cast<std::uint8_t>(c);
    if (byte_fallback[byte] >= 0) {
      out.push_back(byte_fallback[byte]);
    } else if (missing == MissingByte::unknown_token) {
      if (unk) out.push_back(*unk);
    } else if (missing == MissingByte::fail) {
      return Status(ErrorCode::unsupported, "text",
                    "byte 0x" + std::string(1, "0123456789ABCDEF"[byte >> 4]) + "0123456789ABCDEF"[byte & 15] +
                        " has no token (neither its symbol nor <0xNN> is in the vocabulary)");
    }
  }
  return {};
}

namespace {

constexpr std::string_view kSpmSpace = "\xE2\x96\x81";  // U+2581 LOWER ONE EIGHTH BLOCK

void append_spm_escaped(std::string& out, std::string_view text) {
  for (const char c : text) {
    if (c == ' ') {
      out.append(kSpmSpace);
    } else {
      out.push_back(c);
    }
  }
}

std::string spm_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size() + 8);
  append_spm_escaped(out, text);
  return out;
}

struct SpmSymbol {
  std::uint32_t begin, len;
  std::int32_t prev, next;
};

struct SpmCandidate {
  float score;
  std::int32_t left;
  std::uint32_t len;  // of the merged text, to recognise a stale candidate
  // The heap's top is the highest score, then the leftmost.
  bool operator<(const SpmCandidate& o) const { return score != o.score ? score < o.score : left > o.left; }
};

}  // namespace

Status Tokenizer::Impl::spm_fragment(std::string_view fragment, bool space_prefix, MissingByte missing,
                                     std::vector<TokenId>& out) const {
  if (fragment.empty()) return {};
  thread_local std::string text;
  thread_local std::vector<SpmSymbol> syms;
  thread_local std::vector<SpmCandidate> heap;
  text.clear();
  if (space_prefix) text.append(kSpmSpace);
  append_spm_escaped(text, fragment);
  syms.clear();
  for (std::size_t i = 0; i < text.size();) {  // one symbol per code point (the text is valid UTF-8)
    const std::size_t len = std::max<std::size_t>(1, detail::utf8_step(text, i).len);
    const auto n = static_cast<std::int32_t>(syms.size());
    syms.push_back({static_cast<std::uint32_t>(i), static_cast<std::uint32_t>(len), n - 1, n + 1});
    i += len;
  }
  syms.back().next = -1;

  heap.clear();
  auto try_push = [&](std::int32_t left) {
    if (left < 0) return;
    const SpmSymbol& l = syms[static_cast<std::size_t>(left)];
    if (l.next < 0) return;
    const SpmSymbol& r = syms[static_cast<std::size_t>(l.next)];
    const TokenId id = token_to_id.find(std::string_view(text).substr(l.begin, l.len + r.len));
    if (id < 0 || types[static_cast<std::size_t>(id)] != TokenType::normal) return;
    heap.push_back({scores[static_cast<std::size_t>(id)], left, l.len + r.len});
    std::push_heap(heap.begin(), heap.end());
  };
  for (std::int32_t i = 0; i + 1 < static_cast<std::int32_t>(syms.size()); ++i) try_push(i);

  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end());
    const SpmCandidate c = heap.back();
    heap.pop_back();
    SpmSymbol& l = syms[static_cast<std::size_t>(c.left)];
    if (l.len == 0 || l.next < 0) continue;  // absorbed, or nothing to its right any more
    SpmSymbol& r = syms[static_cast<std::size_t>(l.next)];
    if (l.len + r.len != c.len) continue;  // stale: a neighbour changed since the candidate was made
    l.len += r.len;
    r.len = 0;
    l.next = r.next;
    if (r.next >= 0) syms[static_cast<std::size_t>(r.next)].prev = c.left;
    try_push(l.prev);
    try_push(c.left);
  }

  for (std::int32_t i = 0; i >= 0; i = syms[static_cast<std::size_t>(i)].next) {
    const SpmSymbol& sym = syms[static_cast<std::size_t>(i)];
    const std::string_view piece = std::string_view(text).substr(sym.begin, sym.len);
    if (const TokenId id = token_to_id.find(piece); id >= 0) {
      const TokenType t = types[static_cast<std::size_t>(id)];
      if (t == TokenType::normal || t == TokenType::user_defined || t == TokenType::unused) {
        out.push_back(id);
        continue;
      }
    }
    // A code point with no token: its <0xNN> byte tokens, or (a vocabulary without them) the
    // policy applied once for the whole code point, as SentencePiece emits one <unk> per piece.
    const bool spelled = std::all_of(piece.begin(), piece.end(),
                                     [this](char c) { return byte_fallback[static_cast<std::uint8_t>(c)] >= 0; });
    if (Status st = missing_bytes(spelled ? piece : piece.substr(0, 1), missing, out); !st) return st;
  }
  return {};
}

Status Tokenizer::Impl::encode_fragment(std::string_view text, Span range, MissingByte missing,
                                        std::vector<TokenId>& out) const {
  if (range.end <= range.begin) return {};
  thread_local std::vector<Span> pieces;
  pieces.clear();
  if (Status st = pre->split(text, range, pieces); !st) return st;
  for (const Span p : pieces) {
    if (Status st = bpe(text.substr(p.begin, p.end - p.begin), missing, out); !st) return st;
  }
  return {};
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

std::vector<std::string> known_pre_tokenizers() { return PreTokenizer::known_names(); }

namespace {

constexpr std::array<std::string_view, 22> kEogTexts = {
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<\xEF\xBD\x9C"
    "end\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>",  // <｜end▁of▁sentence｜>
    "[e~[",
};

}  // namespace

Result<Tokenizer> Tokenizer::create(TokenizerData data) {
  if (data.model != "gpt2" && data.model != "llama") {
    return Status(ErrorCode::unsupported, "tokenizer.ggml.model",
                  "tokenizer model '" + data.model +
                      "' is not supported (byte-level BPE \"gpt2\" and SentencePiece BPE \"llama\" are)");
  }
  auto impl = std::make_unique<Impl>();
  impl->model = data.model;
  impl->spm = data.model == "llama";
  impl->add_space_prefix = impl->spm && data.add_space_prefix.value_or(true);
  const std::size_t n = data.tokens.size();
  if (n == 0) return Status::invalid("tokenizer.ggml.tokens", "the vocabulary is empty");
  if (n > static_cast<std::size_t>(std::numeric_limits<TokenId>::max())) {
    return Status::invalid("tokenizer.ggml.tokens", "too many tokens: " + std::to_string(n));
  }
  if (!data.token_types.empty() && data.token_types.size() != n) {
    return Status::invalid("tokenizer.ggml.token_type", std::to_string(data.token_types.size()) + " token types for " +
                                                            std::to_string(n) + " tokens");
  }

  if (impl->spm) {
    if (!data.scores.empty() && data.scores.size() != n) {
      return Status::invalid("tokenizer.ggml.scores",
                             std::to_string(data.scores.size()) + " scores for " + std::to_string(n) + " tokens");
    }
    impl->scores = std::move(data.scores);
    impl->scores.resize(n, 0.0f);
  } else {
    auto pre = PreTokenizer::create(data.pre);
    if (!pre) return pre.status();
    impl->pre.emplace(std::move(pre).value());
  }

  impl->types.resize(n, TokenType::normal);
  impl->bytes.resize(n);
  impl->byte_token.fill(-1);
  impl->byte_fallback.fill(-1);
  impl->tokens = std::move(data.tokens);
  for (std::size_t i = 0; i < n; ++i) {
    const auto id = static_cast<TokenId>(i);
    const std::string& text = impl->tokens[i];
    if (!data.token_types.empty()) {
      const std::int32_t t = data.token_types[i];
      if (t < 0 || t > static_cast<std::int32_t>(TokenType::byte)) {
        return Status::invalid("tokenizer.ggml.token_type[" + std::to_string(i) + "]",
                               "unknown token type " + std::to_string(t));
      }
      impl->types[i] = static_cast<TokenType>(t);
    }
    switch (impl->types[i]) {
      case TokenType::control:
      case TokenType::user_defined:
      case TokenType::unknown: impl->bytes[i] = text; break;
      case TokenType::byte: {
        const int b = parse_byte_token(text);
        if (b < 0) {
          return Status::invalid("tokenizer.ggml.tokens[" + std::to_string(i) + "]",
                                 "BYTE token '" + text + "' is not of the form <0xNN>");
        }
        impl->bytes[i] = std::string(1, static_cast<char>(b));
        if (impl->byte_fallback[static_cast<std::size_t>(b)] < 0) impl->byte_fallback[static_cast<std::size_t>(b)] = id;
        break;
      }
      default: impl->bytes[i] = impl->spm ? spm_decode(text) : byte_level_decode(text); break;
    }
    if ((impl->types[i] == TokenType::control || impl->types[i] == TokenType::user_defined) && !text.empty()) {
      impl->specials[static_cast<std::uint8_t>(text[0])].push_back(
          {text, id, impl->types[i] == TokenType::user_defined});
    }
  }
  impl->token_to_id.build(impl->tokens);
  for (auto& bucket : impl->specials) {
    std::stable_sort(bucket.begin(), bucket.end(),
                     [](const Special& a, const Special& b) { return a.text.size() > b.text.size(); });
  }
  if (!impl->spm) {
    const ByteLevel& bl = ByteLevel::get();
    for (std::size_t b = 0; b < 256; ++b) {
      std::string sym;
      detail::append_utf8(sym, bl.byte_to_cp[b]);
      impl->byte_token[b] = impl->token_to_id.find(sym);
    }
  }

  if (impl->spm) data.merges.clear();  // SentencePiece merges by score; merges, if any, are not used
  impl->merges.reserve(data.merges.size());
  for (std::size_t i = 0; i < data.merges.size(); ++i) {
    const std::string& m = data.merges[i];
    const auto field = [i] { return "tokenizer.ggml.merges[" + std::to_string(i) + "]"; };
    const std::size_t sp = m.size() > 1 ? m.find(' ', 1) : std::string::npos;
    if (sp == std::string::npos || sp + 1 >= m.size()) {
      return Status::invalid(field(), "merge '" + m + "' is not two tokens separated by a space");
    }
    const std::string_view left(m.data(), sp), right(m.data() + sp + 1, m.size() - sp - 1);
    const TokenId l = impl->token_to_id.find(left), r = impl->token_to_id.find(right);
    if (l < 0 || r < 0) {
      return Status::invalid(
          field(), "merge '" + m + "' refers to '" + std::string(l < 0 ? left : right) + "', which is not a token");
    }
    std::string joined;
    joined.reserve(m.size() - 1);
    joined.append(left).append(right);
    const TokenId res = impl->token_to_id.find(joined);
    if (res < 0) {
      return Status::invalid(field(), "merge '" + m + "' gives '" + joined + "', which is not a token");
    }
    if (i > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max())) {
      return Status::invalid("tokenizer.ggml.merges", "too many merges");
    }
    // A repeated merge keeps its first (lowest) rank, as llama.cpp does.
    impl->merges.insert(pair_key(l, r), Merge{static_cast<std::int32_t>(i), res});
  }

  auto special = [n](const std::optional<std::int64_t>& v, const char* key, std::optional<TokenId>& dst) -> Status {
    if (!v) return {};
    if (*v < 0 || *v >= static_cast<std::int64_t>(n)) {
      return Status::invalid(
          key, "token id " + std::to_string(*v) + " is outside the vocabulary [0, " + std::to_string(n) + ")");
    }
    dst = static_cast<TokenId>(*v);
    return {};
  };
  if (Status st = special(data.bos_id, "tokenizer.ggml.bos_token_id", impl->bos); !st) return st;
  if (Status st = special(data.eos_id, "tokenizer.ggml.eos_token_id", impl->eos); !st) return st;
  if (Status st = special(data.unk_id, "tokenizer.ggml.unknown_token_id", impl->unk); !st) return st;
  if (Status st = special(data.pad_id, "tokenizer.ggml.padding_token_id", impl->pad); !st) return st;
  if (Status st = special(data.eot_id, "tokenizer.ggml.eot_token_id", impl->eot); !st) return st;
  if (Status st = special(data.eom_id, "tokenizer.ggml.eom_token_id", impl->eom); !st) return st;
  for (const auto& id : {impl->eos, impl->eot, impl->eom}) {
    if (id) impl->eog.push_back(*id);
  }
  // Only CONTROL tokens: llama.cpp also takes a non-control token with one of these texts (and
  // warns), which in Gemma's vocabulary makes the HTML tag "</s>" (USER_DEFINED) end generation.
  for (const std::string_view text : kEogTexts) {
    const TokenId id = impl->token_to_id.find(text);
    if (id >= 0 && impl->types[static_cast<std::size_t>(id)] == TokenType::control) {
      impl->eog.push_back(id);
    }
  }
  std::sort(impl->eog.begin(), impl->eog.end());
  impl->eog.erase(std::unique(impl->eog.begin(), impl->eog.end()), impl->eog.end());
  if (data.add_bos && !impl->bos) {
    return Status::invalid("tokenizer.ggml.add_bos_token", "add_bos is set but there is no bos_token_id");
  }
  if (data.add_eos && !impl->eos) {
    return Status::invalid("tokenizer.ggml.add_eos_token", "add_eos is set but there is no eos_token_id");
  }
  impl->add_bos = data.add_bos;
  impl->add_eos = data.add_eos;
  return Tokenizer(std::move(impl));
}

namespace {

// Checks the text per the policy; returns the view to tokenize (possibly of `storage`).
Result<std::string_view> checked_text(std::string_view text, InvalidUtf8 policy, std::string& storage) {
  const auto bad = detail::first_invalid_utf8(text);
  if (!bad) return text;
  if (policy == InvalidUtf8::reject) {
    return Status::invalid("text", "ill-formed UTF-8 at byte offset " + std::to_string(*bad));
  }
  storage.reserve(text.size() + 8);
  detail::utf8_sanitize(text, storage, /*final=*/true);
  return std::string_view(storage);
}

}  // namespace

Result<std::vector<TokenId>> Tokenizer::encode(std::string_view text, const EncodeOptions& options) const {
  return encode(text, options, {});
}

Result<std::vector<TokenId>> Tokenizer::encode(std::string_view text, const EncodeOptions& options,
                                               std::span<const TextRange> plain) const {
  std::string storage;
  auto checked = checked_text(text, plain.empty() ? options.invalid_utf8 : InvalidUtf8::reject, storage);
  if (!checked) return checked.status();
  const std::string_view s = *checked;
  for (std::size_t k = 0; k < plain.size(); ++k) {
    if (plain[k].begin > plain[k].end || plain[k].end > s.size() || (k > 0 && plain[k].begin < plain[k - 1].end)) {
      return Status::invalid("plain[" + std::to_string(k) + "]", "ranges must be sorted, disjoint and inside the text");
    }
  }
  std::size_t next_plain = 0;  // the first range that ends after the position being matched
  auto overlaps_plain = [&](std::size_t begin, std::size_t end) {
    while (next_plain < plain.size() && plain[next_plain].end <= begin) ++next_plain;
    return next_plain < plain.size() && plain[next_plain].begin < end;
  };

  std::vector<TokenId> ids;
  ids.reserve(s.size() / 3 + 4);
  if (options.add_special && impl_->add_bos) ids.push_back(*impl_->bos);
  // SentencePiece's space prefix goes before the text and after each special token (llama.cpp).
  bool after_special = true;
  auto fragment = [&](std::size_t begin, std::size_t end) -> Status {
    if (end <= begin) return {};
    if (!impl_->spm) return impl_->encode_fragment(s, {begin, end}, options.missing_byte, ids);
    const bool prefix = impl_->add_space_prefix && after_special;
    after_special = false;
    return impl_->spm_fragment(s.substr(begin, end - begin), prefix, options.missing_byte, ids);
  };
  std::size_t frag = 0, i = 0;
  while (i < s.size()) {
    auto m = impl_->match_special(s, i, options.parse_special);
    if (m && overlaps_plain(i, i + m->first)) m.reset();
    if (!m) {
      ++i;
      continue;
    }
    if (Status st = fragment(frag, i); !st) return st;
    ids.push_back(m->second);
    after_special = true;
    i += m->first;
    frag = i;
  }
  if (Status st = fragment(frag, s.size()); !st) return st;
  if (options.add_special && impl_->add_eos) ids.push_back(*impl_->eos);
  return ids;
}

Result<std::vector<std::string>> Tokenizer::pre_tokenize(std::string_view text) const {
  std::string storage;
  auto checked = checked_text(text, InvalidUtf8::replace, storage);
  if (!checked) return checked.status();
  const std::string_view s = *checked;
  if (impl_->spm) return std::vector<std::string>{spm_escape(s)};
  std::vector<Span> spans;
  if (!s.empty()) {
    if (Status st = impl_->pre->split(s, {0, s.size()}, spans); !st) return st;
  }
  std::vector<std::string> out;
  out.reserve(spans.size());
  for (const Span p : spans) out.emplace_back(s.substr(p.begin, p.end - p.begin));
  return out;
}

Result<std::string> Tokenizer::decode_bytes(std::span<const TokenId> ids, const DecodeOptions& options) const {
  std::string out;
  for (std::size_t k = 0; k < ids.size(); ++k) {
    const TokenId id = ids[k];
    if (id < 0 || static_cast<std::size_t>(id) >= impl_->tokens.size()) {
      return Status::invalid("ids[" + std::to_string(k) + "]", "token id " + std::to_string(id) +
                                                                   " is outside the vocabulary [0, " +
                                                                   std::to_string(impl_->tokens.size()) + ")");
    }
    if (options.skip_special && impl_->types[static_cast<std::size_t>(id)] == TokenType::control) continue;
    out += impl_->bytes[static_cast<std::size_t>(id)];
  }
  return out;
}

Result<std::string> Tokenizer::decode(std::span<const TokenId> ids, const DecodeOptions& options) const {
  auto raw = decode_bytes(ids, options);
  if (!raw) return raw.status();
  if (!detail::first_invalid_utf8(*raw)) return raw;
  std::string out;
  out.reserve(raw->size() + 8);
  detail::utf8_sanitize(*raw, out, /*final=*/true);
  return out;
}

std::size_t Tokenizer::vocab_size() const noexcept { return impl_->tokens.size(); }

std::optional<TokenId> Tokenizer::token_id(std::string_view token_text) const {
  const TokenId id = impl_->token_to_id.find(token_text);
  if (id < 0) return std::nullopt;
  return id;
}

namespace {
const std::string kEmpty;
}

const std::string& Tokenizer::token_text(TokenId id) const {
  if (id < 0 || static_cast<std::size_t>(id) >= impl_->tokens.size()) return kEmpty;
  return impl_->tokens[static_cast<std::size_t>(id)];
}

const std::string& Tokenizer::token_bytes(TokenId id) const {
  if (id < 0 || static_cast<std::size_t>(id) >= impl_->tokens.size()) return kEmpty;
  return impl_->bytes[static_cast<std::size_t>(id)];
}

TokenType Tokenizer::token_type(TokenId id) const {
  if (id < 0 || static_cast<std::size_t>(id) >= impl_->tokens.size()) return TokenType::undefined;
  return impl_->types[static_cast<std::size_t>(id)];
}

bool Tokenizer::is_control(TokenId id) const { return token_type(id) == TokenType::control; }

std::optional<TokenId> Tokenizer::bos_id() const noexcept { return impl_->bos; }
std::optional<TokenId> Tokenizer::eos_id() const noexcept { return impl_->eos; }
std::optional<TokenId> Tokenizer::unk_id() const noexcept { return impl_->unk; }
std::optional<TokenId> Tokenizer::pad_id() const noexcept { return impl_->pad; }
std::optional<TokenId> Tokenizer::eot_id() const noexcept { return impl_->eot; }
std::optional<TokenId> Tokenizer::eom_id() const noexcept { return impl_->eom; }
const std::vector<TokenId>& Tokenizer::eog_ids() const noexcept { return impl_->eog; }
bool Tokenizer::is_eog(TokenId id) const noexcept {
  return std::binary_search(impl_->eog.begin(), impl_->eog.end(), id);
}
bool Tokenizer::add_space_prefix() const noexcept { return impl_->add_space_prefix; }
const std::string& Tokenizer::model_name() const noexcept { return impl_->model; }
bool Tokenizer::add_bos() const noexcept { return impl_->add_bos; }
bool Tokenizer::add_eos() const noexcept { return impl_->add_eos; }
const std::string& Tokenizer::pre_tokenizer_name() const noexcept { return impl_->pre ? impl_->pre->name() : kEmpty; }
bool Tokenizer::regex_jit() const noexcept { return impl_->pre && impl_->pre->jit(); }

// ---- StreamDecoder ----

StreamDecoder::StreamDecoder(const Tokenizer& tokenizer, DecodeOptions options)
    : tokenizer_(&tokenizer), options_(options) {}

Result<std::string> StreamDecoder::push(TokenId id) {
  const TokenId one[1] = {id};
  auto raw = tokenizer_->decode_bytes(one, options_);
  if (!raw) return raw.status();
  pending_ += *raw;
  std::string out;
  const std::size_t used = detail::utf8_sanitize(pending_, out, /*final=*/false);
  pending_.erase(0, used);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out;
  detail::utf8_sanitize(pending_, out, /*final=*/true);
  pending_.clear();
  return out;
}

void StreamDecoder::reset() noexcept { pending_.clear(); }

}  // namespace kallpa::tokenizer
