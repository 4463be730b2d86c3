// SentencePiece BPE (tokenizer.ggml.model "llama") on small hand-built vocabularies: merges by
// score, ties, byte fallback, the space prefix, special and user-defined tokens, decoding (batch
// and streamed), end-of-generation tokens, plain ranges, and typed errors for bad data. On the real
// Gemma-3-270M vocabulary (when models/ has it): a chat turn's ids. The cross-check against
// Hugging Face tokenizers on that vocabulary is tests/tokenizer/crosscheck_spm.py.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "kallpa/model/gguf.h"
#include "kallpa/model/gguf_tokenizer.h"
#include "kallpa/tokenizer/tokenizer.h"
#include "support/model_files.h"

namespace kallpa::tokenizer {
namespace {

const std::string kSp = "\xE2\x96\x81";  // U+2581, SentencePiece's space

// <pad> <eos> <bos> <unk> <ctl> <end_of_turn>, the 256 <0xNN> byte tokens, then normal tokens.
struct SpmVocab {
  TokenizerData data;

  SpmVocab() {
    data.model = "llama";
    add("<pad>", TokenType::control);          // 0
    add("<eos>", TokenType::control);          // 1
    add("<bos>", TokenType::control);          // 2
    add("<unk>", TokenType::unknown);          // 3
    add("<ctl>", TokenType::control);          // 4
    add("<end_of_turn>", TokenType::control);  // 5
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof name, "<0x%02X>", b);
      add(name, TokenType::byte, 0.0f);
    }
    data.pad_id = 0;
    data.eos_id = 1;
    data.bos_id = 2;
    data.unk_id = 3;
    data.add_space_prefix = false;
  }
  TokenId add(const std::string& text, TokenType type = TokenType::normal, float score = -1000.0f) {
    data.tokens.push_back(text);
    data.token_types.push_back(static_cast<std::int32_t>(type));
    data.scores.push_back(score);
    return static_cast<TokenId>(data.tokens.size() - 1);
  }
  Tokenizer build() {
    auto t = Tokenizer::create(data);
    EXPECT_TRUE(t.is_ok()) << t.status().to_string();
    return std::move(t).value();
  }
};

std::vector<TokenId> enc(const Tokenizer& t, std::string_view text, EncodeOptions o = {.add_special = false}) {
  auto r = t.encode(text, o);
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
  return r.is_ok() ? *r : std::vector<TokenId>{};
}

TokenId byte_id(unsigned char b) { return 6 + b; }

TEST(SpmTokenizer, MergesTheHighestScoringPairFirst) {
  SpmVocab v;
  const TokenId a = v.add("a", TokenType::normal, -1), b = v.add("b", TokenType::normal, -1),
                c = v.add("c", TokenType::normal, -1);
  const TokenId ab = v.add("ab", TokenType::normal, -5), bc = v.add("bc", TokenType::normal, -2);
  Tokenizer t = v.build();
  // "bc" scores higher than "ab": a + bc, although "ab" is further left.
  EXPECT_EQ(enc(t, "abc"), (std::vector<TokenId>{a, bc}));
  EXPECT_EQ(enc(t, "ab"), (std::vector<TokenId>{ab}));
  EXPECT_EQ(enc(t, "ca"), (std::vector<TokenId>{c, a}));
  (void)b;
}

TEST(SpmTokenizer, EqualScoresMergeLeftmostFirst) {
  SpmVocab v;
  const TokenId a = v.add("a", TokenType::normal, -1);
  const TokenId aa = v.add("aa", TokenType::normal, -3);
  Tokenizer t = v.build();
  EXPECT_EQ(enc(t, "aaa"), (std::vector<TokenId>{aa, a}));
  EXPECT_EQ(enc(t, "aaaa"), (std::vector<TokenId>{aa, aa}));
}

TEST(SpmTokenizer, MergesOnlyIntoNormalTokens) {
  SpmVocab v;
  const TokenId x = v.add("<", TokenType::normal, -1);
  for (const char* piece : {"c", "t", "l", ">", "ct", "ctl"}) v.add(piece, TokenType::normal, -1);
  const TokenId y = v.add("ctl>", TokenType::normal, -2);
  Tokenizer t = v.build();
  // "<ctl>" as plain text: "<" + "ctl>" would spell the CONTROL token 4, which merges never make.
  EXPECT_EQ(enc(t, "<ctl>", {.add_special = false, .parse_special = false}), (std::vector<TokenId>{x, y}));
  EXPECT_EQ(enc(t, "<ctl>"), (std::vector<TokenId>{4}));
}

