// Test helper for the NumPy cross-check: writes the synthetic Llama fixture, or prints the logits
// of the last of the given tokens as a JSON array.
//
//   kallpa_logits_tool --write-synthetic OUT.gguf [--matrix-type q4_1|q8_0|q4_0|f16|f32]
//   kallpa_logits_tool MODEL.gguf ID [ID ...]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "kallpa/runtime/engine.h"
#include "support/synthetic_llama.h"

int main(int argc, char** argv) {
  using namespace kallpa;
  if (argc >= 3 && std::strcmp(argv[1], "--write-synthetic") == 0) {
    model::SyntheticLlamaSpec spec;
    if (argc >= 5 && std::strcmp(argv[3], "--matrix-type") == 0) {
      const std::string t = argv[4];
      spec.matrix_type = t == "q8_0"   ? ops::GgmlType::q8_0
                         : t == "q4_0" ? ops::GgmlType::q4_0
                         : t == "f16"  ? ops::GgmlType::f16
                         : t == "f32"  ? ops::GgmlType::f32
                                       : ops::GgmlType::q4_1;
    }
    const auto bytes = model::synthetic_llama(spec);
    std::ofstream out(argv[2], std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    return out ? 0 : 1;
  }
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s MODEL.gguf ID [ID ...] | --write-synthetic OUT.gguf\n", argv[0]);
    return 2;
  }
  runtime::EngineOptions options;
  options.model_path = argv[1];
  options.cache.max_tokens = 1024;
  // KALLPA_DEVICE runs the model on a device, strictly: every op there, none on the CPU.
  if (const char* device = std::getenv("KALLPA_DEVICE"); device != nullptr && *device != '\0') {
    options.device = device;
    options.strict_device = true;
  }
  auto engine = runtime::Engine::load(options);
  if (!engine) {
    std::fprintf(stderr, "%s\n", engine.status().to_string().c_str());
    const bool absent = engine.status().code() == ErrorCode::unsupported && engine.status().field() == "device";
    return absent ? 77 : 1;
  }
  std::vector<std::int32_t> ids;
  for (int i = 2; i < argc; ++i) ids.push_back(std::atoi(argv[i]));
  runtime::Session session(**engine, {.temperature = 0});
  if (Status s = session.feed(ids); !s) {
    std::fprintf(stderr, "%s\n", s.to_string().c_str());
    return 1;
  }
  std::printf("[");
  const auto logits = session.logits();
  for (std::size_t i = 0; i < logits.size(); ++i) std::printf("%s%.7g", i ? "," : "", double(logits[i]));
  std::printf("]\n");
  return 0;
}
