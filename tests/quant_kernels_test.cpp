// Tensor-type kernels: dequantisation against values worked out by hand, quantisation round trips,
// the AVX2 kernels against the scalar reference, and matmul against an exact product (double) of
// the dequantised weights, for every supported type. Python cross-checks against gguf.quants live
// in tools/gguf/crosscheck.py.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "kallpa/half.h"
#include "kallpa/ops/quant.h"
#include "ops/quant_kernels.h"
#include "ops/quant_types.h"
#include "ops/repack.h"
#include "support/synthetic_llama.h"

namespace {

using namespace kallpa::ops;
using kallpa::ErrorCode;

const GgmlType kAllTypes[] = {GgmlType::f32,  GgmlType::f16,  GgmlType::bf16,
                              GgmlType::q8_0, GgmlType::q4_0, GgmlType::q4_1};

template <typename T>
std::vector<std::byte> as_bytes(const T& v) {
  std::vector<std::byte> b(sizeof(T));
  std::memcpy(b.data(), &v, sizeof(T));
  return b;
}

TEST(QuantDequant, HandWorkedBlocks) {
  float out[32];
  {
    BlockQ8_0 b{};
    b.d = 0x3800;  // 0.5
    for (int j = 0; j < 32; ++j) b.qs[j] = static_cast<std::int8_t>(j - 16);
    b.qs[31] = -128;
    ASSERT_TRUE(dequantize_row(GgmlType::q8_0, &b, out, 32).is_ok());
    for (int j = 0; j < 31; ++j) EXPECT_EQ(out[j], static_cast<float>(j - 16) * 0.5f) << j;
    EXPECT_EQ(out[31], -64.0f);
  }
  {
    BlockQ4_0 b{};
    b.d = 0x3400;  // 0.25
    for (int j = 0; j < 16; ++j) b.qs[j] = static_cast<std::uint8_t>(j | ((15 - j) << 4));
    ASSERT_TRUE(dequantize_row(GgmlType::q4_0, &b, out, 32).is_ok());
    for (int j = 0; j < 16; ++j) {
      EXPECT_EQ(out[j], static_cast<float>(j - 8) * 0.25f) << j;       // low nibbles: elements 0..15
      EXPECT_EQ(out[16 + j], static_cast<float>(7 - j) * 0.25f) << j;  // high nibbles: elements 16..31
    }
  }
  {
    BlockQ4_1 b{};
    b.d = 0x3800;  // 0.5
    b.m = 0xbc00;  // -1
    for (int j = 0; j < 16; ++j) b.qs[j] = static_cast<std::uint8_t>(j | ((15 - j) << 4));
    ASSERT_TRUE(dequantize_row(GgmlType::q4_1, &b, out, 32).is_ok());
    for (int j = 0; j < 16; ++j) {
      EXPECT_EQ(out[j], static_cast<float>(j) * 0.5f - 1.0f) << j;
      EXPECT_EQ(out[16 + j], static_cast<float>(15 - j) * 0.5f - 1.0f) << j;
    }
  }
  {
    const std::uint16_t h[4] = {0x3c00, 0xc000, 0x7bff, 0x0001};
    ASSERT_TRUE(dequantize_row(GgmlType::f16, h, out, 4).is_ok());
    EXPECT_EQ(out[0], 1.0f);
    EXPECT_EQ(out[1], -2.0f);
    EXPECT_EQ(out[2], 65504.0f);
    EXPECT_EQ(out[3], std::ldexp(1.0f, -24));
    const std::uint16_t bf[2] = {0x3f80, 0xc040};
    ASSERT_TRUE(dequantize_row(GgmlType::bf16, bf, out, 2).is_ok());
    EXPECT_EQ(out[0], 1.0f);
    EXPECT_EQ(out[1], -3.0f);
    const float f[2] = {1.25f, -7.5f};
    ASSERT_TRUE(dequantize_row(GgmlType::f32, f, out, 2).is_ok());
    EXPECT_EQ(out[1], -7.5f);
  }
  EXPECT_EQ(dequantize_row(GgmlType::iq2_xxs, out, out, 256).code(), ErrorCode::unsupported);
  EXPECT_EQ(dequantize_row(GgmlType::q4_1, out, out, 31).code(), ErrorCode::invalid_argument);
}

TEST(QuantDequant, HandWorkedQuantisation) {
  // Q4_1 of 0..31 / 2: min 0, max 15.5, d = 15.5/15, q = trunc(x/d + 0.5).
  float x[32];
  for (int j = 0; j < 32; ++j) x[j] = static_cast<float>(j) * 0.5f;
  BlockQ4_1 b{};
  ASSERT_TRUE(quantize_row(GgmlType::q4_1, x, &b, 32).is_ok());
  EXPECT_EQ(b.m, 0);
  EXPECT_EQ(b.d, kallpa::f32_to_f16(15.5f / 15.0f));
  EXPECT_EQ(b.qs[0] & 0x0f, 0);
  EXPECT_EQ(b.qs[15] >> 4, 15);  // element 31
  EXPECT_EQ(b.qs[2] & 0x0f, 1);  // 1.0 / 1.0333 + 0.5 -> 1
  // Q4_0: the largest magnitude (-4) maps to q = 0 and d = 4/8 = 0.5.
  float y[32] = {};
  y[5] = -4.0f;
  y[20] = 3.0f;
  BlockQ4_0 c{};
  ASSERT_TRUE(quantize_row(GgmlType::q4_0, y, &c, 32).is_ok());
  EXPECT_EQ(kallpa::f16_to_f32(c.d), 0.5f);
  EXPECT_EQ(c.qs[5] & 0x0f, 0);
  EXPECT_EQ(c.qs[4] >> 4, 14);  // element 20: 3.0 / 0.5 + 8.5 = 14.5 -> 14, dequantises to (14 - 8) * 0.5
  float back[32];
  ASSERT_TRUE(dequantize_row(GgmlType::q4_0, &c, back, 32).is_ok());
  EXPECT_EQ(back[5], -4.0f);
  EXPECT_EQ(back[20], 3.0f);
  EXPECT_EQ(back[0], 0.0f);
}

TEST(QuantDequant, RoundTripErrorBounds) {
  const std::int64_t n = 32 * 64;
  const auto x = kallpa::model::synthetic_values(11, static_cast<std::size_t>(n), 3.0f);
  for (GgmlType t : kAllTypes) {
    std::vector<std::byte> q(static_cast<std::size_t>(row_size(t, n)));
    ASSERT_TRUE(quantize_row(t, x.data(), q.data(), n).is_ok());
    std::vector<float> back(static_cast<std::size_t>(n));
    ASSERT_TRUE(dequantize_row(t, q.data(), back.data(), n).is_ok());
    for (std::int64_t b = 0; b < n / 32; ++b) {
      float amax = 0, mn = 1e30f, mx = -1e30f;
      for (int j = 0; j < 32; ++j) {
        const float v = x[b * 32 + j];
        amax = std::max(amax, std::fabs(v));
        mn = std::min(mn, v);
        mx = std::max(mx, v);
      }
      float bound = 0;
      switch (t) {
        case GgmlType::f32: bound = 0; break;
        case GgmlType::f16: bound = amax * 1e-3f; break;
        case GgmlType::bf16: bound = amax * 8e-3f; break;
        case GgmlType::q8_0: bound = amax / 254.0f * 1.01f + amax * 1e-3f; break;
        case GgmlType::q4_0: bound = amax / 8.0f * 1.01f + amax * 2e-3f; break;  // clamped at 7d
        default: bound = (mx - mn) / 30.0f * 1.01f + amax * 2e-3f; break;
      }
      for (int j = 0; j < 32; ++j) {
        ASSERT_LE(std::fabs(back[b * 32 + j] - x[b * 32 + j]), bound) << ggml_type_name(t) << " at " << b * 32 + j;
      }
    }
  }
}

TEST(QuantKernels, ActivationQuantisationMatchesScalar) {
  if (!kernels::avx2_available()) GTEST_SKIP() << "no AVX2 on this machine: only the scalar kernels run";
  const std::int64_t k = 32 * 40;
  auto x = kallpa::model::synthetic_values(3, static_cast<std::size_t>(k), 10.0f);
  for (int j = 0; j < 32; ++j) x[static_cast<std::size_t>(j)] = 0.0f;  // all-zero block
  for (int j = 0; j < 32; ++j) x[static_cast<std::size_t>(32 + j)] = static_cast<float>(j - 16) * 0.5f;  // exact halves
  x[70] = 1e-30f;
  std::vector<BlockQ8x> a(static_cast<std::size_t>(k / 32)), b(a.size());
  kernels::quantize_row_q8x_scalar(x.data(), a.data(), k);
  kernels::quantize_row_q8x_avx2(x.data(), b.data(), k);
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].d, b[i].d) << i;
    EXPECT_EQ(a[i].s, b[i].s) << i;
    EXPECT_EQ(std::memcmp(a[i].qs, b[i].qs, 32), 0) << i;
  }
  EXPECT_EQ(a[0].d, 0.0f);
  EXPECT_EQ(a[1].qs[0], -127);

  std::vector<BlockQ16x> c(static_cast<std::size_t>(k / 32)), e(c.size());
  kernels::quantize_row_q16x_scalar(x.data(), c.data(), k);
  kernels::quantize_row_q16x_avx2(x.data(), e.data(), k);
  for (std::size_t i = 0; i < c.size(); ++i) {
    EXPECT_EQ(c[i].d, e[i].d) << i;
    EXPECT_EQ(c[i].s, e[i].s) << i;
    EXPECT_EQ(std::memcmp(c[i].qs, e[i].qs, sizeof c[i].qs), 0) << i;
  }
  EXPECT_EQ(c[0].d, 0.0f);
  EXPECT_EQ(c[0].s, 0.0f);
  // Block 1 holds (j - 16) / 2: max |x| = 8 at j = 0, so q = round((j - 16) * 32767 / 16).
  for (int j = 0; j < 32; ++j) {
    EXPECT_EQ(c[1].qs[j],
              static_cast<std::int16_t>(std::nearbyint(static_cast<float>(j - 16) * 0.5f * (32767.0f / 8.0f))))
        << j;
  }
  // Every element within half a step of the input (plus the rounding of x * (32767 / amax)).
  for (std::size_t blk = 0; blk < c.size(); ++blk) {
    for (int j = 0; j < 32; ++j) {
      const float xv = x[blk * 32 + static_cast<std::size_t>(j)];
      EXPECT_LE(std::fabs(static_cast<double>(c[blk].qs[j]) * c[blk].d - xv),
                0.5 * c[blk].d + 4.0 * std::ldexp(std::fabs(static_cast<double>(xv)), -24))
          << blk << ":" << j;
    }
  }
}

