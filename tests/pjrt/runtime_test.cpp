// The PJRT runtime layer: version negotiation and every error path, against fake plugins built in
// this directory (fake_pjrt_plugin.cpp), and the real XLA CPU plugins when fetched.
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "backends/pjrt/attention_program.h"
#include "backends/pjrt/pjrt_runtime.h"

namespace kallpa::pjrt {
namespace {

std::string fake(const std::string& name) { return std::string(KALLPA_FAKE_PJRT_DIR) + "/fake-pjrt-" + name + ".so"; }

// Sets an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) { setenv(name, value, 1); }
  ~ScopedEnv() { unsetenv(name_); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
};

TEST(PjrtPlugin, MissingFileIsNotFound) {
  Result<std::shared_ptr<Plugin>> p = Plugin::load("/nonexistent/libtpu.so");
  ASSERT_FALSE(p);
  EXPECT_EQ(p.status().code(), ErrorCode::not_found);
  EXPECT_NE(p.status().message().find("is not a file"), std::string::npos) << p.status().to_string();
}

TEST(PjrtPlugin, CorruptFileDoesNotLoad) {
  const std::filesystem::path path = std::filesystem::temp_directory_path() / "kallpa-corrupt-pjrt-plugin.so";
  std::ofstream(path) << "this is not an ELF file";
  Result<std::shared_ptr<Plugin>> p = Plugin::load(path.string());
  std::filesystem::remove(path);
  ASSERT_FALSE(p);
  EXPECT_EQ(p.status().code(), ErrorCode::not_found);
  EXPECT_NE(p.status().message().find("does not load as a shared library"), std::string::npos)
      << p.status().to_string();
}

TEST(PjrtPlugin, LibraryWithoutGetPjrtApiIsNotAPlugin) {
  Result<std::shared_ptr<Plugin>> p = Plugin::load(fake("no-entry"));
  ASSERT_FALSE(p);
  EXPECT_EQ(p.status().code(), ErrorCode::not_found);
  EXPECT_NE(p.status().message().find("exports no GetPjrtApi"), std::string::npos) << p.status().to_string();
}

struct VersionCase {
  const char* plugin;
  const char* version;
};

class PjrtUnsupportedVersion : public testing::TestWithParam<VersionCase> {};

TEST_P(PjrtUnsupportedVersion, IsRefusedWithTheVersionAndTheSupportedRange) {
  Result<std::shared_ptr<Plugin>> p = Plugin::load(fake(GetParam().plugin));
  ASSERT_FALSE(p);
  EXPECT_EQ(p.status().code(), ErrorCode::unsupported);
  const std::string m = p.status().message();
  EXPECT_NE(m.find(std::string("speaks PJRT API ") + GetParam().version), std::string::npos) << m;
  EXPECT_NE(m.find("kallpa drives 0.81 to 0.199"), std::string::npos) << m;
}

INSTANTIATE_TEST_SUITE_P(Versions, PjrtUnsupportedVersion,
                         testing::Values(VersionCase{"too-old", "0.80"}, VersionCase{"too-new", "0.200"},
                                         VersionCase{"major-1", "1.90"}),
                         [](const testing::TestParamInfo<VersionCase>& param) {
                           std::string name = param.param.plugin;
                           for (char& ch : name) ch = ch == '-' ? '_' : ch;
                           return name;
                         });

TEST(PjrtPlugin, TableWithoutARequiredSlotIsRefusedNamingIt) {
  // The table ends before PJRT_Client_Compile, as a plugin built on an older header would.
  Result<std::shared_ptr<Plugin>> p = Plugin::load(fake("short-table"));
  ASSERT_FALSE(p);
  EXPECT_EQ(p.status().code(), ErrorCode::unsupported);
  EXPECT_NE(p.status().message().find("lacks PJRT_Client_Compile"), std::string::npos) << p.status().to_string();
}

TEST(PjrtPlugin, SupportedVersionsLoadAtBothEndsOfTheRange) {
  for (const auto& [name, version] :
       {std::pair{"ok", "0.90"}, std::pair{"oldest", "0.81"}, std::pair{"newest", "0.199"}}) {
    Result<std::shared_ptr<Plugin>> p = Plugin::load(fake(name));
    ASSERT_TRUE(p) << name << ": " << p.status().to_string();
    EXPECT_EQ((*p)->version_string(), version);
  }
}

TEST(PjrtClient, FakePluginRunsTheWholeCallSequence) {
  Result<std::shared_ptr<Plugin>> p = Plugin::load(fake("ok"));
  ASSERT_TRUE(p) << p.status().to_string();
  Result<std::unique_ptr<Client>> c = Client::create(*p, 0);
  ASSERT_TRUE(c) << c.status().to_string();
  EXPECT_EQ((*c)->platform(), "fake");
  EXPECT_EQ((*c)->device_kind(), "fake device");
  EXPECT_EQ((*c)->device_count(), 1u);
  Result<std::unique_ptr<Executable>> exe = (*c)->compile("module {}");
  ASSERT_TRUE(exe) << exe.status().to_string();
  EXPECT_EQ((*exe)->num_outputs(), 1u);
  const float x = 1.0f;
  Result<Buffer> in = (*c)->upload(&x, ElementType::f32, {});
  ASSERT_TRUE(in) << in.status().to_string();
  Result<std::vector<Buffer>> out = (*exe)->execute((*c)->device(), {in->get()});
  ASSERT_TRUE(out) << out.status().to_string();
  ASSERT_EQ(out->size(), 1u);
  float y = 0.0f;
  ASSERT_TRUE((*out)[0].to_host(&y, sizeof y));
  EXPECT_EQ(y, 42.0f);
  // A size that differs from the device buffer's is an error, not an overrun.
  double wrong = 0.0;
  Status s = (*out)[0].to_host(&wrong, sizeof wrong);
  EXPECT_EQ(s.code(), ErrorCode::internal);
  // The fake plugin reports no compiled memory (its table has no such slot filled).
  EXPECT_EQ((*exe)->memory_stats().status().code(), ErrorCode::unsupported);
}

TEST(PjrtPlugin, AheadOfTimeCompileNeedsTheTopologySlots) {
  Result<std::shared_ptr<Plugin>> p = Plugin::load(fake("ok"));
  ASSERT_TRUE(p);
  Result<MemoryStats> m = (*p)->compile_for_topology("v5e:2x2", "module {}");
  ASSERT_FALSE(m);
  EXPECT_EQ(m.status().code(), ErrorCode::unsupported);
  EXPECT_NE(m.status().message().find("cannot compile ahead of time: it lacks PJRT_TopologyDescription_Create"),
            std::string::npos)
      << m.status().to_string();
}

TEST(PjrtClient, DeviceOutOfRangeIsNotFound) {
  Result<std::shared_ptr<Plugin>> p = Plugin::load(fake("ok"));
  ASSERT_TRUE(p);
  Result<std::unique_ptr<Client>> c = Client::create(*p, 3);
  ASSERT_FALSE(c);
  EXPECT_EQ(c.status().code(), ErrorCode::not_found);
  EXPECT_EQ(c.status().field(), "KALLPA_PJRT_DEVICE");
  EXPECT_NE(c.status().message().find("has 1 addressable device"), std::string::npos) << c.status().to_string();
}

// Runs the whole sequence on the fake plugin; the first failure's Status.
Status run_sequence() {
  Result<std::shared_ptr<Plugin>> p = Plugin::load(fake("ok"));
  if (!p) return p.status();
  Result<std::unique_ptr<Client>> c = Client::create(*p, 0);
  if (!c) return c.status();
  Result<std::unique_ptr<Executable>> exe = (*c)->compile("module {}");
  if (!exe) return exe.status();
  const float x = 1.0f;
  Result<Buffer> in = (*c)->upload(&x, ElementType::f32, {});
  if (!in) return in.status();
  Result<std::vector<Buffer>> out = (*exe)->execute((*c)->device(), {in->get()});
  if (!out) return out.status();
  float y = 0.0f;
  return (*out)[0].to_host(&y, sizeof y);
}

class PjrtCallFails : public testing::TestWithParam<const char*> {};

TEST_P(PjrtCallFails, TheErrorNamesTheCallAndCarriesThePluginsMessage) {
  ScopedEnv fail("KALLPA_FAKE_PJRT_FAIL", GetParam());
  const Status s = run_sequence();
  ASSERT_FALSE(s) << GetParam() << " did not fail";
  EXPECT_EQ(s.code(), ErrorCode::backend_failure);
  EXPECT_EQ(s.field(), GetParam());
  EXPECT_NE(s.message().find(std::string("fake failure in ") + GetParam()), std::string::npos) << s.to_string();
  EXPECT_NE(s.message().find("PJRT error code"), std::string::npos) << s.to_string();
}

INSTANTIATE_TEST_SUITE_P(EveryCall, PjrtCallFails,
                         testing::Values("PJRT_Plugin_Initialize", "PJRT_Client_Create", "PJRT_Client_PlatformName",
                                         "PJRT_Client_AddressableDevices", "PJRT_Device_GetDescription",
                                         "PJRT_DeviceDescription_Kind", "PJRT_Client_Compile",
                                         "PJRT_LoadedExecutable_GetExecutable", "PJRT_Executable_NumOutputs",
                                         "PJRT_Client_BufferFromHostBuffer", "PJRT_LoadedExecutable_Execute",
                                         "PJRT_Buffer_ToHostBuffer"),
                         [](const testing::TestParamInfo<const char*>& param) { return std::string(param.param); });

// ---- The real XLA CPU plugins (scripts/fetch_pjrt.sh), skipped when they are not fetched. ----

struct RealPlugin {
  const char* path;
  const char* version;
};

class PjrtRealPlugin : public testing::TestWithParam<RealPlugin> {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(GetParam().path)) {
      GTEST_SKIP() << GetParam().path << " is absent: run scripts/fetch_pjrt.sh (setup.sh does)";
    }
  }
};

