// kallpa::ops::matmul on SmolLM2-135M's matrix shapes (rows x cols = outputs x inputs: Q4_1
// 576x576 q/o, 192x576 k/v, 1536x576 gate/up, 576x1536 down; Q8_0 49152x576 output head), exact f32
// activations (the default) vs Q8- and Q16-quantised activations (act 0/1/2), batch 1 (decode), 4
// and 16 (a server's batch of decode streams) and 512 (prefill). threads:0 uses the whole pool,
// threads:1 one thread (the kernels without scheduling). Counters: GFLOP/s (2 * rows * cols * batch
// per call) and weight GB/s (quantised bytes read per call). The head (30 MB) does not fit in the
// caches; the Q4_1 shapes do. Figures: bench/results/quant-matmul.md.
//
//   build/bench/quant_matmul_bench --benchmark_filter='b:1/'
//
// Weight layouts (v):
//   1: ggml's layout (rows of 20/34-byte blocks, as in the file). f32: fused in-register
//      dequantisation, 4 rows x 1-2 columns per tile (decode); dequantised rows + 3 x 4 f32
//      micro-kernel (prefill). q8: the integer (maddubs) kernels, 4 x 1 / 2 x 4 tiles.
//   2: the same kernels on weights repacked at load (WeightLayout::rows4, ops/repack.h): 4 rows'
//      blocks interleaved, their scales side by side (one f16->f32 convert per 4-row tile and block,
//      aligned 16-byte quant loads). Bit-identical results.
// avx2:1 caps the kernels at AVX2, beside the default (the widest ISA): batched Q16 products have
// an AVX-512 VNNI kernel (16 weight rows per vector), bit-identical too. The AVX2 batched Q16
// tiles (4-row fold against rows as lanes) are compared in bench/lab/quant.
//
// BM_BlockTypeGemv: every block type on decode GEMV shapes (4096x4096, a 7B model's q/o, and
// 576x1536, SmolLM2's down), batch 1 and 16, next to Q8_0 and Q4_0 (f32 and q16 activations,
// the engine's decode choice) in the same run. Every type runs with exact f32 activations (act:0;
// blocks dequantised to f32), and those with Q16 integer kernels (Q8_0, Q4_0 and ops/q16_units.h's
// Q5_0, Q5_1, IQ4_NL, Q4_K, Q5_K, Q6_K) with q16 activations too (act:2); isa:1 runs the scalar
// reference kernel. Weights are random blocks with sane scales (no quantiser exists for these
// types here). Figures: bench/results/k-quants.md.
//
//   build/bench/quant_matmul_bench --benchmark_filter=BM_BlockTypeGemv
//
// BM_GemmaMatmul: Gemma-3-270M Q4_K_M's matrices (below).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <tuple>
#include <vector>

#include "kallpa/half.h"

#include "kallpa/ops/quant.h"
#include "ops/huge_buffer.h"
#include "ops/repack.h"
#include "support/synthetic_llama.h"

