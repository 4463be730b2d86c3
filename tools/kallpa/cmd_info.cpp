// `kallpa info MODEL`: what a GGUF file holds and what running it takes, without loading the
// weights: architecture, tensor types with counts, context length, tokenizer, chat template, memory
// (the mapped file plus the KV cache), and whether kallpa can run it (if not, the loader's error,
// which names the architecture or tensor type).
#include <cstdio>
#include <map>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli.h"
#include "engine_cli.h"
#include "kallpa/model/gguf.h"
#include "kallpa/model/gguf_tokenizer.h"
#include "kallpa/model/llama.h"
#include "kallpa/ops/ggml_type.h"
#include "model_path.h"
#include "output.h"

namespace kallpa::cli {
namespace {

struct InfoCliOptions {
  std::string model;
  bool json = false;
  bool tensors = false;  // --tensors: every tensor's name, type and shape too
  std::int64_t context = EngineCliOptions{}.context;
  DType kv_type = EngineCliOptions{}.kv_type;
};

std::uint64_t meta_uint(const model::GgufFile& f, const std::string& key, std::uint64_t fallback) {
  auto v = f.get_uint(key);
  return v ? *v : fallback;
}

int run_info(const InfoCliOptions& o, const GlobalOptions&) {
  const std::string path = o.model.empty() ? default_model_path() : o.model;
  if (path.empty()) {
    print_error("", Status(ErrorCode::not_found, "model", "no model given and none found in models/"));
    return kExitUsage;
  }
  auto opened = model::GgufFile::open(path);
  if (!opened) {
    print_error(fmt::format("cannot open {}", path), opened.status());
    return opened.status().code() == ErrorCode::not_found ? kExitUsage : kExitFailure;
  }
  const model::GgufFile& f = **opened;
  nlohmann::ordered_json out;
  out["file"] = path;
  out["file_bytes"] = f.file_size();
  const std::string arch =
      f.get_string("general.architecture") ? std::string(*f.get_string("general.architecture")) : "";
  out["architecture"] = arch;
  if (auto name = f.get_string("general.name"); name) out["name"] = std::string(*name);

  // Tensor types: how many tensors and bytes of each.
  std::map<std::string, std::pair<std::uint64_t, std::uint64_t>> types;
  std::uint64_t params = 0;
  for (const model::TensorView& t : f.tensors()) {
    auto& [count, bytes] = types[std::string(ops::ggml_type_name(t.type))];
    ++count;
    bytes += t.nbytes;
    params += static_cast<std::uint64_t>(t.nelements());
  }
  nlohmann::ordered_json jt = nlohmann::ordered_json::object();
  for (const auto& [name, cb] : types) jt[name] = {{"tensors", cb.first}, {"bytes", cb.second}};
  out["tensors"] = f.tensors().size();
  out["parameters"] = params;
  out["tensor_types"] = jt;
  if (o.tensors) {
    nlohmann::ordered_json list = nlohmann::ordered_json::array();
    for (const model::TensorView& t : f.tensors()) {
      list.push_back({{"name", std::string(t.name)},
                      {"type", std::string(ops::ggml_type_name(t.type))},
                      {"shape", t.shape_string()},
                      {"bytes", t.nbytes}});
    }
    out["tensor_list"] = list;
  }

  const std::uint64_t context = meta_uint(f, arch + ".context_length", 0);
  out["context_length"] = context;

  // The KV cache kallpa allocates (f16 K and V): per token, every layer's K and V heads.
  const std::uint64_t n_layer = meta_uint(f, arch + ".block_count", 0);
  const std::uint64_t n_head = meta_uint(f, arch + ".attention.head_count", 0);
  const std::uint64_t n_head_kv = meta_uint(f, arch + ".attention.head_count_kv", n_head);
  const std::uint64_t n_embd = meta_uint(f, arch + ".embedding_length", 0);
  const std::uint64_t k_len = meta_uint(f, arch + ".attention.key_length", n_head > 0 ? n_embd / n_head : 0);
  const std::uint64_t v_len = meta_uint(f, arch + ".attention.value_length", k_len);
  const std::uint64_t kv_per_token = n_layer * n_head_kv * (k_len + v_len) * dtype_size(o.kv_type);
  const auto kv_tokens = static_cast<std::uint64_t>(o.context);
  out["memory"] = {{"mapped_bytes", f.file_size()},
                   {"kv_type", dtype_name(o.kv_type)},
                   {"kv_bytes_per_token", kv_per_token},
                   {"kv_cache_tokens", kv_tokens},
                   {"kv_cache_bytes", kv_per_token * kv_tokens},
                   {"total_bytes", f.file_size() + kv_per_token * kv_tokens}};

  // Tokenizer and chat format.
  nlohmann::ordered_json jtok;
  if (auto tok = model::tokenizer_from_gguf(f); tok) {
    jtok["model"] = tok->model_name();
    if (!tok->pre_tokenizer_name().empty()) jtok["pre"] = tok->pre_tokenizer_name();
    jtok["tokens"] = tok->vocab_size();
    if (tok->bos_id()) jtok["bos"] = tok->token_text(*tok->bos_id());
    if (tok->eos_id()) jtok["eos"] = tok->token_text(*tok->eos_id());
    nlohmann::ordered_json eog = nlohmann::ordered_json::array();
    for (tokenizer::TokenId id : tok->eog_ids()) eog.push_back({{"id", id}, {"text", tok->token_text(id)}});
    jtok["end_of_generation"] = eog;
    const tokenizer::ChatFormat chat = model::chat_format_from_gguf(f, *tok);
    out["chat_template"] = {{"in_file", f.has("tokenizer.chat_template")},
                            {"used", chat.kind == tokenizer::ChatFormatKind::file_template ? "file" : "built-in"},
                            {"description", chat.description}};
  } else {
    jtok["error"] = tok.status().to_string();
    out["chat_template"] = {{"in_file", f.has("tokenizer.chat_template")}};
  }
  out["tokenizer"] = jtok;

  // Whether kallpa runs it: the loader's own checks (architecture, metadata, tensor types).
  auto config = model::load_llama_config(f);
  out["supported"] = static_cast<bool>(config);
  if (!config) out["unsupported_reason"] = config.status().to_string();

  if (o.json) {
    fmt::print("{}\n", out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace));
    return kExitOk;
  }
  auto mib = [](std::uint64_t b) { return fmt::format("{:.1f} MiB", double(b) / (1024.0 * 1024.0)); };
  fmt::print("file:          {} ({})\n", path, mib(f.file_size()));
  fmt::print("architecture:  {}{}\n", arch.empty() ? "(none)" : arch,
             out.contains("name") ? fmt::format(" ({})", out["name"].get<std::string>()) : "");
  fmt::print("parameters:    {} in {} tensors\n", params, f.tensors().size());
  fmt::print("tensor types: ");
  for (const auto& [name, cb] : types) fmt::print(" {} x{} ({})", name, cb.first, mib(cb.second));
  fmt::print("\n");
  if (o.tensors) {
    for (const model::TensorView& t : f.tensors()) {
      fmt::print("  {:<40} {:<6} {}\n", t.name, ops::ggml_type_name(t.type), t.shape_string());
    }
  }
  fmt::print("context:       {} tokens\n", context);
  if (jtok.contains("error")) {
    fmt::print("tokenizer:     cannot be read: {}\n", jtok["error"].get<std::string>());
  } else {
    std::string eog;
    for (const auto& e : jtok["end_of_generation"]) {
      eog += fmt::format("{}{} {}", eog.empty() ? "" : ", ", e["id"].get<int>(), e["text"].get<std::string>());
    }
    fmt::print("tokenizer:     {}, {} tokens; stops at: {}\n", jtok["model"].get<std::string>(),
               jtok["tokens"].get<std::size_t>(), eog);
    fmt::print("chat template: {}\n", out["chat_template"]["description"].get<std::string>());
  }
  fmt::print("memory:        {} mapped + {} KV cache {} ({} tokens at {} per token) = {}\n", mib(f.file_size()),
             dtype_name(o.kv_type), mib(kv_per_token * kv_tokens), kv_tokens,
             fmt::format("{:.1f} KiB", double(kv_per_token) / 1024.0), mib(f.file_size() + kv_per_token * kv_tokens));
  if (config) {
    fmt::print("supported:     yes\n");
  } else {
    fmt::print("supported:     no: {}\n", config.status().to_string());
  }
  return kExitOk;
}

}  // namespace

Command add_info_command(CLI::App& app) {
  auto o = std::make_shared<InfoCliOptions>();
  CLI::App* sub = app.add_subcommand(
      "info", "Describe a GGUF model: architecture, tensor types, context, tokenizer, chat template, memory");
  sub->add_option("model", o->model, "GGUF model file (default: models/" + std::string(kDefaultModelFile) + ")");
  sub->add_option("-m,--model-file", o->model, "The same, as an option");
  sub->add_option("--context", o->context, "KV cache capacity to size the memory for (as `generate --context`)")
      ->check(CLI::Range(16, 1 << 20));
  add_kv_type_option(sub, o->kv_type, "KV cache storage type to size the memory for (as `generate --kv-type`)");
  sub->add_flag("--tensors", o->tensors, "Also list every tensor: name, type, shape");
  sub->add_flag("--json", o->json, "One JSON object");
  return {sub, [o](const GlobalOptions& g) { return run_info(*o, g); }};
}

}  // namespace kallpa::cli
