// A BERT-style sentence encoder (sentence-transformers folders such as all-MiniLM-L6-v2): the
// encoder's forward pass, written against the op interface (ops/ops.h) and the attention
// dispatcher like the decoder's, with its attention as one packed, bidirectional problem over every
// sequence of the batch; then the folder's pooling (mean or [CLS]) and, when the folder says so,
// L2 normalisation.
//
// The folder is read as Hugging Face writes it: config.json (the encoder), model.safetensors (the
// weights, F32, F16 or BF16; with or without a "bert." prefix), vocab.txt and tokenizer_config.json
// (the tokenizer), modules.json, 1_Pooling/config.json and sentence_bert_config.json (pooling,
// normalisation, the longest input).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kallpa/dispatcher.h"
#include "kallpa/model/safetensors.h"
#include "kallpa/ops/ops.h"
#include "kallpa/status.h"
#include "kallpa/tokenizer/wordpiece.h"

namespace kallpa::model {

enum class Pooling : std::uint8_t { mean, cls };

struct BertConfig {
  std::int64_t vocab_size = 0;
  std::int64_t hidden = 0;
  std::int64_t layers = 0;
  std::int64_t heads = 0;
  std::int64_t intermediate = 0;
  std::int64_t max_positions = 0;
  std::int64_t type_vocab_size = 0;
  float layer_norm_eps = 1e-12f;
  // What the folder adds on top of the encoder.
  Pooling pooling = Pooling::mean;
  bool normalize = false;
  std::int64_t max_tokens = 0;  // the longest input, [CLS] and [SEP] included
  tokenizer::WordPieceOptions tokenizer;
  std::string name;  // the folder's name
};

// Reads the folder's JSON files (typed errors naming the file and key; unsupported naming a
// model_type, hidden_act, position_embedding_type or pooling mode this encoder does not have).
Result<BertConfig> read_bert_folder(const std::string& folder);

class BertModel {
 public:
  // Validates every weight's name, dtype and shape and places the weights on the ops' device.
  // `ops` runs every forward pass and must outlive the model.
  static Result<std::unique_ptr<BertModel>> load(const std::string& folder, ops::Ops& ops);
  ~BertModel();
  BertModel(const BertModel&) = delete;
  BertModel& operator=(const BertModel&) = delete;

  const BertConfig& config() const noexcept { return config_; }
  const tokenizer::WordPieceTokenizer& tokenizer() const noexcept { return tokenizer_; }

  // One pooled (and, as configured, normalised) vector of config().hidden floats per sequence,
  // row after row in `out`. Each sequence is token ids as the tokenizer gives them, at most
  // config().max_tokens long (invalid_argument naming the sequence otherwise, or for an id
  // outside the vocabulary). The sequences run together: one matrix through the products, one
  // packed problem through attention. Not thread-safe: callers serialise.
  Status embed(std::span<const std::vector<std::int32_t>> sequences, Dispatcher& dispatcher, std::vector<float>& out);

 private:
  struct Weights;
  BertModel() = default;

  BertConfig config_;
  tokenizer::WordPieceTokenizer tokenizer_;
  std::shared_ptr<const SafetensorsFile> file_;
  ops::Ops* ops_ = nullptr;
  std::unique_ptr<Weights> w_;
};

}  // namespace kallpa::model
