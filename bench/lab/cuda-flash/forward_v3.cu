// cuda-flash lab, generation 3: 128 query rows per block, 32 per warp, so that each K/V fragment
// feeds two mma (forward_v3.cuh says how).
#include "forward_v3.cuh"
#include "lab.h"

namespace kallpa::cuda {
namespace {

// Plain problems only (the harness has no softcap or ALiBi); keys scored 32 at a time at D 128.
cudaError_t launch(const FlashParams& p, cudaStream_t stream) {
  auto* kernel = p.d == 64 ? flash_forward_v3<__half, 64, true, false, kTcBlockK>
                           : flash_forward_v3<__nv_bfloat16, 128, true, false, kTcBlockK / 2>;
  return launch_with_smem(kernel, launch_shape_v3(p), p, stream);
}

}  // namespace
}  // namespace kallpa::cuda

int main() {
  return kallpa::lab::run({"v3", "32 query rows per warp (two 16-row slices), Q re-read by ldmatrix; general softmax", kallpa::cuda::launch, false});
}