TEST(SpmTokenizer, SpacesBecomeTheMarkAndThePrefixFollowsTheFlag) {
  SpmVocab v;
  const TokenId sp = v.add(kSp, TokenType::normal, -1), hi = v.add("hi", TokenType::normal, -2);
  v.add("h", TokenType::normal, -1);
  v.add("i", TokenType::normal, -1);
  const TokenId sphi = v.add(kSp + "hi", TokenType::normal, -3);
  {
    Tokenizer t = v.build();
    EXPECT_FALSE(t.add_space_prefix());
    EXPECT_EQ(enc(t, "hi hi"), (std::vector<TokenId>{hi, sphi}));
    EXPECT_EQ(enc(t, "  hi"), (std::vector<TokenId>{sp, sphi}));
    EXPECT_EQ(*t.decode(enc(t, "  hi  hi ")), "  hi  hi ");
  }
  v.data.add_space_prefix = true;
  Tokenizer t = v.build();
  EXPECT_EQ(enc(t, "hi"), (std::vector<TokenId>{sphi}));
  // After a special token the prefix comes again (as llama.cpp does).
  EXPECT_EQ(enc(t, "hi<ctl>hi"), (std::vector<TokenId>{sphi, 4, sphi}));
  v.data.add_space_prefix.reset();  // absent from the file: SentencePiece's default, on
  EXPECT_TRUE(v.build().add_space_prefix());
}

TEST(SpmTokenizer, UnknownCharactersFallBackToTheirBytes) {
  SpmVocab v;
  const TokenId a = v.add("a", TokenType::normal, -1);
  Tokenizer t = v.build();
  // U+00E9 (C3 A9) and an emoji (F0 9F 98 80) are not in the vocabulary.
  EXPECT_EQ(enc(t, "a\xC3\xA9"), (std::vector<TokenId>{a, byte_id(0xC3), byte_id(0xA9)}));
  const std::string text =
      "\xF0\x9F\x98\x80"
      "a";
  const auto ids = enc(t, text);
  EXPECT_EQ(ids, (std::vector<TokenId>{byte_id(0xF0), byte_id(0x9F), byte_id(0x98), byte_id(0x80), a}));
  EXPECT_EQ(*t.decode(ids), text);
  // Streamed: nothing until the code point is whole.
  StreamDecoder sd(t);
  std::string streamed;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const std::string piece = *sd.push(ids[i]);
    if (i < 3) {
      EXPECT_EQ(piece, "");
    }
    streamed += piece;
  }
  streamed += sd.flush();
  EXPECT_EQ(streamed, text);
}

TEST(SpmTokenizer, WithoutByteTokensTheMissingBytePolicyApplies) {
  TokenizerData d;
  d.model = "llama";
  d.tokens = {"<unk>", "a"};
  d.token_types = {static_cast<std::int32_t>(TokenType::unknown), static_cast<std::int32_t>(TokenType::normal)};
  d.scores = {0, -1};
  d.unk_id = 0;
  d.add_space_prefix = false;
  auto t = Tokenizer::create(d);
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  EXPECT_EQ(enc(*t, "ab"), (std::vector<TokenId>{1}));
  // One <unk> per code point, however many bytes it has.
  EXPECT_EQ(enc(*t,
                "a\xC3\xA9"
                "b",
                {.add_special = false, .missing_byte = MissingByte::unknown_token}),
            (std::vector<TokenId>{1, 0, 0}));
  auto fail = t->encode("ab", {.add_special = false, .missing_byte = MissingByte::fail});
  ASSERT_FALSE(fail.is_ok());
  EXPECT_EQ(fail.status().code(), ErrorCode::unsupported);
}

TEST(SpmTokenizer, UserDefinedTokensAreAlwaysMatchedAndControlOnlyWhenAsked) {
  SpmVocab v;
  const TokenId nl = v.add("\n", TokenType::user_defined, 0);
  const TokenId x = v.add("x", TokenType::normal, -1);
  Tokenizer t = v.build();
  EXPECT_EQ(enc(t, "x\nx", {.add_special = false, .parse_special = false}), (std::vector<TokenId>{x, nl, x}));
  EXPECT_EQ(enc(t, "<end_of_turn>\n"), (std::vector<TokenId>{5, nl}));
  // BOS is added when the file asks for it.
  v.data.add_bos = true;
  Tokenizer with_bos = v.build();
  EXPECT_EQ(*with_bos.encode("x"), (std::vector<TokenId>{2, x}));
}

