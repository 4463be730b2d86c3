#include "kallpa/runtime/embedder.h"

#include <utility>

#include <fmt/format.h>

#include "ops/fallback_ops.h"

namespace kallpa::runtime {

Embedder::~Embedder() = default;

Result<std::unique_ptr<Embedder>> Embedder::load(const EmbedderOptions& options) {
  if (options.batch_tokens <= 0) return Status::invalid("batch_tokens", "must be positive");
  std::unique_ptr<Embedder> e(new Embedder());
  e->batch_tokens_ = options.batch_tokens;
  auto ops = ops::make_ops(options.device);
  if (!ops) return ops.status();
  if ((*ops)->host_addressable()) {
    e->ops_ = std::move(*ops);
  } else {
    e->ops_ = std::make_unique<ops::FallbackOps>(std::move(*ops), options.strict_device);
  }
  auto model = model::BertModel::load(options.model_path, *e->ops_);
  if (!model) return model.status();
  e->model_ = std::move(*model);
  e->dispatcher_ = std::make_unique<Dispatcher>(options.attention);
  return e;
}

Result<std::vector<std::int32_t>> Embedder::tokenize(std::string_view text) const {
  return model_->tokenizer().encode(text);
}

Result<Embeddings> Embedder::embed(std::span<const std::string> texts) {
  std::vector<std::vector<std::int32_t>> inputs;
  inputs.reserve(texts.size());
  for (std::size_t i = 0; i < texts.size(); ++i) {
    Result<std::vector<std::int32_t>> ids = tokenize(texts[i]);
    if (!ids) return Status(ids.status().code(), fmt::format("input[{}]", i), ids.status().message());
    inputs.push_back(std::move(*ids));
  }
  return embed_tokens(inputs);
}

Result<Embeddings> Embedder::embed_tokens(std::span<const std::vector<std::int32_t>> inputs) {
  Embeddings result;
  result.dim = model_->config().hidden;
  result.vectors.reserve(inputs.size() * static_cast<std::size_t>(result.dim));
  std::lock_guard lock(mu_);
  std::vector<float> pass;
  // Consecutive inputs up to batch_tokens_ per pass, so the output stays in input order.
  std::size_t begin = 0;
  while (begin < inputs.size()) {
    std::size_t end = begin;
    std::int64_t tokens = 0;
    while (end < inputs.size() &&
           (end == begin || tokens + static_cast<std::int64_t>(inputs[end].size()) <= batch_tokens_)) {
      tokens += static_cast<std::int64_t>(inputs[end].size());
      ++end;
    }
    Status s = model_->embed(inputs.subspan(begin, end - begin), *dispatcher_, pass);
    if (!s) {
      // The model names the input within the pass; say which one of the request it is.
      std::string field = s.field();
      if (field.starts_with("input[")) {
        field = fmt::format("input[{}]", begin + std::stoul(field.substr(6)));
      }
      return Status(s.code(), field, s.message());
    }
    result.vectors.insert(result.vectors.end(), pass.begin(), pass.end());
    result.tokens += tokens;
    begin = end;
  }
  return result;
}

}  // namespace kallpa::runtime
