// Reference dequantisers of the block types beyond Q8_0/Q4_0/Q4_1 (layouts in quant_types.h):
// each value is computed as gguf-py's gguf.quants computes it in float32, so the results are the
// same bits (tests/gguf's cross-check compares them). The products d * sc, (d * sc) * q and
// dmin * m are exact in f32 for every type but Q6_K and Q8_K (whose single product rounds once),
// so `dl * q - ml` rounds once, like numpy's.
#include <cstring>

#include "kallpa/half.h"
#include "ops/q16_units.h"
#include "ops/quant_kernels.h"

namespace kallpa::ops::kernels {

namespace {

const std::uint8_t* bytes_at(const std::byte* p) noexcept { return reinterpret_cast<const std::uint8_t*>(p); }

void dequant_q5_0(const std::byte* src, float* dst, std::int64_t nb) {
  for (std::int64_t b = 0; b < nb; ++b, src += kQ5_0Bytes, dst += kQK) {
    const float d = unit_half(src);
    std::uint32_t qh;
    std::memcpy(&qh, src + 2, 4);
    const std::uint8_t* qs = bytes_at(src + 6);
    for (int j = 0; j < kQK; ++j) {
      const int lo = j < 16 ? qs[j] & 0x0f : qs[j - 16] >> 4;
      const int q = (lo | static_cast<int>(((qh >> j) & 1u) << 4)) - 16;
      dst[j] = d * static_cast<float>(q);
    }
  }
}

void dequant_q5_1(const std::byte* src, float* dst, std::int64_t nb) {
  for (std::int64_t b = 0; b < nb; ++b, src += kQ5_1Bytes, dst += kQK) {
    const float d = unit_half(src);
    const float m = unit_half(src + 2);
    std::uint32_t qh;
    std::memcpy(&qh, src + 4, 4);
    const std::uint8_t* qs = bytes_at(src + 8);
    for (int j = 0; j < kQK; ++j) {
      const int lo = j < 16 ? qs[j] & 0x0f : qs[j - 16] >> 4;
      const int q = lo | static_cast<int>(((qh >> j) & 1u) << 4);
      dst[j] = d * static_cast<float>(q) + m;
    }
  }
}

void dequant_iq4_nl(const std::byte* src, float* dst, std::int64_t nb) {
  for (std::int64_t b = 0; b < nb; ++b, src += kIq4NlBytes, dst += kQK) {
    const float d = unit_half(src);
    const std::uint8_t* qs = bytes_at(src + 2);
    for (int j = 0; j < kQK; ++j) {
      const int nibble = j < 16 ? qs[j] & 0x0f : qs[j - 16] >> 4;
      dst[j] = d * static_cast<float>(kIq4NlValues[nibble]);
    }
  }
}

void dequant_q2_k(const std::byte* src, float* dst, std::int64_t nb) {
  for (std::int64_t b = 0; b < nb; ++b, src += kQ2KBytes, dst += kQK_K) {
    const std::uint8_t* scales = bytes_at(src);
    const std::uint8_t* qs = bytes_at(src + 16);
    const float d = unit_half(src + 80);
    const float dmin = unit_half(src + 82);
    for (int e = 0; e < kQK_K; ++e) {
      const int sc = scales[e / 16];
      const float dl = d * static_cast<float>(sc & 0x0f);
      const float ml = dmin * static_cast<float>(sc >> 4);
      const int q = (qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
      dst[e] = dl * static_cast<float>(q) - ml;
    }
  }
}

void dequant_q3_k(const std::byte* src, float* dst, std::int64_t nb) {
  for (std::int64_t b = 0; b < nb; ++b, src += kQ3KBytes, dst += kQK_K) {
    const std::uint8_t* hmask = bytes_at(src);
    const std::uint8_t* qs = bytes_at(src + 32);
    const std::uint8_t* s = bytes_at(src + 96);
    const float d = unit_half(src + 108);
    for (int e = 0; e < kQK_K; ++e) {
      const int j = e / 16;  // 16 six-bit scales: low 4 bits in bytes 0..7, high 2 in bytes 8..11
      const int lo = j < 8 ? s[j] & 0x0f : s[j - 8] >> 4;
      const int hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
      const float dl = d * static_cast<float>((lo | hi << 4) - 32);
      const int ql = (qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
      const int q = ql - (((hmask[e % 32] >> (e / 32)) & 1) != 0 ? 0 : 4);
      dst[e] = dl * static_cast<float>(q);
    }
  }
}

void dequant_q4_k(const std::byte* src, float* dst, std::int64_t nb) {
  for (std::int64_t b = 0; b < nb; ++b, src += kQ4KBytes, dst += kQK_K) {
    const float d = unit_half(src);
    const float dmin = unit_half(src + 2);
    const std::uint8_t* qs = bytes_at(src + 16);
    for (int c = 0; c < 8; ++c) {
      const KScaleMin sm = kquant_scale_min(bytes_at(src + 4), c);
      const float dl = d * static_cast<float>(sm.scale);
      const float ml = dmin * static_cast<float>(sm.min);
      for (int i = 0; i < 32; ++i) {
        const int q = (qs[32 * (c / 2) + i] >> (4 * (c % 2))) & 0x0f;
        dst[32 * c + i] = dl * static_cast<float>(q) - ml;
      }
    }
  }
}

void dequant_q5_k(const std::byte* src, float* dst, std::int64_t nb) {
  for (std::int64_t b = 0; b < nb; ++b, src += kQ5KBytes, dst += kQK_K) {
    const float d = unit_half(src);
    const float dmin = unit_half(src + 2);
    const std::uint8_t* qh = bytes_at(src + 16);
    const std::uint8_t* qs = bytes_at(src + 48);
    for (int c = 0; c < 8; ++c) {
      const KScaleMin sm = kquant_scale_min(bytes_at(src + 4), c);
      const float dl = d * static_cast<float>(sm.scale);
      const float ml = dmin * static_cast<float>(sm.min);
      for (int i = 0; i < 32; ++i) {
        const int q = ((qs[32 * (c / 2) + i] >> (4 * (c % 2))) & 0x0f) | (((qh[i] >> c) & 1) << 4);
        dst[32 * c + i] = dl * static_cast<float>(q) - ml;
      }
    }
  }
}

void dequant_q6_k(const std::byte* src, float* dst, std::int64_t nb) {
  for (std::int64_t b = 0; b < nb; ++b, src += kQ6KBytes, dst += kQK_K) {
    const std::uint8_t* ql = bytes_at(src);
    const std::uint8_t* qh = bytes_at(src + 128);
    const auto* scales = reinterpret_cast<const std::int8_t*>(src + 192);
    const float d = unit_half(src + 208);
    for (int e = 0; e < kQK_K; ++e) {
      const int h = e / 128, r = e % 128;
      const int lo = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 0x0f;
      const int hi = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
      const float dl = d * static_cast<float>(scales[e / 16]);
      dst[e] = dl * static_cast<float>((lo | hi << 4) - 32);
    }
  }
}

void dequant_q8_k(const std::byte* src, float* dst, std::int64_t nb) {
  for (std::int64_t b = 0; b < nb; ++b, src += kQ8KBytes, dst += kQK_K) {
    float d;
    std::memcpy(&d, src, 4);
    const auto* qs = reinterpret_cast<const std::int8_t*>(src + 4);
    for (int e = 0; e < kQK_K; ++e) dst[e] = d * static_cast<float>(qs[e]);
  }
}

}  // namespace

DequantBlocksFn dequant_blocks_scalar(GgmlType type) noexcept {
  switch (type) {
    case GgmlType::q5_0: return dequant_q5_0;
    case GgmlType::q5_1: return dequant_q5_1;
    case GgmlType::iq4_nl: return dequant_iq4_nl;
    case GgmlType::q2_k: return dequant_q2_k;
    case GgmlType::q3_k: return dequant_q3_k;
    case GgmlType::q4_k: return dequant_q4_k;
    case GgmlType::q5_k: return dequant_q5_k;
    case GgmlType::q6_k: return dequant_q6_k;
    case GgmlType::q8_k: return dequant_q8_k;
    default: return nullptr;
  }
}

}  // namespace kallpa::ops::kernels