// Temp bytes the compiler reports for a prefill attention program over `keys` keys.
std::int64_t temp_bytes(const Client& client, std::int64_t keys) {
  ProgramSpec s;
  s.in_dtype = s.kv_dtype = s.out_dtype = DType::bf16;
  s.seq_q = 256;
  s.hq = 8;
  s.hkv = 2;
  s.head_dim = s.head_dim_v = 64;
  s.seq_k = keys;
  s.chunk = 512;
  s.causal = true;
  s.lse = true;
  Result<std::unique_ptr<Executable>> exe = client.compile(attention_program(s));
  EXPECT_TRUE(exe) << exe.status().to_string();
  if (!exe) return -1;
  Result<MemoryStats> m = (*exe)->memory_stats();
  EXPECT_TRUE(m) << m.status().to_string();
  return m ? m->temp_bytes : -1;
}

TEST_P(PjrtRealPlugin, LoadsWithItsVersionAndCompilesAProgramWhoseMemoryGrowsWithTheChunk) {
  Result<std::shared_ptr<Plugin>> p = Plugin::load(GetParam().path);
  ASSERT_TRUE(p) << p.status().to_string();
  EXPECT_EQ((*p)->version_string(), GetParam().version);
  Result<std::unique_ptr<Client>> c = Client::create(*p, 0);
  ASSERT_TRUE(c) << c.status().to_string();
  EXPECT_EQ((*c)->platform(), "cpu");
  // 2k and 32k keys: the loop walks 512 keys a step, so the temporaries do not grow 16x with the
  // keys, and stay far below one f32 score matrix (8 heads x 256 rows x 32k keys). Some compilers
  // hoist the f32 widening of K and V out of the loop, which grows with the keys but not with
  // the rows (the 0.81 plugin's temp grows 3.5x).
  const std::int64_t small = temp_bytes(**c, 2048), large = temp_bytes(**c, 32768);
  ASSERT_GT(small, 0);
  const std::int64_t scores = std::int64_t{8} * 256 * 32768 * 4;
  EXPECT_LE(large, 4 * small) << "temp bytes: " << small << " for 2k keys, " << large << " for 32k";
  EXPECT_LT(large, scores / 4) << "temp bytes for 32k keys: " << large;
}