struct Problem {
  GgmlType type;
  std::int64_t rows, cols, batch;
  std::vector<std::byte> w;
  std::vector<float> x;
  WeightMatrix wm;
};

Problem make_problem(GgmlType t, std::int64_t rows, std::int64_t cols, std::int64_t batch, std::uint64_t seed) {
  Problem p{t, rows, cols, batch, {}, {}, {}};
  const auto wf = kallpa::model::synthetic_values(seed, static_cast<std::size_t>(rows * cols), 0.5f);
  p.w.resize(static_cast<std::size_t>(row_size(t, cols) * static_cast<std::uint64_t>(rows)));
  for (std::int64_t r = 0; r < rows; ++r) {
    EXPECT_TRUE(
        quantize_row(t, wf.data() + r * cols, p.w.data() + static_cast<std::size_t>(r) * row_size(t, cols), cols)
            .is_ok());
  }
  p.x = kallpa::model::synthetic_values(seed + 1, static_cast<std::size_t>(batch * cols), 2.0f);
  p.wm = WeightMatrix{t, p.w.data(), rows, cols, row_size(t, cols)};
  return p;
}

// Q16 activations: the AVX2 kernels and the scalar reference agree bit for bit, in both weight
// layouts, on every path of gemm_q16_avx2's shape rule (quant_kernels.h): batch 1 takes one-row
// tiles of 1..4 weight rows; batches 2 and 3 fold widened 4-row groups (tiles of 1..4 activation
// rows); from batch 4 (kQ16LanesMinBatch), 16-row groups run rows as lanes (padded tails of 2 or 3
// activation rows, single-row tails through the one-row tiles: batches 5, 6, 7, 9, 17) and the
// 4-row groups past them fold (rows 20, 24, 28, 40); rows % 4 go to the one-row tiles.
TEST(QuantKernels, Q16ActivationsAvx2MatchesScalarBitwise) {
  if (!kernels::avx2_available()) GTEST_SKIP() << "no AVX2 on this machine: only the scalar kernels run";
  for (GgmlType t : {GgmlType::q8_0, GgmlType::q4_0, GgmlType::q4_1}) {
    for (std::int64_t cols : {32, 96, 576}) {
      for (std::int64_t rows : {1, 2, 3, 5, 8, 9, 16, 20, 24, 28, 40}) {
        for (std::int64_t batch : {1, 2, 3, 4, 5, 6, 7, 9, 16, 17}) {
          Problem p = make_problem(t, rows, cols, batch, static_cast<std::uint64_t>(rows * 100 + batch + cols));
          std::vector<std::byte> packed(p.w.size());
          std::vector<WeightMatrix> layouts{p.wm};
          if (rows % 4 == 0) {
            auto r4 = repack_rows4(p.wm, packed.data());
            ASSERT_TRUE(r4.is_ok());
            layouts.push_back(*r4);
          }
          for (const WeightMatrix& wm : layouts) {
            std::vector<float> ys(static_cast<std::size_t>(rows * batch));
            MatmulOptions scalar;
            scalar.max_isa = MatmulOptions::Isa::scalar;
            scalar.activations = MatmulOptions::Activations::q16;
            ASSERT_TRUE(matmul(wm, p.x.data(), batch, cols, ys.data(), rows, scalar).is_ok());
            std::vector<float> yv(ys.size());
            MatmulOptions simd;
            simd.max_isa = MatmulOptions::Isa::avx2;
            simd.activations = MatmulOptions::Activations::q16;
            ASSERT_TRUE(matmul(wm, p.x.data(), batch, cols, yv.data(), rows, simd).is_ok());
            ASSERT_EQ(std::memcmp(ys.data(), yv.data(), ys.size() * sizeof(float)), 0)
                << ggml_type_name(t) << " rows " << rows << " cols " << cols << " batch " << batch
                << (wm.layout == WeightLayout::rows4 ? " rows4" : " rows");
          }
        }
      }
    }
  }
}

