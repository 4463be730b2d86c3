// The engine on a device (ops/ops.h v2): the forward pass over a device's memory, and the CPU
// fallback for what a device lacks (ops/fallback_ops.h) — counted, exact, refused when strict.
// A test device stands in for a real one: host memory that the model may not touch directly, and
// ops that say `unsupported` for what it is told to lack. Real devices (OpenCL here) run the same
// engine checks in EngineOnDevice.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "kallpa/dispatcher.h"
#include "kallpa/model/gguf.h"
#include "kallpa/model/llama_model.h"
#include "kallpa/runtime/engine.h"
#include "ops/fallback_ops.h"
#include "support/synthetic_llama.h"

namespace kallpa::ops {
namespace {

// Host memory behind a device's face: the model must go through upload/download for every byte
// it reads on the host, so a missing copy shows up as wrong logits. `lacks` names the ops (and
// "q4_1" for placing Q4_1 matrices) that answer unsupported.
class TestDevice final : public Ops {
 public:
  explicit TestDevice(std::set<std::string> lacks) : lacks_(std::move(lacks)), cpu_(make_cpu_ops()) {}
  std::string_view device_name() const noexcept override { return "test-device"; }
  Device device() const noexcept override { return Device::cpu(); }  // so the CPU attention backends run
  Result<void*> allocate(std::size_t bytes, std::string_view what) override { return cpu_->allocate(bytes, what); }
  void free(void* address) noexcept override { cpu_->free(address); }
  Status upload(void* dst, const void* src, std::size_t bytes) override { return cpu_->upload(dst, src, bytes); }
  Status download(void* dst, const void* src, std::size_t bytes) override { return cpu_->download(dst, src, bytes); }
  Status copy(void* dst, const void* src, std::size_t bytes) override { return cpu_->copy(dst, src, bytes); }
  Result<std::shared_ptr<const void>> place_weights(std::span<WeightMatrix* const> matrices, WeightUse use,
                                                    const CopiedFn& copied) override {
    for (const WeightMatrix* m : matrices) {
      if (lacks_.count("q4_1") && m->type == GgmlType::q4_1) return no("Q4_1 weights");
    }
    return cpu_->place_weights(matrices, use, copied);
  }
  Status embedding(const WeightMatrix& t, std::span<const std::int32_t> ids, float* out) override {
    return lacks_.count("embedding") ? no("embedding") : cpu_->embedding(t, ids, out);
  }
  Status rmsnorm(const float* x, const float* w, float eps, float* y, std::int64_t r, std::int64_t d) override {
    return lacks_.count("rmsnorm") ? no("rmsnorm") : cpu_->rmsnorm(x, w, eps, y, r, d);
  }
  Status matmul(const WeightMatrix& w, const float* x, std::int64_t rows, float* y, std::int64_t decode_rows) override {
    return lacks_.count("matmul") ? no("matmul") : cpu_->matmul(w, x, rows, y, decode_rows);
  }
  Status rope(float* x, std::span<const std::int32_t> pos, std::int64_t h, std::int64_t d, std::int64_t n_rot,
              float theta) override {
    return lacks_.count("rope") ? no("rope") : cpu_->rope(x, pos, h, d, n_rot, theta);
  }
  Status swiglu(const float* g, const float* u, float* out, std::int64_t n) override {
    return lacks_.count("swiglu") ? no("swiglu") : cpu_->swiglu(g, u, out, n);
  }
  Status add(float* x, const float* y, std::int64_t n) override {
    return lacks_.count("add") ? no("add") : cpu_->add(x, y, n);
  }
  Status gather_rows(const float* x, std::span<const std::int64_t> rows, std::int64_t dim, float* out) override {
    return lacks_.count("gather_rows") ? no("gather_rows") : cpu_->gather_rows(x, rows, dim, out);
  }
  Status scatter_rows(const float* src, std::int64_t dim, void* dst, DType type,
                      std::span<const std::int64_t> rows) override {
    return lacks_.count("scatter_rows") ? no("scatter_rows") : cpu_->scatter_rows(src, dim, dst, type, rows);
  }

