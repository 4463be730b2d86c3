// `kallpa embed`: sentence embeddings from a sentence-transformers folder, as JSON.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli.h"
#include "engine_cli.h"
#include "model_path.h"
#include "output.h"

namespace kallpa::cli {
namespace {

struct EmbedCliOptions {
  std::vector<std::string> texts;
  bool stdin_lines = false;
  std::string input_json;
  bool tokens = false;
  std::string model;
  std::string device = "cpu";
};

int run_embed(const EmbedCliOptions& o, const GlobalOptions& global) {
  std::vector<std::string> texts = o.texts;
  if (o.stdin_lines) {
    for (std::string line; std::getline(std::cin, line);) texts.push_back(line);
  }
  if (!o.input_json.empty()) {
    std::ifstream file;
    if (o.input_json != "-") file.open(o.input_json);
    std::istream& in = o.input_json == "-" ? std::cin : file;
    const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (!j.is_array()) {
      print_error("", Status::invalid("--input-json", fmt::format("{} is not a JSON array of strings", o.input_json)));
      return kExitUsage;
    }
    for (const nlohmann::json& t : j) {
      if (!t.is_string()) {
        print_error("", Status::invalid("--input-json", fmt::format("element {} is not a string", texts.size())));
        return kExitUsage;
      }
      texts.push_back(t.get<std::string>());
    }
  }
  if (texts.empty()) {
    print_error("", Status::invalid("texts", "nothing to embed: give texts as arguments or --stdin"));
    return kExitUsage;
  }
  int code = kExitOk;
  std::unique_ptr<runtime::Embedder> embedder = load_embedder(o.model, o.device, global, &code);
  if (!embedder) return code;
  Result<runtime::Embeddings> result = embedder->embed(texts);
  if (!result) {
    print_error("", result.status());
    return result.status().code() == ErrorCode::invalid_argument ? kExitUsage : kExitFailure;
  }
  nlohmann::json data = nlohmann::json::array();
  for (std::size_t i = 0; i < texts.size(); ++i) {
    const float* v = result->vectors.data() + i * static_cast<std::size_t>(result->dim);
    nlohmann::json item{{"index", i}, {"embedding", std::vector<float>(v, v + result->dim)}};
    if (o.tokens) {
      Result<std::vector<std::int32_t>> ids = embedder->tokenize(texts[i]);
      if (ids) item["tokens"] = *ids;
    }
    data.push_back(std::move(item));
  }
  const nlohmann::json out{
      {"model", embedder->name()}, {"dim", result->dim}, {"tokens", result->tokens}, {"data", std::move(data)}};
  fmt::print("{}\n", out.dump());
  return kExitOk;
}

}  // namespace

Command add_embed_command(CLI::App& app) {
  auto o = std::make_shared<EmbedCliOptions>();
  CLI::App* sub = app.add_subcommand(
      "embed", "Print sentence embeddings of texts as JSON {model, dim, tokens, data: [{index, embedding}]}");
  sub->add_option("texts", o->texts, "Texts to embed, one vector each");
  sub->add_flag("--stdin", o->stdin_lines, "Also embed each line of standard input");
  sub->add_option("--input-json", o->input_json, "Also embed the strings of a JSON array in this file ('-': stdin)");
  sub->add_flag("--tokens", o->tokens, "Include each text's token ids");
  sub->add_option("-m,--model", o->model,
                  "sentence-transformers folder (default: models/" + std::string(kDefaultEmbeddingModel) + ")");
  sub->add_option("--device", o->device, "cpu, opencl[:N] or cuda[:N]");
  return {sub, [o](const GlobalOptions& g) { return run_embed(*o, g); }};
}

}  // namespace kallpa::cli
