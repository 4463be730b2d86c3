// The benchmark harness: instances are valid problems in every layout, figures follow the issue's
// conventions, and a bench run reports every backend x shape.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "backends/reference/reference.h"
#include "harness/alloc_tracker.h"
#include "harness/attention_bench.h"
#include "harness/problem_instance.h"

namespace kallpa::harness {
namespace {

ProblemSpec spec(const char* text) {
  auto r = parse_problem_spec(text);
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
  return *r;
}

TEST(ProblemInstance, EveryLayoutValidates) {
  for (const char* text : {"b=2,sq=5,skv=9,hq=4,hkv=2,d=16,dtype=f16",
                           "b=2,sq=5,skv=9,hq=4,hkv=2,d=16,dv=8,q=packed,kv=packed,lse,dtype=bf16",
                           "b=3,sq=1,skv=37,hq=4,hkv=1,d=16,kv=paged,page=7,alibi,causal",
                           "b=1,sq=4,skv=4,hq=2,d=8,window=2:0,softcap=5,kv_dtype=f16"}) {
    auto inst = ProblemInstance::create(spec(text));
    ASSERT_TRUE(inst.is_ok()) << inst.status().to_string();
    auto vp = validate((*inst)->problem());
    ASSERT_TRUE(vp.is_ok()) << text << ": " << vp.status().to_string();
    EXPECT_EQ(vp->signature(), spec(text).signature()) << text;
  }
}

TEST(ProblemInstance, PagedBlockTableGivesEveryKeyItsOwnSlot) {
  // A permuted table must still map every (sequence, key) to a distinct slot of the pool.
  auto inst = ProblemInstance::create(spec("b=2,sq=1,skv=20,hq=1,d=4,kv=paged,page=3"));
  ASSERT_TRUE(inst.is_ok());
  auto vp = validate((*inst)->problem());
  ASSERT_TRUE(vp.is_ok());
  std::vector<std::int64_t> rows;
  for (std::int32_t b = 0; b < 2; ++b) {
    for (std::int64_t j = 0; j < 20; ++j) rows.push_back(vp->k_row_offset(b, j));
  }
  std::sort(rows.begin(), rows.end());
  EXPECT_EQ(std::unique(rows.begin(), rows.end()), rows.end()) << "two keys share a slot";
}

// Inputs are a seeded function of (seed, tensor, index): the same seed gives the same bytes, another
// seed others, and K and V differ; over many elements the values have mean ~0 and variance ~1, all
// finite and within the sum-of-four-uniforms bound (deterministic for a given seed, so not flaky).
TEST(ProblemInstance, InputsAreSeededAndUnitVariance) {
  const ProblemSpec s = spec("b=1,sq=1,skv=8192,hq=4,hkv=2,d=16");  // K and V: 262144 f32 each
  auto a = ProblemInstance::create(s, 7), b = ProblemInstance::create(s, 7), c = ProblemInstance::create(s, 8);
  ASSERT_TRUE(a.is_ok() && b.is_ok() && c.is_ok());
  const std::size_t n = 8192 * 2 * 16;
  auto values = [n](const ProblemInstance& inst, bool k) {
    const auto* f = static_cast<const float*>(k ? inst.problem().k.data : inst.problem().v.data);
    return std::vector<float>(f, f + n);
  };
  const std::vector<float> k7 = values(**a, true);
  EXPECT_EQ(k7, values(**b, true));
  EXPECT_NE(k7, values(**c, true));
  EXPECT_NE(k7, values(**a, false));
  double sum = 0.0, sq = 0.0;
  for (float x : k7) {
    ASSERT_TRUE(std::isfinite(x) && std::fabs(x) < 3.47f) << x;
    sum += x;
    sq += double(x) * x;
  }
  const double mean = sum / double(n);
  EXPECT_NEAR(mean, 0.0, 0.02);
  EXPECT_NEAR(sq / double(n) - mean * mean, 1.0, 0.02);
}

TEST(ProblemInstance, FlopsFollowTheIssueConvention) {
  auto full = ProblemInstance::create(spec("b=2,sq=8,skv=8,hq=3,d=16"));
  auto causal = ProblemInstance::create(spec("b=2,sq=8,skv=8,hq=3,d=16,causal"));
  auto decode = ProblemInstance::create(spec("b=1,sq=1,skv=100,hq=4,hkv=2,d=16,dtype=f16"));
  EXPECT_DOUBLE_EQ((*full)->flops(), 4.0 * 8 * 8 * 16 * 3 * 2);
  EXPECT_DOUBLE_EQ((*causal)->flops(), 2.0 * 8 * 8 * 16 * 3 * 2);
  EXPECT_DOUBLE_EQ((*decode)->kv_bytes(), 100.0 * 2 * (16 + 16) * 2);
}

TEST(ProblemInstance, RefusesOversizedRequests) {
  auto r = ProblemInstance::create(spec("b=64,sq=32768,skv=32768,hq=64,d=256"), 1, std::size_t{1} << 30);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), ErrorCode::out_of_memory);
  EXPECT_NE(r.status().message().find("GiB"), std::string::npos);
}

