// Where the tests find the real model files scripts/fetch_model.sh puts in models/.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>

namespace kallpa::test_support {

// $`env` when set, else models/`file` in the repository or the current directory; "" when absent.
inline std::string model_file(const std::string& file, const char* env) {
  if (const char* p = std::getenv(env); p != nullptr && *p != '\0') return p;
  for (const std::filesystem::path& dir :
       {std::filesystem::path(__FILE__).parent_path().parent_path().parent_path() / "models",
        std::filesystem::path("models")}) {
    const auto p = dir / file;
    if (std::filesystem::exists(p)) return p.string();
  }
  return {};
}

inline std::string gemma3_270m_path() { return model_file("gemma-3-270m-q4_k_m.gguf", "KALLPA_GEMMA_MODEL"); }
inline std::string smollm2_path() { return model_file("SmolLM2-135M-Instruct.Q4_1.gguf", "KALLPA_MODEL"); }

}  // namespace kallpa::test_support
