// The registered pjrt backend on the real XLA CPU plugin (API 0.115): problems the conformance
// suite does not build (q and K/V in different dtypes, as the engine's KV cache has them) against
// the reference, and the executable cache's counters. Skipped when the plugin is not fetched.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "backends/pjrt/pjrt_backend.h"
#include "harness/problem_instance.h"
#include "kallpa/half.h"
#include "kallpa/problem_spec.h"
#include "kallpa/registry.h"

namespace kallpa::pjrt {
namespace {

class PjrtBackendTest : public testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(KALLPA_PJRT_PLUGIN_0_115)) {
      GTEST_SKIP() << KALLPA_PJRT_PLUGIN_0_115 << " is absent: run scripts/fetch_pjrt.sh (setup.sh does)";
    }
    // Read by the backend on its first use, which is in this process's first test to get here.
    setenv(kPluginEnv, KALLPA_PJRT_PLUGIN_0_115, 1);
    backend_ = dynamic_cast<PjrtAttention*>(BackendRegistry::global().find("pjrt"));
    reference_ = BackendRegistry::global().find("reference");
    ASSERT_NE(backend_, nullptr);
    ASSERT_NE(reference_, nullptr);
  }

  // Runs `spec` on pjrt and on the reference (same seed, same inputs); the largest difference
  // over o and lse, both read as float.
  double max_difference(const std::string& text) {
    Result<ProblemSpec> spec = parse_problem_spec(text);
    EXPECT_TRUE(spec) << spec.status().to_string();
    Result<std::unique_ptr<harness::ProblemInstance>> a = harness::ProblemInstance::create(*spec, 7);
    Result<std::unique_ptr<harness::ProblemInstance>> b = harness::ProblemInstance::create(*spec, 7);
    EXPECT_TRUE(a && b);
    Result<ValidatedProblem> va = validate((*a)->problem()), vb = validate((*b)->problem());
    EXPECT_TRUE(va && vb);
    const Support s = backend_->supports(va->signature());
    EXPECT_TRUE(s.ok) << s.why_not;
    Status ra = backend_->run(*va, {});
    EXPECT_TRUE(ra) << ra.to_string();
    Status rb = reference_->run(*vb, {});
    EXPECT_TRUE(rb) << rb.to_string();
    const TensorView &oa = (*a)->problem().o, &ob = (*b)->problem().o;
    double worst = 0.0;
    const std::int64_t n = oa.numel();
    for (std::int64_t i = 0; i < n; ++i) {
      worst = std::max(worst, std::abs(double(element(oa, i)) - double(element(ob, i))));
    }
    if ((*a)->problem().lse.present()) {
      const auto* la = static_cast<const float*>((*a)->problem().lse.data);
      const auto* lb = static_cast<const float*>((*b)->problem().lse.data);
      for (std::int64_t i = 0; i < (*a)->problem().lse.numel(); ++i) {
        worst = std::max(worst, std::abs(double(la[i]) - double(lb[i])));
      }
    }
    return worst;
  }

  // Element i of a contiguous view, as float.
  static float element(const TensorView& t, std::int64_t i) { return load_f32(t.dtype, t.data, i); }

  PjrtAttention* backend_ = nullptr;
  AttentionBackend* reference_ = nullptr;
};

TEST_F(PjrtBackendTest, PlatformNamesThePluginAndItsApiVersion) {
  Result<PlatformInfo> info = backend_->platform();
  ASSERT_TRUE(info) << info.status().to_string();
  EXPECT_EQ(info->api_version, "0.115");
  EXPECT_EQ(info->platform, "cpu");
  EXPECT_EQ(info->plugin_path, KALLPA_PJRT_PLUGIN_0_115);
  EXPECT_EQ(info->chunk, kDefaultChunk);
}

