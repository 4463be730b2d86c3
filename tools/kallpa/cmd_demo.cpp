// `kallpa demo`: runs real attention problems on every registered backend, side by side, then once
// more through the automatic dispatcher, and prints what each did, how long it took and how far it
// is from the reference.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "cli.h"
#include "harness/problem_instance.h"
#include "kallpa/conformance.h"
#include "kallpa/half.h"
#include "kallpa/observer.h"
#include "kallpa/problem_spec.h"
#include "output.h"

namespace kallpa::cli {
namespace {

// Problems the demo runs unless --spec says otherwise: a causal GQA prefill in f32 and bf16, and a
// batched decode step over a paged f16 KV cache.
const std::vector<std::string> kDefaultSpecs = {
    "b=1,sq=512,skv=512,hq=8,hkv=2,d=64,causal,dtype=f32",
    "b=1,sq=512,skv=512,hq=8,hkv=2,d=64,causal,dtype=bf16",
    "b=4,sq=1,skv=2048,hq=8,hkv=2,d=128,causal,kv=paged,page=16,dtype=f16",
};

constexpr std::string_view kOracle = "reference";
constexpr std::size_t kMaxDemoBytes = std::size_t{2} << 30;  // tensors per problem

struct DemoOptions {
  std::vector<std::string> specs;
  std::uint64_t seed = 42;
  double min_time = 0.2;  // keep re-running a backend until this much time is spent...
  int max_runs = 10;      // ...or it ran this often
  int calls = 3;          // calls through the dispatcher per problem
};

// Scratch memory for a backend, 64-byte aligned as the contract promises.
class AlignedBuffer {
 public:
  explicit AlignedBuffer(std::size_t bytes)
      : bytes_(bytes), data_(bytes ? ::operator new (bytes, std::align_val_t{64}) : nullptr) {}
  ~AlignedBuffer() {
    if (data_) ::operator delete (data_, std::align_val_t{64});
  }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  Workspace workspace() const noexcept { return {data_, bytes_}; }

 private:
  std::size_t bytes_;
  void* data_;
};

using harness::ProblemInstance;

float load_element(const TensorView& t, std::size_t i) {
  const auto* base = static_cast<const std::uint8_t*>(t.data);
  if (t.dtype == DType::f32) {
    float x;
    std::memcpy(&x, base + 4 * i, 4);
    return x;
  }
  std::uint16_t h;
  std::memcpy(&h, base + 2 * i, 2);
  return t.dtype == DType::f16 ? f16_to_f32(h) : bf16_to_f32(h);
}

void store_element(const TensorView& t, std::size_t i, float x) {
  auto* base = static_cast<std::uint8_t*>(t.data);
  if (t.dtype == DType::f32) {
    std::memcpy(base + 4 * i, &x, 4);
    return;
  }
  const std::uint16_t h = t.dtype == DType::f16 ? f32_to_f16(x) : f32_to_bf16(x);
  std::memcpy(base + 2 * i, &h, 2);
}

// Fills o (and lse) with NaN, so that an element a backend leaves unwritten shows up in the diff.
void poison_outputs(const ProblemInstance& inst) {
  for (const TensorView* t : {&inst.problem().o, &inst.problem().lse}) {
    if (!t->present()) continue;
    const auto n = static_cast<std::size_t>(t->numel());
    for (std::size_t i = 0; i < n; ++i) store_element(*t, i, std::numeric_limits<float>::quiet_NaN());
  }
}

// o in memory order (contiguous here, so also logical order), as double.
std::vector<double> output(const ProblemInstance& inst) {
  const TensorView& o = inst.problem().o;
  std::vector<double> out(static_cast<std::size_t>(o.numel()));
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = load_element(o, i);
  return out;
}

// Remembers the backend that last completed a call successfully.
class LastBackendObserver final : public DispatchObserver {
 public:
  void on_dispatch(const DispatchEvent& event) noexcept override {
    if (event.outcome != Outcome::ok) return;
    std::lock_guard lock(mu_);
    last_.assign(event.backend.begin(), event.backend.end());
  }
  std::string take() {
    std::lock_guard lock(mu_);
    return std::exchange(last_, std::string());
  }

