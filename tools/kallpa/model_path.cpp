#include "model_path.h"

#include <cstdlib>
#include <filesystem>
#include <system_error>
#include <vector>

namespace kallpa::cli {

namespace {

std::string find_model(const char* file, const char* env) {
  namespace fs = std::filesystem;
  if (const char* p = std::getenv(env); p != nullptr && *p != '\0') return p;
  std::error_code ec;
  std::vector<fs::path> candidates;
  if (const char* dir = std::getenv("KALLPA_MODEL_DIR"); dir != nullptr && *dir != '\0') {
    candidates.push_back(fs::path(dir) / file);
  }
  candidates.push_back(fs::path("models") / file);
  // build/tools/kallpa/kallpa -> <repo>/models
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) candidates.push_back(exe.parent_path() / ".." / ".." / ".." / "models" / file);
  for (const fs::path& p : candidates) {
    if (fs::exists(p, ec)) return fs::weakly_canonical(p, ec).string();
  }
  return {};
}

}  // namespace

std::string default_model_path() { return find_model(kDefaultModelFile, "KALLPA_MODEL"); }

std::string default_embedding_model_path() { return find_model(kDefaultEmbeddingModel, "KALLPA_EMBEDDING_MODEL"); }

}  // namespace kallpa::cli