TEST_F(PjrtBackendTest, QueriesAndKvInDifferentDtypesMatchTheReference) {
  // The engine's shapes: f32 queries over an f16 or bf16 KV cache, prefill and paged decode.
  EXPECT_LT(max_difference("b=1,sq=19,skv=19,hq=6,hkv=2,d=64,dtype=f32,kv_dtype=f16,causal,lse"), 1e-4);
  EXPECT_LT(max_difference("b=3,sq=1,skv=45,hq=4,hkv=1,d=32,dtype=f32,kv_dtype=bf16,kv=paged,page=16,causal,lse"),
            1e-4);
  EXPECT_LT(max_difference("b=2,sq=3,skv=40,hq=4,hkv=2,d=32,dtype=bf16,kv_dtype=f32,window=8:0"), 2e-2);
}

TEST_F(PjrtBackendTest, ExecutablesAreCachedPerShapeBucket) {
  // Head dim 40 appears in no other test of this process, so these programs are new here.
  const CacheStats before = backend_->cache_stats();
  ASSERT_LT(max_difference("b=1,sq=4,skv=37,hq=2,hkv=1,d=40,causal"), 1e-4);
  const CacheStats first = backend_->cache_stats();
  EXPECT_EQ(first.compiles, before.compiles + 1);
  EXPECT_GT(first.compile_milliseconds, before.compile_milliseconds);
  // Same bucket (keys up to 64, queries up to 4): no compile, a hit.
  ASSERT_LT(max_difference("b=1,sq=3,skv=50,hq=2,hkv=1,d=40,causal"), 1e-4);
  const CacheStats second = backend_->cache_stats();
  EXPECT_EQ(second.compiles, first.compiles);
  EXPECT_EQ(second.cache_hits, first.cache_hits + 1);
  EXPECT_EQ(second.executions, first.executions + 1);
  // 65 keys: the next bucket, one more compile.
  ASSERT_LT(max_difference("b=1,sq=4,skv=65,hq=2,hkv=1,d=40,causal"), 1e-4);
  EXPECT_EQ(backend_->cache_stats().compiles, second.compiles + 1);
  EXPECT_EQ(backend_->cache_stats().cached_executables, second.cached_executables + 1);
}

TEST_F(PjrtBackendTest, CompileAheadOfTimeIsWhatRunUses) {
  Result<ProblemSpec> spec = parse_problem_spec("b=2,sq=8,skv=100,hq=4,hkv=2,d=48,lse");
  ASSERT_TRUE(spec);
  Result<std::unique_ptr<harness::ProblemInstance>> inst = harness::ProblemInstance::create(*spec);
  ASSERT_TRUE(inst);
  Result<ValidatedProblem> vp = validate((*inst)->problem());
  ASSERT_TRUE(vp);
  Result<CompileReport> first = backend_->compile(*vp);
  ASSERT_TRUE(first) << first.status().to_string();
  EXPECT_FALSE(first->cached);
  EXPECT_EQ(first->program_key, "f32>f32 b2 s8 h4/2 d48/48 n128 c128 lse");
  EXPECT_TRUE(first->memory_known);
  EXPECT_GT(first->argument_bytes, 0);
  const CacheStats warm = backend_->cache_stats();
  ASSERT_TRUE(backend_->run(*vp, {}));
  EXPECT_EQ(backend_->cache_stats().compiles, warm.compiles);
  EXPECT_EQ(backend_->cache_stats().cache_hits, warm.cache_hits + 1);
  Result<CompileReport> again = backend_->compile(*vp);
  ASSERT_TRUE(again);
  EXPECT_TRUE(again->cached);
}