namespace {

using namespace kallpa::model;
using namespace kallpa::ops;

// Times matmul of `wm` with x into y and sets the GFLOP/s and weight-bandwidth counters; false
// (and the benchmark skipped with an error) when a call fails.
bool time_matmul(benchmark::State& state, const WeightMatrix& wm, const std::vector<float>& x, std::int64_t batch,
                 std::vector<float>& y, const MatmulOptions& o, std::size_t weight_bytes) {
  const std::int64_t rows = wm.rows, cols = wm.cols;
  for (auto _ : state) {
    if (!matmul(wm, x.data(), batch, cols, y.data(), rows, o)) {
      state.SkipWithError("matmul failed");
      return false;
    }
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  const double iters = static_cast<double>(state.iterations());
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * static_cast<double>(rows * cols * batch) * iters,
                                                 benchmark::Counter::kIsRate, benchmark::Counter::kIs1000);
  state.counters["wGB/s"] = benchmark::Counter(static_cast<double>(weight_bytes) * iters, benchmark::Counter::kIsRate,
                                               benchmark::Counter::kIs1000);
  return true;
}

// The rows4 copy of `wm` in `packed` (which it sizes), as the engine loads it; nullopt (and the
// benchmark skipped with an error) when repacking fails.
std::optional<WeightMatrix> repacked_rows4(benchmark::State& state, const WeightMatrix& wm, std::size_t bytes,
                                           std::vector<std::byte>& packed) {
  packed.resize(bytes);
  auto r = repack_rows4(wm, packed.data());
  if (!r) {
    state.SkipWithError("repack failed");
    return std::nullopt;
  }
  return *r;
}

void BM_QuantMatmul(benchmark::State& state) {
  const std::int64_t rows = state.range(0), cols = state.range(1), batch = state.range(2);
  const auto act = static_cast<MatmulOptions::Activations>(state.range(3));
  const int threads = static_cast<int>(state.range(4));
  const int version = static_cast<int>(state.range(5));
  const GgmlType t = state.range(6) == 0 ? GgmlType::q4_1 : GgmlType::q8_0;
  const bool avx2_only = state.range(7) == 1;
  const auto wf = synthetic_values(1, static_cast<std::size_t>(rows * cols), 0.05f);
  std::vector<std::byte> w(static_cast<std::size_t>(row_size(t, cols) * static_cast<std::uint64_t>(rows)));
  for (std::int64_t r = 0; r < rows; ++r) {
    if (!quantize_row(t, wf.data() + r * cols, w.data() + static_cast<std::size_t>(r) * row_size(t, cols), cols)) {
      state.SkipWithError("quantize_row failed");
      return;
    }
  }
  WeightMatrix wm{t, w.data(), rows, cols, row_size(t, cols)};
  std::vector<std::byte> packed;
  if (version == 2) {
    auto r = repacked_rows4(state, wm, w.size(), packed);
    if (!r) return;
    wm = *r;
  }
  const auto x = synthetic_values(2, static_cast<std::size_t>(batch * cols), 1.0f);
  std::vector<float> y(static_cast<std::size_t>(batch * rows));
  MatmulOptions o;
  o.max_threads = threads;
  o.activations = act;
  if (avx2_only) o.max_isa = MatmulOptions::Isa::avx2;
  if (!time_matmul(state, wm, x, batch, y, o, w.size())) return;
  const char* act_name = act == MatmulOptions::Activations::q8    ? " q8"
                         : act == MatmulOptions::Activations::q16 ? " q16"
                                                                  : " f32";
  state.SetLabel(std::string(ggml_type_name(t)) + act_name + " v" + std::to_string(version) +
                 (avx2_only ? " avx2" : std::string(" ") + std::string(quant_kernel_isa())));
}

void shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"rows", "cols", "b", "act", "threads", "v", "q8_0", "avx2"});
  const std::tuple<std::int64_t, std::int64_t, std::int64_t> kShapes[] = {
      {576, 576, 0}, {192, 576, 0}, {1536, 576, 0}, {576, 1536, 0}, {49152, 576, 1}};
  for (std::int64_t threads : {0, 1}) {  // 0: the whole pool; 1: the kernels alone, no scheduling
    for (std::int64_t batch : {1, 4, 16, 512}) {
      for (const auto& [rows, cols, head] : kShapes) {
        if (head != 0 && batch == 512) continue;  // the head runs on one row per sequence
        for (std::int64_t act : {0, 1, 2}) {
          for (std::int64_t v : {1, 2}) {
            b->Args({rows, cols, batch, act, threads, v, head, 0});
            // Batched Q16 decode: the AVX-512 VNNI kernel (where the machine has it) beside AVX2.
            if (act == 2 && (batch == 4 || batch == 16)) b->Args({rows, cols, batch, act, threads, v, head, 1});
          }
        }
      }
    }
  }
}

BENCHMARK(BM_QuantMatmul)->Apply(shapes)->UseRealTime()->Unit(benchmark::kMicrosecond);

