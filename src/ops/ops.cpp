#include "kallpa/ops/ops.h"

#include <map>
#include <mutex>

#include <fmt/format.h>

namespace kallpa::ops {

Status Ops::matmul_group(std::span<const MatmulJob> jobs, const float* x, std::int64_t rows, std::int64_t decode_rows) {
  for (const MatmulJob& j : jobs) {
    if (j.w == nullptr || j.ldy != j.w->rows) return Status::invalid("jobs", "ldy must equal the matrix's rows");
    if (Status s = matmul(*j.w, x, rows, j.y, decode_rows); !s) return s;
  }
  return {};
}

Status Ops::rope_ext(float* x, std::span<const std::int32_t> positions, std::int64_t heads, std::int64_t head_dim,
                     std::int64_t n_rot, const RopeParams& params) {
  if (params.plain()) return rope(x, positions, heads, head_dim, n_rot, params.theta);
  return Status(ErrorCode::unsupported, "rope", fmt::format("{} has no NeoX-style or scaled RoPE", device_name()));
}

Status Ops::geglu(const float*, const float*, float*, std::int64_t) {
  return Status(ErrorCode::unsupported, "geglu", fmt::format("{} has no GELU-gated product", device_name()));
}

Status Ops::layernorm(const float*, const float*, const float*, float, float*, std::int64_t, std::int64_t) {
  return Status(ErrorCode::unsupported, "layernorm", fmt::format("{} has no layer norm", device_name()));
}

Status Ops::gelu_erf(float*, std::int64_t) {
  return Status(ErrorCode::unsupported, "gelu_erf", fmt::format("{} has no exact GELU", device_name()));
}

Status Ops::scale(float*, float, std::int64_t) {
  return Status(ErrorCode::unsupported, "scale", fmt::format("{} has no scaling op", device_name()));
}

Status Ops::add_bias(float*, const float*, std::int64_t, std::int64_t) {
  return Status(ErrorCode::unsupported, "add_bias", fmt::format("{} has no bias op", device_name()));
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
  Device dev;
  if (Status s = parse_device(device, &dev); !s || dev.kind == DeviceKind::plugin) {
    return Status::invalid("device", fmt::format("'{}' is not an engine device: cpu, opencl[:N] or cuda[:N]{}", device,
                                                 s ? "" : " (" + s.message() + ")"));
  }
  if (dev.kind == DeviceKind::cpu) {
    if (dev.index != 0) return Status(ErrorCode::unsupported, "device", "there is one CPU device, cpu (cpu:0)");
    return make_cpu_ops();
  }
  OpsFactory factory;
  {
    OpsRegistry& r = OpsRegistry::get();
    std::lock_guard lock(r.mu);
    if (auto it = r.factories.find(dev.kind); it != r.factories.end()) factory = it->second;
  }
  if (!factory) {
    return Status(ErrorCode::unsupported, "device",
                  fmt::format("{}: this build has no engine ops for {} devices", device, device_kind_name(dev.kind)));
  }
  return factory(dev.index);
}

}  // namespace kallpa::ops