// The shape rule of gemm_q16_avx2 called directly, without matmul's task split: a whole matrix of
// 1..3 groups of 16 rows plus 4-row groups and a tail, so that one call takes the fold alone
// (batches 2, 3) or the lanes followed by the fold and the one-row tiles (batches 4 and up), each
// against the scalar reference, bit for bit.
TEST(QuantKernels, Q16Avx2ShapeRuleMatchesScalarBitwise) {
  if (!kernels::avx2_available()) GTEST_SKIP() << "no AVX2 on this machine: only the scalar kernels run";
  constexpr std::int64_t cols = 160;
  const std::int64_t batches[] = {2, 3, kernels::kQ16LanesMinBatch, 5, 8, 11};
  for (GgmlType t : {GgmlType::q8_0, GgmlType::q4_0, GgmlType::q4_1}) {
    for (std::int64_t rows : {4, 12, 16, 24, 36, 52}) {
      for (std::int64_t batch : batches) {
        Problem p = make_problem(t, rows, cols, batch, static_cast<std::uint64_t>(rows * 31 + batch));
        std::vector<BlockQ16x> xq(static_cast<std::size_t>(batch * cols / 32));
        for (std::int64_t b = 0; b < batch; ++b) {
          kernels::quantize_row_q16x_scalar(p.x.data() + b * cols, xq.data() + b * cols / 32, cols);
        }
        std::vector<std::byte> packed(p.w.size());
        auto r4 = repack_rows4(p.wm, packed.data());
        ASSERT_TRUE(r4.is_ok());
        for (const WeightMatrix& wm : {p.wm, *r4}) {
          const auto* w = static_cast<const std::byte*>(wm.data);
          const std::int64_t ldy = rows + 3;  // outputs of one activation row are not contiguous
          std::vector<float> ys(static_cast<std::size_t>(batch * ldy), -1.0f), yv(ys);
          kernels::gemm_q16_scalar(t, wm.layout, w, wm.row_bytes, rows, xq.data(), batch, cols, ys.data(), ldy);
          kernels::gemm_q16_avx2(t, wm.layout, w, wm.row_bytes, rows, xq.data(), batch, cols, yv.data(), ldy);
          ASSERT_EQ(std::memcmp(ys.data(), yv.data(), ys.size() * sizeof(float)), 0)
              << ggml_type_name(t) << " rows " << rows << " batch " << batch
              << (wm.layout == WeightLayout::rows4 ? " rows4" : " rows");
        }
      }
    }
  }
}