// rows x cols of a block type as random bytes whose scales are finite f16 values in [1e-3, 5e-2]
// (Q8_0 and Q4_0 from quantize_row on smooth values instead).
std::vector<std::byte> block_weights(GgmlType t, std::int64_t rows, std::int64_t cols) {
  std::vector<std::byte> w(static_cast<std::size_t>(row_size(t, cols) * static_cast<std::uint64_t>(rows)));
  if (t == GgmlType::q8_0 || t == GgmlType::q4_0) {
    const auto wf = synthetic_values(1, static_cast<std::size_t>(rows * cols), 0.05f);
    for (std::int64_t r = 0; r < rows; ++r) {
      (void)quantize_row(t, wf.data() + r * cols, w.data() + static_cast<std::size_t>(r) * row_size(t, cols), cols);
    }
    return w;
  }
  std::mt19937 rng(3);
  for (auto& b : w) b = static_cast<std::byte>(rng());
  const auto traits = *ggml_type_traits(static_cast<std::uint32_t>(t));
  std::vector<std::size_t> scales;
  switch (t) {
    case GgmlType::q5_1:
    case GgmlType::q4_k:
    case GgmlType::q5_k: scales = {0, 2}; break;
    case GgmlType::q2_k: scales = {80, 82}; break;
    case GgmlType::q3_k: scales = {108}; break;
    case GgmlType::q6_k: scales = {208}; break;
    case GgmlType::q8_k: break;
    default: scales = {0}; break;
  }
  std::uniform_real_distribution<float> mag(1e-3f, 5e-2f);
  for (std::size_t at = 0; at < w.size(); at += static_cast<std::size_t>(traits.type_size)) {
    for (std::size_t off : scales) {
      const std::uint16_t h = kallpa::f32_to_f16(mag(rng));
      std::memcpy(w.data() + at + off, &h, 2);
    }
    if (t == GgmlType::q8_k) {
      const float d = mag(rng);
      std::memcpy(w.data() + at, &d, 4);
    }
  }
  return w;
}

void BM_BlockTypeGemv(benchmark::State& state) {
  const std::int64_t rows = state.range(0), cols = state.range(1), batch = state.range(2);
  const auto t = static_cast<GgmlType>(state.range(3));
  const auto act = static_cast<MatmulOptions::Activations>(state.range(4));
  const auto w = block_weights(t, rows, cols);
  const WeightMatrix wm{t, w.data(), rows, cols, row_size(t, cols)};
  const auto x = synthetic_values(2, static_cast<std::size_t>(batch * cols), 1.0f);
  std::vector<float> y(static_cast<std::size_t>(batch * rows));
  MatmulOptions o;
  o.max_threads = static_cast<int>(state.range(5));
  o.activations = act;
  if (state.range(6) == 1) o.max_isa = MatmulOptions::Isa::scalar;
  if (!time_matmul(state, wm, x, batch, y, o, w.size())) return;
  state.SetLabel(std::string(ggml_type_name(t)) + (act == MatmulOptions::Activations::q16 ? " q16" : " f32") +
                 (state.range(6) == 1 ? " scalar" : ""));
}

void block_type_shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"rows", "cols", "b", "type", "act", "threads", "isa"});
  const GgmlType kTypes[] = {GgmlType::q8_0, GgmlType::q4_0,   GgmlType::q4_k, GgmlType::q5_k,
                             GgmlType::q6_k, GgmlType::q2_k,   GgmlType::q3_k, GgmlType::q5_0,
                             GgmlType::q5_1, GgmlType::iq4_nl, GgmlType::q8_k};
  for (std::int64_t threads : {0, 1}) {
    for (const auto& [rows, cols] : {std::pair<std::int64_t, std::int64_t>{4096, 4096}, {576, 1536}}) {
      for (std::int64_t batch : {1, 16}) {
        for (GgmlType t : kTypes) {
          const auto id = static_cast<std::int64_t>(t);
          b->Args({rows, cols, batch, id, 0, threads, 0});
          const bool q16 = t == GgmlType::q8_0 || t == GgmlType::q4_0 || t == GgmlType::q4_k || t == GgmlType::q5_k ||
                           t == GgmlType::q6_k || t == GgmlType::q5_0 || t == GgmlType::q5_1 || t == GgmlType::iq4_nl;
          if (q16) b->Args({rows, cols, batch, id, 2, threads, 0});
          const bool km = t == GgmlType::q4_k || t == GgmlType::q6_k;
          if (km && threads == 1 && batch == 1 && rows == 576) {
            b->Args({rows, cols, batch, id, 0, threads, 1});
            b->Args({rows, cols, batch, id, 2, threads, 1});
          }
        }
      }
    }
  }
}

