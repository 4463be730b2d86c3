// cpu-flash kernels under Google Benchmark: the tiled SIMD path ("fast") and the scalar generic
// path side by side, plus reference-style baselines when registered. Counters: GFLOP/s with
// FLOPs = 4 * Sq * Skv * D * Hq * B (halved for causal when Sq = Skv) and, for decode, the K/V bytes
// read per second (GB/s).
//
//   build/bench/cpu_flash_bench --benchmark_filter='prefill.*fast'
//
// Versions (llm.c style; the number is the kernel generation measured):
//   v1 generic: scalar per-row online softmax.
//   v2 fast:    q^T-major rows kernel (broadcast K/V, lanes over rows) + head-dim decode kernel,
//               key tiles of 128, 64 rows per task, split-KV below 32 tasks.
//   v3 padded:  v2 with tile row strides of an odd number of cache lines (a 512-byte stride put a
//               128-row strip of q^T, S or V into an eighth of the L1 sets), the rescale of o
//               folded into the P·V pass and a cheaper exp. Prefill only; decode-shaped tasks are
//               unchanged.
//   Decode-shaped problems (Sq * group <= 16 rows per KV head) have their own generations:
//   v2 tiled:   the general path above (one task per KV head and split, strided K/V reads).
//   v3 staged:  one task per key chunk over all KV heads (K/V streamed in memory order, next block
//               prefetched), each block converted to f32 scratch, 4-key dots with a transposing
//               reduction, last chunk merges (one parallel_for).
//   v4 direct:  v3 reading K/V in place (F16C / bf16 promote in registers, no scratch round trip).
//   v5 stream:  v4 with each block walked in memory order (four key rows across every head at a
//               time, for scores and again for P·V) and K and V each prefetched 16 keys ahead into
//               L2 as one forward stream; 3-row dot kernels for GQA groups of 3.
#include <benchmark/benchmark.h>

#include <immintrin.h>

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backends/cpu-flash/cpu_flash.h"
#include "kallpa/half.h"
#include "kallpa/registry.h"

