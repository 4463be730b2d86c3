// cuda-flash's tensor-core kernels are numbered as in llm.c (flash_tc_v1.cu, flash_tc_v2.cu,
// flash_tc_v3.cu, flash_tc_v6.cu), each kept to be benchmarked beside the next; p.tc_version picks one.
#include "backends/cuda/flash_kernels.h"

namespace kallpa::cuda {

cudaError_t launch_flash_tensor_core(const FlashParams& p, cudaStream_t stream) {
  switch (p.tc_version) {
    case 1: return launch_tensor_core_v1(p, stream);
    case 2: return launch_tensor_core_v2(p, stream);
#ifdef KALLPA_CUDA_WGMMA_BUILT
    case 6:
    case 7:
    case 8:
    case 9: return launch_tensor_core_wgmma(p, stream);  // cuda_flash.cpp checked wgmma_refusal()
#endif
    default: return launch_tensor_core_v3(p, stream);  // 3, 4 and 5
  }
}

}  // namespace kallpa::cuda
