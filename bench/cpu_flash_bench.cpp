// cpu-flash's production kernels under Google Benchmark: the tiled SIMD path ("fast") and the
// scalar generic path side by side, each decode kernel forced beside the automatic choice, plus
// reference-style baselines when registered. Counters: GFLOP/s with FLOPs = 4 * Sq * Skv * D * Hq
// * B (halved for causal when Sq = Skv) and, for decode, the K/V bytes read per second (KV_GB/s).
//
//   build/bench/cpu_flash_bench --benchmark_filter='prefill.*fast'
//
// Names: <shape>/<kernel>[_t1]: _t1 runs one thread (CPU time), else every thread (real time).
//   fast, generic:  the tiled path (prefill.cpp) and the scalar path.
//   auto:           decode as the backend chooses it (choose_decode_kernel).
//   by_head, grouped, lanes, lanes_half_dots: that decode kernel forced (DecodeKernel).
//   decode_l1/*:    every key the same K/V row, so K/V stay in L1: the kernels' compute ceilings.
//   decode_dram/*:  K/V of 256 MiB (far beyond L3) on huge pages, beside stream_read, a plain sum
//                   of the same bytes on the same threads: the practical ceiling. Compare with
//                   --benchmark_repetitions=5 --benchmark_enable_random_interleaving=true;
//                   KALLPA_BENCH_HUGE_PAGES=0 puts the buffers on 4 KiB pages.
// Earlier kernel generations live in bench/lab/cpu-flash (each checks itself and times itself
// against these); the figures measured with this program are in bench/results/cpu-flash-*.md.
#include <benchmark/benchmark.h>

#include <immintrin.h>

#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "backends/cpu-flash/cpu_flash.h"
#include "core/parallel.h"
#include "harness/thp_allocator.h"
#include "kallpa/half.h"
#include "kallpa/registry.h"

namespace {

using namespace kallpa;

struct Shape {
  std::int64_t b, sq, skv, hq, hkv, d;
  bool causal;
  DType dt;
  // Every key the same K/V row (key stride 0): K/V stay in L1 whatever skv, so a decode kernel
  // runs at its compute ceiling (decode_l1/*).
  bool one_key_row = false;
};

template <typename T>
using HugeVec = std::vector<T, harness::ThpAllocator<T>>;

struct Problem {
  HugeVec<std::uint16_t> q16, k16, v16, o16;
  HugeVec<float> q32, k32, v32, o32;
  AttentionProblem p;
};

std::unique_ptr<Problem> make(const Shape& s) {
  auto pr = std::make_unique<Problem>();
  std::mt19937 rng(42);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  auto mk = [&](HugeVec<std::uint16_t>& b16, HugeVec<float>& b32, std::initializer_list<std::int64_t> shape,
                bool one_row = false) {
    std::int64_t n = 1;
    for (auto x : shape) n *= x;
    if (one_row) n /= shape.begin()[1];
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
    TensorView view = make_contiguous_view(data, s.dt, shape);
    if (one_row) view.stride[1] = 0;
    return view;
  };
  pr->p.q = mk(pr->q16, pr->q32, {s.b, s.sq, s.hq, s.d});
  pr->p.k = mk(pr->k16, pr->k32, {s.b, s.skv, s.hkv, s.d}, s.one_key_row);
  pr->p.v = mk(pr->v16, pr->v32, {s.b, s.skv, s.hkv, s.d}, s.one_key_row);
  pr->p.o = mk(pr->o16, pr->o32, {s.b, s.sq, s.hq, s.d});
  pr->p.causal = s.causal;
  return pr;
}

// One problem per shape, built on first use: the 256 MiB decode_dram shapes take seconds to fill.
const Problem& problem_for(const Shape& s) {
  static std::map<
      std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t, bool, int, bool>,
      std::unique_ptr<Problem>>
      cache;
  auto& slot = cache[{s.b, s.sq, s.skv, s.hq, s.hkv, s.d, s.causal, static_cast<int>(s.dt), s.one_key_row}];
  if (!slot) slot = make(s);
  return *slot;
}

// Sums words [lo, hi) of a and of b, alternating in 64 KiB pieces. AVX2 where the CPU has it, so
// that the sum never limits the stream.
__attribute__((target("avx2"))) std::uint64_t sum_two_avx2(const std::uint64_t* a, const std::uint64_t* b,
                                                           std::int64_t lo, std::int64_t hi) {
  constexpr std::int64_t kPiece = 8192;
  __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
  std::uint64_t tail = 0;
  for (std::int64_t x0 = lo; x0 < hi; x0 += kPiece) {
    const std::int64_t x1 = std::min(hi, x0 + kPiece);
    for (const std::uint64_t* src : {a, b}) {
      std::int64_t x = x0;
      for (; x + 16 <= x1; x += 16) {
        s0 = _mm256_add_epi64(s0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + x)));
        s1 = _mm256_add_epi64(s1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + x + 4)));
        s2 = _mm256_add_epi64(s2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + x + 8)));
        s3 = _mm256_add_epi64(s3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + x + 12)));
      }
      for (; x < x1; ++x) tail += src[x];
    }
  }
  alignas(32) std::uint64_t out[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(out),
                     _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3)));
  return out[0] + out[1] + out[2] + out[3] + tail;
}

