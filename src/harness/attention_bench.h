// `kallpa bench attention`: every selected backend on every shape, side by side in one run, with
// figures relative to the machine's measured peaks.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "harness/peak.h"
#include "kallpa/problem_spec.h"

namespace kallpa::harness {

struct BenchOptions {
  std::vector<std::string> backends;  // empty: every registered backend
  std::vector<ProblemSpec> shapes;    // empty: default_suite()
  double min_seconds = 0.3;           // keep timing one case until this much time has passed
  int min_runs = 3;
  // A backend is skipped on a shape when its speed on earlier shapes predicts a single run longer
  // than this (the reference on 8k x 8k would take minutes).
  double max_seconds_per_run = 4.0;
};

struct BenchRow {
  std::string backend;
  std::string shape;    // canonical spec text
  bool decode = false;  // Sq == 1: judged by bandwidth
  bool ran = false;
  std::string note;  // why it did not run, or what went wrong
  int runs = 0;
  double seconds = 0.0;  // median over runs
  double gflops = 0.0;
  // The backend computes on this machine's CPU, whose peaks are measured: only then are the
  // fractions of them below meaningful (a GPU's 250 TFLOP/s is no percentage of a CPU's FMA peak).
  bool on_host = true;
  double peak_fraction = 0.0;       // of the measured f32 FMA peak; 0 when !on_host
  double gbps = 0.0;                // K/V bytes read per second
  double bandwidth_fraction = 0.0;  // of the measured DRAM read; 0 when !on_host
  std::int64_t kv_bytes = 0;
  // Decode on the CPU: a plain streaming read of the same K/V buffers, timed after every kernel run
  // (medians), and the kernel's GB/s as a fraction of it: a ratio taken side by side, which the
  // machine's changing load (a shared host) moves far less than a peak measured minutes before.
  double read_gbps = 0.0;
  double read_fraction = 0.0;
  std::size_t workspace_bytes = 0;  // declared by the backend, provided by the dispatcher
  std::size_t heap_bytes = 0;       // extra heap high-water mark during one call
};

// Prefill: B=1, H=8, D=64 and 128, Sq=Skv 512..8192, causal and not, f16; GQA 32/8 at D=128;
// decode: Sq=1 against Skv 512..32768 with f16 and bf16 K/V, and one f16 decode with 1 GiB of K/V
// (Skv 524288), beyond the caches.
std::vector<ProblemSpec> default_suite();

std::vector<BenchRow> run_attention_bench(const BenchOptions& options, const MachinePeak& peak,
                                          const std::function<void(const BenchRow&)>& on_row = {});

// A row's K/V fits in the machine's last-level cache (known and at least kv_bytes): repeated calls
// read it (partly) from there, so its bandwidth_fraction is no DRAM ratio.
bool kv_fits_cache(const BenchRow& row, const MachinePeak& peak) noexcept;

std::string format_bench_table(const std::vector<BenchRow>& rows, const MachinePeak& peak);
// One object per backend x shape, each carrying the machine's measured peaks.
nlohmann::json bench_to_json(const std::vector<BenchRow>& rows, const MachinePeak& peak);

}  // namespace kallpa::harness
