// cudnn's verdict on a problem signature, as a pure function (tested without a GPU): the subset of
// the contract that cuDNN 9's single-operation fused attention (CUDNN_BACKEND_OPERATION_SDPA_FWD,
// cuDNN 9.13+) computes exactly as attention.h defines it.
#pragma once

#include <string_view>

#include "kallpa/backend.h"

namespace kallpa::cuda {

struct CudnnFacts {
  int device_index = 0;
  std::string_view device_name;
  int cc_major = 0;
  long cudnn_version = 0;  // cudnnGetVersion(): 91900 for 9.19.0
};

inline constexpr long kCudnnMinVersion = 91300;  // the SDPA_FWD operation descriptor appeared in 9.13

Support cudnn_support(const ProblemSignature& sig, const CudnnFacts* facts, std::string_view unavailable);

}  // namespace kallpa::cuda