 private:
  static Status no(const std::string& what) { return Status(ErrorCode::unsupported, what, "the test device lacks it"); }
  std::set<std::string> lacks_;
  std::unique_ptr<Ops> cpu_;
};

std::shared_ptr<const model::GgufFile> synthetic_file() {
  auto file = model::GgufFile::from_bytes(model::synthetic_llama({}), "synthetic");
  EXPECT_TRUE(file.is_ok()) << file.status().to_string();
  return *file;
}

// Logits of a prompt chunk, then of three batched decode steps of two sequences, on `ops`.
std::vector<float> run(Ops& ops) {
  auto model = model::LlamaModel::load(synthetic_file(), ops);
  EXPECT_TRUE(model.is_ok()) << model.status().to_string();
  if (!model) return {};
  auto cache = (*model)->make_cache({.page_size = 4, .max_tokens = 128});
  EXPECT_TRUE(cache.is_ok()) << cache.status().to_string();
  Dispatcher dispatcher;
  const auto vocab = static_cast<std::size_t>((*model)->config().vocab_size);
  const SeqId a = (*cache)->add_sequence(), b = (*cache)->add_sequence();
  const std::vector<std::int32_t> prompt_a{5, 17, 42, 9, 100, 7, 3}, prompt_b{11, 12};
  std::vector<float> all, logits(2 * vocab);
  model::ForwardItem items[] = {{a, prompt_a, 0, true}, {b, prompt_b, 0, true}};
  EXPECT_TRUE((*cache)->reserve(a, 7 + 3));
  EXPECT_TRUE((*cache)->reserve(b, 2 + 3));
  EXPECT_TRUE((*model)->forward(items, **cache, dispatcher, logits.data()));
  all.insert(all.end(), logits.begin(), logits.end());
  std::int64_t pa = 7, pb = 2;
  for (std::int32_t step = 0; step < 3; ++step) {
    const std::int32_t ta[] = {20 + step}, tb[] = {30 + step};
    // b's step comes first: forward() keeps the caller's order.
    model::ForwardItem steps[] = {{b, tb, pb++, true}, {a, ta, pa++, true}};
    EXPECT_TRUE((*model)->forward(steps, **cache, dispatcher, logits.data()));
    all.insert(all.end(), logits.begin(), logits.end());
  }
  return all;
}

TEST(DeviceOps, AFullDeviceGivesTheCpusLogitsExactly) {
  auto cpu = make_cpu_ops();
  FallbackOps device(std::make_unique<TestDevice>(std::set<std::string>{}), /*strict=*/false);
  const auto want = run(*cpu);
  const auto got = run(device);
  ASSERT_FALSE(want.empty());
  EXPECT_EQ(got, want);
  EXPECT_TRUE(device.fallbacks().empty());
}

TEST(DeviceOps, WhatADeviceLacksRunsOnTheCpuCountedAndExact) {
  auto cpu = make_cpu_ops();
  const auto want = run(*cpu);
  const std::set<std::string> lacks{"q4_1", "rope", "swiglu", "add", "rmsnorm", "gather_rows", "scatter_rows"};
  FallbackOps device(std::make_unique<TestDevice>(lacks), /*strict=*/false);
  EXPECT_EQ(run(device), want);
  const auto counts = device.fallbacks();
  for (const char* op :
       {"place_weights", "matmul", "rope", "swiglu", "add", "rmsnorm", "gather_rows", "scatter_rows"}) {
    EXPECT_GT(counts.count(op) ? counts.at(op) : 0u, 0u) << op;
  }
  // Synthetic layers have 2 rope calls each per forward pass: 2 layers x 2 x 4 passes.
  EXPECT_EQ(counts.at("rope"), 16u);
  EXPECT_EQ(counts.count("embedding"), 0u);  // the Q8_0 table went to the device
}

TEST(DeviceOps, StrictModeRefusesInsteadOfFallingBack) {
  FallbackOps strict_weights(std::make_unique<TestDevice>(std::set<std::string>{"q4_1"}), /*strict=*/true);
  auto model = model::LlamaModel::load(synthetic_file(), strict_weights);
  ASSERT_FALSE(model.is_ok());
  EXPECT_EQ(model.status().code(), ErrorCode::unsupported);

  FallbackOps strict_rope(std::make_unique<TestDevice>(std::set<std::string>{"rope"}), /*strict=*/true);
  auto m = model::LlamaModel::load(synthetic_file(), strict_rope);
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  auto cache = (*m)->make_cache({.page_size = 4, .max_tokens = 64});
  ASSERT_TRUE(cache.is_ok());
  Dispatcher dispatcher;
  std::vector<float> logits(static_cast<std::size_t>((*m)->config().vocab_size));
  const std::int32_t tokens[] = {5, 6, 7};
  model::ForwardItem item{(*cache)->add_sequence(), tokens, 0, true};
  ASSERT_TRUE((*cache)->reserve(item.seq, 3));
  const Status s = (*m)->forward({&item, 1}, **cache, dispatcher, logits.data());
  EXPECT_EQ(s.code(), ErrorCode::unsupported);
  EXPECT_EQ(s.field(), "rope");
  EXPECT_TRUE(strict_rope.fallbacks().empty());
}

TEST(DeviceOps, DeviceNamesAreParsedAndUnknownOnesRefused) {
  auto cpu = make_ops("cpu");
  ASSERT_TRUE(cpu.is_ok());
  EXPECT_EQ((*cpu)->device_name(), "cpu");
  EXPECT_TRUE((*cpu)->host_addressable());
  for (const char* bad : {"gpu", "opencl:x", "cuda:", "opencl:-1", ""}) {
    auto r = make_ops(bad);
    ASSERT_FALSE(r.is_ok()) << bad;
    EXPECT_EQ(r.status().code(), ErrorCode::invalid_argument) << bad;
    EXPECT_EQ(r.status().field(), "device") << bad;
  }
  EXPECT_EQ(make_ops("cpu:1").status().code(), ErrorCode::unsupported);
  // A CUDA build without a GPU, or a build without CUDA: unsupported with a reason, never a crash.
  auto cuda = make_ops("cuda:0");
  if (!cuda) {
    EXPECT_EQ(cuda.status().code(), ErrorCode::unsupported);
    EXPECT_FALSE(cuda.status().message().empty());
  }
}

TEST(DeviceOps, EngineLoadsOnADeviceByNameOrSaysWhyNot) {
  for (const char* device : {"opencl", "cuda"}) {
    runtime::EngineOptions o;
    o.device = device;
    o.cache.max_tokens = 64;
    auto e = runtime::Engine::load(synthetic_file(), o);
    if (!e) {
      EXPECT_EQ(e.status().code(), ErrorCode::unsupported) << e.status().to_string();
      EXPECT_EQ(e.status().field(), "device");
      continue;
    }
    EXPECT_EQ((*e)->ops().device().kind, device == std::string("opencl") ? DeviceKind::opencl : DeviceKind::cuda);
  }
}

// Every device this build has engine ops for, against the CPU on the same batches (prompt chunks
// and batched decode steps): within f32 reordering and the CPU's 16-bit decode activations, and
// the same argmax. Skipped, with the reason, where the device is absent.
class DeviceMatchesCpu : public ::testing::TestWithParam<const char*> {};

TEST_P(DeviceMatchesCpu, LogitsOfPromptAndDecodeSteps) {
  auto ops = make_ops(GetParam());
  if (!ops) GTEST_SKIP() << ops.status().to_string();
  FallbackOps device(std::move(*ops), /*strict=*/true);
  auto cpu = make_cpu_ops();
  const auto want = run(*cpu);
  const auto got = run(device);
  ASSERT_EQ(got.size(), want.size());
  auto model = model::LlamaModel::load(synthetic_file(), *cpu);
  ASSERT_TRUE(model.is_ok());
  const auto vocab = static_cast<std::size_t>((*model)->config().vocab_size);
  for (std::size_t row = 0; row * vocab < want.size(); ++row) {
    const float* w = want.data() + row * vocab;
    const float* g = got.data() + row * vocab;
    double scale = 1.0, diff = 0.0;
    std::size_t arg_w = 0, arg_g = 0;
    for (std::size_t i = 0; i < vocab; ++i) {
      scale = std::max(scale, double(std::fabs(w[i])));
      diff = std::max(diff, double(std::fabs(w[i] - g[i])));
      if (w[i] > w[arg_w]) arg_w = i;
      if (g[i] > g[arg_g]) arg_g = i;
    }
    EXPECT_LE(diff, 2e-3 * scale) << GetParam() << " logits row " << row;
    EXPECT_EQ(arg_g, arg_w) << GetParam() << " logits row " << row;
  }
  EXPECT_TRUE(device.fallbacks().empty());
}

INSTANTIATE_TEST_SUITE_P(Devices, DeviceMatchesCpu, ::testing::Values("opencl", "cuda"),
                         [](const ::testing::TestParamInfo<const char*>& p) { return std::string(p.param); });

}  // namespace
}  // namespace kallpa::ops