// The counters the server exports (AttentionBackend::counters()) move with the cache: a compile
// on a miss, a hit on the same bucket, an execution each.
TEST_F(PjrtBackendTest, PublishedCountersMoveAfterACompileAndAHit) {
  const auto read = [this] {
    std::map<std::string, double> out;
    for (const BackendCounter& c : static_cast<const AttentionBackend*>(backend_)->counters()) {
      EXPECT_TRUE(valid_counter_name(c.name)) << c.name;
      EXPECT_FALSE(c.help.empty()) << c.name;
      out[c.name] = c.value;
    }
    return out;
  };
  std::map<std::string, double> before = read();
  ASSERT_EQ(before.size(), 14u);
  for (const char* name :
       {"compiles", "compile_failures", "compile_seconds", "cache_hits", "executions", "cached_executables",
        "bytes_to_device", "bytes_from_device", "kv_pages_uploaded", "kv_page_updates", "kv_mirrors_created",
        "kv_mirror_evictions", "kv_mirrors", "kv_mirror_bytes"}) {
    EXPECT_EQ(before.count(name), 1u) << name;
  }
  // Head dim 24 appears in no other test of this process: a new program, compiled here.
  ASSERT_LT(max_difference("b=1,sq=2,skv=21,hq=2,hkv=1,d=24,causal"), 1e-4);
  std::map<std::string, double> compiled = read();
  EXPECT_EQ(compiled["compiles"], before["compiles"] + 1);
  EXPECT_GT(compiled["compile_seconds"], before["compile_seconds"]);
  EXPECT_EQ(compiled["cache_hits"], before["cache_hits"]);
  EXPECT_EQ(compiled["executions"], before["executions"] + 1);
  EXPECT_EQ(compiled["cached_executables"], before["cached_executables"] + 1);
  EXPECT_EQ(compiled["compile_failures"], before["compile_failures"]);
  // The copies of one run, f32 throughout, in the bucket b1 s2 n32: q 2x2x24, K and V 32x1x24, two
  // lengths, scale, softcap and two window bounds up; o 2x2x24 down (no lse).
  EXPECT_EQ(compiled["bytes_to_device"] - before["bytes_to_device"], (2 * 2 * 24 + 2 * 32 * 24 + 2 + 4) * 4);
  EXPECT_EQ(compiled["bytes_from_device"] - before["bytes_from_device"], 2 * 2 * 24 * 4);
  // Same bucket (keys up to 32, queries up to 2): a hit, nothing compiled.
  ASSERT_LT(max_difference("b=1,sq=2,skv=30,hq=2,hkv=1,d=24,causal"), 1e-4);
  std::map<std::string, double> hit = read();
  EXPECT_EQ(hit["compiles"], compiled["compiles"]);
  EXPECT_EQ(hit["compile_seconds"], compiled["compile_seconds"]);
  EXPECT_EQ(hit["cache_hits"], compiled["cache_hits"] + 1);
  EXPECT_EQ(hit["executions"], compiled["executions"] + 1);
  EXPECT_EQ(hit["cached_executables"], compiled["cached_executables"]);
  // Every executable the cache holds was counted as a compile: none was compiled around it.
  EXPECT_EQ(hit["compiles"], hit["cached_executables"]);
}

