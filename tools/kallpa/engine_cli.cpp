#include "engine_cli.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "kallpa/model/gguf.h"
#include "kallpa/process_group.h"
#include "model_path.h"
#include "output.h"

namespace kallpa::cli {
namespace {

// Prints "loading NAME: 45% of 97 MiB" on stderr once a load has taken a second, refreshed in place
// on a terminal (one line at the start and one at the end otherwise, so logs stay readable).
// A thread of its own, because the slow part may be a stage that reports no progress.
class LoadIndicator {
 public:
  explicit LoadIndicator(std::string name)
      : name_(std::move(name)), tty_(isatty(STDERR_FILENO) == 1), thread_([this] { loop(); }) {}
  ~LoadIndicator() { finish(); }

  void update(const runtime::LoadProgress& p) {
    done_.store(p.done, std::memory_order_relaxed);
    total_.store(p.total, std::memory_order_relaxed);
  }

  void finish() {
    {
      std::lock_guard lock(mu_);
      if (stopped_) return;
      stopped_ = true;
    }
    cv_.notify_all();
    thread_.join();
    if (shown_) {
      const double s = std::chrono::duration<double>(clock::now() - start_).count();
      fmt::print(stderr, "{}loaded {} in {:.1f} s{}\n", tty_ ? "\r" : "", name_, s, tty_ ? "\033[K" : "");
    }
  }

 private:
  using clock = std::chrono::steady_clock;

  void loop() {
    std::unique_lock lock(mu_);
    if (cv_.wait_for(lock, std::chrono::seconds(1), [this] { return stopped_; })) return;
    do {
      show();
    } while (tty_ && !cv_.wait_for(lock, std::chrono::milliseconds(200), [this] { return stopped_; }));
    if (!tty_) cv_.wait(lock, [this] { return stopped_; });
  }

  void show() {
    const std::uint64_t total = total_.load(std::memory_order_relaxed);
    const std::uint64_t done = done_.load(std::memory_order_relaxed);
    std::string what = total == 0 || done < total
                           ? fmt::format("{:.0f}% of {:.0f} MiB", total ? 100.0 * double(done) / double(total) : 0.0,
                                         double(total) / (1 << 20))
                           : std::string("preparing weights");
    fmt::print(stderr, "{}loading {}: {}{}", tty_ ? "\r" : "", name_, what, tty_ ? "\033[K" : "...\n");
    std::fflush(stderr);
    shown_ = true;
  }

