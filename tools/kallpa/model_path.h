// Where the default models live: $KALLPA_MODEL, else $KALLPA_MODEL_DIR/<file>, else models/<file>
// in the current directory, else models/<file> in the repository the executable was built in.
#pragma once

#include <string>

namespace kallpa::cli {

inline constexpr const char* kDefaultModelFile = "SmolLM2-135M-Instruct.Q4_1.gguf";
// The sentence encoder's folder (scripts/fetch_model.sh --model minilm), found the same way with
// $KALLPA_EMBEDDING_MODEL in place of $KALLPA_MODEL.
inline constexpr const char* kDefaultEmbeddingModel = "all-MiniLM-L6-v2";

// The path to use when -m is not given, or "" when none exists (the message says how to fetch it).
std::string default_model_path();
std::string default_embedding_model_path();

}  // namespace kallpa::cli
