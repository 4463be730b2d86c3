// Sentence embeddings: a sentence-transformers encoder folder (model/bert_model.h) behind texts
// in, vectors out. Texts are tokenized, grouped into forward passes of at most
// EmbedderOptions::batch_tokens tokens, and each pass runs all its texts together. Safe to call
// from several threads: passes run one at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "kallpa/dispatcher.h"
#include "kallpa/model/bert_model.h"
#include "kallpa/ops/ops.h"
#include "kallpa/status.h"

namespace kallpa::runtime {

struct EmbedderOptions {
  std::string model_path;  // the folder
  std::string device = "cpu";
  bool strict_device = false;
  DispatchOptions attention;
  std::int64_t batch_tokens = 4096;  // tokens per forward pass (a longer single text still runs alone)
};

struct Embeddings {
  std::int64_t dim = 0;
  std::vector<float> vectors;  // one row of dim per input, in input order
  std::int64_t tokens = 0;     // over every input, [CLS] and [SEP] included
};

class Embedder {
 public:
  static Result<std::unique_ptr<Embedder>> load(const EmbedderOptions& options);
  ~Embedder();

  const model::BertConfig& config() const noexcept { return model_->config(); }
  const std::string& name() const noexcept { return model_->config().name; }
  // Token ids as the encoder reads them ([CLS] ... [SEP]).
  Result<std::vector<std::int32_t>> tokenize(std::string_view text) const;

  // invalid_argument naming the input ("input[3]") that is not valid UTF-8 or too long.
  Result<Embeddings> embed(std::span<const std::string> texts);
  // Inputs already tokenized (as tokenize() gives them, or OpenAI's arrays of token ids).
  Result<Embeddings> embed_tokens(std::span<const std::vector<std::int32_t>> inputs);

 private:
  Embedder() = default;
  std::unique_ptr<ops::Ops> ops_;
  std::unique_ptr<Dispatcher> dispatcher_;
  std::unique_ptr<model::BertModel> model_;
  std::int64_t batch_tokens_ = 0;
  std::mutex mu_;
};

}  // namespace kallpa::runtime
