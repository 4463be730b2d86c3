// cuda-flash lab, generation 6: the first Hopper kernel, on wgmma (forward_v6.cuh says how).
#include "forward_v6.cuh"
#include "lab.h"

namespace kallpa::cuda {
namespace {

cudaError_t launch(const FlashParams& p, cudaStream_t stream) {
  auto* kernel = p.d == 64 ? flash_forward_v6<__half, 64, false, false> : flash_forward_v6<__nv_bfloat16, 128, false, false>;
  return launch_with_smem(kernel, launch_shape_v6(p), p, stream);
}

}  // namespace
}  // namespace kallpa::cuda

int main() {
  return kallpa::lab::run({"v6", "wgmma (Hopper): two warpgroups, 128-key tiles, each product waited for in turn", kallpa::cuda::launch, true});
}