// Q16 activations, batched: the AVX-512 VNNI kernel (16 weight rows per vector; rows past the last
// group of 16 and single activation rows go to AVX2) gives the scalar reference's bits, in both
// weight layouts, on groups that start anywhere a task may start them, and for rows long enough to
// be swept in chunks of blocks (1536: three whole chunks; 1600: a short last one).
TEST(QuantKernels, Q16ActivationsAvx512MatchesScalarBitwise) {
  if (!kernels::avx512_vnni_available()) GTEST_SKIP() << "no AVX-512 VNNI on this machine";
  ASSERT_EQ(quant_kernel_isa(), "avx512-vnni");
  for (GgmlType t : {GgmlType::q8_0, GgmlType::q4_0, GgmlType::q4_1}) {
    for (std::int64_t cols : {32, 96, 576, 1536, 1600}) {
      for (std::int64_t rows : {16, 20, 32, 52, 100}) {
        for (std::int64_t batch : {1, 2, 3, 4, 5, 7, 9, 16, 70}) {
          Problem p = make_problem(t, rows, cols, batch, static_cast<std::uint64_t>(rows * 31 + batch + cols));
          std::vector<std::byte> packed(p.w.size());
          auto r4 = repack_rows4(p.wm, packed.data());
          ASSERT_TRUE(r4.is_ok());
          for (const WeightMatrix& wm : {p.wm, *r4}) {
            std::vector<float> ys(static_cast<std::size_t>(rows * batch)), yv(ys.size()), y2(ys.size());
            MatmulOptions scalar, avx2, best;
            scalar.max_isa = MatmulOptions::Isa::scalar;
            avx2.max_isa = MatmulOptions::Isa::avx2;
            scalar.activations = avx2.activations = best.activations = MatmulOptions::Activations::q16;
            ASSERT_TRUE(matmul(wm, p.x.data(), batch, cols, ys.data(), rows, scalar).is_ok());
            ASSERT_TRUE(matmul(wm, p.x.data(), batch, cols, yv.data(), rows, best).is_ok());
            ASSERT_TRUE(matmul(wm, p.x.data(), batch, cols, y2.data(), rows, avx2).is_ok());
            const std::string where = std::string(ggml_type_name(t)) + " rows " + std::to_string(rows) + " cols " +
                                      std::to_string(cols) + " batch " + std::to_string(batch) +
                                      (wm.layout == WeightLayout::rows4 ? " rows4" : " rows");
            ASSERT_EQ(std::memcmp(ys.data(), yv.data(), ys.size() * sizeof(float)), 0) << "avx512 vs scalar, " << where;
            ASSERT_EQ(std::memcmp(ys.data(), y2.data(), ys.size() * sizeof(float)), 0) << "avx2 vs scalar, " << where;
          }
        }
      }
    }
  }
}

