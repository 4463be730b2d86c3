// Plain scalar reference kernels: the definition the SIMD versions are tested against.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kallpa/half.h"
#include "ops/q16_units.h"
#include "ops/quant_kernels.h"

namespace kallpa::ops::kernels {

namespace {

template <typename T>
T load(const void* p) noexcept {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

}  // namespace

void dequantize_row_scalar(GgmlType type, const void* src, float* dst, std::int64_t n) {
  const auto* p = static_cast<const std::byte*>(src);
  switch (type) {
    case GgmlType::f32: std::memcpy(dst, p, static_cast<std::size_t>(n) * sizeof(float)); return;
    case GgmlType::f16:
      for (std::int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(load<std::uint16_t>(p + 2 * i));
      return;
    case GgmlType::bf16:
      for (std::int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(load<std::uint16_t>(p + 2 * i));
      return;
    case GgmlType::q8_0:
      for (std::int64_t b = 0; b < n / kQK; ++b) {
        const auto blk = load<BlockQ8_0>(p + b * static_cast<std::int64_t>(sizeof(BlockQ8_0)));
        const float d = f16_to_f32(blk.d);
        for (int j = 0; j < kQK; ++j) dst[b * kQK + j] = static_cast<float>(blk.qs[j]) * d;
      }
      return;
    case GgmlType::q4_0:
      for (std::int64_t b = 0; b < n / kQK; ++b) {
        const auto blk = load<BlockQ4_0>(p + b * static_cast<std::int64_t>(sizeof(BlockQ4_0)));
        const float d = f16_to_f32(blk.d);
        for (int j = 0; j < kQK / 2; ++j) {
          dst[b * kQK + j] = static_cast<float>((blk.qs[j] & 0x0f) - 8) * d;
          dst[b * kQK + j + kQK / 2] = static_cast<float>((blk.qs[j] >> 4) - 8) * d;
        }
      }
      return;
    case GgmlType::q4_1:
      for (std::int64_t b = 0; b < n / kQK; ++b) {
        const auto blk = load<BlockQ4_1>(p + b * static_cast<std::int64_t>(sizeof(BlockQ4_1)));
        const float d = f16_to_f32(blk.d);
        const float m = f16_to_f32(blk.m);
        for (int j = 0; j < kQK / 2; ++j) {
          dst[b * kQK + j] = static_cast<float>(blk.qs[j] & 0x0f) * d + m;
          dst[b * kQK + j + kQK / 2] = static_cast<float>(blk.qs[j] >> 4) * d + m;
        }
      }
      return;
    default:
      if (const DequantBlocksFn dequant = dequant_blocks_scalar(type); dequant != nullptr) {
        dequant(p, dst, n / ggml_type_traits(static_cast<std::uint32_t>(type))->block_size);
        return;
      }
      std::fill(dst, dst + n, 0.0f);  // callers check support first
      return;
  }
}

void quantize_row_scalar(GgmlType type, const float* src, void* dst, std::int64_t n) {
  auto* p = static_cast<std::byte*>(dst);
  auto store = [](std::byte* at, const auto& v) { std::memcpy(at, &v, sizeof(v)); };
  switch (type) {
    case GgmlType::f32: std::memcpy(p, src, static_cast<std::size_t>(n) * sizeof(float)); return;
    case GgmlType::f16:
      for (std::int64_t i = 0; i < n; ++i) store(p + 2 * i, f32_to_f16(src[i]));
      return;
    case GgmlType::bf16:
      for (std::int64_t i = 0; i < n; ++i) store(p + 2 * i, f32_to_bf16(src[i]));
      return;
    case GgmlType::q8_0:
      for (std::int64_t b = 0; b < n / kQK; ++b) {
        const float* x = src + b * kQK;
        float amax = 0.0f;
        for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(x[j]));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        BlockQ8_0 blk{};
        blk.d = f32_to_f16(d);
        for (int j = 0; j < kQK; ++j) blk.qs[j] = static_cast<std::int8_t>(std::round(x[j] * id));
        store(p + b * static_cast<std::int64_t>(sizeof blk), blk);
      }
      return;
    case GgmlType::q4_0:
      for (std::int64_t b = 0; b < n / kQK; ++b) {
        const float* x = src + b * kQK;
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < kQK; ++j) {
          if (std::fabs(x[j]) > amax) {
            amax = std::fabs(x[j]);
            max = x[j];
          }
        }
        const float d = max / -8.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        BlockQ4_0 blk{};
        blk.d = f32_to_f16(d);
        for (int j = 0; j < kQK / 2; ++j) {
          const int q0 = std::min(15, static_cast<int>(std::trunc(x[j] * id + 8.5f)));
          const int q1 = std::min(15, static_cast<int>(std::trunc(x[j + kQK / 2] * id + 8.5f)));
          blk.qs[j] = static_cast<std::uint8_t>(std::max(0, q0) | (std::max(0, q1) << 4));
        }
        store(p + b * static_cast<std::int64_t>(sizeof blk), blk);
      }
      return;
    case GgmlType::q4_1:
      for (std::int64_t b = 0; b < n / kQK; ++b) {
        const float* x = src + b * kQK;
        float mn = x[0], mx = x[0];
        for (int j = 1; j < kQK; ++j) {
          mn = std::min(mn, x[j]);
          mx = std::max(mx, x[j]);
        }
        const float d = (mx - mn) / 15.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        BlockQ4_1 blk{};
        blk.d = f32_to_f16(d);
        blk.m = f32_to_f16(mn);
        for (int j = 0; j < kQK / 2; ++j) {
          const int q0 = std::min(15, static_cast<int>(std::trunc((x[j] - mn) * id + 0.5f)));
          const int q1 = std::min(15, static_cast<int>(std::trunc((x[j + kQK / 2] - mn) * id + 0.5f)));
          blk.qs[j] = static_cast<std::uint8_t>(std::max(0, q0) | (std::max(0, q1) << 4));
        }
        store(p + b * static_cast<std::int64_t>(sizeof blk), blk);
      }
      return;
    default: return;
  }
}

namespace {

// Both activation block types: d = max|x| / qmax, q = round-half-even(x * (qmax / max|x|)) (so
// |q| <= qmax), s = d * sum(q).
template <typename Block>
void quantize_activations(const float* x, Block* out, std::int64_t k, float qmax) {
  for (std::int64_t b = 0; b < k / kQK; ++b) {
    const float* xb = x + b * kQK;
    float amax = 0.0f;
    for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / qmax;
    const float id = d != 0.0f ? qmax / amax : 0.0f;
    int sum = 0;
    for (int j = 0; j < kQK; ++j) {
      const int q = static_cast<int>(std::nearbyint(xb[j] * id));
      out[b].qs[j] = static_cast<std::remove_reference_t<decltype(out[b].qs[0])>>(q);
      sum += q;
    }
    out[b].d = d;
    out[b].s = d * static_cast<float>(sum);
  }
}

}  // namespace

void quantize_row_q8x_scalar(const float* x, BlockQ8x* out, std::int64_t k) { quantize_activations(x, out, k, 127.0f); }

void quantize_row_q16x_scalar(const float* x, BlockQ16x* out, std::int64_t k) {
  quantize_activations(x, out, k, 32767.0f);
}

void load_row_ggml(GgmlType type, WeightLayout layout, const std::byte* w, std::size_t row_bytes, std::int64_t r,
                   std::int64_t k, std::byte* out) {
  const BlockGeom g = block_geom(type);
  for (std::int64_t b = 0; b < k / kQK; ++b) {
    const BlockPtr p = block_ptr(g, layout, w, row_bytes, r, b);
    std::byte* o = out + static_cast<std::size_t>(b) * g.bytes;
    std::memcpy(o, p.d, 2);
    if (g.has_m) std::memcpy(o + 2, p.m, 2);
    std::memcpy(o + (g.has_m ? 4 : 2), p.qs, g.qs_bytes);
  }
}

void gemm_q_scalar(GgmlType type, WeightLayout layout, const std::byte* w, std::size_t row_bytes, std::int64_t nw,
                   const BlockQ8x* xq, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy) {
  const std::int64_t nb = k / kQK;
  std::vector<std::byte> row(row_bytes);
  for (std::int64_t x = 0; x < nx; ++x) {
    const BlockQ8x* xr = xq + x * nb;
    for (std::int64_t r = 0; r < nw; ++r) {
      load_row_ggml(type, layout, w, row_bytes, r, k, row.data());
      const std::byte* wr = row.data();
      float acc = 0.0f;
      float macc = 0.0f;
      for (std::int64_t b = 0; b < nb; ++b) {
        const BlockQ8x& xb = xr[b];
        int isum = 0;
        float d = 0.0f;
        if (type == GgmlType::q8_0) {
          const auto blk = load<BlockQ8_0>(wr + b * static_cast<std::int64_t>(sizeof(BlockQ8_0)));
          for (int j = 0; j < kQK; ++j) isum += blk.qs[j] * xb.qs[j];
          d = f16_to_f32(blk.d);
        } else if (type == GgmlType::q4_0) {
          const auto blk = load<BlockQ4_0>(wr + b * static_cast<std::int64_t>(sizeof(BlockQ4_0)));
          for (int j = 0; j < kQK / 2; ++j) {
            isum += (blk.qs[j] & 0x0f) * xb.qs[j] + (blk.qs[j] >> 4) * xb.qs[j + kQK / 2];
          }
          d = f16_to_f32(blk.d);
          macc = std::fma(-8.0f * d, xb.s, macc);
        } else {  // q4_1
          const auto blk = load<BlockQ4_1>(wr + b * static_cast<std::int64_t>(sizeof(BlockQ4_1)));
          for (int j = 0; j < kQK / 2; ++j) {
            isum += (blk.qs[j] & 0x0f) * xb.qs[j] + (blk.qs[j] >> 4) * xb.qs[j + kQK / 2];
          }
          d = f16_to_f32(blk.d);
          macc = std::fma(f16_to_f32(blk.m), xb.s, macc);
        }
        acc += static_cast<float>(isum) * (d * xb.d);
      }
      y[x * ldy + r] = acc + macc;
    }
  }
}
void q16_unit_quants_scalar(GgmlType t, const std::byte* u, int c, std::int32_t* wq) noexcept {
  const auto* b = reinterpret_cast<const std::uint8_t*>(u);
  switch (t) {
    case GgmlType::q5_0:
    case GgmlType::q5_1: {
      const std::size_t at = t == GgmlType::q5_0 ? 2 : 4;
      std::uint32_t qh;
      std::memcpy(&qh, b + at, 4);
      const std::uint8_t* qs = b + at + 4;
      const int bias = t == GgmlType::q5_0 ? 16 : 0;
      for (int j = 0; j < kQK; ++j) {
        const int nib = j < 16 ? (qs[j] & 0x0f) : (qs[j - 16] >> 4);
        wq[j] = (nib | static_cast<int>((qh >> j) & 1u) << 4) - bias;
      }
      return;
    }
    case GgmlType::iq4_nl:
      for (int j = 0; j < kQK; ++j) wq[j] = kIq4NlValues[j < 16 ? (b[2 + j] & 0x0f) : (b[2 + j - 16] >> 4)];
      return;
    case GgmlType::q4_k:
    case GgmlType::q5_k: {
      const bool five = t == GgmlType::q5_k;
      const std::uint8_t* qs = b + (five ? 48 : 16) + 32 * (c / 2);
      for (int i = 0; i < kQK; ++i) {
        int q = (qs[i] >> (4 * (c % 2))) & 0x0f;
        if (five) q |= ((b[16 + i] >> c) & 1) << 4;
        wq[i] = q;
      }
      return;
    }
    case GgmlType::q6_k: {
      const int h = c / 4;
      const std::uint8_t* ql = b + 64 * h + 32 * (c % 2);
      const std::uint8_t* qh = b + 128 + 32 * h;
      const auto* sc = reinterpret_cast<const std::int8_t*>(b + 192);
      for (int i = 0; i < kQK; ++i) {
        const int q = ((ql[i] >> (4 * ((c / 2) % 2))) & 0x0f) | (((qh[i] >> (2 * (c % 4))) & 3) << 4);
        wq[i] = sc[2 * c + i / 16] * (q - 32);
      }
      return;
    }
    default: return;
  }
}

namespace {

// gemm_q16_scalar for the types of ops/q16_units.h (rows layout).
void gemm_q16_units_scalar(GgmlType type, const std::byte* w, std::size_t row_bytes, std::int64_t nw,
                           const BlockQ16x* xq, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy) {
  const Q16Unit g = q16_unit(type);
  const std::int64_t nb = k / kQK;
  for (std::int64_t r = 0; r < nw; ++r) {
    const std::byte* row = w + static_cast<std::size_t>(r) * row_bytes;
    for (std::int64_t xi = 0; xi < nx; ++xi) {
      const BlockQ16x* xr = xq + xi * nb;
      float acc_e = 0.0f, acc_o = 0.0f, macc = 0.0f;
      for (std::int64_t b = 0; b < nb; ++b) {
        const std::byte* unit = row + static_cast<std::size_t>(b / g.blocks) * g.bytes;
        const int c = static_cast<int>(b % g.blocks);
        float d[kMaxUnitBlocks], m[kMaxUnitBlocks];
        q16_unit_scales(type, unit, d, m);
        std::int32_t wq[kQK];
        q16_unit_quants_scalar(type, unit, c, wq);
        const float scale = d[c] * xr[b].d;
        std::int32_t e = 0, o = 0;  // exact: see ops/q16_units.h
        for (int j = 0; j < kQK; ++j) ((j & 2) == 0 ? e : o) += wq[j] * xr[b].qs[j];
        acc_e = std::fma(static_cast<float>(e), scale, acc_e);
        acc_o = std::fma(static_cast<float>(o), scale, acc_o);
        if (g.has_m) macc = std::fma(m[c], xr[b].s, macc);
      }
      y[xi * ldy + r] = (acc_e + acc_o) + macc;
    }
  }
}

}  // namespace

void gemm_q16_scalar(GgmlType type, WeightLayout layout, const std::byte* w, std::size_t row_bytes, std::int64_t nw,
                     const BlockQ16x* xq, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy) {
  if (has_q16_unit_kernel(type)) return gemm_q16_units_scalar(type, w, row_bytes, nw, xq, nx, k, y, ldy);
  const std::int64_t nb = k / kQK;
  const BlockGeom g = block_geom(type);
  std::vector<std::byte> row(row_bytes);
  for (std::int64_t r = 0; r < nw; ++r) {
    load_row_ggml(type, layout, w, row_bytes, r, k, row.data());
    for (std::int64_t xi = 0; xi < nx; ++xi) {
      const BlockQ16x* xr = xq + xi * nb;
      float acc_e = 0.0f, acc_o = 0.0f;
      float macc = 0.0f;
      for (std::int64_t b = 0; b < nb; ++b) {
        const std::byte* blk = row.data() + static_cast<std::size_t>(b) * g.bytes;
        int wq[kQK];
        float d, m = 0.0f;
        if (type == GgmlType::q8_0) {
          const auto q = load<BlockQ8_0>(blk);
          for (int j = 0; j < kQK; ++j) wq[j] = q.qs[j];
          d = f16_to_f32(q.d);
        } else {
          const std::uint8_t* qs = reinterpret_cast<const std::uint8_t*>(blk + (g.has_m ? 4 : 2));
          for (int j = 0; j < kQK / 2; ++j) {
            wq[j] = qs[j] & 0x0f;
            wq[j + kQK / 2] = qs[j] >> 4;
          }
          d = f16_to_f32(load<std::uint16_t>(blk));
          m = g.has_m ? f16_to_f32(load<std::uint16_t>(blk + 2)) : -8.0f * d;
        }
        const float scale = d * xr[b].d;
        int e = 0, o = 0;  // exact: |sum| < 2^31 for any quants
        for (int j = 0; j < kQK; ++j) ((j & 2) == 0 ? e : o) += wq[j] * xr[b].qs[j];
        acc_e = std::fma(static_cast<float>(e), scale, acc_e);
        acc_o = std::fma(static_cast<float>(o), scale, acc_o);
        if (type != GgmlType::q8_0) macc = std::fma(m, xr[b].s, macc);
      }
      y[xi * ldy + r] = (acc_e + acc_o) + macc;
    }
  }
}

void gemm_f_scalar(GgmlType type, const std::byte* w, std::size_t row_bytes, std::int64_t nw, const float* x,
                   std::int64_t ldx, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy) {
  for (std::int64_t xi = 0; xi < nx; ++xi) {
    const float* xr = x + xi * ldx;
    for (std::int64_t r = 0; r < nw; ++r) {
      const std::byte* wr = w + static_cast<std::size_t>(r) * row_bytes;
      float acc = 0.0f;
      for (std::int64_t i = 0; i < k; ++i) {
        float wv;
        if (type == GgmlType::f32) {
          wv = load<float>(wr + 4 * i);
        } else if (type == GgmlType::f16) {
          wv = f16_to_f32(load<std::uint16_t>(wr + 2 * i));
        } else {
          wv = bf16_to_f32(load<std::uint16_t>(wr + 2 * i));
        }
        acc += wv * xr[i];
      }
      y[xi * ldy + r] = acc;
    }
  }
}

namespace {

// The canonical f32 sum of quant.h: 8 lanes, lane l takes j = l mod 8 in increasing j.
float canonical_dot(const float* w, const float* x, std::int64_t k) {
  float a[8] = {};
  for (std::int64_t i = 0; i < k; i += 8) {
    for (int l = 0; l < 8; ++l) a[l] = std::fma(w[i + l], x[i + l], a[l]);
  }
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

}  // namespace

void gemm_qf_scalar(GgmlType type, WeightLayout layout, const std::byte* w, std::size_t row_bytes, std::int64_t nw,
                    const float* x, std::int64_t ldx, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy) {
  std::vector<float> wrow(static_cast<std::size_t>(k));
  std::vector<std::byte> row(row_bytes);
  for (std::int64_t r = 0; r < nw; ++r) {
    load_row_ggml(type, layout, w, row_bytes, r, k, row.data());
    dequantize_row_scalar(type, row.data(), wrow.data(), k);
    for (std::int64_t xi = 0; xi < nx; ++xi) y[xi * ldy + r] = canonical_dot(wrow.data(), x + xi * ldx, k);
  }
}

void gemm_dq_scalar(GgmlType type, const std::byte* w, std::size_t row_bytes, std::int64_t nw, const float* x,
                    std::int64_t ldx, std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy) {
  std::vector<float> wrow(static_cast<std::size_t>(k));
  for (std::int64_t r = 0; r < nw; ++r) {
    dequantize_row_scalar(type, w + static_cast<std::size_t>(r) * row_bytes, wrow.data(), k);
    for (std::int64_t xi = 0; xi < nx; ++xi) y[xi * ldy + r] = canonical_dot(wrow.data(), x + xi * ldx, k);
  }
}

}  // namespace kallpa::ops::kernels