// The page update program on a real compiler: pages land at their indices, the rest of the pool
// is untouched, a padded repeat is harmless, and the result (the donated pool, where the plugin
// honours donation) feeds the next update.
TEST_P(PjrtRealPlugin, PageUpdateWritesPagesAtTheirBlocksAndChains) {
  Result<std::shared_ptr<Plugin>> p = Plugin::load(GetParam().path);
  ASSERT_TRUE(p) << p.status().to_string();
  Result<std::unique_ptr<Client>> c = Client::create(*p, 0);
  ASSERT_TRUE(c) << c.status().to_string();
  PageUpdateSpec s;
  s.num_blocks = 6;
  s.page_size = 2;
  s.hkv = 1;
  s.head_dim = 3;
  s.head_dim_v = 2;
  s.pages = 2;
  ASSERT_TRUE(check_spec(s));
  Result<std::unique_ptr<Executable>> exe = (*c)->compile(page_update_program(s));
  ASSERT_TRUE(exe) << exe.status().to_string();
  const std::int64_t kpage = 2 * 3, vpage = 2 * 2;  // elements per page
  std::vector<float> k(6 * kpage), v(6 * vpage);
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = static_cast<float>(i);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = -static_cast<float>(i);
  Result<Buffer> kb = (*c)->upload(k.data(), ElementType::f32, {6, 2, 1, 3});
  Result<Buffer> vb = (*c)->upload(v.data(), ElementType::f32, {6, 2, 1, 2});
  ASSERT_TRUE(kb && vb);
  Buffer kpool = std::move(*kb), vpool = std::move(*vb);
  const auto update = [&](std::vector<std::int32_t> index, float tag) {
    std::vector<float> kn(2 * kpage), vn(2 * vpage);
    for (std::size_t i = 0; i < 2; ++i) {
      for (std::int64_t e = 0; e < kpage; ++e) kn[i * kpage + e] = tag + static_cast<float>(index[i] * 10 + e);
      for (std::int64_t e = 0; e < vpage; ++e) vn[i * vpage + e] = -tag - static_cast<float>(index[i] * 10 + e);
    }
    Result<Buffer> knb = (*c)->upload(kn.data(), ElementType::f32, {2, 2, 1, 3});
    Result<Buffer> vnb = (*c)->upload(vn.data(), ElementType::f32, {2, 2, 1, 2});
    Result<Buffer> ib = (*c)->upload(index.data(), ElementType::s32, {2, 1});
    ASSERT_TRUE(knb && vnb && ib);
    Result<std::vector<Buffer>> out =
        (*exe)->execute((*c)->device(), {kpool.get(), vpool.get(), knb->get(), vnb->get(), ib->get()});
    ASSERT_TRUE(out) << out.status().to_string();
    ASSERT_EQ(out->size(), 2u);
    kpool = std::move((*out)[0]);
    vpool = std::move((*out)[1]);
    for (std::size_t i = 0; i < 2; ++i) {
      for (std::int64_t e = 0; e < kpage; ++e) k[index[i] * kpage + e] = kn[i * kpage + e];
      for (std::int64_t e = 0; e < vpage; ++e) v[index[i] * vpage + e] = vn[i * vpage + e];
    }
  };
  update({4, 1}, 1000.0f);
  update({2, 2}, 2000.0f);  // one page, padded by repeating it
  std::vector<float> kd(k.size()), vd(v.size());
  ASSERT_TRUE(kpool.to_host(kd.data(), kd.size() * sizeof(float)));
  ASSERT_TRUE(vpool.to_host(vd.data(), vd.size() * sizeof(float)));
  EXPECT_EQ(kd, k);
  EXPECT_EQ(vd, v);
}

INSTANTIATE_TEST_SUITE_P(CpuPlugins, PjrtRealPlugin,
                         testing::Values(RealPlugin{KALLPA_PJRT_PLUGIN_0_115, "0.115"},
                                         RealPlugin{KALLPA_PJRT_PLUGIN_0_81, "0.81"}),
                         [](const testing::TestParamInfo<RealPlugin>& param) {
                           std::string name = std::string("api_") + param.param.version;
                           for (char& ch : name) ch = ch == '.' ? '_' : ch;
                           return name;
                         });

}  // namespace
}  // namespace kallpa::pjrt
