#include "kallpa/runtime/ops.h"

#include <charconv>
#include <map>
#include <mutex>

#include <fmt/format.h>

namespace kallpa::runtime {

Status Ops::matmul_group(std::span<const model::MatmulJob> jobs, const float* x, std::int64_t rows,
                         std::int64_t decode_rows) {
  for (const model::MatmulJob& j : jobs) {
    if (j.w == nullptr || j.ldy != j.w->rows) return Status::invalid("jobs", "ldy must equal the matrix's rows");
    if (Status s = matmul(*j.w, x, rows, j.y, decode_rows); !s) return s;
  }
  return {};
}

namespace {

struct OpsRegistry {
  std::mutex mu;
  std::map<DeviceKind, OpsFactory> factories;
  static OpsRegistry& get() {
    static OpsRegistry r;
    return r;
  }
};

}  // namespace

void register_ops(DeviceKind kind, OpsFactory factory) {
  OpsRegistry& r = OpsRegistry::get();
  std::lock_guard lock(r.mu);
  r.factories[kind] = std::move(factory);
}

Result<std::unique_ptr<Ops>> make_ops(std::string_view device) {
  const std::string_view kind_text = device.substr(0, device.find(':'));
  int index = 0;
  if (kind_text.size() < device.size()) {
    const std::string_view digits = device.substr(kind_text.size() + 1);
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
    if (digits.empty() || ec != std::errc() || end != digits.data() + digits.size() || index < 0) {
      return Status::invalid("device", fmt::format("'{}': the index after ':' must be a number >= 0", device));
    }
  }
  DeviceKind kind;
  if (kind_text == "cpu") {
    if (index != 0) return Status(ErrorCode::unsupported, "device", "there is one CPU device, cpu (cpu:0)");
    return make_cpu_ops();
  } else if (kind_text == "opencl") {
    kind = DeviceKind::opencl;
  } else if (kind_text == "cuda") {
    kind = DeviceKind::cuda;
  } else {
    return Status::invalid("device", fmt::format("'{}' is not a device: cpu, opencl[:N] or cuda[:N]", device));
  }
  OpsFactory factory;
  {
    OpsRegistry& r = OpsRegistry::get();
    std::lock_guard lock(r.mu);
    if (auto it = r.factories.find(kind); it != r.factories.end()) factory = it->second;
  }
  if (!factory) {
    return Status(ErrorCode::unsupported, "device",
                  fmt::format("{}: this build has no engine ops for {} devices", device, kind_text));
  }
  return factory(index);
}

}  // namespace kallpa::runtime