// A paged cache that states page versions is kept on the device: a run copies only the pages
// whose version moved since the device last saw them, and a page changed without a new version is
// not re-read (which is how this test sees that the device copy, not the host, is read).
TEST_F(PjrtBackendTest, PagedKvWithPageVersionsIsMirroredAndOnlyChangedPagesAreCopied) {
  // Head dim 28 appears in no other test of this process: a pool of its own.
  Result<ProblemSpec> spec = parse_problem_spec("b=2,sq=1,skv=40,hq=4,hkv=2,d=28,kv=paged,page=16,causal");
  ASSERT_TRUE(spec) << spec.status().to_string();
  Result<std::unique_ptr<harness::ProblemInstance>> inst = harness::ProblemInstance::create(*spec, 11);
  ASSERT_TRUE(inst) << inst.status().to_string();
  AttentionProblem p = (*inst)->problem();
  const std::int64_t blocks = p.k.shape[0];
  std::vector<std::uint64_t> versions(static_cast<std::size_t>(blocks));
  for (std::size_t b = 0; b < versions.size(); ++b) versions[b] = 100 + b;
  p.page_versions = versions.data();
  p.kv_pool_id = 0x6b76'6d69'7272'6f72ULL;  // any id no other test uses
  std::vector<float> expected(static_cast<std::size_t>(p.o.numel()));
  AttentionProblem ref = p;
  ref.o.data = expected.data();

  // The largest difference between pjrt's o and the reference's, both over the current bytes.
  const auto difference = [&] {
    Result<ValidatedProblem> vp = validate(p), vr = validate(ref);
    EXPECT_TRUE(vp && vr);
    Status s = backend_->run(*vp, {});
    EXPECT_TRUE(s) << s.to_string();
    EXPECT_TRUE(reference_->run(*vr, {}));
    double worst = 0.0;
    for (std::int64_t i = 0; i < p.o.numel(); ++i) {
      worst = std::max(worst, std::abs(double(element(p.o, i)) - double(expected[static_cast<std::size_t>(i)])));
    }
    return worst;
  };
  // Sequence 0's first block: overwritten with new keys below.
  const std::int32_t block = p.block_table[0];
  auto* k = static_cast<float*>(p.k.data);
  const auto rewrite_block = [&](float value) {
    for (std::int64_t r = 0; r < p.k.shape[1]; ++r) {
      for (std::int64_t h = 0; h < p.k.shape[2]; ++h) {
        for (std::int64_t c = 0; c < p.k.shape[3]; ++c) {
          k[block * p.k.stride[0] + r * p.k.stride[1] + h * p.k.stride[2] + c * p.k.stride[3]] =
              value * static_cast<float>((r + c) % 5);
        }
      }
    }
  };
  const std::uint64_t used = 3 + 3;  // 40 keys in pages of 16, two sequences

  const CacheStats start = backend_->cache_stats();
  ASSERT_LT(difference(), 1e-4);
  const CacheStats first = backend_->cache_stats();
  EXPECT_EQ(first.kv_mirrors_created, start.kv_mirrors_created + 1);
  EXPECT_EQ(first.kv_pages_uploaded, start.kv_pages_uploaded + used);
  EXPECT_EQ(first.kv_mirrors, start.kv_mirrors + 1);

  // Nothing changed: no page crosses, the answer is the same.
  ASSERT_LT(difference(), 1e-4);
  const CacheStats second = backend_->cache_stats();
  EXPECT_EQ(second.kv_pages_uploaded, first.kv_pages_uploaded);
  EXPECT_EQ(second.kv_mirrors_created, first.kv_mirrors_created);
  EXPECT_EQ(second.bytes_to_device - first.bytes_to_device, first.bytes_to_device - start.bytes_to_device -
                                                                used * 16 * 2 * 28 * 2 * 4 - used * 4 -
                                                                (8 - used) * (16 * 2 * 28 * 2 * 4 + 4));

  // One block rewritten with a new version: that page alone crosses, and the answer follows it.
  rewrite_block(0.5f);
  versions[static_cast<std::size_t>(block)] = 1000;
  ASSERT_LT(difference(), 1e-4);
  const CacheStats third = backend_->cache_stats();
  EXPECT_EQ(third.kv_pages_uploaded, second.kv_pages_uploaded + 1);

  // Rewritten without a new version (a broken promise): the device's copy answers, so pjrt no
  // longer agrees with the reference, which reads the host's bytes.
  rewrite_block(-0.75f);
  EXPECT_GT(difference(), 1e-3);
  EXPECT_EQ(backend_->cache_stats().kv_pages_uploaded, third.kv_pages_uploaded);

  // Version 0 means unknown: the page is read afresh on every run.
  versions[static_cast<std::size_t>(block)] = 0;
  ASSERT_LT(difference(), 1e-4);
  ASSERT_LT(difference(), 1e-4);
  EXPECT_EQ(backend_->cache_stats().kv_pages_uploaded, third.kv_pages_uploaded + 2);
}

}  // namespace
}  // namespace kallpa::pjrt
