// The cuda-flash kernel lab's harness (lab.cpp): every forward_vN.cu program hands it one kernel
// generation and gets the same checks and timings, so that generations compare on equal terms.
//
// A generation's launcher takes FlashParams as cuda-flash's production launchers do (contiguous
// [rows, heads, dim] views, no paging, no softcap or ALiBi, positive scale) and must handle the two
// combinations the harness runs: bf16 with head dim 128 and f16 with head dim 64.
#pragma once

#include <cuda_runtime.h>

#include "backends/cuda/flash_params.h"

namespace kallpa::lab {

using Launch = cudaError_t (*)(const cuda::FlashParams& p, cudaStream_t stream);

struct Generation {
  const char* name;  // "v1", ...
  const char* what;  // one line: what it adds to the generation before it
  Launch launch;
  bool hopper_only;  // sm_90a code: runs only on a compute capability 9.0 device
};

// Checks the generation's output on a few shapes against a CPU reference (f64 over the same
// 16-bit inputs), then times it beside the production kernels on prefill shapes (cudaEvent) and
// prints both. Returns the process exit status: 0 when every check passed, 1 on a mismatch or CUDA
// error, 77 when there is no suitable device (skipped).
int run(const Generation& g);

}  // namespace kallpa::lab