 private:
  std::mutex mu_;
  std::string last_;
};

// Max |a - ref|; NaN when one side is NaN where the other is not (a disagreement, not a number).
double max_abs_diff(const std::vector<double>& a, const std::vector<double>& ref) {
  double worst = 0.0;
  for (std::size_t i = 0; i < a.size() && i < ref.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(ref[i])) {
      if (std::isnan(a[i]) != std::isnan(ref[i])) return std::nan("");
      continue;
    }
    if (a[i] == ref[i]) continue;  // also equal infinities
    worst = std::max(worst, std::fabs(a[i] - ref[i]));
  }
  return worst;
}

// True when some element is outside the conformance tolerance for the dtype.
bool beyond_tolerance(const std::vector<double>& a, const std::vector<double>& ref, DType dtype) {
  const conformance::Tolerance tol = conformance::tolerance_for(dtype);
  for (std::size_t i = 0; i < a.size() && i < ref.size(); ++i) {
    if (std::isnan(a[i]) != std::isnan(ref[i])) return true;
    if (std::isnan(a[i]) || a[i] == ref[i]) continue;
    if (std::fabs(a[i] - ref[i]) > tol.atol + tol.rtol * std::fabs(ref[i])) return true;
  }
  return false;
}

struct Timing {
  Status status;
  double best_seconds = 0.0;
  int runs = 0;
  std::vector<double> output;  // from the first run
};

Timing time_backend(AttentionBackend& backend, const ValidatedProblem& vp, const ProblemInstance& inst,
                    const DemoOptions& options) {
  using clock = std::chrono::steady_clock;
  Timing t;
  AlignedBuffer scratch(backend.workspace_size(vp));
  poison_outputs(inst);
  double spent = 0.0;
  t.best_seconds = HUGE_VAL;
  while (t.runs < options.max_runs && (t.runs == 0 || spent < options.min_time)) {
    const auto start = clock::now();
    t.status = backend.run(vp, scratch.workspace());
    const double seconds = std::chrono::duration<double>(clock::now() - start).count();
    if (!t.status) return t;
    if (t.runs == 0) t.output = output(inst);
    t.best_seconds = std::min(t.best_seconds, seconds);
    spent += seconds;
    ++t.runs;
  }
  return t;
}

bool listed(const DispatchOptions& options, std::string_view name) {
  return options.backends.empty() ||
         std::find(options.backends.begin(), options.backends.end(), name) != options.backends.end();
}

std::string describe_dispatch(const DispatchOptions& options) {
  if (options.backends.empty()) return "automatic";
  std::string list;
  for (const auto& name : options.backends) list += (list.empty() ? "" : ",") + name;
  return fmt::format("explicit {}{}", list, options.strict ? ", strict" : "");
}

void print_stats(const StatsObserver& stats) {
  Table table({{"backend"},
               {"calls", Table::Align::right},
               {"failed", Table::Align::right},
               {"fallbacks", Table::Align::right},
               {"mean", Table::Align::right},
               {"min", Table::Align::right},
               {"p50 <=", Table::Align::right},
               {"p99 <=", Table::Align::right},
               {"max", Table::Align::right}});
  for (const auto& [name, s] : stats.snapshot()) {
    table.add_row({name, std::to_string(s.calls), std::to_string(s.failures), std::to_string(s.fallbacks),
                   format_duration(s.mean_seconds()), format_duration(s.min_seconds),
                   format_duration(s.quantile_seconds(0.5)), format_duration(s.quantile_seconds(0.99)),
                   format_duration(s.max_seconds)});
  }
  fmt::print("dispatch telemetry (StatsObserver):\n");
  table.print(stdout);
}

int run_demo(const DemoOptions& options, const GlobalOptions& global) {
  BackendRegistry& registry = BackendRegistry::global();
  Result<DispatchOptions> dispatch = dispatch_options(global, registry);
  if (!dispatch) {
    print_error("", dispatch.status());
    return kExitUsage;
  }

  // Parse every spec before running anything, so that a typo fails fast.
  std::vector<ProblemSpec> specs;
  const std::vector<std::string>& texts = options.specs.empty() ? kDefaultSpecs : options.specs;
  for (const std::string& text : texts) {
    Result<ProblemSpec> spec = parse_problem_spec(text);
    if (!spec) {
      print_error(fmt::format("invalid --spec '{}'", text), spec.status());
      return kExitUsage;
    }
    specs.push_back(std::move(spec).value());
  }

  const std::vector<BackendInfo> backends = registry.list();
  fmt::print("kallpa demo: {} backend(s) registered; dispatch {}\n\n", backends.size(), describe_dispatch(*dispatch));

  Dispatcher dispatcher(*dispatch, &registry);
  auto stats = std::make_shared<StatsObserver>();
  auto last = std::make_shared<LastBackendObserver>();
  dispatcher.add_observer(stats);
  dispatcher.add_observer(last);

  int exit_code = kExitOk;
  std::vector<std::string> notes;
  for (std::size_t n = 0; n < specs.size(); ++n) {
    const ProblemSpec& spec = specs[n];
    if (spec.device != Device::cpu()) {
      print_error("",
                  Status(ErrorCode::unsupported, "device",
                         fmt::format("the demo allocates host memory only; '{}' is not cpu", spec.device.to_string())));
      return kExitUsage;
    }
    Result<std::unique_ptr<ProblemInstance>> built = ProblemInstance::create(spec, options.seed + n, kMaxDemoBytes);
    if (!built) {
      print_error(fmt::format("cannot build '{}'", spec.to_string()), built.status());
      return kExitUsage;
    }
    const ProblemInstance& inst = **built;
    Result<ValidatedProblem> validated = validate(inst.problem());
    if (!validated) {
      print_error(fmt::format("'{}' failed validation", spec.to_string()), validated.status());
      return kExitFailure;
    }
    const ValidatedProblem& vp = *validated;
    const ProblemSignature& sig = vp.signature();
    fmt::print("problem {}/{}: {}  ({:.3g} GFLOP)\n", n + 1, specs.size(), spec.to_string(), inst.flops() * 1e-9);

    // The oracle first, so that every other backend can be compared with it.
    std::optional<Timing> oracle;
    std::string oracle_note = "no reference backend";
    if (AttentionBackend* ref = registry.find(kOracle)) {
      if (Support s = ref->supports(sig); !s.ok) {
        oracle_note = "reference: " + s.why_not;
      } else {
        oracle = time_backend(*ref, vp, inst, options);
        if (!oracle->status) oracle_note = "reference failed";
      }
    }
    const bool have_oracle = oracle && oracle->status;

    Table table({{"backend"},
                 {"device"},
                 {"result"},
                 {"best", Table::Align::right},
                 {"runs", Table::Align::right},
                 {"GFLOP/s", Table::Align::right},
                 {"max|diff|", Table::Align::right},
                 {"note"}});
    for (const BackendInfo& info : backends) {
      AttentionBackend& backend = *info.backend;
      const std::string name(backend.name());
      const bool is_oracle = name == kOracle;
      if (!is_oracle && !listed(*dispatch, name)) continue;
      const std::string device(device_kind_name(backend.device_kind()));
      const bool explicit_choice = !dispatch->backends.empty();

      if (info.health == Health::quarantined) {
        table.add_row({name, device, "skipped", "-", "-", "-", "-", "quarantined: " + info.health_reason});
        if (explicit_choice && dispatch->strict) exit_code = kExitFailure;
        continue;
      }
      if (Support s = backend.supports(sig); !s.ok) {
        table.add_row({name, device, "skipped", "-", "-", "-", "-", s.why_not});
        if (explicit_choice && dispatch->strict && !is_oracle) exit_code = kExitFailure;
        continue;
      }
      Timing t = is_oracle ? *oracle : time_backend(backend, vp, inst, options);
      if (!t.status) {
        table.add_row({name, device, "FAILED", "-", "-", "-", "-", t.status.to_string()});
        exit_code = kExitFailure;
        continue;
      }
      std::string diff = "n/a", note;
      if (is_oracle) {
        diff = "-";
        note = "the oracle";
      } else if (have_oracle) {
        diff = format_error(max_abs_diff(t.output, oracle->output));
        if (beyond_tolerance(t.output, oracle->output, spec.dtype)) {
          note = fmt::format("beyond the {} tolerance: run `kallpa conformance --backend {}`", dtype_name(spec.dtype),
                             name);
          notes.push_back(fmt::format("{} disagrees with reference on {}", name, spec.to_string()));
        }
      } else {
        note = oracle_note;
      }
      table.add_row({name, device, "ok", format_duration(t.best_seconds), std::to_string(t.runs),
                     format_rate(inst.flops() / t.best_seconds * 1e-9), diff, note});
    }
    table.print(stdout);

    // The same problem through the dispatcher, as a library user would call it.
    Result<std::vector<AttentionBackend*>> order = dispatcher.candidates(sig);
    if (!order) {
      fmt::print("dispatcher: no candidate: {}\n\n", order.status().to_string());
      exit_code = kExitFailure;
      continue;
    }
    std::string order_text;
    for (AttentionBackend* b : *order) order_text += (order_text.empty() ? "" : " > ") + std::string(b->name());
    poison_outputs(inst);
    Status status;
    std::string ran;
    for (int c = 0; c < options.calls && status; ++c) {
      status = dispatcher.run(vp);
      ran = last->take();
    }
    if (!status) {
      fmt::print("dispatcher ({}): candidates {}; call FAILED: {}\n\n", describe_dispatch(*dispatch), order_text,
                 status.to_string());
      exit_code = kExitFailure;
      continue;
    }
    const std::string diff = have_oracle ? format_error(max_abs_diff(output(inst), oracle->output)) : "n/a";
    fmt::print("dispatcher ({}): chose {}; candidates {}; {} call(s) ok; max|diff| vs reference {}\n\n",
               describe_dispatch(*dispatch), ran.empty() ? "?" : ran, order_text, options.calls, diff);
  }

  print_stats(*stats);
  for (const std::string& note : notes) fmt::print("note: {}\n", note);
  return exit_code;
}

}  // namespace

Command add_demo_command(CLI::App& app) {
  auto options = std::make_shared<DemoOptions>();
  CLI::App* sub = app.add_subcommand("demo", "Run real attention problems on every backend and through the dispatcher");
  sub->add_option("--spec", options->specs,
                  "Problem(s) to run instead of the defaults, e.g. "
                  "b=1,sq=4096,skv=4096,hq=32,hkv=8,d=128,causal,dtype=bf16")
      ->type_name("SPEC");
  sub->add_option("--seed", options->seed, "Seed for the random inputs")->capture_default_str();
  sub->add_option("--min-time", options->min_time, "Seconds to keep re-running each backend")
      ->check(CLI::Range(0.0, 60.0))
      ->capture_default_str();
  sub->add_option("--max-runs", options->max_runs, "Most runs per backend and problem")
      ->check(CLI::Range(1, 1000000))
      ->capture_default_str();
  sub->add_option("--calls", options->calls, "Calls through the dispatcher per problem")
      ->check(CLI::Range(1, 1000000))
      ->capture_default_str();
  return {sub, [options](const GlobalOptions& global) { return run_demo(*options, global); }};
}

}  // namespace kallpa::cli
