#include "harness/attention_bench.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <optional>

#include <fmt/format.h>

#include "harness/alloc_tracker.h"
#include "harness/problem_instance.h"
#include "kallpa/device.h"
#include "kallpa/dispatcher.h"
#include "kallpa/registry.h"

namespace kallpa::harness {

std::vector<ProblemSpec> default_suite() {
  std::vector<ProblemSpec> out;
  for (int d : {64, 128}) {
    for (bool causal : {false, true}) {
      for (std::int64_t n : {512, 1024, 2048, 4096, 8192}) {
        ProblemSpec s;
        s.seqlen_q = s.seqlen_k = n;
        s.hq = 8;
        s.head_dim = d;
        s.dtype = DType::f16;
        s.causal = causal;
        out.push_back(s);
      }
    }
  }
  for (std::int64_t n : {512, 2048}) {  // GQA 32/8
    ProblemSpec s;
    s.seqlen_q = s.seqlen_k = n;
    s.hq = 32;
    s.hkv = 8;
    s.head_dim = 128;
    s.dtype = DType::f16;
    s.causal = true;
    out.push_back(s);
  }
  for (DType kv : {DType::f16, DType::bf16}) {
    for (std::int64_t n : {512, 2048, 8192, 32768}) {
      ProblemSpec s;
      s.seqlen_q = 1;
      s.seqlen_k = n;
      s.hq = 32;
      s.hkv = 8;
      s.head_dim = 64;
      s.dtype = kv;
      out.push_back(s);
    }
  }
  // One decode far past any cache (1 GiB of f16 K/V; the largest above is 33.5 MB, which a server
  // CPU's L3 can hold): its %read is the DRAM figure.
  ProblemSpec dram;
  dram.seqlen_q = 1;
  dram.seqlen_k = 524288;
  dram.hq = 32;
  dram.hkv = 8;
  dram.head_dim = 64;
  dram.dtype = DType::f16;
  out.push_back(dram);
  return out;
}

namespace {

Status stage_on_device(AttentionBackend& backend, const ProblemInstance& inst, std::optional<StagedProblem>& out) {
  DeviceMemory* memory = backend.device_memory();
  if (memory == nullptr) {
    ProblemSignature on_device;
    on_device.device = Device{backend.device_kind(), 0};
    return Status(ErrorCode::unsupported, std::string(backend.name()),
                  "unavailable: " + backend.supports(on_device).why_not);
  }
  Result<StagedProblem> staged = StagedProblem::stage(*memory, inst.problem());
  if (!staged) return staged.status();
  out.emplace(std::move(*staged));
  return {};
}

}  // namespace

std::vector<BenchRow> run_attention_bench(const BenchOptions& options, const MachinePeak& peak,
                                          const std::function<void(const BenchRow&)>& on_row) {
  std::vector<std::string> names = options.backends;
  if (names.empty()) {
    for (const BackendInfo& info : BackendRegistry::global().list()) names.emplace_back(info.backend->name());
  }
  const std::vector<ProblemSpec> shapes = options.shapes.empty() ? default_suite() : options.shapes;
  std::map<std::string, double> rate;  // backend -> flops per second seen so far (its slowest)

  std::vector<BenchRow> rows;
  for (const ProblemSpec& spec : shapes) {
    auto made = ProblemInstance::create(spec);
    for (const std::string& name : names) {
      BenchRow row;
      row.backend = name;
      row.shape = spec.to_string();
      row.decode = spec.seqlen_q == 1;
      auto finish = [&] {
        if (on_row) on_row(row);
        rows.push_back(row);
      };
      if (!made) {
        row.note = made.status().to_string();
        finish();
        continue;
      }
      ProblemInstance& inst = **made;
      AttentionBackend* backend = BackendRegistry::global().find(name);
      if (!backend) {
        row.note = "no such backend";
        finish();
        continue;
      }
      auto vp = validate(inst.problem());
      if (!vp) {
        row.note = vp.status().to_string();
        finish();
        continue;
      }
      // A device backend gets the instance staged onto its device once (device.h): its times
      // exclude uploads and downloads of q/k/v/o, but include its own per-call copies.
      std::optional<StagedProblem> staged;
      if (backend->device_kind() != DeviceKind::cpu) {
        if (Status s = stage_on_device(*backend, inst, staged); !s) {
          row.note = s.to_string();
          finish();
          continue;
        }
        vp = validate(staged->problem());
        if (!vp) {
          row.note = vp.status().to_string();
          finish();
          continue;
        }
      }
      if (Support s = backend->supports(vp->signature()); !s.ok) {
        row.note = "unsupported: " + s.why_not;
        finish();
        continue;
      }
      if (auto it = rate.find(name); it != rate.end() && inst.flops() / it->second > options.max_seconds_per_run) {
        row.note = fmt::format("skipped: estimated {:.0f} s per run", inst.flops() / it->second);
        finish();
        continue;
      }
      row.workspace_bytes = backend->workspace_size(*vp);
      Dispatcher dispatcher({{name}, true});

      // The first call warms caches, thread pools and page tables; it also gives the heap figure.
      reset_heap_peak();
      const std::size_t heap_before = heap_bytes_in_use();
      Status status = dispatcher.run(*vp);
      row.heap_bytes = heap_peak_bytes() - heap_before;
      std::vector<double> times, read_times;
      const bool read_beside = row.decode && backend->device_kind() == DeviceKind::cpu;
      const auto kv_buffers = inst.kv_buffers();
      std::size_t kv_buffer_bytes = 0;
      for (const auto& b : kv_buffers) kv_buffer_bytes += b.size();
      const auto bench_start = std::chrono::steady_clock::now();
      while (status) {
        const auto t0 = std::chrono::steady_clock::now();
        status = dispatcher.run(*vp);
        const auto t1 = std::chrono::steady_clock::now();
        times.push_back(std::chrono::duration<double>(t1 - t0).count());
        if (read_beside) read_times.push_back(stream_read(kv_buffers, 0).seconds);
        const double elapsed = std::chrono::duration<double>(t1 - bench_start).count();
        if (static_cast<int>(times.size()) >= options.min_runs && elapsed >= options.min_seconds) break;
        if (elapsed > options.max_seconds_per_run * 2) break;  // slow case: a few runs are enough
      }
      if (!status) {
        row.note = status.to_string();
        finish();
        continue;
      }
      std::sort(times.begin(), times.end());
      row.ran = true;
      row.runs = static_cast<int>(times.size());
      row.seconds = times[times.size() / 2];
      row.gflops = inst.flops() / row.seconds / 1e9;
      row.on_host = backend->device_kind() == DeviceKind::cpu;
      row.peak_fraction = row.on_host && peak.fma_gflops > 0 ? row.gflops / peak.fma_gflops : 0.0;
      row.gbps = inst.kv_bytes() / row.seconds / 1e9;
      row.bandwidth_fraction = row.on_host && peak.dram_read_gbps > 0 ? row.gbps / peak.dram_read_gbps : 0.0;
      row.kv_bytes = static_cast<std::int64_t>(inst.kv_bytes());
      if (!read_times.empty()) {
        std::sort(read_times.begin(), read_times.end());
        row.read_gbps = static_cast<double>(kv_buffer_bytes) / read_times[read_times.size() / 2] / 1e9;
        row.read_fraction = row.gbps / row.read_gbps;
      }
      const double r = inst.flops() / row.seconds;
      auto [it, fresh] = rate.emplace(name, r);
      if (!fresh) it->second = std::min(it->second, r);
      finish();
    }
  }
  return rows;
}

bool kv_fits_cache(const BenchRow& row, const MachinePeak& peak) noexcept {
  return peak.last_level_cache_bytes > 0 && row.kv_bytes <= peak.last_level_cache_bytes;
}

std::string format_bench_table(const std::vector<BenchRow>& rows, const MachinePeak& peak) {
  std::string out = fmt::format(
      "machine: {} threads, {}, f32 FMA peak {:.1f} GFLOP/s, DRAM read {:.1f} GB/s{}\n", peak.threads, peak.simd_target,
      peak.fma_gflops, peak.dram_read_gbps,
      peak.last_level_cache_bytes > 0
          ? fmt::format(", last-level cache {:.0f} MiB", static_cast<double>(peak.last_level_cache_bytes) / (1 << 20))
          : std::string());
  out += fmt::format("{:<62} {:<10} {:>10} {:>9} {:>6} {:>8} {:>6} {:>6} {:>10} {:>9}\n", "shape", "backend", "ms",
                     "GFLOP/s", "%peak", "GB/s", "%bw", "%read", "workspace", "heap");
  std::string last_shape;
  bool any_cached = false, any_read = false, any_device = false;
  for (const BenchRow& r : rows) {
    const std::string shape = r.shape == last_shape ? "" : r.shape;
    last_shape = r.shape;
    if (!r.ran) {
      out += fmt::format("{:<62} {:<10} {}\n", shape, r.backend, r.note);
      continue;
    }
    // A decode whose K/V fits in the last-level cache is marked: repeated calls read it from there.
    const bool cached = r.on_host && r.decode && kv_fits_cache(r, peak);
    any_cached = any_cached || cached;
    any_read = any_read || r.read_gbps > 0;
    any_device = any_device || !r.on_host;
    out += fmt::format(
        "{:<62} {:<10} {:>10.3f} {:>9.1f} {:>6} {:>8.1f} {:>6} {:>6} {:>10} {:>9}\n", shape, r.backend, r.seconds * 1e3,
        r.gflops, r.on_host ? fmt::format("{:.1f}%", r.peak_fraction * 100) : std::string("-"), r.gbps,
        r.on_host ? fmt::format("{:.1f}%{}", r.bandwidth_fraction * 100, cached ? "*" : "") : std::string("-"),
        r.read_gbps > 0 ? fmt::format("{:.1f}%", r.read_fraction * 100) : std::string("-"), r.workspace_bytes,
        r.heap_bytes);
  }
  if (any_device) {
    out += "%peak and %bw are of this machine's CPU (above): '-' for backends on another device.\n";
  }
  if (any_read) {
    out += "%read: decode GB/s over a plain read of the same K/V timed after each call (medians), side by side.\n";
  }
  if (any_cached) {
    out +=
        "* K/V fits in the last-level cache: repeated calls read it (partly) from there, so %bw is not a DRAM "
        "ratio; give a longer skv (--spec) for one.\n";
  }
  return out;
}

nlohmann::json bench_to_json(const std::vector<BenchRow>& rows, const MachinePeak& peak) {
  nlohmann::json results = nlohmann::json::array();
  for (const BenchRow& r : rows) {
    nlohmann::json j = {{"backend", r.backend},
                        {"shape", r.shape},
                        {"decode", r.decode},
                        {"ran", r.ran},
                        {"threads", peak.threads},
                        {"machine_fma_gflops", peak.fma_gflops},
                        {"machine_dram_gbps", peak.dram_read_gbps},
                        {"simd", peak.simd_target},
                        {"machine_llc_bytes", peak.last_level_cache_bytes}};
    if (r.ran) {
      const auto fraction = [&r](double f) { return r.on_host ? nlohmann::json(f) : nlohmann::json(nullptr); };
      j.update({{"seconds", r.seconds},
                {"gflops", r.gflops},
                {"on_host", r.on_host},
                {"peak_fraction", fraction(r.peak_fraction)},
                {"gbps", r.gbps},
                {"bandwidth_fraction", fraction(r.bandwidth_fraction)},
                {"runs", r.runs},
                {"kv_bytes", r.kv_bytes},
                {"kv_fits_cache", r.on_host && kv_fits_cache(r, peak)},
                {"read_gbps", r.read_gbps},
                {"read_fraction", r.read_fraction},
                {"workspace_bytes", r.workspace_bytes},
                {"heap_bytes", r.heap_bytes}});
    } else {
      j.update({{"seconds", nullptr}, {"gflops", nullptr}, {"gbps", nullptr}, {"note", r.note}});
    }
    results.push_back(std::move(j));
  }
  return results;
}

}  // namespace kallpa::harness
