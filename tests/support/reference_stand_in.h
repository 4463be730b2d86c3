// The global registry's reference under another name ("ref"), for registries the tests make by
// hand: the fallback a dispatcher finds there and, when asked, the oracle its run-time checks use.
#pragma once

#include <string_view>

#include "kallpa/backend.h"
#include "kallpa/registry.h"

namespace kallpa::testing {

class ReferenceStandIn final : public AttentionBackend {
 public:
  explicit ReferenceStandIn(bool is_oracle) : is_oracle_(is_oracle) {}
  std::string_view name() const noexcept override { return "ref"; }
  std::string_view version() const noexcept override { return "0"; }
  DeviceKind device_kind() const noexcept override { return DeviceKind::cpu; }
  int priority() const noexcept override { return 0; }
  Support supports(const ProblemSignature&) const noexcept override { return Support::yes(); }
  Status run(const ValidatedProblem& vp, Workspace ws) noexcept override {
    return BackendRegistry::global().find("reference")->run(vp, ws);
  }
  const AttentionOracle* oracle() const noexcept override {
    return is_oracle_ ? BackendRegistry::global().oracle() : nullptr;
  }

 private:
  bool is_oracle_;
};

}  // namespace kallpa::testing
