// opencl-flash and device memory (device.h): the fake-address allocation table, staging of
// problems onto the device, selection by device, and that the conformance suite's staging still
// catches a kernel that writes outside its outputs or into its inputs on the device. Every test is
// skipped, with the reason, when this machine has no OpenCL device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kallpa/conformance.h"
#include "kallpa/device.h"
#include "kallpa/dispatcher.h"
#include "kallpa/registry.h"
#include "test_problem.h"

namespace kallpa {
namespace {

using testing::DenseF32Problem;

// opencl-flash and its device memory, or the reason the test cannot run.
struct OpenCl {
  AttentionBackend* backend = nullptr;
  DeviceMemory* memory = nullptr;
  std::string why_not;
};

OpenCl opencl() {
  OpenCl o;
  o.backend = BackendRegistry::global().find("opencl-flash");
  if (o.backend == nullptr) {
    o.why_not = "opencl-flash is not built (no OpenCL headers/loader at configure time)";
    return o;
  }
  o.memory = o.backend->device_memory();
  if (o.memory == nullptr) {
    ProblemSignature sig;
    sig.device = Device{DeviceKind::opencl, 0};
    o.why_not = "no OpenCL device: " + o.backend->supports(sig).why_not;
  }
  return o;
}

#define REQUIRE_OPENCL(o)    \
  const OpenCl o = opencl(); \
  if (o.memory == nullptr) GTEST_SKIP() << o.why_not

TEST(DeviceMemory, RoundTripsAndRefusesAddressesItDidNotHandOut) {
  REQUIRE_OPENCL(cl);
  DeviceMemory& mem = *cl.memory;
  EXPECT_EQ(mem.version(), kDeviceMemoryVersion);
  EXPECT_EQ(mem.device().kind, DeviceKind::opencl);
  Result<DeviceBuffer> a = DeviceBuffer::allocate(mem, 1000);
  Result<DeviceBuffer> b = DeviceBuffer::allocate(mem, 1000);
  ASSERT_TRUE(a && b);
  EXPECT_NE(a->data(), b->data());
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a->data()) % 256, 0u);

  std::vector<std::uint8_t> in(1000), out(1000, 0);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = static_cast<std::uint8_t>(i * 7);
  ASSERT_TRUE(mem.upload(a->data(), in.data(), in.size()));
  // An address inside an allocation works like a host pointer offset.
  auto* middle = static_cast<std::byte*>(a->data()) + 100;
  ASSERT_TRUE(mem.download(out.data(), middle, 900));
  EXPECT_EQ(std::memcmp(out.data(), in.data() + 100, 900), 0);
  ASSERT_TRUE(mem.synchronize());

  const Status past_end = mem.download(out.data(), middle, 901);
  EXPECT_EQ(past_end.code(), ErrorCode::invalid_argument);
  EXPECT_NE(past_end.message().find("outside"), std::string::npos) << past_end.to_string();
  const Status host = mem.upload(in.data(), in.data(), 4);
  EXPECT_EQ(host.code(), ErrorCode::invalid_argument) << host.to_string();

  void* freed = a->data();
  a->reset();
  EXPECT_EQ(mem.upload(freed, in.data(), 4).code(), ErrorCode::invalid_argument);
  Result<DeviceBuffer> empty = DeviceBuffer::allocate(mem, 0);
  ASSERT_TRUE(empty);
  EXPECT_TRUE(mem.upload(empty->data(), in.data(), 0));
}

TEST(OpenClFlash, MatchesTheReferenceThroughTheDispatcherOnDeviceTensors) {
  REQUIRE_OPENCL(cl);
  DenseF32Problem host(2, 33, 47, 4, 2, 24, 20, /*with_lse=*/true);
  host.problem.causal = true;
  host.problem.softcap = 8.0f;
  DenseF32Problem want(2, 33, 47, 4, 2, 24, 20, true);
  want.problem.causal = true;
  want.problem.softcap = 8.0f;
  ASSERT_TRUE(BackendRegistry::global().find("reference")->run(*validate(want.problem), {}));

  Result<StagedProblem> staged = StagedProblem::stage(*cl.memory, host.problem);
  ASSERT_TRUE(staged) << staged.status().to_string();
  EXPECT_EQ(staged->problem().o.device, cl.memory->device());
  Dispatcher d({{"opencl-flash"}, /*strict=*/true});
  const Status s = d.run(staged->problem());
  ASSERT_TRUE(s) << s.to_string();
  ASSERT_TRUE(staged->download_outputs());
  for (std::size_t i = 0; i < want.o.size(); ++i) ASSERT_NEAR(host.o[i], want.o[i], 2e-5) << "o[" << i << "]";
  for (std::size_t i = 0; i < want.lse.size(); ++i) ASSERT_NEAR(host.lse[i], want.lse[i], 2e-5) << "lse[" << i << "]";

  // Automatic selection by device: the same problem on the host never reaches opencl-flash.
  Dispatcher automatic;
  auto on_host = automatic.candidates(validate(host.problem)->signature());
  ASSERT_TRUE(on_host);
  for (AttentionBackend* b : *on_host) EXPECT_NE(b->name(), "opencl-flash");
  auto on_device = automatic.candidates(validate(staged->problem())->signature());
  ASSERT_TRUE(on_device) << on_device.status().to_string();
  ASSERT_FALSE(on_device->empty());
  EXPECT_EQ(on_device->front()->name(), "opencl-flash");
}

