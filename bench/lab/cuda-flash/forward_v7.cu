// cuda-flash lab, generation 7: v6 with the scores of tile j and the values product of tile j - 1
// on the tensor cores together, and tile j's softmax running under the latter (forward_v6.cuh).
#include "forward_v6.cuh"
#include "lab.h"

namespace kallpa::cuda {
namespace {

cudaError_t launch(const FlashParams& p, cudaStream_t stream) {
  auto* kernel = p.d == 64 ? flash_forward_v6<__half, 64, true, false> : flash_forward_v6<__nv_bfloat16, 128, true, false>;
  return launch_with_smem(kernel, launch_shape_v6(p), p, stream);
}

}  // namespace
}  // namespace kallpa::cuda

int main() {
  return kallpa::lab::run({"v7", "v6 with the two products overlapped (FlashAttention-3 intra-warpgroup pipelining)", kallpa::cuda::launch, true});
}
