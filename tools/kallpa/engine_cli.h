// Loading the engine from the command line, shared by every subcommand that runs a model
// (generate, chat, tokenize, bench model, serve): the model/threads/context options, the default
// model path, a progress indicator for slow loads, and errors printed the CLI's way.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <CLI/CLI.hpp>

#include "cli.h"
#include "kallpa/runtime/embedder.h"
#include "kallpa/runtime/engine.h"
#include "kallpa/tensor.h"

namespace kallpa::cli {

struct EngineCliOptions {
  std::string model;
  int threads = 0;
  std::int64_t context = 4096;  // KV cache capacity in tokens
  DType kv_type = DType::f16;   // KV cache storage type: f32, f16 or bf16
  std::string device = "cpu";   // --device; --strict also refuses CPU fallbacks of device ops
};

void add_engine_options(CLI::App* sub, EngineCliOptions& options);
// --kv-type NAME (f32, f16 or bf16) into `kv_type`, described by `help`.
void add_kv_type_option(CLI::App* sub, DType& kv_type, const std::string& help);

// Loads the engine; prints the error and returns nullptr on failure, with the exit code in *code
// (usage for a missing model or a bad --attention, failure otherwise). Shows progress on stderr
// when the load takes longer than a second.
std::unique_ptr<runtime::Engine> load_engine(const EngineCliOptions& options, const GlobalOptions& global, int* code);

// The sentence encoder at `folder` ("" : the default one) on `device`, with --attention/--strict;
// nullptr after printing why (and *code set) when it cannot be loaded.
std::unique_ptr<runtime::Embedder> load_embedder(const std::string& folder, const std::string& device,
                                                 const GlobalOptions& global, int* code);

// The attention backend that served the most successful calls since load ("-" when none), for
// summary lines and reports.
std::string main_attention_backend(const runtime::Engine& engine);

}  // namespace kallpa::cli
