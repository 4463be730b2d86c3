// `kallpa bench model`: prompt-processing and generation speed of a model, llama-bench style.
#pragma once

#include <CLI/CLI.hpp>

#include "cli.h"

namespace kallpa::cli {

// Adds `model` under the `bench` subcommand; the returned function runs it when it was parsed.
std::function<int(const GlobalOptions&)> add_bench_model_subcommand(CLI::App* bench);

}  // namespace kallpa::cli
