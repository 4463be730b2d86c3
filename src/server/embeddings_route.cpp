// POST /v1/embeddings: the request parsed (embeddings_api.h), the model checked, the inputs
// embedded in one call (the embedder batches them into forward passes), the vectors answered.
#include <algorithm>

#include <fmt/format.h>

#include "server/embeddings_api.h"
#include "server/server_impl.h"
#include "server/sse.h"

namespace kallpa::server {

bool Server::Impl::serves_embedding(const std::string& model) const {
  if (model == options.embedding_model_name) return true;
  const auto& aliases = options.embedding_model_aliases;
  return std::find(aliases.begin(), aliases.end(), model) != aliases.end();
}

void Server::Impl::handle_embeddings(const HttpRequest& req, HttpResponse& res) {
  if (embedder == nullptr) {
    ApiError e;
    e.status = 404;
    e.code = "model_not_found";
    e.param = "model";
    e.message = "this server serves no embedding model (start it with --embedding-model)";
    write_error(res, e);
    return;
  }
  InFlight in_flight(*this);  // before the draining check: see drain()
  if (!accepting(res)) return;
  EmbeddingLimits embedding_limits;
  embedding_limits.max_inputs = options.max_embedding_inputs;
  embedding_limits.dim = embedder->config().hidden;
  ParsedEmbeddingsRequest parsed = parse_embeddings_request(req.body, embedding_limits);
  if (auto* error = std::get_if<ApiError>(&parsed)) {
    write_error(res, *error);
    return;
  }
  const EmbeddingsRequest& r = std::get<EmbeddingsRequest>(parsed);
  if (!r.model.empty() && !serves_embedding(r.model)) {
    ApiError e;
    e.status = 404;
    e.code = "model_not_found";
    e.param = "model";
    e.message =
        engine != nullptr && serves(r.model)
            ? fmt::format("'{}' is a chat model; embeddings come from '{}'", r.model, options.embedding_model_name)
            : fmt::format("the model '{}' does not exist; this server embeds with '{}'", r.model,
                          options.embedding_model_name);
    write_error(res, e);
    return;
  }
  const std::size_t inputs = r.tokens.empty() ? r.texts.size() : r.tokens.size();
  Result<runtime::Embeddings> result = r.tokens.empty() ? embedder->embed(r.texts) : embedder->embed_tokens(r.tokens);
  if (!result) {
    // invalid_argument names the input ("input[3]") that is too long or not valid UTF-8: a 400;
    // anything else is the server's failure.
    write_error(res, from_status(result.status()));
    return;
  }
  metrics.embeddings_finished(static_cast<std::int64_t>(inputs), result->tokens);
  res.status = 200;
  res.set_content(
      dump_json(embeddings_body(*result, r.model.empty() ? options.embedding_model_name : r.model, r.base64)),
      "application/json");
}

}  // namespace kallpa::server
