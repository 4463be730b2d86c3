// The tokenizers (byte-level and SentencePiece BPE), against their promises
// (kallpa/tokenizer/tokenizer.h, chat.h, chat_template.h):
//   text:  decode(encode(text)) == text for valid UTF-8 whose bytes the vocabulary spells, with
//          control-token texts parsed as specials or as ordinary text alike (SentencePiece: with
//          U+2581 read back as a space);
//   ids:   any id sequence decodes to valid UTF-8, or out-of-range ids give a typed error, and
//          StreamDecoder's pieces + flush() equal decode() of the same ids;
//   chat:  decode(encode_chatml(messages)) == format_chatml(messages);
//   template: a GGUF chat template (Jinja text) is read as ChatML options or refused with a typed
//          error, and options read from it render a conversation; the Jinja engine parses and
//          renders it or gives a typed error, never a crash, and marks message text inside the
//          output.
// The first input byte picks the property. The vocabularies: the synthetic byte-level one and a
// small SentencePiece one (always), and the GGUF at $KALLPA_FUZZ_TOKENIZER_MODEL when set and
// readable (the real SmolLM2 or Gemma-3-270M vocabulary).
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_target.h"
#include "kallpa/model/gguf.h"
#include "kallpa/model/gguf_tokenizer.h"
#include "kallpa/tokenizer/chat.h"
#include "kallpa/tokenizer/chat_template.h"
#include "support/synthetic_llama.h"
#include "tokenizer/utf8.h"

namespace {

using kallpa::tokenizer::TokenId;
using kallpa::tokenizer::Tokenizer;

std::vector<Tokenizer> load_tokenizers() {
  std::vector<Tokenizer> out;
  const auto bytes = kallpa::model::synthetic_llama();
  auto synthetic = kallpa::model::GgufFile::from_bytes(bytes);
  FUZZ_CHECK(synthetic.is_ok(), "the synthetic model does not load");
  auto tok = kallpa::model::tokenizer_from_gguf(**synthetic);
  FUZZ_CHECK(tok.is_ok(), "the synthetic vocabulary does not load");
  out.push_back(std::move(*tok));
  {
    // SentencePiece: ASCII letters, a few pieces with spaces, byte fallback for the rest.
    kallpa::tokenizer::TokenizerData d;
    d.model = "llama";
    auto add = [&](const std::string& t, kallpa::tokenizer::TokenType type, float score) {
      d.tokens.push_back(t);
      d.token_types.push_back(static_cast<std::int32_t>(type));
      d.scores.push_back(score);
    };
    add("<unk>", kallpa::tokenizer::TokenType::unknown, 0);
    add("<s>", kallpa::tokenizer::TokenType::control, 0);
    add("<end_of_turn>", kallpa::tokenizer::TokenType::control, 0);
    add("\n", kallpa::tokenizer::TokenType::user_defined, 0);
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof name, "<0x%02X>", b);
      add(name, kallpa::tokenizer::TokenType::byte, 0);
    }
    float score = -1;
    for (const char* t : {"\xE2\x96\x81", "e", "t", "a", "o", "h",
                          "\xE2\x96\x81"
                          "t",
                          "he",
                          "\xE2\x96\x81"
                          "the",
                          "at",
                          "\xE2\x96\x81"
                          "a"}) {
      add(t, kallpa::tokenizer::TokenType::normal, score);
      score -= 1;
    }
    d.unk_id = 0;
    d.bos_id = 1;
    d.add_space_prefix = false;  // with it, decode gives the added space back too
    auto spm = Tokenizer::create(std::move(d));
    FUZZ_CHECK(spm.is_ok(), "the SentencePiece vocabulary does not load");
    out.push_back(std::move(*spm));
  }
  if (const char* path = std::getenv("KALLPA_FUZZ_TOKENIZER_MODEL"); path != nullptr && *path != '\0') {
    auto file = kallpa::model::GgufFile::open(path);
    if (file) {
      auto real = kallpa::model::tokenizer_from_gguf(**file);
      FUZZ_CHECK(real.is_ok(), "the model's vocabulary does not load");
      out.push_back(std::move(*real));
    } else {
      std::fprintf(stderr, "tokenizer_fuzz: %s: %s (synthetic vocabulary only)\n", path,
                   file.status().message().c_str());
    }
  }
  return out;
}

bool valid_utf8(std::string_view s) { return !kallpa::tokenizer::detail::first_invalid_utf8(s).has_value(); }

void text_round_trip(const Tokenizer& tok, std::string_view text) {
  for (const bool specials : {false, true}) {
    auto ids = tok.encode(text, {.add_special = false,
                                 .parse_special = specials,
                                 .invalid_utf8 = kallpa::tokenizer::InvalidUtf8::reject,
                                 .missing_byte = kallpa::tokenizer::MissingByte::fail});
    if (!ids) {  // refused for a reason the options name: invalid UTF-8 or an unspellable byte
      const auto code = ids.status().code();
      FUZZ_CHECK(code == kallpa::ErrorCode::invalid_argument || code == kallpa::ErrorCode::unsupported,
                 "encode failed with an unexpected error");
      FUZZ_CHECK(code != kallpa::ErrorCode::invalid_argument || !valid_utf8(text), "valid UTF-8 rejected");
      continue;
    }
    FUZZ_CHECK(valid_utf8(text), "invalid UTF-8 accepted under InvalidUtf8::reject");
    auto back = tok.decode(*ids);
    FUZZ_CHECK(back.is_ok(), "decode of encode's ids failed");
    std::string want;  // the text, with SentencePiece's space mark read back as a space
    constexpr std::string_view mark = "\xE2\x96\x81";
    for (std::size_t i = 0; i < text.size();) {
      if (tok.model_name() == "llama" && text.substr(i, mark.size()) == mark) {
        want.push_back(' ');
        i += mark.size();
      } else {
        want.push_back(text[i++]);
      }
    }
    FUZZ_CHECK(*back == want, "decode(encode(text)) != text");
  }
  // The default options replace ill-formed sequences and never fail on text.
  auto ids = tok.encode(text, {.add_special = false});
  FUZZ_CHECK(ids.is_ok(), "encode with default options failed");
  auto back = tok.decode(*ids);
  FUZZ_CHECK(back.is_ok() && valid_utf8(*back), "decode gave invalid UTF-8");
}

