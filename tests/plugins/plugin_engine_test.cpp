// The engine with faulty plugins of the highest priority in the global registry: two are wrong
// (caught by the health check), three break only after passing it (an error, NaN output, a C++
// exception; caught at run time). The greedy text stays the same as with the reference alone.
// Its own test program, so that no other test shares a registry with these plugins.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "kallpa/conformance.h"
#include "kallpa/model/gguf.h"
#include "kallpa/plugin.h"
#include "kallpa/registry.h"
#include "kallpa/runtime/engine.h"
#include "support/fault_plugins.h"
#include "support/synthetic_llama.h"

namespace kallpa::runtime {
namespace {

using testing::fault_plugin;

std::unique_ptr<Engine> engine_for(std::shared_ptr<const model::GgufFile> file, DispatchOptions attention) {
  EngineOptions o;
  o.attention = std::move(attention);
  o.cache.max_tokens = 256;
  auto e = Engine::load(std::move(file), o);
  EXPECT_TRUE(e.is_ok()) << e.status().to_string();
  return std::move(*e);
}

std::string greedy_text(Engine& e) {
  std::vector<std::int32_t> prompt;
  for (int i = 0; i < 12; ++i) prompt.push_back(3 + (i * 37) % 290);
  Session s(e, {.temperature = 0});
  GenerateOptions g;
  g.max_tokens = 24;
  g.stop_at_eos = false;
  auto r = generate(s, prompt, g);
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
  return r.is_ok() ? r->text : std::string();
}

TEST(EngineWithFaultyPlugins, GreedyTextIsUnchanged) {
  auto bytes = model::synthetic_llama();
  auto file = model::GgufFile::from_bytes(bytes, "synthetic");
  ASSERT_TRUE(file.is_ok()) << file.status().to_string();

  DispatchOptions reference_only;
  reference_only.backends = {"reference"};
  reference_only.strict = true;
  const std::string want = greedy_text(*engine_for(*file, reference_only));
  ASSERT_FALSE(want.empty());

  BackendRegistry& global = BackendRegistry::global();
  for (const char* fault : {"offby", "decode"}) ASSERT_TRUE(load_plugin(fault_plugin(fault), global).status) << fault;
  // These pass the canaries, then fail every call.
  const std::string after = std::to_string(conformance::canary_cases().size());
  setenv("KALLPA_FAULT_AFTER", after.c_str(), 1);
  for (const char* fault : {"error", "nan", "throw"})
    ASSERT_TRUE(load_plugin(fault_plugin(fault), global).status) << fault;
  unsetenv("KALLPA_FAULT_AFTER");

  DispatchOptions automatic;
  automatic.paranoid = true;
  automatic.quarantine_after = 2;
  auto engine = engine_for(*file, automatic);
  EXPECT_EQ(greedy_text(*engine), want);

  for (const char* fault : {"offby", "decode"}) {
    auto info = global.info(std::string("fault-") + fault);
    EXPECT_EQ(info->health, Health::quarantined) << fault;
    EXPECT_NE(info->health_reason.find("canary"), std::string::npos) << info->health_reason;
    EXPECT_EQ(engine->attention_stats().snapshot().count(std::string("fault-") + fault), 0u) << "never called";
  }
  for (const char* fault : {"error", "nan", "throw"}) {
    const std::string name = std::string("fault-") + fault;
    auto info = global.info(name);
    EXPECT_EQ(info->health, Health::quarantined) << fault;
    EXPECT_NE(info->health_reason.find("2 run-time failure(s)"), std::string::npos) << info->health_reason;
    const auto stats = engine->attention_stats().snapshot()[name];
    EXPECT_EQ(stats.calls, 2u) << fault;
    EXPECT_EQ(stats.failures, 2u) << fault;
  }
  const HealthCounters c = global.health_counters();
  EXPECT_EQ(c.quarantined_at_check, 2u);
  EXPECT_EQ(c.quarantined_at_run, 3u);
}

}  // namespace
}  // namespace kallpa::runtime