TEST(QuantKernels, Avx2MatchesScalar) {
  if (!kernels::avx2_available()) GTEST_SKIP() << "no AVX2 on this machine: only the scalar kernels run";
  for (GgmlType t : kAllTypes) {
    for (std::int64_t cols : {32, 64, 576}) {
      for (std::int64_t rows : {1, 2, 3, 5, 8, 9}) {
        for (std::int64_t batch : {1, 2, 3, 4, 5, 9}) {
          Problem p = make_problem(t, rows, cols, batch, static_cast<std::uint64_t>(rows * 100 + batch));
          std::vector<float> ys(static_cast<std::size_t>(rows * batch)), yv(ys.size());
          MatmulOptions scalar, simd;
          scalar.max_isa = MatmulOptions::Isa::scalar;
          scalar.activations = simd.activations = MatmulOptions::Activations::q8;
          ASSERT_TRUE(matmul(p.wm, p.x.data(), batch, cols, ys.data(), rows, scalar).is_ok());
          ASSERT_TRUE(matmul(p.wm, p.x.data(), batch, cols, yv.data(), rows, simd).is_ok());
          for (std::size_t i = 0; i < ys.size(); ++i) {
            ASSERT_NEAR(ys[i], yv[i], 2e-5 * std::sqrt(static_cast<double>(cols)) * (1 + std::fabs(ys[i])))
                << ggml_type_name(t) << " rows " << rows << " cols " << cols << " batch " << batch << " at " << i;
          }
        }
      }
    }
  }
}

// y agrees with the exact product of the dequantised weights: within f32 rounding (1e-5 of
// sum |w x|) with exact activations (the default), within the bound the activation quantisation
// allows (sum_j |w_j| * max|x_block| / 254 per block) with Q8 activations, and 256x tighter
// (/ 65534) with Q16 activations; both kernel paths.
TEST(QuantKernels, MatmulMatchesExactProduct) {
  for (const auto act :
       {MatmulOptions::Activations::f32, MatmulOptions::Activations::q8, MatmulOptions::Activations::q16}) {
    for (bool force_scalar : {false, true}) {
      for (GgmlType t : kAllTypes) {
        const std::int64_t rows = 37, cols = 32 * 7, batch = 6;
        Problem p = make_problem(t, rows, cols, batch, 99);
        std::vector<float> y(static_cast<std::size_t>(rows * batch));
        MatmulOptions o;
        o.max_isa = force_scalar ? MatmulOptions::Isa::scalar : MatmulOptions::Isa::best;
        o.activations = act;
        ASSERT_TRUE(matmul(p.wm, p.x.data(), batch, cols, y.data(), rows, o).is_ok());
        std::vector<float> wrow(static_cast<std::size_t>(cols));
        for (std::int64_t r = 0; r < rows; ++r) {
          ASSERT_TRUE(dequantize_rows(p.wm, r, 1, wrow.data()).is_ok());
          for (std::int64_t b = 0; b < batch; ++b) {
            const float* x = p.x.data() + b * cols;
            double exact = 0, abs_sum = 0, qbound = 0;
            for (std::int64_t blk = 0; blk < cols / 32; ++blk) {
              double amax = 0, wsum = 0;
              for (int j = 0; j < 32; ++j) {
                const std::int64_t i = blk * 32 + j;
                exact += static_cast<double>(wrow[i]) * x[i];
                abs_sum += std::fabs(static_cast<double>(wrow[i]) * x[i]);
                amax = std::max(amax, static_cast<double>(std::fabs(x[i])));
                wsum += std::fabs(wrow[i]);
              }
              qbound += wsum * amax / 254.0;
            }
            const bool quant = t == GgmlType::q8_0 || t == GgmlType::q4_0 || t == GgmlType::q4_1;
            const bool q8 = quant && act == MatmulOptions::Activations::q8;
            const bool q16 = quant && act == MatmulOptions::Activations::q16;
            const double tol = (q8    ? qbound * 1.01
                                : q16 ? qbound * 254.0 / 65534.0 * 1.01
                                      : 0.0) +
                               1e-5 * abs_sum + 1e-6;
            ASSERT_NEAR(y[static_cast<std::size_t>(b * rows + r)], exact, tol)
                << ggml_type_name(t) << (force_scalar ? " scalar" : "")
                << (q8    ? " q8"
                    : q16 ? " q16"
                          : " f32")
                << " row " << r << " batch " << b;
          }
        }
      }
    }
  }
}

// Results do not depend on the batch size, the batch row's position, the thread count or ld.
TEST(QuantKernels, MatmulIsDeterministic) {
  for (const auto act :
       {MatmulOptions::Activations::f32, MatmulOptions::Activations::q8, MatmulOptions::Activations::q16}) {
    for (GgmlType t : kAllTypes) {
      const std::int64_t rows = 150, cols = 96, batch = 70;
      Problem p = make_problem(t, rows, cols, batch, 5);
      std::vector<float> all(static_cast<std::size_t>(rows * batch)), one_thread(all.size());
      MatmulOptions o;
      o.activations = act;
      ASSERT_TRUE(matmul(p.wm, p.x.data(), batch, cols, all.data(), rows, o).is_ok());
      MatmulOptions o1 = o;
      o1.max_threads = 1;
      ASSERT_TRUE(matmul(p.wm, p.x.data(), batch, cols, one_thread.data(), rows, o1).is_ok());
      EXPECT_EQ(std::memcmp(all.data(), one_thread.data(), all.size() * sizeof(float)), 0) << ggml_type_name(t);
      for (std::int64_t b : {0, 3, 63, 64, 69}) {
        std::vector<float> y(static_cast<std::size_t>(rows + 5), -1.0f);
        ASSERT_TRUE(matmul(p.wm, p.x.data() + b * cols, 1, cols, y.data(), rows + 5, o).is_ok());
        EXPECT_EQ(std::memcmp(y.data(), all.data() + b * rows, static_cast<std::size_t>(rows) * sizeof(float)), 0)
            << ggml_type_name(t) << " batch row " << b;
        EXPECT_EQ(y[static_cast<std::size_t>(rows)], -1.0f);  // ldy padding untouched
      }
    }
  }
}

