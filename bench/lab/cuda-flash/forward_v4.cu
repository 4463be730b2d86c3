// cuda-flash lab, generation 4: v3 with the lean softmax where there is no softcap or ALiBi. v3's
// softmax is a chain of dependent instructions per row (scale, max, exponent, sum, one after the
// other); v4 takes the maximum of raw scores (a positive scale keeps their order), folds the scale
// into the exponent's FFMA and runs max and sum as four independent chains per row, so that a
// warp issues while the previous results are in flight.
#include "forward_v3.cuh"
#include "lab.h"

namespace kallpa::cuda {
namespace {

// Plain problems only (the harness has no softcap or ALiBi); keys scored 32 at a time at D 128.
cudaError_t launch(const FlashParams& p, cudaStream_t stream) {
  auto* kernel = p.d == 64 ? flash_forward_v3<__half, 64, true, true, kTcBlockK>
                           : flash_forward_v3<__nv_bfloat16, 128, true, true, kTcBlockK / 2>;
  return launch_with_smem(kernel, launch_shape_v3(p), p, stream);
}

}  // namespace
}  // namespace kallpa::cuda

int main() {
  return kallpa::lab::run({"v4", "v3 with the lean softmax (raw-score max, scale in the exponent, 4 chains per row)", kallpa::cuda::launch, false});
}
