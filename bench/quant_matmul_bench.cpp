// kallpa::model::matmul with Q4_1 weights on SmolLM2-135M's matrix shapes (rows x cols = outputs x
// inputs: 576x576 q/o, 192x576 k/v, 1536x576 gate/up, 576x1536 down), exact f32 activations (the
// default) vs Q8-quantised activations, batch 1 (decode) and 512 (prefill), side by side.
// threads:0 uses the whole pool, threads:1 one thread (the kernels without scheduling).
// Counters: GFLOP/s (2 * rows * cols * batch per call) and weight GB/s (Q4_1 bytes read per call).
//
//   build/bench/quant_matmul_bench --benchmark_filter='b:1/'
//
// Versions:
//   v1 f32: fused in-register dequantisation, 4 rows x 1-2 columns per tile (decode); 24 dequantised
//           rows per tile + 3 x 4 f32 micro-kernel (prefill). q8: the integer (maddubs) kernels.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "kallpa/model/quant.h"
#include "model/synthetic_llama.h"

namespace {

using namespace kallpa::model;

void BM_QuantMatmul(benchmark::State& state) {
  const std::int64_t rows = state.range(0), cols = state.range(1), batch = state.range(2);
  const bool q8 = state.range(3) != 0;
  const int threads = static_cast<int>(state.range(4));
  const GgmlType t = GgmlType::q4_1;
  const auto wf = synthetic_values(1, static_cast<std::size_t>(rows * cols), 0.05f);
  std::vector<std::byte> w(static_cast<std::size_t>(row_size(t, cols) * static_cast<std::uint64_t>(rows)));
  for (std::int64_t r = 0; r < rows; ++r) {
    if (!quantize_row(t, wf.data() + r * cols, w.data() + static_cast<std::size_t>(r) * row_size(t, cols), cols)) {
      state.SkipWithError("quantize_row failed");
      return;
    }
  }
  const WeightMatrix wm{t, w.data(), rows, cols, row_size(t, cols)};
  const auto x = synthetic_values(2, static_cast<std::size_t>(batch * cols), 1.0f);
  std::vector<float> y(static_cast<std::size_t>(batch * rows));
  MatmulOptions o;
  o.max_threads = threads;
  o.activations = q8 ? MatmulOptions::Activations::q8 : MatmulOptions::Activations::f32;
  for (auto _ : state) {
    if (!matmul(wm, x.data(), batch, cols, y.data(), rows, o)) {
      state.SkipWithError("matmul failed");
      return;
    }
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  const double iters = static_cast<double>(state.iterations());
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * static_cast<double>(rows * cols * batch) * iters,
                                                 benchmark::Counter::kIsRate, benchmark::Counter::kIs1000);
  state.counters["wGB/s"] = benchmark::Counter(static_cast<double>(w.size()) * iters, benchmark::Counter::kIsRate,
                                               benchmark::Counter::kIs1000);
  state.SetLabel(q8 ? "q8" : "f32");
}

void shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"rows", "cols", "b", "q8", "threads"});
  for (std::int64_t threads : {0, 1}) {  // 0: the whole pool; 1: the kernels alone, no scheduling
    for (std::int64_t batch : {1, 512}) {
      for (auto rc : {std::pair<std::int64_t, std::int64_t>{576, 576}, {192, 576}, {1536, 576}, {576, 1536}}) {
        for (std::int64_t q8 : {0, 1}) b->Args({rc.first, rc.second, batch, q8, threads});
      }
    }
  }
}

BENCHMARK(BM_QuantMatmul)->Apply(shapes)->UseRealTime()->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
