// `kallpa generate`, `kallpa chat` and `kallpa tokenize`: the engine from the command line.
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli.h"
#include "engine_cli.h"
#include "kallpa/runtime/engine.h"
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
};

int run_generate(const GenerateCliOptions& o, const GlobalOptions& global) {
  runtime::SamplingParams params;
  int code = kExitOk;
  auto engine = load_for_sampling(o.engine, o.sampling, global, &params, &code);
  if (!engine) return code;
  Result<std::vector<std::int32_t>> prompt = std::vector<std::int32_t>{};
  if (o.chat) {
    std::vector<tokenizer::ChatMessage> messages;
    tokenizer::ChatMlOptions chat = engine->chat_options();
    if (!o.system.empty()) messages.push_back({"system", o.system});
    messages.push_back({"user", o.prompt});
    prompt = tokenizer::encode_chatml(engine->tokenizer(), messages, chat);
  } else {
    prompt = engine->tokenizer().encode(o.prompt);
  }
  if (!prompt) {
    print_error("prompt", prompt.status());
    return kExitUsage;
  }
  runtime::Session session(*engine, params);
  runtime::GenerateOptions gen;
  gen.max_tokens = o.sampling.max_tokens;
  gen.stop = o.stop;
  auto result = runtime::generate(session, *prompt, gen, [](std::string_view text) {
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
  });
  if (!result) {
    std::fputc('\n', stdout);
    print_error("generation failed", result.status());
    return result.status().code() == ErrorCode::invalid_argument ? kExitUsage : kExitFailure;
  }
  std::fputc('\n', stdout);
  if (!o.quiet) print_summary(*engine, *result);
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
  const auto im_end = tok.token_id("<|im_end|>");
  const auto newline = tok.encode("\n", {.add_special = false});
  if (!im_end || !newline) {
    print_error("", Status(ErrorCode::unsupported, "model", "the vocabulary has no ChatML markers"));
    return kExitFailure;
  }
  runtime::Session session(*engine, params);
  tokenizer::ChatMlOptions first = engine->chat_options();
  if (!o.system.empty()) first.default_system_prompt = o.system;
  tokenizer::ChatMlOptions later = first;
  later.default_system_prompt.reset();
  fmt::print(stderr, "kallpa chat: type a message, an empty line or Ctrl-D to quit\n");
  std::string line;
  bool first_turn = true;
  while (true) {
    fmt::print(stderr, "> ");
    if (!std::getline(std::cin, line) || line.empty()) break;
    std::vector<tokenizer::ChatMessage> turn{{"user", line}};
    auto ids = tokenizer::encode_chatml(tok, turn, first_turn ? first : later);
    if (!ids) {
      print_error("message", ids.status());
      continue;
    }
    std::vector<std::int32_t> feed;
    if (!first_turn) {
      // Close the assistant's previous reply: its <|im_end|> was sampled but never fed.
      feed.push_back(*im_end);
      feed.insert(feed.end(), newline->begin(), newline->end());
    }
    feed.insert(feed.end(), ids->begin(), ids->end());
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
    first_turn = false;
  }
  return kExitOk;
}

struct TokenizeCliOptions {
  EngineCliOptions engine;
  std::string text;
  bool json = false;
  bool no_special = false;
};

int run_tokenize(const TokenizeCliOptions& o, const GlobalOptions& global) {
  int code = kExitOk;
  auto engine = load_engine(o.engine, global, &code);
  if (!engine) return code;
  const tokenizer::Tokenizer& tok = engine->tokenizer();
  auto ids = tok.encode(o.text, {.add_special = true, .parse_special = !o.no_special});
  if (!ids) {
    print_error("text", ids.status());
    return kExitUsage;
  }
  if (o.json) {
    nlohmann::json out = nlohmann::json::array();
    for (std::int32_t id : *ids) out.push_back({{"id", id}, {"piece", tok.token_bytes(id)}});
    fmt::print("{}\n", out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    return kExitOk;
  }
  for (std::int32_t id : *ids)
    fmt::print("{:>7} {}\n", id,
               nlohmann::json(tok.token_bytes(id)).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  fmt::print(stderr, "{} token(s)\n", ids->size());
  return kExitOk;
}

}  // namespace

Command add_generate_command(CLI::App& app) {
  auto o = std::make_shared<GenerateCliOptions>();
  CLI::App* sub = app.add_subcommand("generate", "Generate text from a prompt, streaming tokens to stdout");
  sub->add_option("-p,--prompt", o->prompt, "The prompt")->required();
  sub->add_flag("--chat", o->chat, "Wrap the prompt in the model's chat template (one user turn)");
  sub->add_option("--system", o->system, "System prompt for --chat (default: the model's)");
  sub->add_option("--stop", o->stop, "Stop string (repeatable; not printed)");
  sub->add_flag("--quiet,-q", o->quiet, "No summary line on stderr");
  add_engine_options(sub, o->engine);
  add_sampling_options(sub, o->sampling);
  return {sub, [o](const GlobalOptions& g) { return run_generate(*o, g); }};
}

Command add_chat_command(CLI::App& app) {
  auto o = std::make_shared<ChatCliOptions>();
  CLI::App* sub = app.add_subcommand("chat", "Interactive multi-turn chat (ChatML) on stdin/stdout");
  sub->add_option("--system", o->system, "System prompt (default: the model's)");
  add_engine_options(sub, o->engine);
  add_sampling_options(sub, o->sampling);
  return {sub, [o](const GlobalOptions& g) { return run_chat(*o, g); }};
}

Command add_tokenize_command(CLI::App& app) {
  auto o = std::make_shared<TokenizeCliOptions>();
  CLI::App* sub = app.add_subcommand("tokenize", "Print the token ids of a text");
  sub->add_option("text", o->text, "The text")->required();
  sub->add_flag("--json", o->json, "A JSON array of {id, piece}");
  sub->add_flag("--no-special", o->no_special, "Treat special-token text as plain text");
  add_engine_options(sub, o->engine);
  return {sub, [o](const GlobalOptions& g) { return run_tokenize(*o, g); }};
}

}  // namespace kallpa::cli