// Exact activations: the AVX2 kernels (fused for small batches, dequantised tile + micro-kernel for
// larger ones) agree with the scalar reference bit for bit, for every quantised type and odd shapes,
// and every output is independent of the batch size, its batch position and the thread count.
TEST(QuantKernels, ExactActivationsAreBitwiseReproducible) {
  const GgmlType kQuant[] = {GgmlType::q8_0, GgmlType::q4_0, GgmlType::q4_1};
  for (GgmlType t : kQuant) {
    for (std::int64_t cols : {32, 96, 576, 1536}) {
      for (std::int64_t rows : {1, 3, 5, 7, 13, 27, 70}) {
        const std::int64_t batch = 70;
        Problem p = make_problem(t, rows, cols, batch, static_cast<std::uint64_t>(rows * 7 + cols));
        const std::size_t n = static_cast<std::size_t>(rows * batch);
        std::vector<float> ref(n), two(n), one(n);
        MatmulOptions scalar;
        scalar.max_isa = MatmulOptions::Isa::scalar;
        ASSERT_TRUE(matmul(p.wm, p.x.data(), batch, cols, ref.data(), rows, scalar).is_ok());
        MatmulOptions o2;
        o2.max_threads = 2;
        ASSERT_TRUE(matmul(p.wm, p.x.data(), batch, cols, two.data(), rows, o2).is_ok());
        MatmulOptions o1;
        o1.max_threads = 1;
        ASSERT_TRUE(matmul(p.wm, p.x.data(), batch, cols, one.data(), rows, o1).is_ok());
        const std::string what =
            std::string(ggml_type_name(t)) + " rows " + std::to_string(rows) + " cols " + std::to_string(cols);
        ASSERT_EQ(std::memcmp(ref.data(), two.data(), n * sizeof(float)), 0) << what << " avx2 vs scalar";
        ASSERT_EQ(std::memcmp(one.data(), two.data(), n * sizeof(float)), 0) << what << " 1 vs 2 threads";
        // Every sub-batch [b0, b0 + nb) for nb = 1 .. 70 (offsets vary with nb) gives the same rows.
        for (std::int64_t nb = 1; nb <= batch; ++nb) {
          const std::int64_t b0 = (nb * 13) % (batch - nb + 1);
          std::vector<float> y(static_cast<std::size_t>((rows + 3) * nb), -1.0f);
          ASSERT_TRUE(matmul(p.wm, p.x.data() + b0 * cols, nb, cols, y.data(), rows + 3).is_ok());
          for (std::int64_t b = 0; b < nb; ++b) {
            ASSERT_EQ(std::memcmp(y.data() + b * (rows + 3), two.data() + (b0 + b) * rows,
                                  static_cast<std::size_t>(rows) * sizeof(float)),
                      0)
                << what << " sub-batch " << b0 << "+" << nb << " row " << b;
            ASSERT_EQ(y[static_cast<std::size_t>(b * (rows + 3) + rows)], -1.0f);
          }
        }
      }
    }
  }
}

// The exact-activation bound on a larger, model-like shape: |y - exact| <= 1e-5 * sum |w x|.
TEST(QuantKernels, ExactActivationsErrorIsF32Rounding) {
  for (GgmlType t : {GgmlType::q8_0, GgmlType::q4_0, GgmlType::q4_1}) {
    const std::int64_t rows = 45, cols = 1536, batch = 67;
    Problem p = make_problem(t, rows, cols, batch, 17);
    std::vector<float> y(static_cast<std::size_t>(rows * batch));
    ASSERT_TRUE(matmul(p.wm, p.x.data(), batch, cols, y.data(), rows).is_ok());
    std::vector<float> wrow(static_cast<std::size_t>(cols));
    double worst = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      ASSERT_TRUE(dequantize_rows(p.wm, r, 1, wrow.data()).is_ok());
      for (std::int64_t b = 0; b < batch; ++b) {
        const float* x = p.x.data() + b * cols;
        double exact = 0, abs_sum = 0;
        for (std::int64_t i = 0; i < cols; ++i) {
          exact += static_cast<double>(wrow[static_cast<std::size_t>(i)]) * x[i];
          abs_sum += std::fabs(static_cast<double>(wrow[static_cast<std::size_t>(i)]) * x[i]);
        }
        const double err = std::fabs(y[static_cast<std::size_t>(b * rows + r)] - exact);
        worst = std::max(worst, err / abs_sum);
        ASSERT_LE(err, 1e-5 * abs_sum) << ggml_type_name(t) << " row " << r << " batch " << b;
      }
    }
    EXPECT_LT(worst, 1e-6) << ggml_type_name(t);
  }
}