BENCHMARK(BM_BlockTypeGemv)->Apply(block_type_shapes)->UseRealTime()->Unit(benchmark::kMicrosecond);

// Gemma-3-270M Q4_K_M's matrices (rows x cols, the file's type): Q5_0 1024x640 q, 256x640 k/v,
// 2048x640 gate/up; Q4_K 640x1024 output, 640x2048 down; Q6_K 640x2048 down; Q8_0 256x640 v and
// the 262144x640 output head (the tied embedding, 178 MB: decode's largest read; Q8_0 repacked
// into rows4 as the engine loads it). Batch 1 (a decode step) and batch 512 (a pp512 prompt), each
// with q16 (the engine's activations for every row) and f32 (exact) activations.
// bench/peer_llama_cpp.py --matmul runs these beside llama.cpp's MUL_MAT on the same shapes and
// types; figures in bench/results/gemma3-vs-llama-cpp.md.
struct GemmaShape {
  std::int64_t rows, cols;
  GgmlType type;
};
constexpr GemmaShape kGemmaShapes[] = {{1024, 640, GgmlType::q5_0}, {256, 640, GgmlType::q5_0},
                                       {2048, 640, GgmlType::q5_0}, {640, 1024, GgmlType::q4_k},
                                       {640, 2048, GgmlType::q4_k}, {640, 2048, GgmlType::q6_k},
                                       {256, 640, GgmlType::q8_0},  {262144, 640, GgmlType::q8_0}};

// w (rows x cols of type t) as the engine reads it: Q8_0/Q4_0/Q4_1 repacked into rows4 in
// `packed`, as the model loader does; the other types as they are. nullopt (and the benchmark
// skipped with an error) when repacking fails.
std::optional<WeightMatrix> engine_layout(benchmark::State& state, GgmlType t, const std::vector<std::byte>& w,
                                          std::int64_t rows, std::int64_t cols, std::vector<std::byte>& packed) {
  const WeightMatrix wm{t, w.data(), rows, cols, row_size(t, cols)};
  if (!can_repack_rows4(wm)) return wm;
  return repacked_rows4(state, wm, w.size(), packed);
}

// Q8_0 in the engine's layout: repacked into rows4 at load, as the model loader does.
void BM_GemmaMatmul(benchmark::State& state) {
  const std::int64_t rows = state.range(0), cols = state.range(1), batch = state.range(2);
  const auto t = static_cast<GgmlType>(state.range(3));
  const auto act = static_cast<MatmulOptions::Activations>(state.range(4));
  const auto w = block_weights(t, rows, cols);
  std::vector<std::byte> packed;
  const auto engine = engine_layout(state, t, w, rows, cols, packed);
  if (!engine) return;
  const WeightMatrix wm = *engine;
  const auto x = synthetic_values(2, static_cast<std::size_t>(batch * cols), 1.0f);
  std::vector<float> y(static_cast<std::size_t>(batch * rows));
  MatmulOptions o;
  o.max_threads = static_cast<int>(state.range(5));
  o.activations = act;
  if (!time_matmul(state, wm, x, batch, y, o, w.size())) return;
  state.SetLabel(std::string(ggml_type_name(t)) + (act == MatmulOptions::Activations::q16 ? " q16" : " f32") +
                 (wm.layout == WeightLayout::rows4 ? " rows4" : ""));
}

