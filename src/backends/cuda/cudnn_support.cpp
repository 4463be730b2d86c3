#include "backends/cuda/cudnn_support.h"

#include <fmt/format.h>

namespace kallpa::cuda {

Support cudnn_support(const ProblemSignature& sig, const CudnnFacts* facts, std::string_view unavailable) {
  if (facts == nullptr) return Support::no(std::string(unavailable));
  if (sig.device.kind != DeviceKind::cuda || sig.device.index != facts->device_index) {
    return Support::no(
        fmt::format("the tensors are on {}; cudnn runs on cuda:{} ('{}'): put them there through "
                    "its device_memory()",
                    sig.device.to_string(), facts->device_index, facts->device_name));
  }
  if (sig.q_dtype == DType::f32) {
    return Support::no("cuDNN's fused attention takes f16 or bf16 inputs (and fp8 on Hopper), not f32");
  }
  if (sig.kv_dtype != sig.q_dtype || sig.o_dtype != sig.q_dtype) {
    return Support::no(fmt::format("cuDNN's fused attention needs one dtype for q, k, v and o; these are {}/{}/{}",
                                   dtype_name(sig.q_dtype), dtype_name(sig.kv_dtype), dtype_name(sig.o_dtype)));
  }
  if (sig.q_layout != QLayout::dense || sig.kv_layout != KvLayout::dense) {
    return Support::no(
        "packed (varlen) and paged layouts need cuDNN's ragged-offset or page-table tensors, which "
        "this backend does not build; dense layouts only");
  }
  if (sig.causal || sig.window) {
    return Support::no(
        fmt::format("cuDNN {}'s single-operation SDPA has no causal or sliding-window mask (those come "
                    "with score-modifier subgraphs in 9.21, or the multi-operation fused graph, which "
                    "this backend does not build)",
                    facts->cudnn_version));
  }
  if (sig.softcap) return Support::no("cuDNN's single-operation SDPA has no softcap");
  if (sig.alibi) return Support::no("cuDNN's single-operation SDPA has no ALiBi bias");
  if (!sig.unit_stride_last_dim) return Support::no("cuDNN needs unit stride along the head dim");
  if (sig.head_dim != sig.head_dim_v) {
    return Support::no(
        fmt::format("head dims {}/{}: this backend asks cuDNN only for D == Dv", sig.head_dim, sig.head_dim_v));
  }
  const int max_d = facts->cc_major >= 9 ? 256 : 128;
  if (sig.head_dim % 8 != 0 || sig.head_dim > max_d) {
    return Support::no(
        fmt::format("head dim {}: cuDNN's fused attention takes multiples of 8 up to {} on compute "
                    "capability {}.x",
                    sig.head_dim, max_d, facts->cc_major));
  }
  return Support::yes();
}

}  // namespace kallpa::cuda