TEST(SpmTokenizer, PlainRangesAreNeverReadAsSpecialTokens) {
  SpmVocab v;
  const TokenId lt = v.add("<", TokenType::normal, -1);
  for (const char* s : {"e", "n", "d", "_", "o", "f", "t", "u", "r", ">"}) v.add(s, TokenType::normal, -1);
  Tokenizer t = v.build();
  const std::string text = "<end_of_turn><end_of_turn>";
  const std::vector<TextRange> plain = {{13, 26}};
  auto ids = t.encode(text, {.add_special = false}, plain);
  ASSERT_TRUE(ids.is_ok()) << ids.status().to_string();
  EXPECT_EQ(ids->front(), 5);
  EXPECT_EQ((*ids)[1], lt);
  EXPECT_EQ(ids->size(), 1u + 13u);
  EXPECT_EQ(*t.decode(*ids), text);
  // Ranges out of order or outside the text are refused.
  const std::vector<TextRange> bad = {{5, 40}};
  EXPECT_EQ(t.encode(text, {}, bad).status().code(), ErrorCode::invalid_argument);
}

TEST(SpmTokenizer, EndOfGenerationTokensComeFromTheIdsAndTheKnownTexts) {
  SpmVocab v;
  const TokenId im_end = v.add("<|im_end|>", TokenType::control, 0);
  const TokenId other = v.add("<|other|>", TokenType::control, 0);
  const TokenId html = v.add("</s>", TokenType::user_defined, 0);  // an HTML tag in Gemma's vocabulary
  v.data.eot_id = other;
  Tokenizer t = v.build();
  EXPECT_TRUE(t.is_eog(1));  // eos
  EXPECT_TRUE(t.is_eog(5));  // <end_of_turn>, by its text
  EXPECT_TRUE(t.is_eog(im_end));
  EXPECT_TRUE(t.is_eog(other));  // eot id
  EXPECT_FALSE(t.is_eog(2));     // bos
  EXPECT_FALSE(t.is_eog(4));
  EXPECT_FALSE(t.is_eog(html));  // an end-of-generation text, but not a CONTROL token
  EXPECT_EQ(t.eot_id(), other);
  EXPECT_TRUE(std::is_sorted(t.eog_ids().begin(), t.eog_ids().end()));
}

TEST(SpmTokenizer, BadDataGetsTypedErrorsNamingTheKey) {
  SpmVocab v;
  v.data.scores.pop_back();
  auto r = Tokenizer::create(v.data);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().field(), "tokenizer.ggml.scores");

  SpmVocab e;
  e.data.eom_id = 1 << 20;
  auto r2 = Tokenizer::create(e.data);
  ASSERT_FALSE(r2.is_ok());
  EXPECT_EQ(r2.status().field(), "tokenizer.ggml.eom_token_id");

  SpmVocab m;
  m.data.model = "bert";
  auto r3 = Tokenizer::create(m.data);
  ASSERT_FALSE(r3.is_ok());
  EXPECT_EQ(r3.status().code(), ErrorCode::unsupported);
  EXPECT_NE(r3.status().message().find("bert"), std::string::npos);

  Tokenizer t = SpmVocab().build();
  const std::vector<TokenId> out_of_range = {7, 99999};
  EXPECT_EQ(t.decode(out_of_range).status().code(), ErrorCode::invalid_argument);
  StreamDecoder sd(t);
  EXPECT_FALSE(sd.push(-1).is_ok());
}

// ---- the real Gemma-3-270M vocabulary, when models/ has the file ----

TEST(SpmTokenizerGemma, ChatTurnIdsAndEndOfGeneration) {
  const std::string path = test_support::gemma3_270m_path();
  if (path.empty()) GTEST_SKIP() << "gemma-3-270m-q4_k_m.gguf not found (scripts/fetch_model.sh --model gemma3-270m)";
  auto file = model::GgufFile::open(path);
  ASSERT_TRUE(file.is_ok()) << file.status().to_string();
  const auto t0 = std::chrono::steady_clock::now();
  auto tok = model::tokenizer_from_gguf(**file);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(tok.is_ok()) << tok.status().to_string();
  RecordProperty("load_ms", std::to_string(seconds * 1e3));
  EXPECT_EQ(tok->vocab_size(), 262144u);
  EXPECT_EQ(tok->model_name(), "llama");
  EXPECT_FALSE(tok->add_space_prefix());
  EXPECT_TRUE(tok->add_bos());
  // <bos> <start_of_turn> user \n ... <end_of_turn> \n <start_of_turn> model \n
  auto ids = tok->encode("<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n");
  ASSERT_TRUE(ids.is_ok());
  ASSERT_GE(ids->size(), 9u);
  EXPECT_EQ((*ids)[0], 2);
  EXPECT_EQ((*ids)[1], 105);
  EXPECT_EQ(tok->token_text((*ids)[2]), "user");
  EXPECT_EQ((*ids)[3], 107);
  EXPECT_EQ((*ids)[5], 106);
  EXPECT_EQ(*tok->decode(*ids), "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n");
  EXPECT_TRUE(tok->is_eog(1));    // <eos>
  EXPECT_TRUE(tok->is_eog(106));  // <end_of_turn>
  EXPECT_FALSE(tok->is_eog(105));
}

}  // namespace
}  // namespace kallpa::tokenizer
