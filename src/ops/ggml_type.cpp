#include "kallpa/ops/ggml_type.h"

#include "ops/quant_kernels.h"

namespace kallpa::ops {

std::optional<GgmlTypeTraits> ggml_type_traits(std::uint32_t type) noexcept {
  // Block sizes and bytes per block as ggml defines them (cross-checked with gguf-py's
  // GGML_QUANT_SIZES).
  switch (type) {
    case 0: return GgmlTypeTraits{"F32", 1, 4};
    case 1: return GgmlTypeTraits{"F16", 1, 2};
    case 2: return GgmlTypeTraits{"Q4_0", 32, 18};
    case 3: return GgmlTypeTraits{"Q4_1", 32, 20};
    case 6: return GgmlTypeTraits{"Q5_0", 32, 22};
    case 7: return GgmlTypeTraits{"Q5_1", 32, 24};
    case 8: return GgmlTypeTraits{"Q8_0", 32, 34};
    case 9: return GgmlTypeTraits{"Q8_1", 32, 40};
    case 10: return GgmlTypeTraits{"Q2_K", 256, 84};
    case 11: return GgmlTypeTraits{"Q3_K", 256, 110};
    case 12: return GgmlTypeTraits{"Q4_K", 256, 144};
    case 13: return GgmlTypeTraits{"Q5_K", 256, 176};
    case 14: return GgmlTypeTraits{"Q6_K", 256, 210};
    case 15: return GgmlTypeTraits{"Q8_K", 256, 292};
    case 16: return GgmlTypeTraits{"IQ2_XXS", 256, 66};
    case 17: return GgmlTypeTraits{"IQ2_XS", 256, 74};
    case 18: return GgmlTypeTraits{"IQ3_XXS", 256, 98};
    case 19: return GgmlTypeTraits{"IQ1_S", 256, 50};
    case 20: return GgmlTypeTraits{"IQ4_NL", 32, 18};
    case 21: return GgmlTypeTraits{"IQ3_S", 256, 110};
    case 22: return GgmlTypeTraits{"IQ2_S", 256, 82};
    case 23: return GgmlTypeTraits{"IQ4_XS", 256, 136};
    case 24: return GgmlTypeTraits{"I8", 1, 1};
    case 25: return GgmlTypeTraits{"I16", 1, 2};
    case 26: return GgmlTypeTraits{"I32", 1, 4};
    case 27: return GgmlTypeTraits{"I64", 1, 8};
    case 28: return GgmlTypeTraits{"F64", 1, 8};
    case 29: return GgmlTypeTraits{"IQ1_M", 256, 56};
    case 30: return GgmlTypeTraits{"BF16", 1, 2};
    case 34: return GgmlTypeTraits{"TQ1_0", 256, 54};
    case 35: return GgmlTypeTraits{"TQ2_0", 256, 66};
    case 39: return GgmlTypeTraits{"MXFP4", 32, 17};
    default: return std::nullopt;
  }
}

std::string_view ggml_type_name(GgmlType type) noexcept {
  const auto traits = ggml_type_traits(static_cast<std::uint32_t>(type));
  return traits ? traits->name : std::string_view("unknown");
}

bool is_compute_supported(GgmlType type) noexcept {
  return type == GgmlType::f32 || type == GgmlType::f16 || type == GgmlType::bf16 || kernels::is_quantized(type) ||
         kernels::is_block_dequant(type);
}

std::string_view compute_supported_type_names() noexcept {
  return "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K";
}

}  // namespace kallpa::ops