  std::string name_;
  bool tty_;
  bool shown_ = false;
  bool stopped_ = false;
  std::atomic<std::uint64_t> done_{0}, total_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  clock::time_point start_ = clock::now();
  std::thread thread_;  // last: starts after everything it reads
};

// What identifies a model file across the ranks of a job: its size and its whole header (metadata,
// tokenizer, and the tensor table with every tensor's name, type, shape and offset). Another
// model, quantization, conversion or a truncated copy changes one of them; reading the weights
// themselves would cost every rank a pass over the whole file at each start.
std::string model_file_identity(const std::string& path) {
  auto file = model::GgufFile::open(path);
  if (!file) return "unreadable: " + file.status().to_string();
  const model::GgufFile& f = **file;
  std::string identity = fmt::format("{} bytes|", f.file_size());
  if (f.base() != nullptr) {
    identity.append(reinterpret_cast<const char*>(f.base()), static_cast<std::size_t>(f.data_offset()));
  }
  return identity;
}

// Under mpirun every rank must run the same model, or the ranks' shares of one computation would
// not fit together: the ranks compare their files' identities before loading, naming the rank
// whose file differs from rank 0's.
Status agree_on_model_file(const std::string& path) {
  ProcessGroup* group = process_group();
  if (group == nullptr || group->size() < 2) return {};
  return group->agree("model file", model_file_identity(path));
}

}  // namespace

void add_engine_options(CLI::App* sub, EngineCliOptions& o) {
  sub->add_option("-m,--model", o.model,
                  "GGUF model (default: $KALLPA_MODEL or models/" + std::string(kDefaultModelFile) + ")");
  sub->add_option("--threads,-t", o.threads, "CPU threads (default: all cores; env KALLPA_THREADS)")
      ->check(CLI::Range(1, 1024));
  sub->add_option("--context", o.context, "KV cache capacity in tokens")->check(CLI::Range(16, 1 << 20));
  add_kv_type_option(sub, o.kv_type,
                     "KV cache storage type: f16 (default), bf16 (same size, wider range, fewer mantissa bits) or "
                     "f32 (twice the memory, exact); docs/memory.md gives each one's effect on answers");
  sub->add_option("--device", o.device,
                  "Where the model runs: cpu, opencl[:N] or cuda[:N] (env KALLPA_DEVICE). An op the device lacks "
                  "runs on the CPU with copies, counted and logged once; --strict refuses that instead")
      ->envname("KALLPA_DEVICE");
}

void add_kv_type_option(CLI::App* sub, DType& kv_type, const std::string& help) {
  static const std::map<std::string, DType> kTypes = {{"f32", DType::f32}, {"f16", DType::f16}, {"bf16", DType::bf16}};
  std::vector<std::string> names;
  for (const auto& [name, type] : kTypes) names.push_back(name);
  // The check runs before the callback, so the callback only ever sees one of the names.
  sub->add_option_function<std::string>(
         "--kv-type", [&kv_type](const std::string& name) { kv_type = kTypes.at(name); }, help)
      ->check(CLI::IsMember(names))
      ->type_name("TYPE")
      ->default_str(std::string(dtype_name(kv_type)));
}

namespace {

// The attention dispatch the global options ask for (--attention, --verify-rate, ...); false, with
// the error printed and *code set, when they are not valid.
bool cli_dispatch_options(const GlobalOptions& global, DispatchOptions& out, int* code) {
  auto dispatch = dispatch_options(global, BackendRegistry::global());
  if (!dispatch) {
    print_error("", dispatch.status());
    *code = kExitUsage;
    return false;
  }
  out = *dispatch;
  return true;
}

}  // namespace

std::unique_ptr<runtime::Embedder> load_embedder(const std::string& folder, const std::string& device,
                                                 const GlobalOptions& global, int* code) {
  runtime::EmbedderOptions options;
  options.model_path = folder.empty() ? default_embedding_model_path() : folder;
  if (options.model_path.empty()) {
    print_error("", Status(ErrorCode::not_found, "embedding model",
                           fmt::format("no model given and {} not found; run `bash scripts/fetch_model.sh --model "
                                       "minilm` or set KALLPA_EMBEDDING_MODEL",
                                       kDefaultEmbeddingModel)));
    *code = kExitUsage;
    return nullptr;
  }
  if (!cli_dispatch_options(global, options.attention, code)) return nullptr;
  options.device = device;
  options.strict_device = global.strict;
  auto embedder = runtime::Embedder::load(options);
  if (!embedder) {
    print_error(fmt::format("cannot load {}", options.model_path), embedder.status());
    *code = embedder.status().code() == ErrorCode::not_found ? kExitUsage : kExitFailure;
    return nullptr;
  }
  return std::move(*embedder);
}

std::unique_ptr<runtime::Engine> load_engine(const EngineCliOptions& o, const GlobalOptions& global, int* code) {
  if (o.threads > 0) setenv("KALLPA_THREADS", std::to_string(o.threads).c_str(), 1);  // before the pool starts
  runtime::EngineOptions options;
  options.model_path = o.model.empty() ? default_model_path() : o.model;
  if (options.model_path.empty()) {
    print_error("", Status(ErrorCode::not_found, "model",
                           fmt::format("no -m given and {} not found; run `bash scripts/fetch_model.sh` or set "
                                       "KALLPA_MODEL",
                                       kDefaultModelFile)));
    *code = kExitUsage;
    return nullptr;
  }
  if (!cli_dispatch_options(global, options.attention, code)) return nullptr;
  if (Status s = agree_on_model_file(options.model_path); !s) {
    print_error("", s);
    *code = kExitUsage;
    return nullptr;
  }
  options.cache.max_tokens = o.context;
  options.cache.dtype = o.kv_type;
  options.device = o.device;
  options.strict_device = global.strict;
  LoadIndicator indicator(std::filesystem::path(options.model_path).filename().string());
  options.on_progress = [&indicator](const runtime::LoadProgress& p) { indicator.update(p); };
  auto engine = runtime::Engine::load(options);
  indicator.finish();
  if (!engine) {
    print_error(fmt::format("cannot load {}", options.model_path), engine.status());
    const ErrorCode c = engine.status().code();
    const bool bad_device = engine.status().field() == "device" && c == ErrorCode::invalid_argument;
    *code = c == ErrorCode::not_found || bad_device ? kExitUsage : kExitFailure;
    return nullptr;
  }
  return std::move(*engine);
}

std::string main_attention_backend(const runtime::Engine& engine) {
  std::string best = "-";
  std::uint64_t most = 0;
  for (const auto& [name, stats] : engine.attention_stats().snapshot()) {
    if (stats.calls - stats.failures > most) {
      most = stats.calls - stats.failures;
      best = name;
    }
  }
  return best;
}

}  // namespace kallpa::cli
