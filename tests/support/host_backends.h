// The host (device kind cpu) attention backends that can run in this process, for tests that
// hold every such backend to the same answer. A host backend may still be unable to run here:
// pjrt takes host tensors but needs a PJRT plugin (KALLPA_PJRT_PLUGIN); it declines every
// problem and says why, so it is left out rather than failed.
#pragma once

#include <utility>
#include <vector>

#include "kallpa/attention.h"
#include "kallpa/registry.h"

namespace kallpa::test_support {

// Whether `backend` takes a plain f32 dense problem on the host: the least any host backend that
// can run here supports.
inline bool runs_here(const AttentionBackend& backend) {
  ProblemSignature plain;
  plain.hq = plain.hkv = 1;
  plain.head_dim = plain.head_dim_v = 16;
  return backend.supports(plain).ok;
}

inline std::vector<BackendInfo> host_backends_that_run_here(const BackendRegistry& registry) {
  std::vector<BackendInfo> out;
  for (BackendInfo& info : registry.list()) {
    if (info.backend->device_kind() == DeviceKind::cpu && runs_here(*info.backend)) out.push_back(std::move(info));
  }
  return out;
}

}  // namespace kallpa::test_support