// Repacking (rows4) only reorders bytes: every kernel path (AVX2/scalar, decode/prefill tiles,
// exact/Q8 activations) gives the same bits as with ggml's layout, and rows read back unchanged.
TEST(QuantKernels, RepackedRows4IsBitwiseIdentical) {
  for (GgmlType t : {GgmlType::q8_0, GgmlType::q4_0, GgmlType::q4_1}) {
    for (std::int64_t rows : {4, 8, 12, 36, 100}) {
      for (std::int64_t cols : {32, 96, 576}) {
        Problem p = make_problem(t, rows, cols, 9, static_cast<std::uint64_t>(rows * 3 + cols));
        ASSERT_TRUE(can_repack_rows4(p.wm));
        std::vector<std::byte> packed(p.w.size());
        auto r4 = repack_rows4(p.wm, packed.data());
        ASSERT_TRUE(r4.is_ok());
        ASSERT_EQ(r4->layout, WeightLayout::rows4);
        const std::string what =
            std::string(ggml_type_name(t)) + " rows " + std::to_string(rows) + " cols " + std::to_string(cols);
        std::vector<float> a(static_cast<std::size_t>(rows * cols)), b(a.size());
        ASSERT_TRUE(dequantize_rows(p.wm, 0, rows, a.data()).is_ok());
        ASSERT_TRUE(dequantize_rows(*r4, 0, rows, b.data()).is_ok());
        ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << what << " dequantize_rows";
        for (const auto act :
             {MatmulOptions::Activations::f32, MatmulOptions::Activations::q8, MatmulOptions::Activations::q16}) {
          for (bool force_scalar : {false, true}) {
            for (std::int64_t batch : {1, 2, 3, 9}) {
              MatmulOptions o;
              o.activations = act;
              o.max_isa = force_scalar ? MatmulOptions::Isa::scalar : MatmulOptions::Isa::best;
              const std::size_t n = static_cast<std::size_t>(rows * batch);
              std::vector<float> ya(n), yb(n);
              ASSERT_TRUE(matmul(p.wm, p.x.data(), batch, cols, ya.data(), rows, o).is_ok());
              ASSERT_TRUE(matmul(*r4, p.x.data(), batch, cols, yb.data(), rows, o).is_ok());
              ASSERT_EQ(std::memcmp(ya.data(), yb.data(), n * sizeof(float)), 0)
                  << what << " batch " << batch << (force_scalar ? " scalar" : " simd")
                  << (act == MatmulOptions::Activations::q8    ? " q8"
                      : act == MatmulOptions::Activations::q16 ? " q16"
                                                               : " f32");
            }
          }
        }
      }
    }
  }
}

TEST(QuantKernels, RepackRejectsWhatItCannotPack) {
  Problem p = make_problem(GgmlType::q4_1, 6, 64, 1, 1);  // 6 rows: not a multiple of 4
  std::vector<std::byte> dst(p.w.size());
  EXPECT_FALSE(can_repack_rows4(p.wm));
  EXPECT_EQ(repack_rows4(p.wm, dst.data()).status().code(), ErrorCode::invalid_argument);
  Problem f = make_problem(GgmlType::f16, 4, 64, 1, 1);
  EXPECT_FALSE(can_repack_rows4(f.wm));
  // A matrix claiming the rows4 layout with a row count it cannot have is refused by matmul.
  WeightMatrix bad = p.wm;
  bad.layout = WeightLayout::rows4;
  std::vector<float> y(6);
  EXPECT_EQ(matmul(bad, p.x.data(), 1, 64, y.data(), 6).code(), ErrorCode::invalid_argument);
  // RepackedWeights repacks what it can and leaves the rest.
  Problem q = make_problem(GgmlType::q8_0, 8, 64, 1, 2);
  WeightMatrix a = q.wm, c = p.wm;
  RepackedWeights store;
  ASSERT_TRUE(store.repack({&a, &c}).is_ok());
  if (store.bytes() != 0) {  // KALLPA_REPACK=0 turns repacking off
    EXPECT_EQ(a.layout, WeightLayout::rows4);
    EXPECT_EQ(store.bytes(), q.w.size());
  }
  EXPECT_EQ(c.layout, WeightLayout::rows);
  EXPECT_EQ(c.data, p.wm.data);
}