void id_stream(const Tokenizer& tok, const std::uint8_t* data, std::size_t size) {
  const auto vocab = static_cast<TokenId>(tok.vocab_size());
  std::vector<TokenId> ids;
  bool in_range = true;
  for (std::size_t i = 0; i + 1 < size; i += 2) {
    // Mostly valid ids, now and then one just outside the vocabulary (or negative).
    const int raw = data[i] | (data[i + 1] << 8);
    TokenId id = static_cast<TokenId>(raw % (vocab + 2)) - 1;
    ids.push_back(id);
    in_range = in_range && id >= 0 && id < vocab;
  }
  auto whole = tok.decode(ids);
  if (!in_range) {
    FUZZ_CHECK(!whole.is_ok(), "an out-of-range id was decoded");
    return;
  }
  FUZZ_CHECK(whole.is_ok() && valid_utf8(*whole), "decode of valid ids failed or gave invalid UTF-8");
  kallpa::tokenizer::StreamDecoder stream(tok);
  std::string pieces;
  for (TokenId id : ids) {
    auto piece = stream.push(id);
    FUZZ_CHECK(piece.is_ok() && valid_utf8(*piece), "a streamed piece failed or is invalid UTF-8");
    pieces += *piece;
  }
  pieces += stream.flush();
  FUZZ_CHECK(pieces == *whole, "streamed pieces != decode()");
}

void chat(const Tokenizer& tok, std::string_view rest) {
  // Messages as role \0 content \0 role \0 content ...
  std::vector<kallpa::tokenizer::ChatMessage> messages;
  std::vector<std::string_view> parts;
  for (std::size_t at = 0; at <= rest.size();) {
    const std::size_t end = std::min(rest.find('\0', at), rest.size());
    parts.push_back(rest.substr(at, end - at));
    at = end + 1;
  }
  for (std::size_t i = 0; i + 1 < parts.size(); i += 2)
    messages.push_back({std::string(parts[i]), std::string(parts[i + 1])});
  if (messages.empty() || !tok.token_id("<|im_start|>") || !tok.token_id("<|im_end|>")) return;
  const std::string text = kallpa::tokenizer::format_chatml(messages);
  // Only where every byte is spellable and valid (else encode_chatml drops or replaces, by design).
  if (!tok.encode(text, {.add_special = false,
                         .parse_special = false,
                         .invalid_utf8 = kallpa::tokenizer::InvalidUtf8::reject,
                         .missing_byte = kallpa::tokenizer::MissingByte::fail})) {
    return;
  }
  auto ids = kallpa::tokenizer::encode_chatml(tok, messages);
  FUZZ_CHECK(ids.is_ok(), "encode_chatml failed on valid text");
  auto back = tok.decode(*ids);
  FUZZ_CHECK(back.is_ok() && *back == text, "decode(encode_chatml(m)) != format_chatml(m)");
}

void chat_template(std::string_view jinja) {
  auto options = kallpa::tokenizer::chatml_options_from_template(jinja);
  if (!options) {
    FUZZ_CHECK(!options.status().message().empty(), "a refused template without a reason");
    return;
  }
  const kallpa::tokenizer::ChatMessage hello[] = {{"user", "Hello"}};
  FUZZ_CHECK(!kallpa::tokenizer::format_chatml(hello, *options).empty(), "an accepted template renders nothing");
}

void jinja_template(std::string_view source) {
  auto tmpl = kallpa::tokenizer::ChatTemplate::parse(std::string(source));
  if (!tmpl) {
    FUZZ_CHECK(tmpl.status().code() == kallpa::ErrorCode::invalid_argument ||
                   tmpl.status().code() == kallpa::ErrorCode::unsupported,
               "a template refused with an unexpected error");
    return;
  }
  const kallpa::tokenizer::ChatMessage messages[] = {{"system", "S"}, {"user", "Hello"}, {"assistant", "Hi"}};
  kallpa::tokenizer::ChatTemplateInputs in;
  in.messages = messages;
  in.bos_token = "<s>";
  auto r = tmpl->render(in);
  if (!r) {
    FUZZ_CHECK(r.status().code() == kallpa::ErrorCode::invalid_argument, "rendering failed with an unexpected error");
    return;
  }
  std::size_t end = 0;
  for (const kallpa::tokenizer::TextRange& range : r->from_messages) {
    FUZZ_CHECK(range.begin >= end && range.begin < range.end && range.end <= r->text.size(),
               "message ranges out of order or outside the text");
    end = range.end;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::vector<Tokenizer> tokenizers = load_tokenizers();
  if (size == 0) return 0;
  const std::string_view rest(reinterpret_cast<const char*>(data + 1), size - 1);
  if (data[0] % 4 == 3) {
    // Jinja text: the ChatML reader and the Jinja engine.
    chat_template(rest);
    if (kallpa::tokenizer::jinja_available()) jinja_template(rest);
    return 0;
  }
  for (const Tokenizer& tok : tokenizers) {
    switch (data[0] % 4) {
      case 0: text_round_trip(tok, rest); break;
      case 1: id_stream(tok, data + 1, size - 1); break;
      default: chat(tok, rest); break;
    }
  }
  return 0;
}