namespace {

using namespace kallpa;

struct Shape {
  std::int64_t b, sq, skv, hq, hkv, d;
  bool causal;
  DType dt;
};

struct Problem {
  std::vector<std::uint16_t> q16, k16, v16, o16;
  std::vector<float> q32, k32, v32, o32;
  AttentionProblem p;
};

std::unique_ptr<Problem> make(const Shape& s) {
  auto pr = std::make_unique<Problem>();
  std::mt19937 rng(42);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  auto mk = [&](std::vector<std::uint16_t>& b16, std::vector<float>& b32, std::initializer_list<std::int64_t> shape) {
    std::int64_t n = 1;
    for (auto x : shape) n *= x;
    void* data;
    if (s.dt == DType::f32) {
      b32.resize(static_cast<std::size_t>(n));
      for (auto& e : b32) e = dist(rng);
      data = b32.data();
    } else {
      b16.resize(static_cast<std::size_t>(n));
      for (auto& e : b16) e = s.dt == DType::f16 ? f32_to_f16(dist(rng)) : f32_to_bf16(dist(rng));
      data = b16.data();
    }
    return make_contiguous_view(data, s.dt, shape);
  };
  pr->p.q = mk(pr->q16, pr->q32, {s.b, s.sq, s.hq, s.d});
  pr->p.k = mk(pr->k16, pr->k32, {s.b, s.skv, s.hkv, s.d});
  pr->p.v = mk(pr->v16, pr->v32, {s.b, s.skv, s.hkv, s.d});
  pr->p.o = mk(pr->o16, pr->o32, {s.b, s.sq, s.hq, s.d});
  pr->p.causal = s.causal;
  return pr;
}

void run_backend(benchmark::State& state, AttentionBackend& be, const Shape& s) {
  auto pr = make(s);
  auto vp = validate(pr->p);
  if (!vp.is_ok()) {
    state.SkipWithError(vp.status().to_string().c_str());
    return;
  }
  std::vector<std::byte> ws(be.workspace_size(*vp) + 64);
  for (auto _ : state) {
    const Status st = be.run(*vp, {ws.data(), ws.size()});
    if (!st.is_ok()) {
      state.SkipWithError(st.to_string().c_str());
      return;
    }
  }
  double flops = 4.0 * static_cast<double>(s.sq * s.skv * s.d * s.hq * s.b);
  if (s.causal && s.sq == s.skv) flops /= 2;
  const double kv_bytes = 2.0 * static_cast<double>(s.b * s.skv * s.hkv * s.d) * static_cast<double>(dtype_size(s.dt));
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["KV_GB/s"] = benchmark::Counter(kv_bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["ws_MiB"] = static_cast<double>(ws.size()) / (1 << 20);
}

// Every decode kernel generation on one decode shape, one thread (CPU time) and all threads.
void register_decode_versions(const std::string& name, const Shape& s) {
  using cpu_flash::DecodeKernel;
  static cpu_flash::CpuFlashBackend v2(cpu_flash::Options{0, cpu_flash::Path::fast, DecodeKernel::tiled});
  static cpu_flash::CpuFlashBackend v3(cpu_flash::Options{0, cpu_flash::Path::fast, DecodeKernel::staged});
  static cpu_flash::CpuFlashBackend v4(cpu_flash::Options{0, cpu_flash::Path::fast, DecodeKernel::direct});
  static cpu_flash::CpuFlashBackend v5(cpu_flash::Options{0, cpu_flash::Path::fast, DecodeKernel::stream});
  static cpu_flash::CpuFlashBackend v2_1(cpu_flash::Options{1, cpu_flash::Path::fast, DecodeKernel::tiled});
  static cpu_flash::CpuFlashBackend v3_1(cpu_flash::Options{1, cpu_flash::Path::fast, DecodeKernel::staged});
  static cpu_flash::CpuFlashBackend v4_1(cpu_flash::Options{1, cpu_flash::Path::fast, DecodeKernel::direct});
  static cpu_flash::CpuFlashBackend v5_1(cpu_flash::Options{1, cpu_flash::Path::fast, DecodeKernel::stream});
  const std::pair<const char*, cpu_flash::CpuFlashBackend*> one[] = {
      {"/v2_tiled_t1", &v2_1}, {"/v3_staged_t1", &v3_1}, {"/v4_direct_t1", &v4_1}, {"/v5_stream_t1", &v5_1}};
  const std::pair<const char*, cpu_flash::CpuFlashBackend*> all[] = {
      {"/v2_tiled", &v2}, {"/v3_staged", &v3}, {"/v4_direct", &v4}, {"/v5_stream", &v5}};
  for (const auto& [suffix, be] : one)
    benchmark::RegisterBenchmark((name + suffix).c_str(), [s, be = be](benchmark::State& st) { run_backend(st, *be, s); })
        ->Unit(benchmark::kMillisecond);
  for (const auto& [suffix, be] : all)
    benchmark::RegisterBenchmark((name + suffix).c_str(), [s, be = be](benchmark::State& st) { run_backend(st, *be, s); })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
}

void register_shape(const std::string& kind, const Shape& s, bool with_generic) {
  const std::string name = kind + "/" + std::string(dtype_name(s.dt)) + "/d" + std::to_string(s.d) + "/h" +
                           std::to_string(s.hq) + "_" + std::to_string(s.hkv) + "/sq" + std::to_string(s.sq) + "_skv" +
                           std::to_string(s.skv) + (s.causal ? "/causal" : "");
  using cpu_flash::DecodeKernel;
  using cpu_flash::PrefillKernel;
  static cpu_flash::CpuFlashBackend fast(
      cpu_flash::Options{0, cpu_flash::Path::fast, DecodeKernel::automatic, PrefillKernel::rows});
  static cpu_flash::CpuFlashBackend generic(cpu_flash::Options{0, cpu_flash::Path::generic});
  static cpu_flash::CpuFlashBackend fast1(
      cpu_flash::Options{1, cpu_flash::Path::fast, DecodeKernel::automatic, PrefillKernel::rows});
  static cpu_flash::CpuFlashBackend padded(
      cpu_flash::Options{0, cpu_flash::Path::fast, DecodeKernel::automatic, PrefillKernel::padded});
  static cpu_flash::CpuFlashBackend padded1(
      cpu_flash::Options{1, cpu_flash::Path::fast, DecodeKernel::automatic, PrefillKernel::padded});
  if (kind.rfind("decode", 0) == 0) {
    register_decode_versions(name, s);
  } else {
    // One thread, CPU time: per-core efficiency, robust on a busy machine.
    benchmark::RegisterBenchmark((name + "/v2_fast_t1").c_str(), [s](benchmark::State& st) { run_backend(st, fast1, s); })
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark((name + "/v2_fast").c_str(), [s](benchmark::State& st) { run_backend(st, fast, s); })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark((name + "/v3_padded_t1").c_str(), [s](benchmark::State& st) { run_backend(st, padded1, s); })
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark((name + "/v3_padded").c_str(), [s](benchmark::State& st) { run_backend(st, padded, s); })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
  if (with_generic)
    benchmark::RegisterBenchmark((name + "/v1_generic").c_str(), [s](benchmark::State& st) { run_backend(st, generic, s); })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  if (AttentionBackend* gemm = BackendRegistry::global().find("cpu-gemm"))
    benchmark::RegisterBenchmark((name + "/cpu-gemm").c_str(), [s, gemm](benchmark::State& st) { run_backend(st, *gemm, s); })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
}

int register_all() {
  for (DType dt : {DType::f16, DType::bf16, DType::f32})
    for (std::int64_t d : {64, 128})
      for (std::int64_t n : {512, 2048, 8192})
        for (bool causal : {false, true}) {
          if (dt == DType::f32 && n != 2048) continue;
          register_shape("prefill", {1, n, n, 8, 8, d, causal, dt}, n == 512);
        }
  // llama.cpp's comparison point: 512 queries against longer KV.
  for (DType dt : {DType::f16})
    for (std::int64_t d : {64, 128})
      for (std::int64_t skv : {2048, 8192}) register_shape("prefill", {1, 512, skv, 8, 8, d, false, dt}, false);
  register_shape("prefill_gqa", {1, 2048, 2048, 32, 8, 128, true, DType::bf16}, false);
  // SmolLM2's GQA group of 3 (9 query heads on 3 KV heads, D = 64): the 3-row dot kernel of v5.
  for (std::int64_t skv : {512, 4096}) register_shape("decode_gqa3", {1, 1, skv, 9, 3, 64, false, DType::f16}, false);
  for (DType dt : {DType::f16, DType::bf16})
    for (std::int64_t d : {64, 128})
      for (std::int64_t skv : {512, 4096, 32768}) {
        register_shape("decode", {1, 1, skv, 8, 8, d, false, dt}, skv <= 4096);
        register_shape("decode_gqa", {1, 1, skv, 32, 8, d, false, dt}, false);
      }
  // The engine's decode (SmolLM2: 9 query heads on 3 KV heads, D = 64, paged f16 cache, page 16)
  // is measured through `kallpa bench attention --spec ...,kv=paged,page=16`.
  return 0;
}

// FP32 FMA peak of one core (12 independent FMA chains), so kernel numbers can be read as a
// fraction of the machine's peak measured in the same run.
__attribute__((target("avx2,fma"))) double fma_chains_avx2(long n) {
  __m256 a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_ps(1.0f + static_cast<float>(i) * 1e-3f);
  const __m256 b = _mm256_set1_ps(0.9999f), c = _mm256_set1_ps(1e-4f);
  for (long i = 0; i < n; ++i)
    for (int k = 0; k < 12; ++k) {
      a[k] = _mm256_fmadd_ps(a[k], b, c);
      asm volatile("" : "+x"(a[k]));
    }
  float r = 0;
  for (int k = 0; k < 12; ++k) r += _mm256_cvtss_f32(a[k]);
  return r;
}

__attribute__((target("avx512f"))) double fma_chains_avx512(long n) {
  __m512 a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(1.0f + static_cast<float>(i) * 1e-3f);
  const __m512 b = _mm512_set1_ps(0.9999f), c = _mm512_set1_ps(1e-4f);
  for (long i = 0; i < n; ++i)
    for (int k = 0; k < 12; ++k) {
      a[k] = _mm512_fmadd_ps(a[k], b, c);
      asm volatile("" : "+v"(a[k]));
    }
  float r = 0;
  for (int k = 0; k < 12; ++k) r += _mm512_cvtss_f32(a[k]);
  return r;
}

void BM_FmaPeak1Core(benchmark::State& state) {
  const bool avx512 = __builtin_cpu_supports("avx512f");
  if (!avx512 && !__builtin_cpu_supports("fma")) {
    state.SkipWithError("no FMA");
    return;
  }
  constexpr long kN = 1 << 20;
  for (auto _ : state) benchmark::DoNotOptimize(avx512 ? fma_chains_avx512(kN) : fma_chains_avx2(kN));
  state.counters["GFLOP/s"] = benchmark::Counter(static_cast<double>(kN) * 12 * (avx512 ? 32 : 16) * 1e-9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_FmaPeak1Core)->Unit(benchmark::kMillisecond);

const int registered = register_all();

}  // namespace

BENCHMARK_MAIN();
