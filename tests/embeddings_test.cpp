// The sentence encoder's parts: the safetensors reader (every malformed file a typed error), BERT's
// WordPiece tokenizer, the layer norm and exact GELU ops, and the encoder on small random folders
// (batching, pooling, normalisation, bad folders). The real all-MiniLM-L6-v2 against an
// independent implementation: tests/embeddings/crosscheck.py.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

#include <cstring>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "kallpa/model/bert_model.h"
#include "kallpa/model/safetensors.h"
#include "kallpa/ops/ops.h"
#include "kallpa/runtime/embedder.h"
#include "kallpa/tokenizer/wordpiece.h"
#include "support/sentence_encoder_folder.h"

namespace kallpa {
namespace {

namespace fs = std::filesystem;
using testing::EncoderFolderOptions;
using testing::SafetensorsEntry;

class TempDir {
 public:
  TempDir() {
    path_ = fs::temp_directory_path() / fmt::format("kallpa-embed-{}-{}", ::getpid(), counter_++);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
  static inline int counter_ = 0;
};

// Options with one field set (designated initialisers would leave the strings uninitialised-warned).
template <typename Set>
EncoderFolderOptions with(Set set) {
  EncoderFolderOptions o;
  set(o);
  return o;
}

std::string floats(std::vector<float> v) { return {reinterpret_cast<const char*>(v.data()), v.size() * 4}; }

Status open_bytes(const TempDir& dir, const std::string& bytes) {
  const std::string path = dir.file("t.safetensors");
  std::ofstream(path, std::ios::binary) << bytes;
  return model::SafetensorsFile::open(path).status();
}

TEST(Safetensors, ReadsTensorsAndMetadata) {
  TempDir dir;
  const std::string path = dir.file("ok.safetensors");
  std::ofstream(path, std::ios::binary) << testing::safetensors_bytes(
      {{"a", {"F32", {2, 2}, floats({1, 2, 3, 4})}}, {"b", {"F16", {1}, std::string("\x00\x3c", 2)}}});
  auto file = model::SafetensorsFile::open(path);
  ASSERT_TRUE(file) << file.status().to_string();
  const model::SafetensorsTensor* a = (*file)->find("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->dtype, model::SafetensorsDType::f32);
  EXPECT_EQ(a->shape, (std::vector<std::int64_t>{2, 2}));
  float third = 0;
  std::memcpy(&third, a->data + 8, 4);
  EXPECT_EQ(third, 3.0f);
  EXPECT_EQ((*file)->find("b")->bytes, 2u);
  EXPECT_EQ((*file)->metadata().at("format"), "pt");
  EXPECT_EQ((*file)->find("c"), nullptr);
}

TEST(Safetensors, MalformedFilesAreTypedErrorsNamingTheField) {
  TempDir dir;
  const std::string good = testing::safetensors_bytes({{"w", {"F32", {2}, floats({1, 2})}}});
  struct Case {
    std::string name, bytes, field;
  };
  std::string huge_length = good;
  huge_length[6] = 1;  // a header length far past the end
  std::string not_json = good;
  not_json[8] = '[';
  const std::vector<Case> cases = {
      {"empty", "", "header"},
      {"short", good.substr(0, 5), "header"},
      {"header past the end", huge_length, "header"},
      {"header not an object", not_json, "header"},
      {"truncated data", good.substr(0, good.size() - 4), "w.data_offsets"},
      {"unknown dtype", testing::safetensors_bytes({{"w", {"F8", {2}, floats({1, 2})}}}), "w.dtype"},
      {"size differs from shape", testing::safetensors_bytes({{"w", {"F32", {3}, floats({1, 2})}}}), "w.data_offsets"},
  };
  for (const Case& c : cases) {
    Status s = open_bytes(dir, c.bytes);
    EXPECT_EQ(s.code(), ErrorCode::parse_error) << c.name << ": " << s.to_string();
    EXPECT_EQ(s.field(), c.field) << c.name << ": " << s.to_string();
  }
  // Two tensors over the same bytes.
  std::string overlap =
      testing::safetensors_bytes({{"a", {"F32", {2}, floats({1, 2})}}, {"b", {"F32", {2}, floats({3, 4})}}});
  const std::string from = R"("data_offsets":[8,16])", to = R"("data_offsets":[0, 8])";
  const auto at = overlap.find(from);
  ASSERT_NE(at, std::string::npos);
  overlap.replace(at, from.size(), to);
  EXPECT_EQ(open_bytes(dir, overlap).code(), ErrorCode::parse_error);
  EXPECT_EQ(model::SafetensorsFile::open(dir.file("absent")).status().code(), ErrorCode::not_found);
}

tokenizer::WordPieceTokenizer small_tokenizer(tokenizer::WordPieceOptions options = {}) {
  auto t = tokenizer::WordPieceTokenizer::from_vocabulary(testing::encoder_vocabulary(), options);
  EXPECT_TRUE(t) << t.status().to_string();
  return std::move(*t);
}

std::vector<std::string> pieces(const tokenizer::WordPieceTokenizer& t, const std::string& text) {
  auto ids = t.encode(text);
  EXPECT_TRUE(ids) << ids.status().to_string();
  std::vector<std::string> out;
  for (std::int32_t id : *ids) out.push_back(t.token(id));
  return out;
}

TEST(WordPiece, LongestMatchFirstWithContinuations) {
  const auto t = small_tokenizer();
  EXPECT_EQ(pieces(t, "the cat sat"), (std::vector<std::string>{"[CLS]", "the", "cat", "sat", "[SEP]"}));
  EXPECT_EQ(pieces(t, "unaffable"), (std::vector<std::string>{"[CLS]", "un", "##aff", "##able", "[SEP]"}));
  EXPECT_EQ(pieces(t, "cats"), (std::vector<std::string>{"[CLS]", "cat", "##s", "[SEP]"}));
  // A word that no sequence of pieces spells is one [UNK], not a partial spelling.
  EXPECT_EQ(pieces(t, "cat7"), (std::vector<std::string>{"[CLS]", "[UNK]", "[SEP]"}));
}

TEST(WordPiece, BasicTokenizationSplitsCleansAndFolds) {
  const auto t = small_tokenizer();
  auto words = t.basic_tokenize("Héllo,\tWORLD!\u00a0ça\x01va  中文?");
  ASSERT_TRUE(words);
  // The control character \x01 is dropped, joining "ça" and "va".
  EXPECT_EQ(*words, (std::vector<std::string>{"hello", ",", "world", "!", "cava", "中", "文", "?"}));
  // Cased: no lowercasing, no accent stripping; CJK splitting off keeps ideographs in one word.
  const auto cased = small_tokenizer(tokenizer::WordPieceOptions{
      .lowercase = false, .strip_accents = false, .split_cjk = false, .max_chars_per_word = 100});
  words = cased.basic_tokenize("Héllo 中文");
  ASSERT_TRUE(words);
  EXPECT_EQ(*words, (std::vector<std::string>{"Héllo", "中文"}));
  // Words past the length limit are [UNK] whole.
  EXPECT_EQ(pieces(t, std::string(101, 'a')), (std::vector<std::string>{"[CLS]", "[UNK]", "[SEP]"}));
  EXPECT_EQ(t.encode("bad \xff utf8").status().code(), ErrorCode::invalid_argument);
}

TEST(WordPiece, VocabularyErrorsNameTheLine) {
  auto v = testing::encoder_vocabulary();
  v.push_back("the");
  auto dup = tokenizer::WordPieceTokenizer::from_vocabulary(v, {});
  EXPECT_EQ(dup.status().code(), ErrorCode::invalid_argument);
  EXPECT_NE(dup.status().message().find(std::to_string(v.size())), std::string::npos) << dup.status().to_string();
  auto no_cls = tokenizer::WordPieceTokenizer::from_vocabulary({"[PAD]", "[UNK]", "[SEP]"}, {});
  EXPECT_EQ(no_cls.status().code(), ErrorCode::not_found);
}

TEST(EncoderOps, LayerNormAndExactGelu) {
  auto ops = ops::make_cpu_ops();
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.5f, 2.0f);
  const int rows = 3, dim = 37;
  std::vector<float> x(rows * dim), w(dim), b(dim), y(rows * dim);
  for (float& v : x) v = normal(rng);
  for (float& v : w) v = normal(rng);
  for (float& v : b) v = normal(rng);
  ASSERT_TRUE(ops->layernorm(x.data(), w.data(), b.data(), 1e-5f, y.data(), rows, dim));
  for (int r = 0; r < rows; ++r) {
    double mean = 0, var = 0;
    for (int i = 0; i < dim; ++i) mean += x[r * dim + i];
    mean /= dim;
    for (int i = 0; i < dim; ++i) var += (x[r * dim + i] - mean) * (x[r * dim + i] - mean);
    var /= dim;
    for (int i = 0; i < dim; ++i) {
      const double want = (x[r * dim + i] - mean) / std::sqrt(var + 1e-5) * w[i] + b[i];
      EXPECT_NEAR(y[r * dim + i], want, 1e-5 * (1 + std::abs(want)));
    }
  }
  std::vector<float> g = {-3.0f, -1.0f, 0.0f, 0.5f, 2.0f};
  const std::vector<float> in = g;
  ASSERT_TRUE(ops->gelu_erf(g.data(), static_cast<std::int64_t>(g.size())));
  for (std::size_t i = 0; i < g.size(); ++i) {
    EXPECT_NEAR(g[i], 0.5 * in[i] * (1 + std::erf(in[i] / std::sqrt(2.0))), 1e-6);
  }
}

runtime::Embeddings embed(runtime::Embedder& e, const std::vector<std::string>& texts) {
  auto r = e.embed(texts);
  EXPECT_TRUE(r) << r.status().to_string();
  return r ? std::move(*r) : runtime::Embeddings{};
}

std::unique_ptr<runtime::Embedder> load(const std::string& folder, std::int64_t batch_tokens = 4096) {
  runtime::EmbedderOptions o;
  o.model_path = folder;
  o.batch_tokens = batch_tokens;
  auto e = runtime::Embedder::load(o);
  EXPECT_TRUE(e) << e.status().to_string();
  return e ? std::move(*e) : nullptr;
}

TEST(Embedder, BatchedEqualsAloneAndVectorsAreUnitLength) {
  TempDir dir;
  const std::string folder = testing::write_encoder_folder(dir.file("enc"));
  auto together = load(folder);
  auto one_by_one = load(folder, /*batch_tokens=*/1);  // every text its own pass
  ASSERT_TRUE(together && one_by_one);
  const std::vector<std::string> texts = {"the cat sat on the mat", "hello world!", "unaffable cats?", "a"};
  const runtime::Embeddings a = embed(*together, texts), b = embed(*one_by_one, texts);
  ASSERT_EQ(a.dim, 16);
  ASSERT_EQ(a.vectors.size(), texts.size() * 16);
  EXPECT_EQ(a.tokens, 8 + 5 + 8 + 3);  // [CLS] and [SEP] counted
  for (std::size_t i = 0; i < texts.size(); ++i) {
    double norm = 0;
    for (int d = 0; d < 16; ++d) {
      const float x = a.vectors[i * 16 + d];
      norm += double(x) * x;
      EXPECT_NEAR(x, b.vectors[i * 16 + d], 1e-5) << "text " << i << " dim " << d;
    }
    EXPECT_NEAR(norm, 1.0, 1e-5);
  }
  // Different texts, different vectors (the sequences do not see each other's tokens).
  EXPECT_GT(std::abs(a.vectors[0] - a.vectors[16]) + std::abs(a.vectors[1] - a.vectors[17]), 1e-4);
}

TEST(Embedder, ClsPoolingAndPrefixedNames) {
  TempDir dir;
  auto mean = load(testing::write_encoder_folder(dir.file("mean")));
  auto cls =
      load(testing::write_encoder_folder(dir.file("cls"), with([](EncoderFolderOptions& o) { o.pooling = "cls"; })));
  auto prefixed = load(
      testing::write_encoder_folder(dir.file("prefixed"), with([](EncoderFolderOptions& o) { o.prefix_bert = true; })));
  ASSERT_TRUE(mean && cls && prefixed);
  const auto m = embed(*mean, {"the cat"}), c = embed(*cls, {"the cat"}), p = embed(*prefixed, {"the cat"});
  EXPECT_EQ(m.vectors, p.vectors);  // same seed, same weights, other names
  EXPECT_NE(m.vectors, c.vectors);
}

TEST(Embedder, BadFoldersAndInputsAreTypedErrors) {
  TempDir dir;
  const auto load_status = [](const std::string& folder) {
    runtime::EmbedderOptions o;
    o.model_path = folder;
    return runtime::Embedder::load(o).status();
  };
  Status s = load_status(testing::write_encoder_folder(
      dir.file("drop"), with([](EncoderFolderOptions& o) { o.drop_tensor = "encoder.layer.1.output.dense.weight"; })));
  EXPECT_EQ(s.code(), ErrorCode::not_found);
  EXPECT_EQ(s.field(), "encoder.layer.1.output.dense.weight");
  s = load_status(testing::write_encoder_folder(dir.file("shape"), with([](EncoderFolderOptions& o) {
                                                  o.misshape_tensor = "encoder.layer.0.attention.self.key.bias";
                                                })));
  EXPECT_EQ(s.code(), ErrorCode::invalid_argument);
  EXPECT_EQ(s.field(), "encoder.layer.0.attention.self.key.bias");
  s = load_status(
      testing::write_encoder_folder(dir.file("max"), with([](EncoderFolderOptions& o) { o.pooling = "max"; })));
  EXPECT_EQ(s.code(), ErrorCode::unsupported);
  EXPECT_EQ(load_status(dir.file("nothing")).code(), ErrorCode::not_found);
  const std::string gpt = testing::write_encoder_folder(dir.file("gpt"));
  std::ofstream(fs::path(gpt) / "config.json") << R"({"model_type": "gpt2"})";
  s = load_status(gpt);
  EXPECT_EQ(s.code(), ErrorCode::unsupported);
  EXPECT_NE(s.message().find("gpt2"), std::string::npos);

  auto e =
      load(testing::write_encoder_folder(dir.file("ok"), with([](EncoderFolderOptions& o) { o.max_positions = 8; })));
  ASSERT_TRUE(e);
  auto too_long = e->embed(std::vector<std::string>{"the cat", "the cat sat on the mat hello world"});
  EXPECT_EQ(too_long.status().code(), ErrorCode::invalid_argument);
  EXPECT_EQ(too_long.status().field(), "input[1]");
  auto bad_id = e->embed_tokens(std::vector<std::vector<std::int32_t>>{{2, 9999, 3}});
  EXPECT_EQ(bad_id.status().code(), ErrorCode::invalid_argument);
  auto bad_text = e->embed(std::vector<std::string>{"ok", "\xc3"});
  EXPECT_EQ(bad_text.status().field(), "input[1]");
}

}  // namespace
}  // namespace kallpa