TEST(AttentionBench, ReportsEveryBackendOnEveryShape) {
  BenchOptions options;
  options.backends = {"reference", "cpu-gemm", "nosuch"};
  options.shapes = {spec("b=1,sq=16,skv=16,hq=2,d=16,causal"), spec("b=1,sq=1,skv=64,hq=2,d=16,dtype=bf16")};
  options.min_seconds = 0.0;
  options.min_runs = 2;
  MachinePeak peak;
  peak.fma_gflops = 100.0;
  peak.dram_read_gbps = 10.0;
  auto rows = run_attention_bench(options, peak);
  ASSERT_EQ(rows.size(), 6u);
  for (const BenchRow& r : rows) {
    if (r.backend == "nosuch") {
      EXPECT_FALSE(r.ran);
      EXPECT_EQ(r.note, "no such backend");
      continue;
    }
    ASSERT_TRUE(r.ran) << r.backend << " " << r.shape << ": " << r.note;
    EXPECT_GE(r.runs, 2);
    EXPECT_GT(r.seconds, 0.0);
    EXPECT_NEAR(r.peak_fraction, r.gflops / 100.0, 1e-12);
    EXPECT_NEAR(r.bandwidth_fraction, r.gbps / 10.0, 1e-12);
  }
  auto json = bench_to_json(rows, peak);
  ASSERT_TRUE(json.is_array());
  for (const auto& j : json) {
    for (const char* key : {"backend", "shape", "seconds", "gflops", "gbps"}) EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_NE(format_bench_table(rows, peak).find("cpu-gemm"), std::string::npos);
  // No cache size known: nothing is marked as cache-resident.
  EXPECT_EQ(format_bench_table(rows, peak).find("last-level cache"), std::string::npos);
}

// A decode whose K/V fits in the last-level cache is marked as such (table and JSON), since its
// bandwidth fraction is then no DRAM figure; one that does not, and prefill, are not. Decode rows
// also carry a plain read of their K/V timed beside the kernel (%read).
TEST(AttentionBench, MarksDecodeWhoseKvFitsTheLastLevelCache) {
  BenchOptions options;
  options.backends = {"reference"};
  options.shapes = {spec("b=1,sq=1,skv=64,hq=2,d=16"), spec("b=1,sq=1,skv=1024,hq=2,d=16"),
                    spec("b=1,sq=16,skv=16,hq=2,d=16")};
  options.min_seconds = 0.0;
  options.min_runs = 1;
  MachinePeak peak;
  peak.fma_gflops = 100.0;
  peak.dram_read_gbps = 10.0;
  peak.last_level_cache_bytes = 64 * 1024;  // K/V (f32) of 64 keys: 16 KiB; of 1024 keys: 256 KiB
  const auto rows = run_attention_bench(options, peak);
  ASSERT_EQ(rows.size(), 3u);
  for (const BenchRow& r : rows) ASSERT_TRUE(r.ran) << r.shape << ": " << r.note;
  EXPECT_TRUE(kv_fits_cache(rows[0], peak));
  EXPECT_EQ(rows[0].kv_bytes, 2 * 64 * 2 * 16 * 4);  // K and V, keys, heads, dims, f32
  EXPECT_FALSE(kv_fits_cache(rows[1], peak));
  const std::string table = format_bench_table(rows, peak);
  EXPECT_NE(table.find("last-level cache 0 MiB"), std::string::npos) << table;
  EXPECT_NE(table.find("%*"), std::string::npos) << table;
  EXPECT_EQ(table.find("%*"), table.rfind("%*")) << "only the cache-resident decode is marked:\n" << table;
  EXPECT_NE(table.find("not a DRAM ratio"), std::string::npos) << table;
  // Decode rows on a CPU backend carry the side-by-side plain read of their K/V; prefill does not.
  for (int i : {0, 1}) {
    EXPECT_GT(rows[i].read_gbps, 0.0) << rows[i].shape;
    EXPECT_NEAR(rows[i].read_fraction, rows[i].gbps / rows[i].read_gbps, 1e-12) << rows[i].shape;
  }
  EXPECT_EQ(rows[2].read_gbps, 0.0);
  EXPECT_NE(table.find("%read"), std::string::npos) << table;
  const auto json = bench_to_json(rows, peak);
  EXPECT_GT(json[1]["read_gbps"].get<double>(), 0.0);
  EXPECT_EQ(json[0]["kv_fits_cache"], true);
  EXPECT_EQ(json[1]["kv_fits_cache"], false);
  EXPECT_EQ(json[0]["machine_llc_bytes"], 64 * 1024);
}

// The machine's peaks are its CPU's: a row of a backend on another device (a GPU at 250 TFLOP/s)
// gets no fraction of them -- '-' in the table, null in the JSON -- and no cache mark.
TEST(AttentionBench, GivesNoCpuPeakFractionsToDeviceBackends) {
  MachinePeak peak;
  peak.fma_gflops = 100.0;
  peak.dram_read_gbps = 10.0;
  peak.last_level_cache_bytes = 1 << 30;
  BenchRow gpu;
  gpu.backend = "cuda-flash";
  gpu.shape = "b=8,sq=1,skv=32768,hq=32,hkv=8,d=128,dtype=bf16";
  gpu.decode = gpu.ran = true;
  gpu.on_host = false;
  gpu.seconds = 3e-4;
  gpu.gflops = 7600.0;
  gpu.gbps = 3500.0;
  gpu.kv_bytes = 1 << 20;  // would fit the cache
  BenchRow cpu = gpu;
  cpu.backend = "cpu-flash";
  cpu.on_host = true;
  cpu.gflops = 50.0;
  cpu.peak_fraction = 0.5;
  cpu.gbps = 5.0;
  cpu.bandwidth_fraction = 0.5;
  const std::string table = format_bench_table({gpu, cpu}, peak);
  const auto line_of = [&table](const char* backend) {
    const std::size_t at = table.find(backend);
    return table.substr(at, table.find('\n', at) - at);
  };
  EXPECT_EQ(line_of("cuda-flash").find('%'), std::string::npos) << table;
  EXPECT_NE(line_of("cuda-flash").find(" - "), std::string::npos) << table;
  EXPECT_NE(line_of("cpu-flash").find("50.0%"), std::string::npos) << table;
  EXPECT_NE(line_of("cpu-flash").find("50.0%*"), std::string::npos) << "the CPU row is still cache-marked:\n" << table;
  EXPECT_NE(table.find("'-' for backends on another device"), std::string::npos) << table;
  const auto json = bench_to_json({gpu, cpu}, peak);
  EXPECT_TRUE(json[0]["peak_fraction"].is_null());
  EXPECT_TRUE(json[0]["bandwidth_fraction"].is_null());
  EXPECT_EQ(json[0]["kv_fits_cache"], false);
  EXPECT_EQ(json[0]["on_host"], false);
  EXPECT_DOUBLE_EQ(json[1]["peak_fraction"].get<double>(), 0.5);
  EXPECT_EQ(json[1]["kv_fits_cache"], true);
}

TEST(AllocTracker, SeesAllocationsInsideACall) {
  reset_heap_peak();
  const std::size_t before = heap_bytes_in_use();
  {
    std::vector<char> big(1 << 20);
    big[0] = 1;
  }
  EXPECT_GE(heap_peak_bytes() - before, std::size_t{1} << 20);
  EXPECT_LT(heap_bytes_in_use(), before + 4096);
}

// The plain read behind %read and the DRAM peak reads every float of every buffer exactly once,
// whatever the sizes (a tail below one chunk, none at all) and the threads: buffers of ones sum to
// their float count (exact in f32 at these sizes). Its speed is not asserted.
TEST(MachinePeakTest, StreamReadReadsEveryFloatOnce) {
  std::vector<float> small(std::size_t{1} << 14, 1.0f), odd((std::size_t{3} << 18) + 3, 1.0f);
  const std::vector<std::span<const std::byte>> buffers{std::as_bytes(std::span<const float>(small)),
                                                        std::as_bytes(std::span<const float>(odd))};
  const double floats = static_cast<double>(small.size() + odd.size());
  for (int threads : {0, 1}) {
    const StreamRead r = stream_read(buffers, threads);
    EXPECT_GT(r.seconds, 0.0);
    EXPECT_EQ(r.sum, floats) << threads << " threads";
  }
  EXPECT_EQ(stream_read({}, 0).sum, 0.0);
}

TEST(MachinePeakTest, MeasuresPositiveCeilings) {
  // Only that the measurement runs and gives plausible positive numbers: speed is not asserted.
  MachinePeak p = measure_peak(1);
  EXPECT_EQ(p.threads, 1);
  EXPECT_GT(p.fma_gflops, 0.1);
  EXPECT_GT(p.int16_gops, 0.1);
  EXPECT_GT(p.dram_read_gbps, 0.1);
  EXPECT_GE(p.last_level_cache_bytes, 0);
  EXPECT_FALSE(p.simd_target.empty());
}

}  // namespace
}  // namespace kallpa::harness