TEST(OpenClFlash, RefusesHostPointersLabelledAsDeviceMemory) {
  REQUIRE_OPENCL(cl);
  DenseF32Problem t(1, 4, 4, 1, 1, 8);
  for (TensorView* v : {&t.problem.q, &t.problem.k, &t.problem.v, &t.problem.o}) v->device = cl.memory->device();
  Result<ValidatedProblem> vp = validate(t.problem);
  ASSERT_TRUE(vp);
  const Status s = cl.backend->run(*vp, {});
  EXPECT_EQ(s.code(), ErrorCode::invalid_argument) << s.to_string();
  EXPECT_EQ(s.field(), "q.data") << s.to_string();
}

TEST(OpenClFlash, SaysWhyNotForHostTensorsAndAnotherDevice) {
  REQUIRE_OPENCL(cl);
  ProblemSignature sig;
  sig.head_dim = sig.head_dim_v = 64;
  sig.hq = sig.hkv = 1;
  EXPECT_NE(cl.backend->supports(sig).why_not.find("device_memory()"), std::string::npos);
  sig.device = Device{DeviceKind::opencl, 7};
  EXPECT_NE(cl.backend->supports(sig).why_not.find("opencl:7"), std::string::npos);
  sig.device = cl.memory->device();
  EXPECT_TRUE(cl.backend->supports(sig).ok);
}

TEST(OpenClFlash, IsHealthyAfterTheCanariesOnItsDevice) {
  REQUIRE_OPENCL(cl);
  BackendRegistry::global().ensure_checked();
  auto info = BackendRegistry::global().info("opencl-flash");
  ASSERT_TRUE(info);
  EXPECT_EQ(info->health, Health::healthy) << info->health_reason;
}

// A device kernel's mistakes, made through the public DeviceMemory API after a correct run.
enum class DeviceFault { none, write_before_o, write_into_k };

class FaultyDeviceBackend final : public AttentionBackend {
 public:
  FaultyDeviceBackend(AttentionBackend& real, DeviceFault fault) : real_(real), fault_(fault) {}
  std::string_view name() const noexcept override { return "faulty-device"; }
  std::string_view version() const noexcept override { return "0"; }
  DeviceKind device_kind() const noexcept override { return real_.device_kind(); }
  int priority() const noexcept override { return 0; }
  Support supports(const ProblemSignature& sig) const noexcept override { return real_.supports(sig); }
  DeviceMemory* device_memory() const noexcept override { return real_.device_memory(); }
  Status run(const ValidatedProblem& vp, Workspace ws) noexcept override {
    if (Status s = real_.run(vp, ws); !s) return s;
    const float junk = 0.25f;
    switch (fault_) {
      case DeviceFault::write_before_o:
        return device_memory()->upload(static_cast<std::byte*>(vp.problem().o.data) - 2, &junk, 2);
      case DeviceFault::write_into_k: return device_memory()->upload(vp.problem().k.data, &junk, 2);
      case DeviceFault::none: break;
    }
    return {};
  }

 private:
  AttentionBackend& real_;
  DeviceFault fault_;
};

TEST(OpenClStaging, CatchesStrayWritesAndInputWritesOnTheDevice) {
  REQUIRE_OPENCL(cl);
  const std::vector<conformance::Case> canaries = conformance::canary_cases();
  ASSERT_FALSE(canaries.empty());
  const conformance::Case& c = canaries.front();

  FaultyDeviceBackend clean(*cl.backend, DeviceFault::none);
  const conformance::CaseResult ok = conformance::run_case(clean, c);
  EXPECT_TRUE(ok.passed && !ok.skipped) << ok.failure << ok.skip_reason;

  FaultyDeviceBackend stray(*cl.backend, DeviceFault::write_before_o);
  const conformance::CaseResult r = conformance::run_case(stray, c);
  EXPECT_FALSE(r.passed);
  EXPECT_NE(r.failure.find("out-of-bounds write at o: guard before the view"), std::string::npos) << r.failure;

  FaultyDeviceBackend input(*cl.backend, DeviceFault::write_into_k);
  const conformance::CaseResult in = conformance::run_case(input, c);
  EXPECT_FALSE(in.passed);
  EXPECT_NE(in.failure.find("modified its input k"), std::string::npos) << in.failure;
}

TEST(OpenClStaging, DeviceBackendWithoutDeviceMemoryIsSkippedWithTheReason) {
  // No OpenCL needed: a device backend that cannot stage is never silently passed.
  class NoMemory final : public AttentionBackend {
   public:
    std::string_view name() const noexcept override { return "no-memory"; }
    std::string_view version() const noexcept override { return "0"; }
    DeviceKind device_kind() const noexcept override { return DeviceKind::opencl; }
    int priority() const noexcept override { return 0; }
    Support supports(const ProblemSignature&) const noexcept override { return Support::yes(); }
    Status run(const ValidatedProblem&, Workspace) noexcept override { return {}; }
  } backend;
  const conformance::CaseResult r = conformance::run_case(backend, conformance::canary_cases().front());
  EXPECT_TRUE(r.skipped);
  EXPECT_NE(r.skip_reason.find("no device memory"), std::string::npos) << r.skip_reason;
}

}  // namespace
}  // namespace kallpa
