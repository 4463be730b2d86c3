// Writes the tiny synthetic Llama (src/model/synthetic_llama.h) as a GGUF file, for the server
// tests: kallpa_server_fixture OUT.gguf [CONTEXT_LENGTH]. Random weights, so the text is noise,
// but it is deterministic, tokenizes, speaks ChatML's markers and runs in milliseconds.
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "model/synthetic_llama.h"

int main(int argc, char** argv) {
  if (argc < 2 || argc > 3) {
    std::fprintf(stderr, "usage: %s OUT.gguf [CONTEXT_LENGTH]\n", argv[0]);
    return 2;
  }
  kallpa::model::SyntheticLlamaSpec spec;
  spec.context_length = argc == 3 ? static_cast<std::uint32_t>(std::strtoul(argv[2], nullptr, 10)) : 4096;
  if (spec.context_length < 16) {
    std::fprintf(stderr, "context length must be >= 16\n");
    return 2;
  }
  const auto bytes = kallpa::model::synthetic_llama(spec);
  std::ofstream out(argv[1], std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!out) {
    std::fprintf(stderr, "cannot write %s\n", argv[1]);
    return 1;
  }
  return 0;
}
