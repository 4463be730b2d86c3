// kallpa_tokenize_tool: drives kallpa's tokenizer from JSON, for the cross-check against Hugging
// Face tokenizers (tests/tokenizer/crosscheck.py), without needing the GGUF loader.
//
//   kallpa_tokenize_tool --vocab VOCAB.json --input INPUT.json  > OUTPUT.json
//   kallpa_tokenize_tool --gguf MODEL.gguf --input INPUT.json    (the tokenizer the GGUF file carries)
//
// VOCAB.json: {"model", "pre", "tokens", "token_types", "merges" or "scores", "bos_id", "eos_id",
//              "unk_id", "pad_id", "add_bos", "add_eos", "add_space_prefix"} (the GGUF
//              tokenizer.ggml.* keys; ids may be null).
// INPUT.json: {"texts": [str...], "chats": [[{"role", "content"}...]...],
//              "add_special": bool, "parse_special": bool}
// OUTPUT.json: {"pre": str, "jit": bool, "load_seconds": float (open_seconds of it: the GGUF parse),
//               "encode_seconds": float, "bytes": int,
//               "results": [{"ids", "pieces", "decoded", "streamed"}...],
//               "chats": [{"text", "ids", "ids_structured"}...]}
// Errors go to stderr with exit code 1 (2 for usage).
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>

#include <nlohmann/json.hpp>

#include "kallpa/model/gguf_tokenizer.h"
#include "kallpa/tokenizer/chat.h"
#include "kallpa/tokenizer/tokenizer.h"

namespace tk = kallpa::tokenizer;
using nlohmann::json;

namespace {

json read_json(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  return json::parse(in);
}

std::optional<std::int64_t> opt_id(const json& j, const char* key) {
  if (!j.contains(key) || j[key].is_null()) return std::nullopt;
  return j[key].get<std::int64_t>();
}

constexpr const char* kUsage =
    "usage: kallpa_tokenize_tool (--vocab VOCAB.json | --gguf MODEL.gguf) --input INPUT.json\n";

double g_open_seconds = 0.0;  // of the last from_gguf: opening and parsing the file alone

kallpa::Result<tk::Tokenizer> from_gguf(const std::string& path) {
  const auto t0 = std::chrono::steady_clock::now();
  auto file = kallpa::model::GgufFile::open(path);
  g_open_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!file) return file.status();
  return kallpa::model::tokenizer_from_gguf(**file);
}

kallpa::Result<tk::Tokenizer> from_vocab_json(const std::string& vocab_path) {
  const json v = read_json(vocab_path);
  tk::TokenizerData data;
  data.model = v.value("model", std::string("gpt2"));
  data.pre = v.value("pre", std::string("default"));
  data.tokens = v.at("tokens").get<std::vector<std::string>>();
  if (v.contains("token_types")) data.token_types = v["token_types"].get<std::vector<std::int32_t>>();
  if (v.contains("merges")) data.merges = v["merges"].get<std::vector<std::string>>();
  if (v.contains("scores")) data.scores = v["scores"].get<std::vector<float>>();
  if (v.contains("add_space_prefix") && !v["add_space_prefix"].is_null()) {
    data.add_space_prefix = v["add_space_prefix"].get<bool>();
  }
  data.bos_id = opt_id(v, "bos_id");
  data.eos_id = opt_id(v, "eos_id");
  data.unk_id = opt_id(v, "unk_id");
  data.pad_id = opt_id(v, "pad_id");
  data.eot_id = opt_id(v, "eot_id");
  data.eom_id = opt_id(v, "eom_id");
  data.add_bos = v.value("add_bos", false);
  data.add_eos = v.value("add_eos", false);
  return tk::Tokenizer::create(std::move(data));
}

int run(int argc, char** argv) {
  std::string vocab_path, gguf_path, input_path;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--vocab" && i + 1 < argc) {
      vocab_path = argv[++i];
    } else if (a == "--gguf" && i + 1 < argc) {
      gguf_path = argv[++i];
    } else if (a == "--input" && i + 1 < argc) {
      input_path = argv[++i];
    } else {
      std::fprintf(stderr, "%s", kUsage);
      return 2;
    }
  }
  if (vocab_path.empty() == gguf_path.empty() || input_path.empty()) {
    std::fprintf(stderr, "%s", kUsage);
    return 2;
  }
  const auto load_start = std::chrono::steady_clock::now();
  auto tok = gguf_path.empty() ? from_vocab_json(vocab_path) : from_gguf(gguf_path);
  if (!tok) {
    std::fprintf(stderr, "kallpa_tokenize_tool: %s\n", tok.status().to_string().c_str());
    return 1;
  }
  const double load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count();

  const json in = read_json(input_path);
  tk::EncodeOptions eo;
  eo.add_special = in.value("add_special", true);
  eo.parse_special = in.value("parse_special", true);

  json out;
  out["pre"] = tok->pre_tokenizer_name();
  out["jit"] = tok->regex_jit();
  out["load_seconds"] = load_seconds;
  out["open_seconds"] = g_open_seconds;
  std::vector<std::string> texts = in.value("texts", std::vector<std::string>{});

  // Timing pass first (encode only), then the detailed pass.
  std::size_t bytes = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (const auto& t : texts) {
    auto ids = tok->encode(t, eo);
    if (!ids) {
      std::fprintf(stderr, "kallpa_tokenize_tool: encode: %s\n", ids.status().to_string().c_str());
      return 1;
    }
    bytes += t.size();
  }
  const auto t1 = std::chrono::steady_clock::now();
  out["encode_seconds"] = std::chrono::duration<double>(t1 - t0).count();
  out["bytes"] = bytes;

  json results = json::array();
  for (const auto& t : texts) {
    auto ids = tok->encode(t, eo);
    auto pieces = tok->pre_tokenize(t);
    auto decoded = tok->decode(*ids);
    if (!pieces || !decoded) {
      std::fprintf(stderr, "kallpa_tokenize_tool: %s\n",
                   (!pieces ? pieces.status() : decoded.status()).to_string().c_str());
      return 1;
    }
    tk::StreamDecoder sd(*tok);
    std::string streamed;
    for (tk::TokenId id : *ids) streamed += *sd.push(id);
    streamed += sd.flush();
    results.push_back({{"ids", *ids}, {"pieces", *pieces}, {"decoded", *decoded}, {"streamed", streamed}});
  }
  out["results"] = std::move(results);

  json chats = json::array();
  for (const auto& c : in.value("chats", json::array())) {
    std::vector<tk::ChatMessage> msgs;
    for (const auto& m : c) msgs.push_back({m.at("role").get<std::string>(), m.at("content").get<std::string>()});
    const std::string text = tk::format_chatml(msgs);
    auto ids = tok->encode(text, eo);
    auto structured = tk::encode_chatml(*tok, msgs);
    if (!ids || !structured) {
      std::fprintf(stderr, "kallpa_tokenize_tool: chat: %s\n",
                   (!ids ? ids.status() : structured.status()).to_string().c_str());
      return 1;
    }
    chats.push_back({{"text", text}, {"ids", *ids}, {"ids_structured", *structured}});
  }
  out["chats"] = std::move(chats);
  std::cout << out.dump(-1, ' ', false, json::error_handler_t::strict) << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kallpa_tokenize_tool: %s\n", e.what());
    return 1;
  }
}