std::uint64_t sum_two(const std::uint64_t* a, const std::uint64_t* b, std::int64_t lo, std::int64_t hi) {
  if (__builtin_cpu_supports("avx2")) return sum_two_avx2(a, b, lo, hi);
  constexpr std::int64_t kPiece = 8192;
  std::uint64_t a0 = 0, a1 = 0;
  for (std::int64_t x0 = lo; x0 < hi; x0 += kPiece) {
    const std::int64_t x1 = std::min(hi, x0 + kPiece);
    for (std::int64_t x = x0; x < x1; ++x) a0 += a[x];
    for (std::int64_t x = x0; x < x1; ++x) a1 += b[x];
  }
  return a0 + a1;
}

// The practical ceiling of a decode kernel: the same K and V bytes summed by the same threads, each
// thread its contiguous share of the keys, K and V alternating in 64 KiB pieces (two streams per
// thread, as the kernels read them).
void run_stream_read(benchmark::State& state, const Shape& s) {
  const Problem& pr = problem_for(s);
  const auto* k = static_cast<const std::uint64_t*>(pr.p.k.data);
  const auto* v = static_cast<const std::uint64_t*>(pr.p.v.data);
  const std::int64_t words = s.b * s.skv * s.hkv * s.d * static_cast<std::int64_t>(dtype_size(s.dt)) / 8;
  auto& pool = parallel::ThreadPool::global();
  const int threads = pool.threads_for(0);
  std::vector<std::uint64_t> sums(static_cast<std::size_t>(threads) * 8);
  for (auto _ : state) {
    pool.parallel_for(
        threads,
        [&](std::int64_t t, int) {
          const std::int64_t lo = words * t / threads, hi = words * (t + 1) / threads;
          sums[static_cast<std::size_t>(t) * 8] = sum_two(k, v, lo, hi);
        },
        threads);
    benchmark::DoNotOptimize(sums.data());
  }
  const double kv_bytes = 2.0 * static_cast<double>(words) * 8;
  state.counters["KV_GB/s"] = benchmark::Counter(kv_bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void run_backend(benchmark::State& state, AttentionBackend& be, const Shape& s) {
  const Problem* pr = &problem_for(s);
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

// Every production decode kernel, and the automatic choice, on one decode shape, one thread (CPU
// time) and all threads.
void register_decode_kernels(const std::string& name, const Shape& s) {
  using cpu_flash::DecodeKernel;
  struct Entry {
    const char* name;
    DecodeKernel kernel;
  };
  static const Entry kernels[] = {{"auto", DecodeKernel::automatic},
                                  {"by_head", DecodeKernel::by_head},
                                  {"grouped", DecodeKernel::grouped},
                                  {"lanes", DecodeKernel::lanes},
                                  {"lanes_half_dots", DecodeKernel::lanes_half_dots}};
  // One backend per kernel and thread count, alive for the whole run.
  static std::map<std::pair<int, int>, std::unique_ptr<cpu_flash::CpuFlashBackend>> backends;
  auto backend = [](DecodeKernel k, int threads) {
    auto& be = backends[{static_cast<int>(k), threads}];
    if (!be) be = std::make_unique<cpu_flash::CpuFlashBackend>(cpu_flash::Options{threads, cpu_flash::Path::fast, k});
    return be.get();
  };
  const bool l1 = name.rfind("decode_l1", 0) == 0;      // the memory-order kernels' ceilings, one thread
  const bool dram = name.rfind("decode_dram", 0) == 0;  // all threads, beside the plain read
  for (const Entry& e : kernels) {
    if ((l1 || dram) && (e.kernel == DecodeKernel::automatic || e.kernel == DecodeKernel::by_head)) continue;
    if (!dram) {
      cpu_flash::CpuFlashBackend* be = backend(e.kernel, 1);
      benchmark::RegisterBenchmark((name + "/" + e.name + "_t1").c_str(), [s, be](benchmark::State& st) {
        run_backend(st, *be, s);
      })->Unit(benchmark::kMillisecond);
    }
    if (!l1) {
      cpu_flash::CpuFlashBackend* be = backend(e.kernel, 0);
      benchmark::RegisterBenchmark((name + "/" + e.name).c_str(),
                                   [s, be](benchmark::State& st) { run_backend(st, *be, s); })
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
  if (dram)
    benchmark::RegisterBenchmark((name + "/stream_read").c_str(), [s](benchmark::State& st) { run_stream_read(st, s); })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
}

void register_shape(const std::string& kind, const Shape& s, bool with_generic) {
  const std::string name = kind + "/" + std::string(dtype_name(s.dt)) + "/d" + std::to_string(s.d) + "/h" +
                           std::to_string(s.hq) + "_" + std::to_string(s.hkv) + "/sq" + std::to_string(s.sq) + "_skv" +
                           std::to_string(s.skv) + (s.causal ? "/causal" : "");
  static cpu_flash::CpuFlashBackend fast(cpu_flash::Options{0, cpu_flash::Path::fast});
  static cpu_flash::CpuFlashBackend generic(cpu_flash::Options{0, cpu_flash::Path::generic});
  static cpu_flash::CpuFlashBackend fast1(cpu_flash::Options{1, cpu_flash::Path::fast});
  if (kind.rfind("decode", 0) == 0) {
    register_decode_kernels(name, s);
  } else {
    // One thread, CPU time: per-core efficiency, robust on a busy machine.
    benchmark::RegisterBenchmark((name + "/fast_t1").c_str(), [s](benchmark::State& st) {
      run_backend(st, fast1, s);
    })->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark((name + "/fast").c_str(), [s](benchmark::State& st) { run_backend(st, fast, s); })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
  if (with_generic)
    benchmark::RegisterBenchmark((name + "/generic").c_str(),
                                 [s](benchmark::State& st) { run_backend(st, generic, s); })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  if (kind.rfind("decode_dram", 0) == 0) return;  // cpu-gemm takes seconds per call there
  if (s.one_key_row) return;                      // decode_l1: the kernels' ceilings only
  if (AttentionBackend* gemm = BackendRegistry::global().find("cpu-gemm"))
    benchmark::RegisterBenchmark((name + "/cpu-gemm").c_str(),
                                 [s, gemm](benchmark::State& st) { run_backend(st, *gemm, s); })
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
  // SmolLM2's GQA group of 3 (9 query heads on 3 KV heads, D = 64): the kernels' 3-row groups.
  for (std::int64_t skv : {512, 4096}) register_shape("decode_gqa3", {1, 1, skv, 9, 3, 64, false, DType::f16}, false);
  for (DType dt : {DType::f16, DType::bf16})
    for (std::int64_t d : {64, 128})
      for (std::int64_t skv : {512, 4096, 32768}) {
        register_shape("decode", {1, 1, skv, 8, 8, d, false, dt}, skv <= 4096);
        register_shape("decode_gqa", {1, 1, skv, 32, 8, d, false, dt}, false);
      }
  // K/V in L1 (one key row for every key): what the kernels' arithmetic and walk cost alone.
  for (std::int64_t d : {64, 128})
    for (std::int64_t skv : {4096, 65536}) {
      register_shape("decode_l1_gqa", {1, 1, skv, 32, 8, d, false, DType::f16, true}, false);
      register_shape("decode_l1", {1, 1, skv, 8, 8, d, false, DType::f16, true}, false);
    }
  // SmolLM2's 9/3 heads with K/V in L1 (bench/results/cpu-flash-decode-lanes.md has its figures).
  register_shape("decode_l1_gqa3", {1, 1, 65536, 9, 3, 64, false, DType::f16, true}, false);
  // From DRAM: 256 MiB of K/V, the "far larger than the caches" case.
  for (DType dt : {DType::f16, DType::bf16}) {
    register_shape("decode_dram", {1, 1, 131072, 8, 8, 128, false, dt}, false);
    register_shape("decode_dram_gqa", {1, 1, 131072, 32, 8, 64, false, dt}, false);
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

// The ceiling of MHA decode over f16 K/V on one core: each f16 vector of a 32 KiB buffer (L1)
// converted (vcvtph2ps) and fed to an FMA, eight chains, as the lanes kernels do with every K and V
// element. Its F16_GB/s against the kernels' KV_GB/s; AVX-512 only.
__attribute__((target("avx512f"))) double f16_convert_fma_avx512(const std::uint16_t* buf, long n, int passes) {
  __m512 a[8];
  for (auto& x : a) x = _mm512_setzero_ps();
  const __m512 q = _mm512_set1_ps(1.0001f), zero = _mm512_setzero_ps();
  // The masked forms with a defined source: GCC 12 warns that the plain ones read an undefined one.
  for (int pass = 0; pass < passes; ++pass)
    for (long i = 0; i < n; i += 128)
      for (int j = 0; j < 8; ++j) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(buf + i + 16 * j));
        a[j] = _mm512_fmadd_ps(q, _mm512_mask_cvtph_ps(zero, 0xffff, h), a[j]);
      }
  __m512 r = a[0];
  for (int j = 1; j < 8; ++j) r = _mm512_add_ps(r, a[j]);
  float lanes[16];
  _mm512_storeu_ps(lanes, r);
  double sum = 0.0;
  for (float x : lanes) sum += x;
  return sum;
}

void BM_F16ConvertFma1Core(benchmark::State& state) {
  if (!__builtin_cpu_supports("avx512f")) {
    state.SkipWithError("no AVX-512");
    return;
  }
  constexpr long kHalves = 16 * 1024;  // 32 KiB
  constexpr int kPasses = 64;
  std::vector<std::uint16_t> buf(kHalves, 0x3c00);  // 1.0
  for (auto _ : state) benchmark::DoNotOptimize(f16_convert_fma_avx512(buf.data(), kHalves, kPasses));
  state.counters["F16_GB/s"] =
      benchmark::Counter(2.0 * kHalves * kPasses * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_F16ConvertFma1Core)->Unit(benchmark::kMillisecond);

// Does the order in which one core walks a [keys][8 KV heads][64] f16 K tensor (512 MiB, far past
// the caches) change how well DRAM streaming overlaps with the dot products (4 query rows per KV
// head, the lanes kernels' work per K byte)? Arg 0: key-major (every head of a key, then the next
// key; sequential), else steps of that many keys walked head by head (the kernels' StepWalk uses
// 16). Each walk prefetches the rows 8 keys ahead into L2, as the kernels do; range(2) = 0 drops
// the software prefetch. K_GB/s against a plain read (BM_PlainRead1Core) and the same walk in L2
// (range(1) = 1: 1 MiB, repeated). bench/results/cpu-flash-decode-walk-order.md has the figures.
constexpr int kWalkHeads = 8, kWalkDim = 64, kWalkRows = 4;

// The sum of v's lanes by halves, through the masked extracts (GCC 12 warns that the plain ones and
// _mm512_reduce_add_ps read an undefined register).
__attribute__((target("avx512f"))) inline float walk_sum(__m512 v) {
  const __m512d vd = _mm512_castps_pd(v);
  const __m256d zero = _mm256_setzero_pd();
  const __m256 lo = _mm256_castpd_ps(_mm512_mask_extractf64x4_pd(zero, 0xff, vd, 0));
  const __m256 hi = _mm256_castpd_ps(_mm512_mask_extractf64x4_pd(zero, 0xff, vd, 1));
  const __m256 s8 = _mm256_add_ps(lo, hi);
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  s4 = _mm_add_ss(s4, _mm_shuffle_ps(s4, s4, 1));
  return _mm_cvtss_f32(s4);
}

__attribute__((target("avx512f"))) inline void walk_dots(const std::uint16_t* kh, const float* q, float* sink) {
  __m512 acc[kWalkRows];
  for (auto& a : acc) a = _mm512_setzero_ps();
  const __m512 zero = _mm512_setzero_ps();
  for (int c = 0; c < kWalkDim; c += 16) {
    const __m512 kv = _mm512_mask_cvtph_ps(zero, 0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kh + c)));
    for (int r = 0; r < kWalkRows; ++r) acc[r] = _mm512_fmadd_ps(kv, _mm512_loadu_ps(q + r * kWalkDim + c), acc[r]);
  }
  for (int r = 0; r < kWalkRows; ++r) sink[r] += walk_sum(acc[r]);
}

__attribute__((target("avx512f"))) float walk_keys(const std::uint16_t* k, long keys, int step, const float* q,
                                                   bool prefetch) {
  constexpr long kRow = kWalkHeads * kWalkDim;  // elements per key
  constexpr long kAhead = 8;
  float sink[kWalkRows] = {};
  auto prefetch_row = [&](long j) {
    if (!prefetch) return;
    const char* row = reinterpret_cast<const char*>(k + j * kRow);
    for (long b = 0; b < kRow * 2; b += 64) __builtin_prefetch(row + b, 0, 2);
  };
  if (step == 0) {
    for (long j = 0; j < keys; ++j) {
      prefetch_row(j + kAhead);
      for (int h = 0; h < kWalkHeads; ++h) walk_dots(k + j * kRow + h * kWalkDim, q + h * kWalkRows * kWalkDim, sink);
    }
  } else {
    for (long j0 = 0; j0 < keys; j0 += step) {
      for (int u = 0; u < step; ++u) prefetch_row(j0 + kAhead + u);
      for (int h = 0; h < kWalkHeads; ++h)
        for (int u = 0; u < step; ++u)
          walk_dots(k + (j0 + u) * kRow + h * kWalkDim, q + h * kWalkRows * kWalkDim, sink);
    }
  }
  return sink[0] + sink[1] + sink[2] + sink[3];
}

void BM_DecodeWalkOrder1Core(benchmark::State& state) {
  if (!__builtin_cpu_supports("avx512f")) {
    state.SkipWithError("no AVX-512");
    return;
  }
  const int step = static_cast<int>(state.range(0));
  const bool in_l2 = state.range(1) != 0;
  const bool prefetch = state.range(2) != 0;
  const long keys = in_l2 ? 1024 : 512 * 1024;
  const int repeats = in_l2 ? 128 : 1;
  constexpr long kSlack = 64;  // the prefetches past the last key stay inside the buffer
  std::vector<std::uint16_t> k(static_cast<std::size_t>((keys + kSlack) * kWalkHeads * kWalkDim), 0x3c00);
  std::vector<float> q(kWalkHeads * kWalkRows * kWalkDim, 0.01f);
  for (auto _ : state) {
    for (int r = 0; r < repeats; ++r) benchmark::DoNotOptimize(walk_keys(k.data(), keys, step, q.data(), prefetch));
  }
  state.counters["K_GB/s"] = benchmark::Counter(2e-9 * static_cast<double>(keys * kWalkHeads * kWalkDim * repeats),
                                                benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_DecodeWalkOrder1Core)
    ->ArgsProduct({{0, 1, 2, 4, 16}, {0, 1}, {1, 0}})
    ->ArgNames({"step", "in_l2", "prefetch"})
    ->Unit(benchmark::kMillisecond);

__attribute__((target("avx512f"))) long plain_read_avx512(const std::uint16_t* buf, long bytes) {
  __m512i acc = _mm512_setzero_si512();
  const auto* p = reinterpret_cast<const __m512i*>(buf);
  for (long i = 0; i < bytes / 64; ++i) acc = _mm512_add_epi32(acc, _mm512_loadu_si512(p + i));
  std::int32_t lanes[16];
  _mm512_storeu_si512(lanes, acc);
  long sum = 0;
  for (std::int32_t x : lanes) sum += x;
  return sum;
}

void BM_PlainRead1Core(benchmark::State& state) {
  if (!__builtin_cpu_supports("avx512f")) {
    state.SkipWithError("no AVX-512");
    return;
  }
  constexpr long kBytes = 512L << 20;
  std::vector<std::uint16_t> buf(kBytes / 2, 0x3c00);
  for (auto _ : state) benchmark::DoNotOptimize(plain_read_avx512(buf.data(), kBytes));
  state.counters["GB/s"] =
      benchmark::Counter(static_cast<double>(kBytes) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_PlainRead1Core)->Unit(benchmark::kMillisecond);

const int registered = register_all();

}  // namespace

BENCHMARK_MAIN();
