#include "model_path.h"

#include <cstdlib>
#include <filesystem>
#include <system_error>
#include <vector>

namespace kallpa::cli {

std::string default_model_path() {
  namespace fs = std::filesystem;
  if (const char* p = std::getenv("KALLPA_MODEL"); p != nullptr && *p != '\0') return p;
  std::error_code ec;
  std::vector<fs::path> candidates;
  if (const char* dir = std::getenv("KALLPA_MODEL_DIR"); dir != nullptr && *dir != '\0') {
    candidates.push_back(fs::path(dir) / kDefaultModelFile);
  }
  candidates.push_back(fs::path("models") / kDefaultModelFile);
  // build/tools/kallpa/kallpa -> <repo>/models
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) candidates.push_back(exe.parent_path() / ".." / ".." / ".." / "models" / kDefaultModelFile);
  for (const fs::path& p : candidates) {
    if (fs::exists(p, ec)) return fs::weakly_canonical(p, ec).string();
  }
  return {};
}

}  // namespace kallpa::cli
