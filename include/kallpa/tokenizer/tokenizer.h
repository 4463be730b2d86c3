// The two tokenizer models GGUF files use, built from the plain data a GGUF file's tokenizer
// metadata carries: byte-level BPE (GPT-2 style, tokenizer.ggml.model "gpt2": SmolLM2, Llama 3,
// Qwen) and SentencePiece BPE ("llama": Gemma, Llama 2, Mistral). It does not depend on the GGUF
// loader: whoever reads the file copies the keys into a TokenizerData and calls Tokenizer::create().
//
//   GGUF key                        TokenizerData field
//   tokenizer.ggml.model            model          ("gpt2" or "llama")
//   tokenizer.ggml.pre              pre            ("smollm", "gpt2", "default", ...; see below)
//   tokenizer.ggml.tokens           tokens
//   tokenizer.ggml.token_type       token_types    (may be empty: every token is NORMAL)
//   tokenizer.ggml.scores           scores         ("llama" only: higher merges first)
//   tokenizer.ggml.merges           merges         ("gpt2" only: "left right", by rank)
//   tokenizer.ggml.bos_token_id     bos_id         (likewise eos, eot, eom, unknown, padding)
//   tokenizer.ggml.add_bos_token    add_bos        (likewise add_eos_token)
//   tokenizer.ggml.add_space_prefix add_space_prefix ("llama" only; absent: true, as llama.cpp)
//
// SentencePiece BPE ("llama"): special tokens are split off as below; in each remaining fragment
// spaces become U+2581 ("▁"), with one "▁" prepended when add_space_prefix is set and the fragment
// opens the text or follows a special token. The fragment starts as one symbol per code point; the
// adjacent pair whose concatenation is the NORMAL token with the highest score merges first (the
// leftmost among equal scores), until no pair is a token. A symbol that is no token becomes the
// <0xNN> BYTE tokens of its UTF-8 bytes (byte fallback), else follows EncodeOptions::missing_byte.
// This is SentencePiece's BPE encoding (and llama.cpp's "SPM" tokenizer); decode turns "▁" back
// into spaces (a space add_space_prefix added included: decode does not strip it).
//
// End of generation: is_eog() is true for eos, eot and eom ids and for the CONTROL tokens whose
// text is one llama.cpp treats as end of generation (<end_of_turn>, <|im_end|>, <|eot_id|>,
// <|endoftext|>, <|end|>, ...), whatever their ids. (llama.cpp takes such a text
// even from a non-control token; Gemma's vocabulary has "</s>" as an ordinary HTML tag.)
//
// Byte-level BPE ("gpt2"): (1) special tokens (CONTROL, and USER_DEFINED) are matched verbatim in the text,
// leftmost-longest, and split it into fragments; (2) each fragment is pre-tokenized by the
// regular expressions the pre-tokenizer names (PCRE2, Unicode properties, JIT when available);
// (3) each piece's bytes are mapped to the GPT-2 byte-level alphabet and merged by rank.
// A byte whose byte-level symbol is not in the vocabulary becomes the <0xNN> token when the
// vocabulary has one (byte fallback); otherwise EncodeOptions::missing_byte decides: by default it
// is dropped, as Hugging Face tokenizers (BPE without unk_token) and llama.cpp both do (SmolLM2's
// vocabulary lacks the symbols of bytes 0x04 0x06 0x13 0x14 0x16 0x1D 0xF1 0xF2, and of the bytes
// that never occur in UTF-8).
//
// Invalid UTF-8 input (the regexes need valid UTF-8): by default every ill-formed sequence is
// replaced with U+FFFD (one per maximal subpart, as Python's errors="replace" does) before
// tokenization; with InvalidUtf8::reject, encode() returns invalid_argument naming the byte offset.
//
// Decoding maps ids back to bytes (inverse byte mapping; CONTROL and USER_DEFINED tokens give
// their text verbatim; BYTE tokens <0xNN> give byte NN). decode() and StreamDecoder return valid
// UTF-8: ill-formed sequences become U+FFFD. StreamDecoder emits only complete code points and
// holds an incomplete tail until the next token or flush().
//
// Thread safety: a Tokenizer is immutable after create(); encode()/decode() may run concurrently.
// A StreamDecoder is a per-stream object (not shared between threads) that refers to its
// Tokenizer, which must outlive it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kallpa/status.h"

