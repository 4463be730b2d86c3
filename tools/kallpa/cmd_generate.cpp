// `kallpa generate`, `kallpa chat`, `kallpa tokenize` and `kallpa detokenize`: the engine from the
// command line.
#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli.h"
#include "engine_cli.h"
#include "kallpa/model/gguf_tokenizer.h"
#include "kallpa/process_group.h"
#include "kallpa/runtime/engine.h"
#include "model_path.h"
#include "output.h"

namespace kallpa::cli {
namespace {

struct SamplingCliOptions {
  float temperature = 0.8f;
  std::int32_t top_k = 40;
  float top_p = 0.95f;
  float min_p = 0.05f;
  float repeat_penalty = 1.0f;
  std::int64_t seed = -1;  // -1: random
  std::int64_t max_tokens = 256;
};

void add_sampling_options(CLI::App* sub, SamplingCliOptions& o) {
  sub->add_option("-n,--max-tokens", o.max_tokens, "Tokens to generate at most")->check(CLI::Range(1, 1 << 20));
  sub->add_option("--temp", o.temperature, "Temperature (0: greedy)");
  sub->add_option("--top-k", o.top_k, "Keep the K most likely tokens (0: off)");
  sub->add_option("--top-p", o.top_p, "Nucleus sampling mass (1: off)");
  sub->add_option("--min-p", o.min_p, "Drop tokens below min-p times the top probability (0: off)");
  sub->add_option("--repeat-penalty", o.repeat_penalty, "Repetition penalty (1: off)");
  sub->add_option("--seed", o.seed, "Random seed (same seed, same text; default: random)");
}

Result<runtime::SamplingParams> sampling_params(const SamplingCliOptions& o) {
  runtime::SamplingParams p;
  p.temperature = o.temperature;
  p.top_k = o.top_k;
  p.top_p = o.top_p;
  p.min_p = o.min_p;
  p.repetition_penalty = o.repeat_penalty;
  p.seed = o.seed >= 0 ? static_cast<std::uint64_t>(o.seed) : std::random_device{}();
  if (Status s = p.validate(); !s) return s;
  return p;
}

// Sampling options checked first (a bad value should not wait for a model load), then the engine.
std::unique_ptr<runtime::Engine> load_for_sampling(const EngineCliOptions& e, const SamplingCliOptions& s,
                                                   const GlobalOptions& global, runtime::SamplingParams* params,
                                                   int* code) {
  auto p = sampling_params(s);
  if (!p) {
    print_error("", p.status());
    *code = kExitUsage;
    return nullptr;
  }
  *params = *p;
  return load_engine(e, global, code);
}

void print_summary(runtime::Engine& engine, const runtime::GenerateResult& r) {
  std::string fallbacks;
  for (const auto& [op, n] : engine.op_fallbacks())
    fallbacks += fmt::format("{}{} {}x", fallbacks.empty() ? "" : ", ", op, n);
  fmt::print(stderr,
             "\n[{} prompt tokens in {:.2f} s ({:.1f} tok/s); {} generated in {:.2f} s ({:.1f} tok/s); "
             "finish: {}; device: {}; attention: {}{}]\n",
             r.prompt_tokens, r.prefill_seconds,
             r.prefill_seconds > 0 ? double(r.prompt_tokens) / r.prefill_seconds : 0.0, r.generated_tokens,
             r.decode_seconds, r.decode_seconds > 0 ? double(r.generated_tokens) / r.decode_seconds : 0.0,
             r.finish_reason, engine.ops().device_name(), main_attention_backend(engine),
             fallbacks.empty() ? "" : "; on the CPU: " + fallbacks);
  // The attention backend's own counters (compiles, bytes copied to a device, ...), when it has any.
  if (const AttentionBackend* b = engine.dispatcher().registry().find(main_attention_backend(engine))) {
    std::string line;
    for (const BackendCounter& c : b->counters()) line += fmt::format(" {}={}", c.name, c.value);
    if (!line.empty()) fmt::print(stderr, "[{}:{}]\n", b->name(), line);
  }
}

struct GenerateCliOptions {
  EngineCliOptions engine;
  SamplingCliOptions sampling;
  std::string prompt;
  bool chat = false;
  std::string system;
  std::vector<std::string> stop;
  bool quiet = false;
  int logits_top = 0;  // --logits-top K: one JSON line per step on stdout instead of the text
  // Structured output: at most one of them.
  std::string json_schema_file;  // --json-schema FILE
  std::string grammar_file;      // --grammar FILE (EBNF)
  bool json = false;             // --json: any JSON object
  // --context-parallel: under mpirun, the sequence is spread over the ranks (docs/scale-out.md).
  bool context_parallel = false;
};

// The grammar the options ask for (null when none), compiled against the engine's vocabulary.
Result<std::shared_ptr<const runtime::CompiledGrammar>> grammar_of(const GenerateCliOptions& o,
                                                                   const runtime::Engine& engine) {
  runtime::GrammarSpec spec;
  const std::string& file = o.json_schema_file.empty() ? o.grammar_file : o.json_schema_file;
  if (!file.empty()) {
    std::ifstream in(file, std::ios::binary);
    std::ostringstream text;
    if (!(in && text << in.rdbuf())) {
      return Status(ErrorCode::not_found, o.json_schema_file.empty() ? "--grammar" : "--json-schema",
                    fmt::format("cannot read {}", file));
    }
    spec.source = text.str();
    spec.kind = o.json_schema_file.empty() ? runtime::GrammarKind::ebnf : runtime::GrammarKind::json_schema;
  } else if (!o.json) {
    return std::shared_ptr<const runtime::CompiledGrammar>();
  }
  auto compiler = runtime::GrammarCompiler::create(engine.tokenizer(), engine.config().vocab_size);
  if (!compiler) return compiler.status();
  return (*compiler)->compile(spec);
}

// The K highest logits, highest first (ties: lower id first), with their log-softmax.
nlohmann::json top_logits(const tokenizer::Tokenizer& tok, std::int32_t token, std::span<const float> logits, int k) {
  double max = -std::numeric_limits<double>::infinity();
  for (const float l : logits) max = std::max(max, double(l));
  double sum = 0.0;
  for (const float l : logits) sum += std::exp(double(l) - max);
  const double log_z = max + std::log(sum);
  std::vector<std::int32_t> ids(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  const auto n = std::min<std::size_t>(static_cast<std::size_t>(k), ids.size());
  std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(n), ids.end(),
                    [&](std::int32_t a, std::int32_t b) {
                      const float la = logits[static_cast<std::size_t>(a)], lb = logits[static_cast<std::size_t>(b)];
                      return la != lb ? la > lb : a < b;
                    });
  auto entry = [&](std::int32_t id) {
    const double l = logits[static_cast<std::size_t>(id)];
    return nlohmann::json{{"id", id}, {"piece", tok.token_bytes(id)}, {"logit", l}, {"logprob", l - log_z}};
  };
  nlohmann::json top = nlohmann::json::array();
  for (std::size_t i = 0; i < n; ++i) top.push_back(entry(ids[i]));
  nlohmann::json out = entry(token);
  out["top"] = std::move(top);
  return out;
}

int run_generate(const GenerateCliOptions& o, const GlobalOptions& global) {
  runtime::SamplingParams params;
  int code = kExitOk;
  auto engine = load_for_sampling(o.engine, o.sampling, global, &params, &code);
  if (!engine) return code;
  // Context parallel: rank 0 prints; the other ranks compute their share in silence.
  ProcessGroup* group = o.context_parallel ? process_group() : nullptr;
  if (group != nullptr && group->size() < 2) group = nullptr;
  const bool quiet = o.quiet || (group != nullptr && group->rank() != 0);
  const bool silent = group != nullptr && group->rank() != 0;
  Result<std::vector<std::int32_t>> prompt = std::vector<std::int32_t>{};
  if (o.chat) {
    std::vector<tokenizer::ChatMessage> messages;
    if (!o.system.empty()) messages.push_back({"system", o.system});
    messages.push_back({"user", o.prompt});
    prompt = tokenizer::encode_chat(engine->tokenizer(), engine->chat_format(), messages);
    if (!quiet && engine->chat_format().kind != tokenizer::ChatFormatKind::file_template) {
      fmt::print(stderr, "[chat prompt in {}]\n", engine->chat_format().description);
    }
  } else {
    prompt = engine->tokenizer().encode(o.prompt);
  }
  if (!prompt) {
    print_error("prompt", prompt.status());
    return kExitUsage;
  }
  auto grammar = grammar_of(o, *engine);
  if (!grammar) {
    print_error("structured output", grammar.status());
    return grammar.status().code() == ErrorCode::unsupported ? kExitFailure : kExitUsage;
  }
  runtime::Session session(*engine, params, group);
  runtime::GenerateOptions gen;
  gen.max_tokens = o.sampling.max_tokens;
  gen.stop = o.stop;
  gen.grammar = *grammar;
  std::function<void(std::string_view)> on_text = [](std::string_view text) {
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
  };
  // The step counter outlives the generation, which calls on_token by reference to it.
  const tokenizer::Tokenizer& tok = engine->tokenizer();
  std::int64_t step = 0;
  if (silent) {
    on_text = {};
  } else if (o.logits_top > 0) {
    // One JSON object per line and step; the text itself is not printed.
    gen.on_token = [&](std::int32_t token, std::span<const float> logits) {
      nlohmann::json line = top_logits(tok, token, logits, o.logits_top);
      line["step"] = step++;
      line["eog"] = tok.is_eog(token);
      fmt::print("{}\n", line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
      std::fflush(stdout);
    };
    on_text = {};
  }
  // The transfers' share of the prefill: the group's wait time when the first token is sampled.
  double prefill_wait = 0.0;
  if (group != nullptr) {
    const double before = group->wait_seconds();
    auto inner = std::move(gen.on_token);
    gen.on_token = [&prefill_wait, group, before, first = true, inner = std::move(inner)](
                       std::int32_t token, std::span<const float> logits) mutable {
      if (first) prefill_wait = group->wait_seconds() - before;
      first = false;
      if (inner) inner(token, logits);
    };
  }
  auto result = runtime::generate(session, *prompt, gen, on_text);
  if (!result) {
    if (o.logits_top == 0 && !silent) std::fputc('\n', stdout);
    const std::string what =
        group != nullptr ? fmt::format("rank {}: generation failed", group->rank()) : std::string("generation failed");
    print_error(what, result.status());
    return result.status().code() == ErrorCode::invalid_argument ? kExitUsage : kExitFailure;
  }
  if (o.logits_top == 0 && !silent) std::fputc('\n', stdout);
  if (!quiet) {
    print_summary(*engine, *result);
    if (group != nullptr) {
      fmt::print(stderr, "[context parallel over {} ranks ({}): prefill waited {:.3f} s on transfers ({:.1f}%)]\n",
                 group->size(), group->transport(), prefill_wait,
                 result->prefill_seconds > 0 ? 100.0 * prefill_wait / result->prefill_seconds : 0.0);
    }
  }
  return kExitOk;
}

struct ChatCliOptions {
  EngineCliOptions engine;
  SamplingCliOptions sampling;
  std::string system;
};

int run_chat(const ChatCliOptions& o, const GlobalOptions& global) {
  runtime::SamplingParams params;
  int code = kExitOk;
  auto engine = load_for_sampling(o.engine, o.sampling, global, &params, &code);
  if (!engine) return code;
  const tokenizer::Tokenizer& tok = engine->tokenizer();
  runtime::Session session(*engine, params);
  std::vector<tokenizer::ChatMessage> history;
  if (!o.system.empty()) history.push_back({"system", o.system});
  fmt::print(stderr, "kallpa chat ({}): type a message, an empty line or Ctrl-D to quit\n",
             engine->chat_format().description);
  std::string line;
  while (true) {
    fmt::print(stderr, "> ");
    if (!std::getline(std::cin, line) || line.empty()) break;
    history.push_back({"user", line});
    // The whole conversation is rendered each turn (templates may write earlier turns differently
    // once there are more); only what differs from the tokens already in the session is fed.
    auto ids = tokenizer::encode_chat(tok, engine->chat_format(), history);
    if (!ids) {
      print_error("message", ids.status());
      history.pop_back();
      continue;
    }
    const std::vector<std::int32_t>& have = session.tokens();
    const auto mismatch = std::mismatch(have.begin(), have.end(), ids->begin(), ids->end());
    auto common = static_cast<std::int64_t>(mismatch.first - have.begin());
    if (common == static_cast<std::int64_t>(ids->size())) --common;  // feed at least one token
    session.rewind(common);
    const std::span<const std::int32_t> feed(ids->data() + session.position(),
                                             ids->size() - static_cast<std::size_t>(session.position()));
    runtime::GenerateOptions gen;
    gen.max_tokens = o.sampling.max_tokens;
    auto r = runtime::generate(session, feed, gen, [](std::string_view text) {
      std::fwrite(text.data(), 1, text.size(), stdout);
      std::fflush(stdout);
    });
    std::fputc('\n', stdout);
    if (!r) {
      print_error("generation failed", r.status());
      return kExitFailure;
    }
    history.push_back({"assistant", r->text});
  }
  return kExitOk;
}

struct TokenizeCliOptions {
  std::string model;
  std::string text;
  bool json = false;
  bool no_special = false;
  bool no_bos = false;
};

// tokenize and detokenize need the vocabulary only: the file is opened, no weights are loaded (so
// they work on files whose architecture kallpa cannot run).
std::optional<tokenizer::Tokenizer> load_tokenizer_only(const std::string& model, int* code) {
  const std::string path = model.empty() ? default_model_path() : model;
  if (path.empty()) {
    print_error(
        "", Status(ErrorCode::not_found, "model",
                   fmt::format("no model given (-m) and {} not found; run scripts/fetch_model.sh", kDefaultModelFile)));
    *code = kExitUsage;
    return std::nullopt;
  }
  auto file = model::GgufFile::open(path);
  if (!file) {
    print_error(fmt::format("cannot open {}", path), file.status());
    *code = file.status().code() == ErrorCode::not_found ? kExitUsage : kExitFailure;
    return std::nullopt;
  }
  auto tok = model::tokenizer_from_gguf(**file);
  if (!tok) {
    print_error(fmt::format("cannot read the tokenizer of {}", path), tok.status());
    *code = kExitFailure;
    return std::nullopt;
  }
  return std::move(*tok);
}

int run_tokenize(const TokenizeCliOptions& o, const GlobalOptions&) {
  int code = kExitOk;
  auto tok = load_tokenizer_only(o.model, &code);
  if (!tok) return code;
  auto ids = tok->encode(o.text, {.add_special = !o.no_bos, .parse_special = !o.no_special});
  if (!ids) {
    print_error("text", ids.status());
    return kExitUsage;
  }
  if (o.json) {
    nlohmann::json out = nlohmann::json::array();
    for (std::int32_t id : *ids) out.push_back({{"id", id}, {"piece", tok->token_bytes(id)}});
    fmt::print("{}\n", out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    return kExitOk;
  }
  for (std::int32_t id : *ids)
    fmt::print("{:>7} {}\n", id,
               nlohmann::json(tok->token_bytes(id)).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  fmt::print(stderr, "{} token(s)\n", ids->size());
  return kExitOk;
}

struct DetokenizeCliOptions {
  std::string model;
  std::vector<std::string> ids;  // as given: numbers, separated by spaces and/or commas, or a JSON array
  bool skip_special = false;
  bool json = false;
};

// The ids of `kallpa detokenize`: every argument may hold several, separated by commas, spaces or
// brackets ("1,2,3", "[1, 2, 3]", "1 2 3" and the output of `kallpa tokenize --json` id lists).
Result<std::vector<std::int32_t>> parse_ids(const std::vector<std::string>& args) {
  std::vector<std::int32_t> ids;
  for (const std::string& a : args) {
    std::size_t i = 0;
    while (i < a.size()) {
      const char c = a[i];
      if (c == ',' || c == '[' || c == ']' || std::isspace(static_cast<unsigned char>(c))) {
        ++i;
        continue;
      }
      std::size_t end = i;
      while (end < a.size() && (std::isdigit(static_cast<unsigned char>(a[end])) || (end == i && a[end] == '-'))) ++end;
      const std::string_view num(a.data() + i, end - i);
      std::int64_t v = 0;
      const auto [ptr, ec] = std::from_chars(num.data(), num.data() + num.size(), v);
      const bool whole = ec == std::errc() && ptr == num.data() + num.size() && !num.empty();
      if (!whole || v < std::numeric_limits<std::int32_t>::min() || v > std::numeric_limits<std::int32_t>::max()) {
        std::size_t stop = i;
        while (stop < a.size() && a[stop] != ',' && !std::isspace(static_cast<unsigned char>(a[stop]))) ++stop;
        return Status::invalid("ids", fmt::format("'{}' is not a token id", a.substr(i, stop - i)));
      }
      ids.push_back(static_cast<std::int32_t>(v));
      i = end;
    }
  }
  if (ids.empty()) return Status::invalid("ids", "no token ids given");
  return ids;
}

int run_detokenize(const DetokenizeCliOptions& o, const GlobalOptions&) {
  auto ids = parse_ids(o.ids);
  if (!ids) {
    print_error("", ids.status());
    return kExitUsage;
  }
  int code = kExitOk;
  auto tok = load_tokenizer_only(o.model, &code);
  if (!tok) return code;
  auto text = tok->decode(*ids, {.skip_special = o.skip_special});
  if (!text) {
    print_error("", text.status());
    return kExitUsage;
  }
  if (o.json) {
    fmt::print("{}\n", nlohmann::json{{"text", *text}, {"tokens", ids->size()}}.dump());
    return kExitOk;
  }
  std::fwrite(text->data(), 1, text->size(), stdout);
  std::fputc('\n', stdout);
  return kExitOk;
}

}  // namespace

Command add_generate_command(CLI::App& app) {
  auto o = std::make_shared<GenerateCliOptions>();
  CLI::App* sub = app.add_subcommand("generate", "Generate text from a prompt, streaming tokens to stdout");
  sub->add_option("-p,--prompt", o->prompt, "The prompt")->required();
  sub->add_flag("--chat", o->chat,
                "Wrap the prompt in the model's chat template (one user turn; a built-in format, said in the "
                "log, when the file has none)");
  sub->add_option("--system", o->system, "System message for --chat (default: the template's own, if any)");
  sub->add_option("--stop", o->stop, "Stop string (repeatable; not printed)");
  sub->add_flag("--quiet,-q", o->quiet, "No summary line on stderr");
  sub->add_option("--logits-top", o->logits_top,
                  "Print one JSON line per step instead of the text: the sampled token and the K tokens "
                  "with the highest logits, each with its logit and log-softmax")
      ->check(CLI::Range(1, 1000));
  auto* schema = sub->add_option("--json-schema", o->json_schema_file,
                                 "Structured output: the text is JSON valid against the JSON schema in FILE "
                                 "(docs/structured-output.md)");
  auto* grammar = sub->add_option("--grammar", o->grammar_file,
                                  "Structured output: the text follows the EBNF grammar in FILE (xgrammar's "
                                  "dialect, root rule 'root')");
  auto* json = sub->add_flag("--json", o->json, "Structured output: the text is one JSON object");
  sub->add_flag("--context-parallel", o->context_parallel,
                "Under mpirun: spread the prompt's prefill and the KV cache over the ranks; rank 0 samples and "
                "prints (docs/scale-out.md). Alone, an ordinary run");
  schema->excludes(grammar)->excludes(json);
  grammar->excludes(json);
  add_engine_options(sub, o->engine);
  add_sampling_options(sub, o->sampling);
  return {sub, [o](const GlobalOptions& g) { return run_generate(*o, g); }};
}

Command add_chat_command(CLI::App& app) {
  auto o = std::make_shared<ChatCliOptions>();
  CLI::App* sub = app.add_subcommand(
      "chat", "Interactive multi-turn chat on stdin/stdout, in the model's chat template (built-in if it has none)");
  sub->add_option("--system", o->system, "System prompt (default: the model's)");
  add_engine_options(sub, o->engine);
  add_sampling_options(sub, o->sampling);
  return {sub, [o](const GlobalOptions& g) { return run_chat(*o, g); }};
}

Command add_tokenize_command(CLI::App& app) {
  auto o = std::make_shared<TokenizeCliOptions>();
  CLI::App* sub = app.add_subcommand("tokenize", "Print the token ids of a text (reads only the model's vocabulary)");
  sub->add_option("text", o->text, "The text")->required();
  sub->add_flag("--json", o->json, "A JSON array of {id, piece}");
  sub->add_flag("--no-special", o->no_special, "Treat special-token text as plain text");
  sub->add_flag("--no-bos", o->no_bos, "Do not add BOS/EOS even when the model asks for them");
  sub->add_option("-m,--model", o->model, "GGUF model file (default: models/" + std::string(kDefaultModelFile) + ")");
  return {sub, [o](const GlobalOptions& g) { return run_tokenize(*o, g); }};
}

Command add_detokenize_command(CLI::App& app) {
  auto o = std::make_shared<DetokenizeCliOptions>();
  CLI::App* sub = app.add_subcommand("detokenize", "Print the text of token ids (reads only the model's vocabulary)");
  sub->add_option("ids", o->ids, "Token ids: '1 2 3', '1,2,3' or '[1, 2, 3]'")->required();
  sub->add_flag("--skip-special", o->skip_special, "Control tokens (BOS, <end_of_turn>, ...) give no text");
  sub->add_flag("--json", o->json, "A JSON object {text, tokens}");
  sub->add_option("-m,--model", o->model, "GGUF model file (default: models/" + std::string(kDefaultModelFile) + ")");
  return {sub, [o](const GlobalOptions& g) { return run_detokenize(*o, g); }};
}

}  // namespace kallpa::cli
