// `kallpa bench attention` and `kallpa bench peak` (`bench model` lives in cmd_bench_model.cpp): every selected backend
// on every shape, side by side, against the machine's measured peaks (the harness in src/harness does the work).
#include <cstdlib>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cli.h"
#include "cmd_bench_model.h"
#include "harness/attention_bench.h"
#include "harness/peak.h"
#include "kallpa/problem_spec.h"
#include "output.h"

namespace kallpa::cli {
namespace {

struct BenchCliOptions {
  std::vector<std::string> backends;
  std::vector<std::string> specs;
  double min_time = 0.3;
  double max_seconds_per_run = 4.0;
  int threads = 0;
  bool json = false;
  bool peak_only = false;
};

// Before any kernel runs, so that the thread pool starts with this many threads.
void set_threads(int threads) {
  if (threads > 0) setenv("KALLPA_THREADS", std::to_string(threads).c_str(), 1);
}

int run_peak(const BenchCliOptions& options) {
  set_threads(options.threads);
  const harness::MachinePeak peak = harness::measure_peak(options.threads);
  if (options.json) {
    fmt::print(
        "{{\"threads\": {}, \"simd\": \"{}\", \"fma_gflops\": {:.2f}, \"int16_gops\": {:.2f}, "
        "\"dram_read_gbps\": {:.2f}, \"llc_bytes\": {}}}\n",
        peak.threads, peak.simd_target, peak.fma_gflops, peak.int16_gops, peak.dram_read_gbps,
        peak.last_level_cache_bytes);
  } else {
    fmt::print(
        "threads {}  simd {}  f32 FMA peak {:.1f} GFLOP/s  int16 multiply-add peak {:.1f} GOP/s  DRAM read {:.1f} GB/s"
        "  last-level cache {:.0f} MiB\n",
        peak.threads, peak.simd_target, peak.fma_gflops, peak.int16_gops, peak.dram_read_gbps,
        static_cast<double>(peak.last_level_cache_bytes) / (1 << 20));
  }
  return kExitOk;
}

int run_bench(const BenchCliOptions& options) {
  if (options.peak_only) return run_peak(options);
  set_threads(options.threads);
  harness::BenchOptions bench;
  bench.min_seconds = options.min_time;
  bench.max_seconds_per_run = options.max_seconds_per_run;
  for (const std::string& name : options.backends) {
    if (Status s = BackendRegistry::global().require(name, "--backend"); !s) {
      print_error("", s);
      return kExitUsage;
    }
    bench.backends.push_back(name);
  }
  for (const std::string& text : options.specs) {
    Result<ProblemSpec> spec = parse_problem_spec(text);
    if (!spec) {
      print_error(fmt::format("invalid --spec '{}'", text), spec.status());
      return kExitUsage;
    }
    if (spec->device != Device::cpu()) {
      print_error("", Status(ErrorCode::unsupported, "device",
                             fmt::format("'{}': specs are built in host memory and staged onto each "
                                         "device backend's own device; leave device= out",
                                         spec->device.to_string())));
      return kExitUsage;
    }
    bench.shapes.push_back(std::move(spec).value());
  }

  std::FILE* text = options.json ? stderr : stdout;
  fmt::print(text, "measuring the machine's peaks...\n");
  std::fflush(text);
  const harness::MachinePeak peak = harness::measure_peak(options.threads);
  const std::vector<harness::BenchRow> rows =
      harness::run_attention_bench(bench, peak, [&](const harness::BenchRow& row) {
        if (options.json) return;  // progress only for people
        fmt::print(stderr, "  {} on {}: {}\n", row.backend, row.shape,
                   row.ran ? format_duration(row.seconds) : row.note);
      });
  if (options.json) {
    fmt::print("{}\n", harness::bench_to_json(rows, peak).dump(2));
  } else {
    fmt::print("{}", harness::format_bench_table(rows, peak));
  }
  return kExitOk;
}

}  // namespace

Command add_bench_command(CLI::App& app) {
  auto options = std::make_shared<BenchCliOptions>();
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks");
  bench->require_subcommand(1);
  CLI::App* sub = bench->add_subcommand(
      "attention", "Every backend on every shape, side by side, against the measured machine peaks");
  sub->add_option("--backend,-b", options->backends, "Backend(s) to time (repeatable or comma-separated; default: all)")
      ->type_name("NAME")
      ->delimiter(',');
  sub->add_option("--spec", options->specs, "Shape(s) to time instead of the default suite")->type_name("SPEC");
  sub->add_option("--min-time", options->min_time, "Seconds to keep timing each case")
      ->check(CLI::Range(0.0, 600.0))
      ->capture_default_str();
  sub->add_option("--max-run-time", options->max_seconds_per_run,
                  "Skip a backend on a shape when one run is predicted to take longer (seconds)")
      ->check(CLI::Range(0.0, 3600.0))
      ->capture_default_str();
  sub->add_option("--threads,-t", options->threads, "Threads for kernels and peaks (default: all cores)")
      ->check(CLI::Range(1, 1024));
  sub->add_flag("--json", options->json, "Results as a JSON array on stdout");
  CLI::App* peak = bench->add_subcommand("peak", "Measure this machine's f32 FMA peak and DRAM read bandwidth");
  peak->add_option("--threads,-t", options->threads, "Threads (default: all cores)")->check(CLI::Range(1, 1024));
  peak->add_flag("--json", options->json, "One JSON object on stdout");
  peak->parse_complete_callback([options] { options->peak_only = true; });
  auto run_model = add_bench_model_subcommand(bench);
  CLI::App* model = bench->get_subcommand("model");
  return {bench, [options, model, run_model](const GlobalOptions& global) {
            return model->parsed() ? run_model(global) : run_bench(*options);
          }};
}

}  // namespace kallpa::cli