namespace kallpa::tokenizer {

using TokenId = std::int32_t;

// The values of GGUF's tokenizer.ggml.token_type (llama.cpp's llama_token_type).
enum class TokenType : std::int32_t {
  undefined = 0,
  normal = 1,
  unknown = 2,
  control = 3,       // <|im_start|>, <|endoftext|>, ...: matched verbatim when parse_special
  user_defined = 4,  // added tokens: always matched verbatim, always decoded
  unused = 5,
  byte = 6,  // <0xNN>
};

struct TokenizerData {
  std::string model = "gpt2";
  std::string pre = "default";
  std::vector<std::string> tokens;
  std::vector<std::int32_t> token_types;  // empty, or one per token
  std::vector<float> scores;              // empty, or one per token
  std::vector<std::string> merges;
  // Absent: nullopt. Present ids must lie in [0, tokens.size()) (GGUF stores them as uint32; pass
  // the raw value, an out-of-range one is reported, not truncated).
  std::optional<std::int64_t> bos_id, eos_id, unk_id, pad_id, eot_id, eom_id;
  bool add_bos = false;
  bool add_eos = false;
  std::optional<bool> add_space_prefix;  // nullopt: the model's default (true for "llama")
};

enum class InvalidUtf8 {
  replace,  // ill-formed sequences become U+FFFD before tokenization (default)
  reject,   // encode() fails with invalid_argument, field "text", naming the byte offset
};

// A byte with neither a byte-level symbol token nor a <0xNN> token.
enum class MissingByte {
  drop,           // skipped (default; what the reference implementations do)
  unknown_token,  // the unknown token (unk_id); dropped if there is none
  fail,           // encode() fails with unsupported, field "text", naming the byte
};

struct EncodeOptions {
  bool add_special = true;    // prepend BOS / append EOS when the model asks for it (add_bos/eos)
  bool parse_special = true;  // false: CONTROL token texts in the input are ordinary text
  InvalidUtf8 invalid_utf8 = InvalidUtf8::replace;
  MissingByte missing_byte = MissingByte::drop;
};

// A byte range [begin, end) of a text.
struct TextRange {
  std::size_t begin = 0;
  std::size_t end = 0;
};

struct DecodeOptions {
  bool skip_special = false;  // true: CONTROL tokens (BOS, EOS, <|im_start|>, ...) give no text
};

// Names accepted as TokenizerData::pre. "smollm" (and the llama.cpp pre-tokenizers that share its
// expressions: "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva") splits every
// digit on its own, then applies the GPT-2 expression; "gpt2" and "default" apply the GPT-2
// expression alone; "llama3"/"llama-bpe" and "qwen2" are the Llama 3 and Qwen2 expressions.
// (llama.cpp maps "default", the name converters write for an unrecognised tokenizer, to a legacy
// mix of four expressions; kallpa uses GPT-2's, which is what byte-level BPE vocabularies expect.)
std::vector<std::string> known_pre_tokenizers();

class Tokenizer {
 public:
  // Validates everything; a typed error names the metadata key (and index) at fault:
  // unsupported model or pre-tokenizer, token_type or score count, a token_type value, a merge
  // without a space or whose parts or result are not tokens, special ids out of range, add_bos
  // without bos_id.
  static Result<Tokenizer> create(TokenizerData data);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  Result<std::vector<TokenId>> encode(std::string_view text, const EncodeOptions& options = {}) const;
  // As encode(), but no special token is read where it would overlap one of `plain` (sorted,
  // disjoint byte ranges of text): there the text is ordinary text, whatever it spells. For
  // prompts rendered from a chat template, whose messages must not inject control tokens. The
  // ranges refer to the text as given: text that is not valid UTF-8 is invalid_argument here.
  Result<std::vector<TokenId>> encode(std::string_view text, const EncodeOptions& options,
                                      std::span<const TextRange> plain) const;

  // Pre-tokenization only (no special-token matching, no BPE): the pieces, as substrings of the
  // (UTF-8 checked) input; for "llama", the whole text with spaces as U+2581. For diagnostics.
  Result<std::vector<std::string>> pre_tokenize(std::string_view text) const;

  // Text of ids (valid UTF-8; ill-formed byte sequences become U+FFFD). invalid_argument for an
  // id outside the vocabulary.
  Result<std::string> decode(std::span<const TokenId> ids, const DecodeOptions& options = {}) const;
  // The raw bytes of ids, possibly not valid UTF-8 (a token may hold part of a code point).
  Result<std::string> decode_bytes(std::span<const TokenId> ids, const DecodeOptions& options = {}) const;

  std::size_t vocab_size() const noexcept;
  std::optional<TokenId> token_id(std::string_view token_text) const;
  // The token as stored in the vocabulary (byte-level alphabet for NORMAL tokens); "" if out of range.
  const std::string& token_text(TokenId id) const;
  // The bytes the token decodes to; "" if out of range.
  const std::string& token_bytes(TokenId id) const;
  TokenType token_type(TokenId id) const;  // undefined if out of range
  bool is_control(TokenId id) const;

  std::optional<TokenId> bos_id() const noexcept;
  std::optional<TokenId> eos_id() const noexcept;
  std::optional<TokenId> unk_id() const noexcept;
  std::optional<TokenId> pad_id() const noexcept;
  std::optional<TokenId> eot_id() const noexcept;
  std::optional<TokenId> eom_id() const noexcept;
  // End-of-generation tokens (sorted): generation stops when it samples one of these.
  const std::vector<TokenId>& eog_ids() const noexcept;
  bool is_eog(TokenId id) const noexcept;
  bool add_bos() const noexcept;
  bool add_eos() const noexcept;
  bool add_space_prefix() const noexcept;
  const std::string& model_name() const noexcept;          // "gpt2" or "llama"
  const std::string& pre_tokenizer_name() const noexcept;  // "" for "llama" (no pre-tokenizer)
  bool regex_jit() const noexcept;                         // whether PCRE2's JIT compiled the pre-tokenizer expressions

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  friend class StreamDecoder;
};

// Incremental detokenizer for streamed generation: push() returns the text that became complete
// (only whole code points; an incomplete UTF-8 tail is held back), flush() returns what is left
// (an incomplete tail becomes U+FFFD) and resets. The concatenation of every push() and the final
// flush() equals Tokenizer::decode() of the same ids.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer, DecodeOptions options = {});

  Result<std::string> push(TokenId id);
  std::string flush();
  void reset() noexcept;
  std::size_t pending_bytes() const noexcept { return pending_.size(); }

 private:
  const Tokenizer* tokenizer_;
  DecodeOptions options_;
  std::string pending_;
};

}  // namespace kallpa::tokenizer
