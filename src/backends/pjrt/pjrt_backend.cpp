// pjrt: the attention contract on any XLA device (TPU, GPU, CPU) through a PJRT plugin. kallpa
// describes attention to the device's own compiler as StableHLO (attention_program.h), compiles it
// once per shape bucket, and runs it through the PJRT C API (pjrt_runtime.h).
//
// Tensors stay in host memory (device kind cpu): each run packs the problem's rows into padded,
// contiguous arrays (varlen rows into a dense batch, paged KV into the blocks the table names),
// copies them to the device, executes, and scatters o and lse back into the caller's views. Paged
// K/V whose cache states page versions stays on the device instead (kv_mirror.h): a run copies the
// pages that changed since the device last saw them.
#include "backends/pjrt/pjrt_backend.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "backends/pjrt/attention_program.h"
#include "backends/pjrt/child_probe.h"
#include "backends/pjrt/host_copy.h"
#include "backends/pjrt/kv_mirror.h"
#include "backends/pjrt/pjrt_runtime.h"
#include "kallpa/registry.h"

namespace kallpa::pjrt {
namespace {

// The compiler's memory statistics in a report (plugins that give none leave memory_known false).
void set_memory(CompileReport& report, const MemoryStats& mem) {
  report.memory_known = true;
  report.argument_bytes = mem.argument_bytes;
  report.output_bytes = mem.output_bytes;
  report.temp_bytes = mem.temp_bytes;
  report.generated_code_bytes = mem.generated_code_bytes;
}

// Positions past any sequence: the window bound passed for an unbounded side.
constexpr std::int64_t kUnbounded = std::int64_t{1} << 30;

std::int64_t bucket(std::int64_t n) noexcept {
  return static_cast<std::int64_t>(std::bit_ceil(static_cast<std::uint64_t>(std::max<std::int64_t>(n, 1))));
}

const char* env(const char* name) noexcept {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

// The host arrays of one run, laid out as the program's arguments (attention_program.h).
struct Packed {
  ProgramSpec spec;
  std::vector<char> q, k, v;
  std::vector<std::int32_t> seqlen_q, seqlen_k, table;
  std::vector<float> slopes;
  float scale = 1.0f;
  float softcap = 1.0f;  // 1 when off: the program divides by it only when softcap is on
  std::int32_t window_left = static_cast<std::int32_t>(kUnbounded);
  std::int32_t window_right = static_cast<std::int32_t>(kUnbounded);
};

std::uint64_t element_bytes(ElementType t) noexcept { return t == ElementType::f16 || t == ElementType::bf16 ? 2 : 4; }

// Bytes one run moved between host and device.
struct Transfer {
  std::uint64_t to_device = 0;
  std::uint64_t from_device = 0;
};

// Uploads the packed arguments, runs `exe` on the client's device, and downloads o (in the
// spec's out dtype) and lse (when the spec has it). `moved` counts the bytes copied each way.
// With `k_dev` and `v_dev` (the KV mirror's pools), K and V are already on the device and the
// packed k and v are not read.
Status launch(const Client& client, const Executable& exe, const Packed& in, std::vector<char>& o,
              std::vector<float>& lse, Transfer& moved, PJRT_Buffer* k_dev = nullptr, PJRT_Buffer* v_dev = nullptr) {
  const ProgramSpec& spec = in.spec;
  const ElementType t = element_type(spec.in_dtype), kt = element_type(spec.kv_dtype);
  std::vector<Buffer> args;
  std::vector<PJRT_Buffer*> raw;
  const auto upload = [&](const void* data, ElementType type, std::vector<std::int64_t> dims) -> Status {
    Result<Buffer> b = client.upload(data, type, dims);
    if (!b) return b.status();
    std::uint64_t bytes = element_bytes(type);
    for (const std::int64_t d : dims) bytes *= static_cast<std::uint64_t>(d);
    moved.to_device += bytes;
    raw.push_back(b->get());
    args.push_back(std::move(*b));
    return {};
  };
  const std::int64_t kv_rows = spec.paged ? spec.num_blocks : spec.batch;
  const std::int64_t kv_cols = spec.paged ? spec.page_size : spec.seq_k;
  Status s = upload(in.q.data(), t, {spec.batch, spec.seq_q, spec.hq, spec.head_dim});
  if (s && k_dev != nullptr) {
    raw.push_back(k_dev);
    raw.push_back(v_dev);
  } else {
    if (s) s = upload(in.k.data(), kt, {kv_rows, kv_cols, spec.hkv, spec.head_dim});
    if (s) s = upload(in.v.data(), kt, {kv_rows, kv_cols, spec.hkv, spec.head_dim_v});
  }
  if (s) s = upload(in.seqlen_q.data(), ElementType::s32, {spec.batch});
  if (s) s = upload(in.seqlen_k.data(), ElementType::s32, {spec.batch});
  if (s) s = upload(&in.scale, ElementType::f32, {});
  if (s) s = upload(&in.softcap, ElementType::f32, {});
  if (s) s = upload(&in.window_left, ElementType::s32, {});
  if (s) s = upload(&in.window_right, ElementType::s32, {});
  if (s && spec.paged) s = upload(in.table.data(), ElementType::s32, {spec.batch, spec.max_blocks()});
  if (s && spec.alibi) s = upload(in.slopes.data(), ElementType::f32, {spec.hq});
  if (!s) return s;
  Result<std::vector<Buffer>> outputs = exe.execute(client.device(), raw);
  if (!outputs) return outputs.status();
  const std::size_t want = spec.lse ? 2 : 1;
  if (outputs->size() != want) {
    return Status(ErrorCode::internal, "pjrt",
                  fmt::format("the executable returned {} outputs; the program has {}", outputs->size(), want));
  }
  o.resize(static_cast<std::size_t>(spec.batch * spec.seq_q * spec.hq * spec.head_dim_v) * dtype_size(spec.out_dtype));
  if (Status r = (*outputs)[0].to_host(o.data(), o.size()); !r) return r;
  moved.from_device += o.size();
  if (spec.lse) {
    lse.resize(static_cast<std::size_t>(spec.batch * spec.hq * spec.seq_q));
    if (Status r = (*outputs)[1].to_host(lse.data(), lse.size() * sizeof(float)); !r) return r;
    moved.from_device += lse.size() * sizeof(float);
  }
  return {};
}

// First contact with a plugin, meant for a child process: load, create the client, compile a
// program with every feature on, and run it once on zeros.
Status probe(const std::string& path, int device_index) {
  Result<std::shared_ptr<Plugin>> plugin = Plugin::load(path);
  if (!plugin) return plugin.status();
  Result<std::unique_ptr<Client>> client = Client::create(*plugin, device_index);
  if (!client) return client.status();
  Packed in;
  ProgramSpec& s = in.spec;
  s.in_dtype = s.kv_dtype = s.out_dtype = DType::bf16;
  s.batch = 2;
  s.seq_q = 4;
  s.hq = 4;
  s.hkv = 2;
  s.head_dim = s.head_dim_v = 16;
  s.seq_k = 32;
  s.chunk = 16;
  s.causal = s.window = s.softcap = s.alibi = s.lse = true;
  Result<std::unique_ptr<Executable>> exe = (*client)->compile(attention_program(s));
  if (!exe) return exe.status();
  in.q.assign(static_cast<std::size_t>(s.batch * s.seq_q * s.hq * s.head_dim) * 2, 0);
  in.k.assign(static_cast<std::size_t>(s.batch * s.seq_k * s.hkv * s.head_dim) * 2, 0);
  in.v = in.k;
  in.seqlen_q.assign(static_cast<std::size_t>(s.batch), static_cast<std::int32_t>(s.seq_q));
  in.seqlen_k.assign(static_cast<std::size_t>(s.batch), static_cast<std::int32_t>(s.seq_k));
  in.slopes.assign(static_cast<std::size_t>(s.hq), 0.0f);
  std::vector<char> o;
  std::vector<float> lse;
  Transfer moved;
  return launch(**client, **exe, in, o, lse, moved);
}

class PjrtBackend final : public PjrtAttention {
 public:
  std::string_view name() const noexcept override { return "pjrt"; }
  std::string_view version() const noexcept override { return "0.1.0"; }
  DeviceKind device_kind() const noexcept override { return DeviceKind::cpu; }
  // Below the CPU backends: on host tensors it is chosen by name (--attention pjrt), never by
  // default, since every run copies the problem to the device and back.
  int priority() const noexcept override { return 10; }
  std::string_view description() const noexcept override {
    return "StableHLO compiled by a PJRT plugin (KALLPA_PJRT_PLUGIN: libtpu, XLA CPU/GPU), keys walked in "
           "chunks with an lse merge";
  }

  Support supports(const ProblemSignature& sig) const noexcept override {
    const Runtime* rt = runtime();
    // A plugin that crashed at first contact claims support and fails every run, so that the
    // health check quarantines it with the reason and the dispatcher never selects it.
    if (!rt->crashed.empty()) return Support::yes();
    if (rt->client == nullptr) return Support::no(rt->why_not);
    if (sig.device.kind != DeviceKind::cpu) {
      return Support::no(
          fmt::format("the tensors are on {}; pjrt takes host tensors and copies them to its "
                      "'{}' device itself",
                      sig.device.to_string(), rt->client->platform()));
    }
    return Support::yes();
  }

  Status run(const ValidatedProblem& vp, Workspace) noexcept override {
    try {
      return run_impl(vp);
    } catch (const std::bad_alloc&) {
      return Status(ErrorCode::out_of_memory, "pjrt", "out of host memory while packing the problem");
    } catch (const std::exception& e) {
      return Status(ErrorCode::internal, "pjrt", e.what());
    }
  }

  Result<PlatformInfo> platform() const override {
    const Runtime* rt = runtime();
    if (rt->client == nullptr) return rt->unavailable();
    PlatformInfo info;
    info.plugin_path = rt->client->plugin().path();
    info.api_version = rt->client->plugin().version_string();
    info.platform = rt->client->platform();
    info.device_kind = rt->client->device_kind();
    info.device_count = rt->client->device_count();
    info.device_index = rt->device_index;
    info.chunk = rt->chunk;
    return info;
  }

  CacheStats cache_stats() const override {
    std::shared_lock lock(cache_mu_);
    CacheStats s = stats_;
    s.cache_hits = hits_.load(std::memory_order_relaxed);
    s.executions = executions_.load(std::memory_order_relaxed);
    s.bytes_to_device = bytes_to_device_.load(std::memory_order_relaxed);
    s.bytes_from_device = bytes_from_device_.load(std::memory_order_relaxed);
    s.cached_executables = cache_.size();
    const MirrorStats m = mirrors_.stats();
    s.kv_pages_uploaded = m.pages_uploaded;
    s.kv_page_updates = m.updates;
    s.kv_mirrors_created = m.created;
    s.kv_mirror_evictions = m.evictions;
    s.kv_mirrors = m.mirrors;
    s.kv_mirror_bytes = m.bytes;
    return s;
  }

  std::vector<BackendCounter> counters() const override {
    // Read from the cache's counters only: never loads the plugin, so a scrape of an idle server
    // shows zeros rather than starting a client.
    const CacheStats s = cache_stats();
    using K = BackendCounter::Kind;
    return {
        {"compiles", "Attention programs compiled by the PJRT plugin (each an executable cache miss).", K::counter,
         static_cast<double>(s.compiles)},
        {"compile_failures", "Attention programs the PJRT plugin failed to compile.", K::counter,
         static_cast<double>(s.compile_failures)},
        {"compile_seconds", "Time spent compiling attention programs, failed compiles included.", K::counter,
         s.compile_milliseconds / 1000.0},
        {"cache_hits", "Attention runs that found their executable already compiled.", K::counter,
         static_cast<double>(s.cache_hits)},
        {"executions", "Attention programs executed on the PJRT device.", K::counter,
         static_cast<double>(s.executions)},
        {"cached_executables", "Compiled attention executables held (one per program and shape bucket).", K::gauge,
         static_cast<double>(s.cached_executables)},
        {"bytes_to_device", "Bytes attention runs copied from host to the PJRT device (q, K/V pages, indices).",
         K::counter, static_cast<double>(s.bytes_to_device)},
        {"bytes_from_device", "Bytes attention runs copied from the PJRT device to host (o, lse).", K::counter,
         static_cast<double>(s.bytes_from_device)},
        {"kv_pages_uploaded", "K/V pages copied into the device's copy of a paged cache (changed since last seen).",
         K::counter, static_cast<double>(s.kv_pages_uploaded)},
        {"kv_page_updates", "Page update programs run on the device's copies of paged caches.", K::counter,
         static_cast<double>(s.kv_page_updates)},
        {"kv_mirrors_created", "Device copies of paged K/V pools started (zeros made on the device).", K::counter,
         static_cast<double>(s.kv_mirrors_created)},
        {"kv_mirror_evictions", "Device copies of paged K/V pools dropped to stay under the memory cap.", K::counter,
         static_cast<double>(s.kv_mirror_evictions)},
        {"kv_mirrors", "Device copies of paged K/V pools held.", K::gauge, static_cast<double>(s.kv_mirrors)},
        {"kv_mirror_bytes", "Device bytes the copies of paged K/V pools hold.", K::gauge,
         static_cast<double>(s.kv_mirror_bytes)},
    };
  }

  Result<CompileReport> compile(const ValidatedProblem& vp) override {
    try {
      const Runtime* rt = runtime();
      if (rt->client == nullptr) return rt->unavailable();
      const ProgramSpec spec = plan(vp, rt->chunk);
      CompileReport report;
      report.program_key = spec.key();
      Result<Compiled> exe = executable(*rt, spec);
      if (!exe) return exe.status();
      report.cached = exe->cached;
      report.compile_milliseconds = exe->compile_ms;
      report.program_bytes = exe->program_bytes;
      Result<MemoryStats> mem = exe->exe->memory_stats();
      if (mem) set_memory(report, *mem);
      return report;
    } catch (const std::bad_alloc&) {
      return Status(ErrorCode::out_of_memory, "pjrt", "out of host memory while compiling");
    }
  }

  Result<CompileReport> compile_for_target(const ValidatedProblem& vp, std::string_view topology) override {
    try {
      const Runtime* rt = runtime();
      if (rt->plugin == nullptr) return rt->unavailable();
      const ProgramSpec spec = plan(vp, rt->chunk);
      const std::string text = attention_program(spec);
      CompileReport report;
      report.program_key = spec.key();
      report.program_bytes = text.size();
      const auto t0 = std::chrono::steady_clock::now();
      Result<MemoryStats> mem = rt->plugin->compile_for_topology(topology, text);
      report.compile_milliseconds =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (!mem) return mem.status();
      set_memory(report, *mem);
      return report;
    } catch (const std::bad_alloc&) {
      return Status(ErrorCode::out_of_memory, "pjrt", "out of host memory while compiling");
    }
  }

 private:
  struct Runtime {
    std::shared_ptr<const Plugin> plugin;  // loaded and initialised (null: see why_not, crashed)
    std::unique_ptr<Client> client;        // null when unavailable; why_not (or crashed) says why
    std::string why_not;
    std::string crashed;  // the plugin crashed or hung at first contact, in a child process
    int device_index = 0;
    std::int64_t chunk = kDefaultChunk;
    std::uint64_t mirror_bytes = kDefaultKvMirrorBytes;

    Status unavailable() const {
      if (!crashed.empty()) return Status(ErrorCode::backend_failure, "pjrt", crashed);
      return Status(ErrorCode::unsupported, "pjrt", why_not);
    }
  };

  struct Compiled {
    std::shared_ptr<const Executable> exe;
    bool cached = false;
    double compile_ms = 0.0;
    std::size_t program_bytes = 0;
  };

  // Loaded on first use, from the environment then (`kallpa --pjrt-plugin` sets it before).
  const Runtime* runtime() const noexcept {
    std::call_once(init_once_, [this] {
      try {
        runtime_ = load_runtime();
        mirrors_.set_capacity(runtime_->mirror_bytes);
      } catch (const std::exception& e) {
        runtime_ = std::make_unique<Runtime>();
        runtime_->why_not = fmt::format("PJRT set-up failed: {}", e.what());
      }
    });
    return runtime_.get();
  }

  static std::unique_ptr<Runtime> load_runtime() {
    auto rt = std::make_unique<Runtime>();
    const char* path = env(kPluginEnv);
    if (path == nullptr) {
      rt->why_not = fmt::format(
          "no PJRT plugin given: set {} (or kallpa --pjrt-plugin PATH) to a plugin such as "
          "libtpu.so or XLA's CPU plugin",
          kPluginEnv);
      return rt;
    }
    if (const char* d = env(kDeviceEnv); d != nullptr) {
      const std::string_view text(d);
      int index = -1;
      const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), index);
      if (ec != std::errc() || end != text.data() + text.size() || index < 0) {
        rt->why_not = fmt::format("{}='{}' is not a device index (0, 1, ...)", kDeviceEnv, text);
        return rt;
      }
      rt->device_index = index;
    }
    if (const char* c = env(kChunkEnv); c != nullptr) {
      const std::string_view text(c);
      std::int64_t chunk = 0;
      const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), chunk);
      if (ec != std::errc() || end != text.data() + text.size() || chunk < 1 || chunk > (1 << 20) ||
          !std::has_single_bit(static_cast<std::uint64_t>(chunk))) {
        rt->why_not = fmt::format("{}='{}' is not a power of two in [1, 2^20]", kChunkEnv, text);
        return rt;
      }
      rt->chunk = chunk;
    }
    if (const char* m = env(kKvMirrorBytesEnv); m != nullptr) {
      const std::string_view text(m);
      const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), rt->mirror_bytes);
      if (ec != std::errc() || end != text.data() + text.size()) {
        rt->why_not =
            fmt::format("{}='{}' is not a number of bytes (0 turns the KV mirror off)", kKvMirrorBytesEnv, text);
        return rt;
      }
    }

    // First contact in a child process, unless turned off: a plugin that aborts or hangs there
    // costs the child. A regular error is met again, safely, by the load below.
    const char* isolate = env(kIsolateEnv);
    if (isolate == nullptr || std::string_view(isolate) != "0") {
      double timeout = kDefaultProbeSeconds;
      if (const char* t = env(kProbeTimeoutEnv); t != nullptr) {
        const std::string_view text(t);
        const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), timeout);
        if (ec != std::errc() || end != text.data() + text.size() || !(timeout > 0.0)) {
          rt->why_not = fmt::format("{}='{}' is not a positive number of seconds", kProbeTimeoutEnv, text);
          return rt;
        }
      }
      const int device = rt->device_index;
      const ChildOutcome o = run_in_child([&] { return probe(path, device); }, timeout);
      if (o.kind == ChildOutcome::Kind::crashed) {
        rt->crashed = fmt::format("first contact with '{}' ran in a child process, which {}", path, o.reason);
        return rt;
      }
    }
    Result<std::shared_ptr<Plugin>> plugin = Plugin::load(path);
    if (!plugin) {
      rt->why_not = plugin.status().message();
      return rt;
    }
    rt->plugin = *plugin;  // kept without a client too: ahead-of-time compile needs none
    Result<std::unique_ptr<Client>> client = Client::create(*plugin, rt->device_index);
    if (!client) {
      rt->why_not = fmt::format("'{}' (PJRT API {}) loaded, but {}: {}", path, (*plugin)->version_string(),
                                client.status().field(), client.status().message());
      return rt;
    }
    rt->client = std::move(*client);
    return rt;
  }

  // The program and shape bucket for a problem: batch, query rows and keys padded up to powers
  // of two (paged: the blocks per row), so that a serving workload compiles a bounded set.
  // Mirrored (paged K/V kept on the device): the program reads the whole pool through the
  // caller's own block table.
  static ProgramSpec plan(const ValidatedProblem& vp, std::int64_t chunk, bool mirrored = false) {
    const AttentionProblem& p = vp.problem();
    const ProblemSignature& sig = vp.signature();
    ProgramSpec s;
    s.in_dtype = sig.q_dtype;
    s.kv_dtype = sig.kv_dtype;
    s.out_dtype = sig.o_dtype;
    s.batch = bucket(vp.batch());
    s.seq_q = bucket(vp.max_seqlen_q());
    s.hq = vp.hq();
    s.hkv = vp.hkv();
    s.head_dim = vp.head_dim();
    s.head_dim_v = vp.head_dim_v();
    s.causal = p.causal;
    s.window = sig.window;
    s.softcap = sig.softcap;
    s.alibi = sig.alibi;
    s.lse = sig.lse;
    if (p.kv_layout == KvLayout::paged) {
      const std::int64_t page = p.k.shape[1];
      // Mirrored: the pool's blocks. Copied: the distinct blocks the sequences use.
      std::int64_t blocks = p.k.shape[0];
      if (!mirrored) {
        std::vector<std::int32_t> used;
        const std::int64_t stride = p.block_table_stride > 0 ? p.block_table_stride : p.max_blocks_per_seq;
        for (std::int32_t b = 0; b < vp.batch(); ++b) {
          const std::int64_t n = (vp.seqlen_k(b) + page - 1) / page;
          for (std::int64_t j = 0; j < n; ++j) used.push_back(p.block_table[b * stride + j]);
        }
        std::sort(used.begin(), used.end());
        blocks = bucket(std::unique(used.begin(), used.end()) - used.begin());
      }
      const std::int64_t rows = bucket((vp.max_seqlen_k() + page - 1) / page);
      const std::int64_t per_step =
          std::min(rows, static_cast<std::int64_t>(
                             std::bit_floor(static_cast<std::uint64_t>(std::max<std::int64_t>(1, chunk / page)))));
      s.paged = true;
      s.page_size = page;
      s.num_blocks = blocks;
      s.seq_k = rows * page;
      s.chunk = per_step * page;
    } else {
      s.seq_k = bucket(vp.max_seqlen_k());
      s.chunk = std::min(s.seq_k, chunk);
    }
    return s;
  }

  // Packs the problem into the program's arguments (zero padding everywhere past a length).
  static Packed pack(const ValidatedProblem& vp, const ProgramSpec& s, bool mirrored = false) {
    const AttentionProblem& p = vp.problem();
    Packed out;
    out.spec = s;
    const std::size_t es = dtype_size(p.q.dtype), kv_es = dtype_size(p.k.dtype);
    const std::int64_t hq = vp.hq(), hkv = vp.hkv(), d = vp.head_dim(), dv = vp.head_dim_v();
    const auto last = [](const TensorView& t, int from_end) {
      return t.stride[static_cast<std::size_t>(t.rank - from_end)];
    };

    out.q.assign(static_cast<std::size_t>(s.batch * s.seq_q * hq * d) * es, 0);
    out.seqlen_q.assign(static_cast<std::size_t>(s.batch), 0);
    out.seqlen_k.assign(static_cast<std::size_t>(s.batch), 0);
    const char* q = static_cast<const char*>(p.q.data);
    for (std::int32_t b = 0; b < vp.batch(); ++b) {
      out.seqlen_q[b] = static_cast<std::int32_t>(vp.seqlen_q(b));
      out.seqlen_k[b] = static_cast<std::int32_t>(vp.seqlen_k(b));
      for (std::int64_t i = 0; i < vp.seqlen_q(b); ++i) {
        for (std::int64_t h = 0; h < hq; ++h) {
          const std::int64_t src = vp.q_row_offset(b, i) + h * last(p.q, 2);
          const std::int64_t dst = ((b * s.seq_q + i) * hq + h) * d;
          gather_elems(out.q.data() + dst * static_cast<std::int64_t>(es), q + src * static_cast<std::int64_t>(es), d,
                       last(p.q, 1), es);
        }
      }
    }

    const char* k = static_cast<const char*>(p.k.data);
    const char* v = static_cast<const char*>(p.v.data);
    if (s.paged && mirrored) {
      // K and V are on the device already: the table goes as the caller wrote it, entries past a
      // sequence's keys at block 0 (masked in the program).
      const std::int64_t page = s.page_size, rows = s.max_blocks();
      const std::int64_t stride = p.block_table_stride > 0 ? p.block_table_stride : p.max_blocks_per_seq;
      out.table.assign(static_cast<std::size_t>(s.batch * rows), 0);
      for (std::int32_t b = 0; b < vp.batch(); ++b) {
        const std::int64_t n = (vp.seqlen_k(b) + page - 1) / page;
        std::copy(p.block_table + b * stride, p.block_table + b * stride + n,
                  out.table.begin() + static_cast<std::ptrdiff_t>(b * rows));
      }
    } else if (s.paged) {
      // The blocks the sequences use, renumbered densely; the table is rewritten to match, and
      // entries past a sequence's keys point at block 0 (masked in the program).
      const std::int64_t page = s.page_size, rows = s.max_blocks();
      const std::int64_t stride = p.block_table_stride > 0 ? p.block_table_stride : p.max_blocks_per_seq;
      out.k.assign(static_cast<std::size_t>(s.num_blocks * page * hkv * d) * kv_es, 0);
      out.v.assign(static_cast<std::size_t>(s.num_blocks * page * hkv * dv) * kv_es, 0);
      out.table.assign(static_cast<std::size_t>(s.batch * rows), 0);
      std::unordered_map<std::int32_t, std::int32_t> renumber;
      for (std::int32_t b = 0; b < vp.batch(); ++b) {
        const std::int64_t n = (vp.seqlen_k(b) + page - 1) / page;
        for (std::int64_t j = 0; j < n; ++j) {
          const std::int32_t block = p.block_table[b * stride + j];
          auto [it, fresh] = renumber.try_emplace(block, static_cast<std::int32_t>(renumber.size()));
          out.table[static_cast<std::size_t>(b * rows + j)] = it->second;
          if (!fresh) continue;
          const std::int64_t to = it->second;
          for (std::int64_t t = 0; t < page; ++t) {
            for (std::int64_t h = 0; h < hkv; ++h) {
              const std::int64_t ks = block * p.k.stride[0] + t * p.k.stride[1] + h * p.k.stride[2];
              const std::int64_t vs = block * p.v.stride[0] + t * p.v.stride[1] + h * p.v.stride[2];
              const std::int64_t kd = ((to * page + t) * hkv + h) * d, vd = ((to * page + t) * hkv + h) * dv;
              gather_elems(out.k.data() + kd * static_cast<std::int64_t>(kv_es),
                           k + ks * static_cast<std::int64_t>(kv_es), d, p.k.stride[3], kv_es);
              gather_elems(out.v.data() + vd * static_cast<std::int64_t>(kv_es),
                           v + vs * static_cast<std::int64_t>(kv_es), dv, p.v.stride[3], kv_es);
            }
          }
        }
      }
    } else {
      out.k.assign(static_cast<std::size_t>(s.batch * s.seq_k * hkv * d) * kv_es, 0);
      out.v.assign(static_cast<std::size_t>(s.batch * s.seq_k * hkv * dv) * kv_es, 0);
      for (std::int32_t b = 0; b < vp.batch(); ++b) {
        for (std::int64_t j = 0; j < vp.seqlen_k(b); ++j) {
          for (std::int64_t h = 0; h < hkv; ++h) {
            const std::int64_t ks = vp.k_row_offset(b, j) + h * last(p.k, 2);
            const std::int64_t vs = vp.v_row_offset(b, j) + h * last(p.v, 2);
            const std::int64_t kd = ((b * s.seq_k + j) * hkv + h) * d, vd = ((b * s.seq_k + j) * hkv + h) * dv;
            gather_elems(out.k.data() + kd * static_cast<std::int64_t>(kv_es),
                         k + ks * static_cast<std::int64_t>(kv_es), d, last(p.k, 1), kv_es);
            gather_elems(out.v.data() + vd * static_cast<std::int64_t>(kv_es),
                         v + vs * static_cast<std::int64_t>(kv_es), dv, last(p.v, 1), kv_es);
          }
        }
      }
    }
    if (s.alibi) out.slopes.assign(p.alibi_slopes, p.alibi_slopes + hq);
    out.scale = vp.scale();
    if (p.softcap > 0.0f) out.softcap = p.softcap;
    const auto bound = [](std::int64_t w) {
      return static_cast<std::int32_t>(w < 0 ? kUnbounded : std::min(w, kUnbounded));
    };
    out.window_left = bound(vp.window_left());
    out.window_right = bound(vp.window_right());
    return out;
  }

  // The cached executable for `spec`, compiling it on a miss (counted, timed). The only place the
  // host process compiles for a client: run() and compile() both come here, so no compile on the
  // token path escapes the counters (the first-contact probe compiles in a child process, and
  // compile_for_target has no client and caches nothing).
  Result<Compiled> executable(const Runtime& rt, const ProgramSpec& spec) {
    if (Status s = check_spec(spec); !s) return s;
    return executable(rt, spec.key(), [&] { return attention_program(spec); });
  }

  // The same cache for any program the backend runs (attention, the KV mirror's page programs).
  Result<Compiled> executable(const Runtime& rt, const std::string& key, const std::function<std::string()>& program) {
    {
      std::shared_lock lock(cache_mu_);
      if (auto it = cache_.find(key); it != cache_.end()) return Compiled{it->second, true, 0.0, 0};
    }
    // One compile at a time: two runs missing on the same key compile it once.
    std::lock_guard compile_lock(compile_mu_);
    {
      std::shared_lock lock(cache_mu_);
      if (auto it = cache_.find(key); it != cache_.end()) return Compiled{it->second, true, 0.0, 0};
    }
    const std::string text = program();
    const auto t0 = std::chrono::steady_clock::now();
    Result<std::unique_ptr<Executable>> exe = rt.client->compile(text);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::unique_lock lock(cache_mu_);
    stats_.compile_milliseconds += ms;  // a failed compile stalls the caller just the same
    if (!exe) {
      ++stats_.compile_failures;
      return Status(exe.status().code(), exe.status().field(),
                    fmt::format("compiling [{}]: {}", key, exe.status().message()));
    }
    ++stats_.compiles;
    std::shared_ptr<const Executable> shared(std::move(*exe));
    cache_.emplace(key, shared);
    // Never silent: a compile on the token path stalls it for hundreds of milliseconds.
    spdlog::info("pjrt: compiled [{}] in {:.1f} ms ({} executables cached)", key, ms, cache_.size());
    return Compiled{std::move(shared), false, ms, text.size()};
  }

  Status run_impl(const ValidatedProblem& vp) {
    const Runtime* rt = runtime();
    if (rt->client == nullptr) return rt->unavailable();
    if (vp.total_q() == 0) return {};
    const AttentionProblem& p = vp.problem();
    const bool mirrored = mirrors_.applies(vp);
    const ProgramSpec spec = plan(vp, rt->chunk, mirrored);
    Result<Compiled> exe = executable(*rt, spec);
    if (!exe) return exe.status();
    if (exe->cached) hits_.fetch_add(1, std::memory_order_relaxed);

    const Packed in = pack(vp, spec, mirrored);
    std::vector<char> o;
    std::vector<float> lse;
    Transfer moved;
    Status launched;
    if (mirrored) {
      const KvMirrors::ProgramCache programs = [&](const std::string& key,
                                                   const std::function<std::string()>& program) {
        Result<Compiled> c = executable(*rt, key, program);
        if (!c) return Result<std::shared_ptr<const Executable>>(c.status());
        if (c->cached) hits_.fetch_add(1, std::memory_order_relaxed);
        return Result<std::shared_ptr<const Executable>>(c->exe);
      };
      launched = mirrors_.run_with(*rt->client, vp, programs, moved.to_device, [&](PJRT_Buffer* k, PJRT_Buffer* v) {
        return launch(*rt->client, *exe->exe, in, o, lse, moved, k, v);
      });
    } else {
      launched = launch(*rt->client, *exe->exe, in, o, lse, moved);
    }
    // Counted whether or not the run succeeded: the copies happened.
    bytes_to_device_.fetch_add(moved.to_device, std::memory_order_relaxed);
    bytes_from_device_.fetch_add(moved.from_device, std::memory_order_relaxed);
    if (!launched) return launched;
    executions_.fetch_add(1, std::memory_order_relaxed);
    const std::int64_t hq = vp.hq(), dv = vp.head_dim_v();
    const std::size_t os = dtype_size(p.o.dtype);
    char* od = static_cast<char*>(p.o.data);
    const std::int64_t o_head = p.o.stride[static_cast<std::size_t>(p.o.rank - 2)];
    const std::int64_t o_dim = p.o.stride[static_cast<std::size_t>(p.o.rank - 1)];
    float* lse_out = static_cast<float*>(p.lse.data);
    for (std::int32_t b = 0; b < vp.batch(); ++b) {
      for (std::int64_t i = 0; i < vp.seqlen_q(b); ++i) {
        for (std::int64_t h = 0; h < hq; ++h) {
          const std::int64_t src = ((b * spec.seq_q + i) * hq + h) * dv;
          const std::int64_t dst = vp.o_row_offset(b, i) + h * o_head;
          scatter_elems(od + dst * static_cast<std::int64_t>(os), o.data() + src * static_cast<std::int64_t>(os), dv,
                        o_dim, os);
          if (lse_out != nullptr) {
            lse_out[vp.lse_offset(b, static_cast<std::int32_t>(h), i)] =
                lse[static_cast<std::size_t>((b * hq + h) * spec.seq_q + i)];
          }
        }
      }
    }
    return {};
  }

  mutable std::once_flag init_once_;
  mutable std::unique_ptr<Runtime> runtime_;

  mutable std::shared_mutex cache_mu_;
  std::mutex compile_mu_;
  std::unordered_map<std::string, std::shared_ptr<const Executable>> cache_;  // under cache_mu_
  CacheStats stats_;                                                          // compiles; under cache_mu_
  std::atomic<std::uint64_t> hits_{0};
  std::atomic<std::uint64_t> executions_{0};
  std::atomic<std::uint64_t> bytes_to_device_{0};
  std::atomic<std::uint64_t> bytes_from_device_{0};
  mutable KvMirrors mirrors_{kDefaultKvMirrorBytes};
};

}  // namespace

KALLPA_REGISTER_BACKEND(PjrtBackend);

}  // namespace kallpa::pjrt