// RepackedWeights copies a large matrix in slices of whole 4-row groups and hands each slice's
// original to `copied` as soon as it is written (the model drops the file's pages then): the
// slices cover every row once, in order, and the bytes equal one repack of the whole matrix.
TEST(QuantKernels, RepackedWeightsHandsBackEachRowOnce) {
  Problem big = make_problem(GgmlType::q4_1, 4 * 1000, 576, 1, 7);  // 1.4 MiB: more than one slice
  Problem small = make_problem(GgmlType::q8_0, 8, 64, 1, 8);
  WeightMatrix a = big.wm, b = small.wm;
  std::vector<std::pair<const void*, std::int64_t>> handed;  // (data, rows) of each slice, in order
  RepackedWeights store;
  ASSERT_TRUE(store.repack({&a, &b}, [&](const WeightMatrix& w) { handed.emplace_back(w.data, w.rows); }).is_ok());
  if (store.bytes() == 0) GTEST_SKIP() << "KALLPA_REPACK=0 turns repacking off";
  std::vector<std::byte> whole(big.w.size());
  ASSERT_TRUE(repack_rows4(big.wm, whole.data()).is_ok());
  ASSERT_EQ(a.layout, WeightLayout::rows4);
  EXPECT_EQ(std::memcmp(a.data, whole.data(), whole.size()), 0);
  ASSERT_GT(handed.size(), 2u);  // the big matrix in several slices, the small one in one
  const auto* next = static_cast<const std::byte*>(big.wm.data);
  std::int64_t rows = 0;
  for (std::size_t i = 0; i + 1 < handed.size(); ++i) {
    EXPECT_EQ(handed[i].first, next) << "slice " << i;
    EXPECT_EQ(handed[i].second % 4, 0) << "slice " << i;
    next += static_cast<std::size_t>(handed[i].second) * big.wm.row_bytes;
    rows += handed[i].second;
  }
  EXPECT_EQ(rows, big.wm.rows);
  EXPECT_EQ(handed.back().first, small.wm.data);
  EXPECT_EQ(handed.back().second, small.wm.rows);
}

TEST(QuantKernels, MatmulRejectsBadArguments) {
  Problem p = make_problem(GgmlType::q4_1, 4, 64, 1, 1);
  std::vector<float> y(4);
  EXPECT_EQ(matmul(p.wm, p.x.data(), 1, 32, y.data(), 4).code(), ErrorCode::invalid_argument);  // ldx < cols
  EXPECT_EQ(matmul(p.wm, p.x.data(), 1, 64, y.data(), 3).code(), ErrorCode::invalid_argument);  // ldy < rows
  WeightMatrix bad = p.wm;
  bad.type = GgmlType::iq2_xxs;
  EXPECT_EQ(matmul(bad, p.x.data(), 1, 64, y.data(), 4).code(), ErrorCode::unsupported);
  bad = p.wm;
  bad.row_bytes = 41;
  EXPECT_EQ(matmul(bad, p.x.data(), 1, 64, y.data(), 4).code(), ErrorCode::invalid_argument);
  EXPECT_TRUE(matmul(p.wm, p.x.data(), 0, 64, y.data(), 4).is_ok());
  EXPECT_TRUE(quant_kernel_isa() == "avx512-vnni" || quant_kernel_isa() == "avx2" || quant_kernel_isa() == "scalar");
  EXPECT_EQ(dequantize_rows(p.wm, 3, 2, y.data()).code(), ErrorCode::invalid_argument);
}

}  // namespace

// A group of matrices sharing x gives each matrix exactly what matmul() gives it alone, for every
// activation scheme and for decode-sized and prefill-sized batches; mixed widths are refused.
TEST(QuantKernels, MatmulGroupEqualsSeparateProducts) {
  for (const auto act :
       {MatmulOptions::Activations::f32, MatmulOptions::Activations::q8, MatmulOptions::Activations::q16}) {
    for (std::int64_t batch : {1, 3, 70}) {
      Problem a = make_problem(GgmlType::q4_1, 36, 96, batch, 11);
      Problem b = make_problem(GgmlType::q8_0, 12, 96, batch, 12);
      Problem c = make_problem(GgmlType::f16, 5, 96, batch, 13);
      MatmulOptions o;
      o.activations = act;
      std::vector<float> ya(static_cast<std::size_t>(36 * batch)), yb(static_cast<std::size_t>(12 * batch)),
          yc(static_cast<std::size_t>(5 * batch));
      const MatmulJob jobs[] = {{&a.wm, ya.data(), 36}, {&b.wm, yb.data(), 12}, {&c.wm, yc.data(), 5}};
      ASSERT_TRUE(matmul_group(jobs, a.x.data(), batch, 96, o).is_ok());
      for (const auto& [job, y] : {std::pair{jobs[0], &ya}, std::pair{jobs[1], &yb}, std::pair{jobs[2], &yc}}) {
        std::vector<float> alone(y->size());
        ASSERT_TRUE(matmul(*job.w, a.x.data(), batch, 96, alone.data(), job.w->rows, o).is_ok());
        EXPECT_EQ(std::memcmp(alone.data(), y->data(), alone.size() * sizeof(float)), 0)
            << ggml_type_name(job.w->type) << " batch " << batch;
      }
    }
  }
  Problem wide = make_problem(GgmlType::q4_1, 4, 128, 1, 14);
  Problem narrow = make_problem(GgmlType::q4_1, 4, 96, 1, 15);
  std::vector<float> y1(4), y2(4);
  const MatmulJob mixed[] = {{&wide.wm, y1.data(), 4}, {&narrow.wm, y2.data(), 4}};
  EXPECT_EQ(matmul_group(mixed, wide.x.data(), 1, 128).code(), ErrorCode::invalid_argument);
}
