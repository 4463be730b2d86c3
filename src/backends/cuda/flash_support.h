// cuda-flash's verdict on a problem signature, as a pure function of the device's facts (nullptr:
// no device, `unavailable` says why), so that it is tested without a GPU.
#pragma once

#include <string_view>

#include "backends/cuda/flash_plan.h"
#include "kallpa/backend.h"

namespace kallpa::cuda {

Support flash_support(const ProblemSignature& sig, const DeviceFacts* device, std::string_view unavailable);

}  // namespace kallpa::cuda