void gemma_shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"rows", "cols", "b", "type", "act", "threads"});
  for (std::int64_t threads : {1, 0}) {
    for (const GemmaShape& s : kGemmaShapes) {
      const auto id = static_cast<std::int64_t>(s.type);
      b->Args({s.rows, s.cols, 1, id, 2, threads});
      b->Args({s.rows, s.cols, 1, id, 0, threads});
      if (s.rows < 100000) {
        b->Args({s.rows, s.cols, 512, id, 2, threads});
        b->Args({s.rows, s.cols, 512, id, 0, threads});
      }
    }
  }
}

BENCHMARK(BM_GemmaMatmul)->Apply(gemma_shapes)->UseRealTime()->Unit(benchmark::kMicrosecond);

// Decode from DRAM, as a generated token reads every layer: copies of one Gemma layer matrix
// totalling at least 128 MiB (four times an L3 of 32 MiB), one call per copy in turn, batch 1,
// q16 activations, so every call streams its weights from memory rather than from a cache. wGB/s
// beside `kallpa bench peak`'s DRAM read is the fraction of the bandwidth limit a kernel reaches.
//
//   build/bench/quant_matmul_bench --benchmark_filter=BM_GemmaDecodeStream
void BM_GemmaDecodeStream(benchmark::State& state) {
  const std::int64_t rows = state.range(0), cols = state.range(1);
  const auto t = static_cast<GgmlType>(state.range(2));
  const auto w = block_weights(t, rows, cols);
  std::vector<std::byte> packed;
  const auto engine = engine_layout(state, t, w, rows, cols, packed);
  if (!engine) return;
  const WeightMatrix wm = *engine;
  constexpr std::size_t kStreamBytes = std::size_t{128} << 20;
  const std::size_t copies = std::max<std::size_t>(2, (kStreamBytes + w.size() - 1) / w.size());
  // Pages as the engine has them (huge:1, its repacked copies in a HugeBuffer) or as a file's
  // mapping gives them (huge:0, 4 KiB: the weights it reads in place).
  auto stream = HugeBuffer::allocate(copies * w.size(), "stream");
  std::vector<std::byte> small_pages;
  std::byte* base = nullptr;
  if (state.range(4) == 1 && stream) {
    base = stream->data();
  } else {
    small_pages.resize(copies * w.size());
    base = small_pages.data();
  }
  for (std::size_t c = 0; c < copies; ++c) std::memcpy(base + c * w.size(), wm.data, w.size());
  const auto x = synthetic_values(2, static_cast<std::size_t>(cols), 1.0f);
  std::vector<float> y(static_cast<std::size_t>(rows));
  MatmulOptions o;
  o.max_threads = static_cast<int>(state.range(3));
  o.activations = MatmulOptions::Activations::q16;
  std::size_t c = 0;
  for (auto _ : state) {
    WeightMatrix copy = wm;
    copy.data = base + c * w.size();
    c = (c + 1) % copies;
    if (!matmul(copy, x.data(), 1, cols, y.data(), rows, o)) {
      state.SkipWithError("matmul failed");
      return;
    }
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  state.counters["wGB/s"] = benchmark::Counter(static_cast<double>(w.size()) * static_cast<double>(state.iterations()),
                                               benchmark::Counter::kIsRate, benchmark::Counter::kIs1000);
  state.SetLabel(std::string(ggml_type_name(t)) + (wm.layout == WeightLayout::rows4 ? " rows4" : "") +
                 (base == small_pages.data() ? " 4k" : " huge"));
}

void gemma_stream_shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"rows", "cols", "type", "threads", "huge"});
  for (std::int64_t threads : {1, 0}) {
    for (std::int64_t huge : {0, 1}) {
      for (const GemmaShape& s : kGemmaShapes)
        b->Args({s.rows, s.cols, static_cast<std::int64_t>(s.type), threads, huge});
    }
  }
}

BENCHMARK(BM_GemmaDecodeStream)->Apply(gemma_stream_shapes)->UseRealTime()->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
