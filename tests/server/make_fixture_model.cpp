// Writes the tiny synthetic Llama (tests/support/synthetic_llama.h) as a GGUF file, for the server
// tests: kallpa_server_fixture OUT.gguf [CONTEXT_LENGTH [N_LAYER N_EMBD N_FF]]. Random weights, so
// the text is noise, but it is deterministic, tokenizes, speaks ChatML's markers and runs in
// milliseconds. The larger shape is for tests that need a stream to outlast a signal.
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "support/synthetic_llama.h"

int main(int argc, char** argv) {
  if (argc != 2 && argc != 3 && argc != 6) {
    std::fprintf(stderr, "usage: %s OUT.gguf [CONTEXT_LENGTH [N_LAYER N_EMBD N_FF]]\n", argv[0]);
    return 2;
  }
  kallpa::model::SyntheticLlamaSpec spec;
  spec.context_length = argc == 3 ? static_cast<std::uint32_t>(std::strtoul(argv[2], nullptr, 10)) : 4096;
  if (argc == 6) {
    spec.n_layer = static_cast<std::uint32_t>(std::strtoul(argv[3], nullptr, 10));
    spec.n_embd = static_cast<std::uint32_t>(std::strtoul(argv[4], nullptr, 10));
    spec.n_ff = static_cast<std::uint32_t>(std::strtoul(argv[5], nullptr, 10));
    // Whole Q4/Q8 blocks along every row, and 4 heads.
    if (spec.n_layer == 0 || spec.n_embd == 0 || spec.n_embd % 128 != 0 || spec.n_ff == 0 || spec.n_ff % 32 != 0) {
      std::fprintf(stderr, "need N_LAYER >= 1, N_EMBD a multiple of 128, N_FF a multiple of 32\n");
      return 2;
    }
  }
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
