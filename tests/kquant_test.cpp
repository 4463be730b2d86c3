// The block types computed through dequantisation (Q5_0, Q5_1, IQ4_NL, Q2_K .. Q6_K, Q8_K): blocks
// worked out by hand, the AVX2 dequantisers and products against the scalar reference bit for bit,
// matmul's determinism (thread count, batch position) and error bound, and the block-scale check;
// for the types with Q16 integer kernels (ops/q16_units.h) their integer view of each block, the
// q16 bound, and AVX2 against scalar bit for bit up to the largest integer sums.
// gguf-py's dequantiser is compared bit for bit in tools/gguf/crosscheck.py (ctest
// gguf_crosscheck_gguf_py).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kallpa/half.h"
#include "kallpa/ops/quant.h"
#include "ops/q16_units.h"
#include "ops/quant_kernels.h"
#include "ops/quant_types.h"
#include "ops/repack.h"

namespace {

using namespace kallpa::ops;
using kallpa::ErrorCode;

const GgmlType kBlockTypes[] = {GgmlType::q5_0, GgmlType::q5_1, GgmlType::iq4_nl, GgmlType::q2_k, GgmlType::q3_k,
                                GgmlType::q4_k, GgmlType::q5_k, GgmlType::q6_k,   GgmlType::q8_k};

// Where each type keeps its f16 scales (ggml's layouts); Q8_K's d is an f32 at 0.
std::vector<std::size_t> f16_scale_offsets(GgmlType t) {
  switch (t) {
    case GgmlType::q5_0:
    case GgmlType::iq4_nl: return {0};
    case GgmlType::q5_1:
    case GgmlType::q4_k:
    case GgmlType::q5_k: return {0, 2};
    case GgmlType::q2_k: return {80, 82};
    case GgmlType::q3_k: return {108};
    case GgmlType::q6_k: return {208};
    default: return {};
  }
}

void put_f16(std::vector<std::uint8_t>& b, std::size_t at, float v) {
  const std::uint16_t h = kallpa::f32_to_f16(v);
  std::memcpy(b.data() + at, &h, 2);
}

// rows x cols of type t: random bytes, scales finite in +-[1e-3, 5e-2] (Q8_K: an f32 d).
std::vector<std::uint8_t> random_matrix(GgmlType t, std::int64_t rows, std::int64_t cols, unsigned seed) {
  const auto traits = *ggml_type_traits(static_cast<std::uint32_t>(t));
  const std::int64_t blocks = rows * cols / traits.block_size;
  std::vector<std::uint8_t> b(static_cast<std::size_t>(blocks * traits.type_size));
  std::mt19937 rng(seed);
  for (auto& v : b) v = static_cast<std::uint8_t>(rng());
  std::uniform_real_distribution<float> mag(1e-3f, 5e-2f);
  for (std::int64_t i = 0; i < blocks; ++i) {
    const std::size_t base = static_cast<std::size_t>(i * traits.type_size);
    for (std::size_t at : f16_scale_offsets(t)) put_f16(b, base + at, (rng() & 1) ? mag(rng) : -mag(rng));
    if (t == GgmlType::q8_k) {
      const float d = mag(rng);
      std::memcpy(b.data() + base, &d, 4);
    }
  }
  return b;
}

std::vector<float> dequant(GgmlType t, const std::vector<std::uint8_t>& b, std::int64_t n) {
  std::vector<float> out(static_cast<std::size_t>(n));
  EXPECT_TRUE(dequantize_row(t, b.data(), out.data(), n).is_ok());
  return out;
}

TEST(KQuantDequant, HandWorkedBlocks) {
  {  // Q5_0: d 0.5; element j = (nibble | bit j of qh << 4) - 16
    std::vector<std::uint8_t> b(22, 0);
    put_f16(b, 0, 0.5f);
    const std::uint32_t qh = 0x80000001u;  // elements 0 and 31 get the fifth bit
    std::memcpy(b.data() + 2, &qh, 4);
    b[6 + 0] = 0x3a;   // element 0: 10, element 16: 3
    b[6 + 15] = 0xf0;  // element 15: 0, element 31: 15
    const auto v = dequant(GgmlType::q5_0, b, 32);
    EXPECT_EQ(v[0], 5.0f);    // (10 + 16 - 16) * 0.5
    EXPECT_EQ(v[16], -6.5f);  // (3 - 16) * 0.5
    EXPECT_EQ(v[15], -8.0f);  // (0 - 16) * 0.5
    EXPECT_EQ(v[31], 7.5f);   // (15 + 16 - 16) * 0.5
    EXPECT_EQ(v[7], -8.0f);
  }
  {  // Q5_1: d 0.5, m -1; element = q * d + m
    std::vector<std::uint8_t> b(24, 0);
    put_f16(b, 0, 0.5f);
    put_f16(b, 2, -1.0f);
    const std::uint32_t qh = 0x80000001u;
    std::memcpy(b.data() + 4, &qh, 4);
    b[8 + 0] = 0x3a;
    b[8 + 15] = 0xf0;
    const auto v = dequant(GgmlType::q5_1, b, 32);
    EXPECT_EQ(v[0], 12.0f);   // 26 * 0.5 - 1
    EXPECT_EQ(v[16], 0.5f);   // 3 * 0.5 - 1
    EXPECT_EQ(v[15], -1.0f);  // 0 * 0.5 - 1
    EXPECT_EQ(v[31], 14.5f);  // 31 * 0.5 - 1
  }
  {  // IQ4_NL: d 0.5; the nibble picks one of 16 levels
    std::vector<std::uint8_t> b(18, 0);
    put_f16(b, 0, 0.5f);
    b[2 + 0] = 0xf0;  // element 0: level 0 (-127), element 16: level 15 (113)
    b[2 + 1] = 0x88;  // elements 1 and 17: level 8 (1)
    const auto v = dequant(GgmlType::iq4_nl, b, 32);
    EXPECT_EQ(v[0], -63.5f);
    EXPECT_EQ(v[16], 56.5f);
    EXPECT_EQ(v[1], 0.5f);
    EXPECT_EQ(v[17], 0.5f);
    EXPECT_EQ(v[2], -63.5f);
  }
  {  // Q2_K: d 1, dmin 0.5; scales[e/16]: low nibble scale, high nibble min; 2-bit q
    std::vector<std::uint8_t> b(84, 0);
    put_f16(b, 80, 1.0f);
    put_f16(b, 82, 0.5f);
    b[0] = 0x21;        // sub-block 0: scale 1, min 2
    b[2] = 0x01;        // sub-block 2 (elements 32..47): scale 1, min 0
    b[15] = 0xf3;       // sub-block 15: scale 3, min 15
    b[16 + 0] = 0xe4;   // byte 0: element 0 -> 0, 32 -> 1, 64 -> 2, 96 -> 3
    b[16 + 63] = 0xc0;  // byte 63 (second half, i = 31): element 255 -> 3
    const auto v = dequant(GgmlType::q2_k, b, 256);
    EXPECT_EQ(v[0], -1.0f);   // 1 * 1 * 0 - 0.5 * 2
    EXPECT_EQ(v[32], 1.0f);   // 1 * 1 * 1 - 0
    EXPECT_EQ(v[255], 1.5f);  // 1 * 3 * 3 - 0.5 * 15
    EXPECT_EQ(v[1], -1.0f);
  }
  {  // Q3_K: d 1; 6-bit scales - 32; q = 2 bits - 4 unless the hmask bit is set
    std::vector<std::uint8_t> b(110, 0);
    put_f16(b, 108, 1.0f);
    b[96 + 0] = 0x05;   // scale 0: low 4 bits 5
    b[96 + 8] = 0x02;   // scale 0: high 2 bits 2 -> 37 - 32 = 5
    b[96 + 7] = 0xa0;   // scale 15: low 4 bits 10
    b[96 + 11] = 0x40;  // scale 15: high 2 bits 1 -> 26 - 32 = -6
    b[32 + 0] = 0x03;   // element 0: 3
    b[0] = 0x01;        // hmask: element 0 keeps its 3
    b[32 + 63] = 0x40;  // element 255: 1, hmask bit clear -> 1 - 4 = -3
    const auto v = dequant(GgmlType::q3_k, b, 256);
    EXPECT_EQ(v[0], 15.0f);    // 5 * 3
    EXPECT_EQ(v[1], -20.0f);   // 5 * (0 - 4)
    EXPECT_EQ(v[255], 18.0f);  // -6 * -3
  }
  {  // Q4_K: d 1, dmin 0.5; sub-block c of 32: scale and min of 6 bits
    std::vector<std::uint8_t> b(144, 0);
    put_f16(b, 0, 1.0f);
    put_f16(b, 2, 0.5f);
    b[4 + 0] = 3;        // scale 0
    b[4 + 4] = 2;        // min 0
    b[4 + 1] = 1;        // scale 1 (min 1 = 0)
    b[4 + 11] = 0x21;    // sub-block 7: scale low 4 bits 1, min low 4 bits 2
    b[4 + 3] = 0x40;     // scale 7 high bits 01 -> 17
    b[4 + 7] = 0x80;     // min 7 high bits 10 -> 34
    b[16 + 0] = 0x5a;    // element 0: 10 (sub-block 0), element 32: 5 (sub-block 1)
    b[16 + 127] = 0xf0;  // element 255: 15 (sub-block 7, high nibble)
    const auto v = dequant(GgmlType::q4_k, b, 256);
    EXPECT_EQ(v[0], 29.0f);     // 3 * 10 - 0.5 * 2
    EXPECT_EQ(v[32], 5.0f);     // 1 * 5 - 0
    EXPECT_EQ(v[255], 238.0f);  // 17 * 15 - 0.5 * 34
    EXPECT_EQ(v[1], -1.0f);     // 3 * 0 - 0.5 * 2
  }
  {  // Q5_K: Q4_K's with a fifth bit per element from qh
    std::vector<std::uint8_t> b(176, 0);
    put_f16(b, 0, 1.0f);
    put_f16(b, 2, 0.5f);
    b[4 + 0] = 3;
    b[4 + 4] = 2;
    b[4 + 11] = 0x21;
    b[4 + 3] = 0x40;
    b[4 + 7] = 0x80;
    b[16 + 0] = 0x01;   // qh[0] bit 0: element 0's fifth bit
    b[16 + 31] = 0x80;  // qh[31] bit 7: element 255's
    b[48 + 0] = 0x5a;
    b[48 + 127] = 0xf0;
    const auto v = dequant(GgmlType::q5_k, b, 256);
    EXPECT_EQ(v[0], 77.0f);     // 3 * 26 - 1
    EXPECT_EQ(v[255], 510.0f);  // 17 * 31 - 17
    EXPECT_EQ(v[1], -1.0f);
  }
  {  // Q6_K: d 0.5, int8 scales per 16; q = 4 low bits | 2 high bits << 4, minus 32
    std::vector<std::uint8_t> b(210, 0);
    put_f16(b, 208, 0.5f);
    b[192 + 0] = static_cast<std::uint8_t>(-2);
    b[192 + 15] = 3;
    b[0] = 0x07;         // element 0 low bits 7
    b[128 + 0] = 0x02;   // element 0 high bits 2 -> 39 - 32 = 7
    b[127] = 0xf0;       // element 255 (h 1, r 127): ql[127] high nibble 15
    b[128 + 63] = 0xc0;  // qh[63] bits 6-7: 3 -> 63 - 32 = 31
    const auto v = dequant(GgmlType::q6_k, b, 256);
    EXPECT_EQ(v[0], -7.0f);    // 0.5 * -2 * 7
    EXPECT_EQ(v[255], 46.5f);  // 0.5 * 3 * 31
    EXPECT_EQ(v[1], 32.0f);    // 0.5 * -2 * -32
  }
  {  // Q8_K: f32 d, 256 int8
    std::vector<std::uint8_t> b(292, 0);
    const float d = 0.25f;
    std::memcpy(b.data(), &d, 4);
    b[4 + 0] = 0x80;  // -128
    b[4 + 255] = 127;
    const auto v = dequant(GgmlType::q8_k, b, 256);
    EXPECT_EQ(v[0], -32.0f);
    EXPECT_EQ(v[255], 31.75f);
    EXPECT_EQ(v[1], 0.0f);
  }
}

TEST(KQuantDequant, DispatchedEqualsScalarReferenceBitwise) {
  for (GgmlType t : kBlockTypes) {
    const std::int64_t n = 4 * 256;
    const auto b = random_matrix(t, 1, n, 7);
    const auto got = dequant(t, b, n);
    std::vector<float> want(static_cast<std::size_t>(n));
    kernels::dequantize_row_scalar(t, b.data(), want.data(), n);
    EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0) << ggml_type_name(t);
    for (float v : got) ASSERT_TRUE(std::isfinite(v)) << ggml_type_name(t);
  }
}

TEST(KQuantDequant, RejectsPartialBlocksAndQuantisation) {
  std::vector<std::uint8_t> b(292, 0);
  float out[256];
  EXPECT_EQ(dequantize_row(GgmlType::q4_k, b.data(), out, 128).code(), ErrorCode::invalid_argument);
  EXPECT_EQ(quantize_row(GgmlType::q4_k, out, b.data(), 256).code(), ErrorCode::unsupported);
  EXPECT_EQ(dequantize_row(GgmlType::iq2_xxs, b.data(), out, 256).code(), ErrorCode::unsupported);
}

TEST(KQuantDequant, NonFiniteScalesAreRejected) {
  for (GgmlType t : kBlockTypes) {
    const auto traits = *ggml_type_traits(static_cast<std::uint32_t>(t));
    auto b = random_matrix(t, 2, 512, 3);
    EXPECT_TRUE(check_block_scales(t, b.data(), b.size()).is_ok()) << ggml_type_name(t);
    std::vector<std::size_t> fields = f16_scale_offsets(t);
    if (t == GgmlType::q8_k) fields = {0};
    for (std::size_t at : fields) {
      auto bad = b;
      const std::size_t block = 2;
      const std::size_t pos = block * static_cast<std::size_t>(traits.type_size) + at;
      if (t == GgmlType::q8_k) {
        const float nan = std::nanf("");
        std::memcpy(bad.data() + pos, &nan, 4);
      } else {
        const std::uint16_t inf = 0x7c00;
        std::memcpy(bad.data() + pos, &inf, 2);
      }
      const auto st = check_block_scales(t, bad.data(), bad.size());
      EXPECT_EQ(st.code(), ErrorCode::invalid_argument) << ggml_type_name(t) << " @" << at;
      EXPECT_NE(st.message().find("block 2"), std::string::npos) << st.message();
    }
    EXPECT_EQ(check_block_scales(t, b.data(), b.size() - 1).code(), ErrorCode::invalid_argument);
  }
}

// Products: every ISA and tile gives the scalar reference's bits; each output is the same whatever
// batch position or thread count; and the f32 error bound of quant.h holds against a double product.
TEST(KQuantMatmul, AgreesWithScalarAcrossBatchesAndThreads) {
  const std::int64_t rows = 37, cols = 512;  // rows not a multiple of 4: the single-row tail too
  for (GgmlType t : kBlockTypes) {
    const auto wb = random_matrix(t, rows, cols, 11);
    WeightMatrix w{t, wb.data(), rows, cols, row_size(t, cols), WeightLayout::rows};
    const auto wf = dequant(t, wb, rows * cols);
    std::mt19937 rng(5);
    std::uniform_real_distribution<float> u(-2.0f, 2.0f);
    const std::int64_t max_batch = 7;
    std::vector<float> x(static_cast<std::size_t>(max_batch * cols));
    for (auto& v : x) v = u(rng);
    std::vector<float> ref(static_cast<std::size_t>(max_batch * rows));
    MatmulOptions scalar;
    scalar.max_isa = MatmulOptions::Isa::scalar;
    ASSERT_TRUE(matmul(w, x.data(), max_batch, cols, ref.data(), rows, scalar).is_ok());
    for (std::int64_t b = 0; b < max_batch; ++b) {
      for (std::int64_t r = 0; r < rows; ++r) {
        double exact = 0.0, absdot = 0.0;
        for (std::int64_t j = 0; j < cols; ++j) {
          const double p = static_cast<double>(wf[static_cast<std::size_t>(r * cols + j)]) *
                           x[static_cast<std::size_t>(b * cols + j)];
          exact += p;
          absdot += std::fabs(p);
        }
        ASSERT_LE(std::fabs(ref[static_cast<std::size_t>(b * rows + r)] - exact), 1e-5 * absdot + 1e-6)
            << ggml_type_name(t) << " row " << r << " batch " << b;
      }
    }
    // Q16 activations: the integer kernels' own scalar reference (the types without one take the
    // f32 path whatever the option says).
    std::vector<float> ref16 = ref;
    const bool integer = kernels::has_q16_unit_kernel(t);
    if (integer) {
      scalar.activations = MatmulOptions::Activations::q16;
      ASSERT_TRUE(matmul(w, x.data(), max_batch, cols, ref16.data(), rows, scalar).is_ok());
      EXPECT_NE(ref16, ref) << ggml_type_name(t) << ": q16 activations must take the integer kernel";
    }
    for (std::int64_t batch : {1, 2, 3, 7}) {
      for (int threads : {1, 0}) {
        for (auto act : {MatmulOptions::Activations::f32, MatmulOptions::Activations::q16}) {
          MatmulOptions o;
          o.max_threads = threads;
          o.activations = act;
          const std::vector<float>& want = act == MatmulOptions::Activations::q16 ? ref16 : ref;
          // Batch rows from position 7 - batch on: each must equal the same row of the batch of 7.
          const std::int64_t first = max_batch - batch;
          std::vector<float> y(static_cast<std::size_t>(batch * rows));
          ASSERT_TRUE(matmul(w, x.data() + first * cols, batch, cols, y.data(), rows, o).is_ok());
          EXPECT_EQ(std::memcmp(y.data(), want.data() + first * rows, y.size() * sizeof(float)), 0)
              << ggml_type_name(t) << " batch " << batch << " threads " << threads << " q16 "
              << (act == MatmulOptions::Activations::q16);
        }
      }
    }
  }
}

const GgmlType kQ16UnitTypes[] = {GgmlType::q5_0, GgmlType::q5_1, GgmlType::iq4_nl,
                                  GgmlType::q4_k, GgmlType::q5_k, GgmlType::q6_k};

// Every block's integer view (ops/q16_units.h: wq * d_c + m_c) gives the dequantised values, to
// one f32 rounding: the integer kernels compute with the same weights as the f32 path.
TEST(KQuantQ16, UnitViewIsTheDequantisedBlock) {
  for (GgmlType t : kQ16UnitTypes) {
    const std::int64_t cols = 512;
    const auto wb = random_matrix(t, 3, cols, 21);
    const auto wf = dequant(t, wb, 3 * cols);
    const kernels::Q16Unit g = kernels::q16_unit(t);
    const auto* base = reinterpret_cast<const std::byte*>(wb.data());
    for (std::int64_t b = 0; b < 3 * cols / kQK; ++b) {
      const std::byte* unit = base + static_cast<std::size_t>(b / g.blocks) * g.bytes;
      const int c = static_cast<int>(b % g.blocks);
      float d[kernels::kMaxUnitBlocks] = {}, m[kernels::kMaxUnitBlocks] = {};
      kernels::q16_unit_scales(t, unit, d, m);
      std::int32_t wq[kQK];
      kernels::q16_unit_quants_scalar(t, unit, c, wq);
      for (int j = 0; j < kQK; ++j) {
        const double v = static_cast<double>(wq[j]) * d[c] + (g.has_m ? m[c] : 0.0f);
        const double want = wf[static_cast<std::size_t>(b * kQK + j)];
        ASSERT_LE(std::fabs(v - want), std::ldexp(std::fabs(want), -23) + 1e-30)
            << ggml_type_name(t) << " block " << b << " element " << j;
      }
    }
  }
}

// Q16 activations against the exact product: within quant.h's q16 bound (each activation off by at
// most max|x_block| / 65534) plus f32 rounding.
TEST(KQuantQ16, WithinTheActivationBound) {
  const std::int64_t rows = 20, cols = 768;
  for (GgmlType t : kQ16UnitTypes) {
    const auto wb = random_matrix(t, rows, cols, 31);
    WeightMatrix w{t, wb.data(), rows, cols, row_size(t, cols), WeightLayout::rows};
    const auto wf = dequant(t, wb, rows * cols);
    std::vector<float> x(static_cast<std::size_t>(cols));
    std::mt19937 rng(8);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (auto& v : x) v = nd(rng);
    MatmulOptions o;
    o.activations = MatmulOptions::Activations::q16;
    std::vector<float> y(static_cast<std::size_t>(rows));
    ASSERT_TRUE(matmul(w, x.data(), 1, cols, y.data(), rows, o).is_ok());
    for (std::int64_t r = 0; r < rows; ++r) {
      double exact = 0.0, absdot = 0.0, bound = 0.0;
      for (std::int64_t b = 0; b < cols / kQK; ++b) {
        double xmax = 0.0, wabs = 0.0;
        for (std::int64_t j = b * kQK; j < (b + 1) * kQK; ++j) {
          const double wv = wf[static_cast<std::size_t>(r * cols + j)];
          exact += wv * x[static_cast<std::size_t>(j)];
          absdot += std::fabs(wv * x[static_cast<std::size_t>(j)]);
          xmax = std::max(xmax, static_cast<double>(std::fabs(x[static_cast<std::size_t>(j)])));
          wabs += std::fabs(wv);
        }
        bound += wabs * xmax / 65534.0;
      }
      EXPECT_LE(std::fabs(y[static_cast<std::size_t>(r)] - exact), bound + 1e-5 * absdot + 1e-6)
          << ggml_type_name(t) << " row " << r;
    }
  }
}

// The AVX2 and AVX-512 kernels against the scalar reference, called directly: batches past the kernel's sweep of
// 64 activation rows, row tails of 1..3, AVX-512's 16-row lanes groups (from kQ16UnitsLanesMinBatch
// activation rows: one and two groups, with and without a tail, rows whole and in chunks of
// blocks), and the largest integer halves (Q6_K's folded |wq| = 4096 against |x_q| = 32767 in every
// element: 16 * 4096 * 32767, just under 2^31).
TEST(KQuantQ16, SimdKernelsEqualScalarBitwise) {
  if (!kernels::avx2_available()) GTEST_SKIP() << "no AVX2 on this machine";
  for (std::int64_t cols : {512, 1024})
    for (GgmlType t : kQ16UnitTypes) {
      for (std::int64_t rows : {1, 2, 3, 4, 7, 16, 35}) {
        auto wb = random_matrix(t, rows, cols, static_cast<unsigned>(40 + rows));
        const std::size_t rb = row_size(t, cols);
        for (std::int64_t nx : {1, 2, 5, 8, 70}) {
          std::vector<float> x(static_cast<std::size_t>(nx * cols));
          std::mt19937 rng(static_cast<unsigned>(nx));
          std::uniform_real_distribution<float> u(-3.0f, 3.0f);
          for (auto& v : x) v = u(rng);
          std::vector<BlockQ16x> xq(static_cast<std::size_t>(nx * cols / kQK));
          for (std::int64_t i = 0; i < nx; ++i) {
            kernels::quantize_row_q16x_scalar(x.data() + i * cols, xq.data() + i * cols / kQK, cols);
          }
          std::vector<float> want(static_cast<std::size_t>(nx * rows)), got(want.size());
          const auto* w = reinterpret_cast<const std::byte*>(wb.data());
          kernels::gemm_q16_scalar(t, WeightLayout::rows, w, rb, rows, xq.data(), nx, cols, want.data(), rows);
          kernels::gemm_q16_units_avx2(t, w, rb, rows, xq.data(), nx, cols, got.data(), rows);
          EXPECT_EQ(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)), 0)
              << "avx2 " << ggml_type_name(t) << " rows " << rows << " batch " << nx;
          if (kernels::avx512_vnni_available()) {
            std::fill(got.begin(), got.end(), 0.0f);
            kernels::gemm_q16_units_avx512(t, w, rb, rows, xq.data(), nullptr, nx, cols, got.data(), rows);
            EXPECT_EQ(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)), 0)
                << "avx512 " << ggml_type_name(t) << " rows " << rows << " batch " << nx << " cols " << cols;
            std::vector<std::int32_t> pairs(static_cast<std::size_t>(nx * cols / kQK * 16));
            kernels::pair_q16_activations_avx512(xq.data(), nx * cols / kQK, pairs.data());
            std::fill(got.begin(), got.end(), 0.0f);
            kernels::gemm_q16_units_avx512(t, w, rb, rows, xq.data(), pairs.data(), nx, cols, got.data(), rows);
            EXPECT_EQ(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)), 0)
                << "avx512 lanes " << ggml_type_name(t) << " rows " << rows << " batch " << nx << " cols " << cols;
          }
        }
      }
    }
  // Q6_K at the integer limit: every scale -128, every quant 0 (q - 32 = -32), x all equal; 16 rows,
  // one lanes group, against 8 activation rows for the lanes kernel.
  const std::int64_t cols = 512;
  const std::int64_t rows = 16;
  std::vector<std::uint8_t> wb(static_cast<std::size_t>(rows * row_size(GgmlType::q6_k, cols)), 0);
  for (std::size_t u = 0; u < wb.size() / kQ6KBytes; ++u) {
    for (int s = 0; s < 16; ++s) wb[u * kQ6KBytes + 192 + static_cast<std::size_t>(s)] = 0x80;  // -128
    put_f16(wb, u * kQ6KBytes + 208, 1.0f / 4096.0f);
  }
  std::vector<float> x(static_cast<std::size_t>(cols), 2.0f);
  std::vector<BlockQ16x> xq(static_cast<std::size_t>(cols / kQK));
  kernels::quantize_row_q16x_scalar(x.data(), xq.data(), cols);
  ASSERT_EQ(xq[0].qs[0], 32767);
  std::vector<float> want(rows), got(rows);
  const auto* w = reinterpret_cast<const std::byte*>(wb.data());
  const std::size_t rb = row_size(GgmlType::q6_k, cols);
  kernels::gemm_q16_scalar(GgmlType::q6_k, WeightLayout::rows, w, rb, rows, xq.data(), 1, cols, want.data(), rows);
  kernels::gemm_q16_units_avx2(GgmlType::q6_k, w, rb, rows, xq.data(), 1, cols, got.data(), rows);
  EXPECT_EQ(want, got);
  if (kernels::avx512_vnni_available()) {
    kernels::gemm_q16_units_avx512(GgmlType::q6_k, w, rb, rows, xq.data(), nullptr, 1, cols, got.data(), rows);
    EXPECT_EQ(want, got);
    const std::int64_t nx = kernels::kQ16UnitsLanesMinBatch;
    std::vector<BlockQ16x> xqn;
    for (std::int64_t i = 0; i < nx; ++i) xqn.insert(xqn.end(), xq.begin(), xq.end());
    std::vector<std::int32_t> pairs(xqn.size() * 16);
    kernels::pair_q16_activations_avx512(xqn.data(), static_cast<std::int64_t>(xqn.size()), pairs.data());
    std::vector<float> lanes(static_cast<std::size_t>(nx * rows));
    kernels::gemm_q16_units_avx512(GgmlType::q6_k, w, rb, rows, xqn.data(), pairs.data(), nx, cols, lanes.data(), rows);
    for (std::int64_t i = 0; i < nx; ++i) {
      EXPECT_EQ(std::vector<float>(lanes.begin() + i * rows, lanes.begin() + (i + 1) * rows), want) << "row " << i;
    }
  }
  // Each weight is -128 * -32 / 4096 = 1, each x 2: the dot is 2 * cols.
  for (float v : got) EXPECT_NEAR(v, 2.0 * cols, 1e-3 * cols);
}

// The prompt products' tiles against the scalar reference, bit for bit: the AVX2 3 x 4 micro-kernel
// and the AVX-512 one (two rows per register, tiles of 6 rows x 8 activation rows, an odd last row
// on AVX2), on row counts and batches that reach every tile and remainder.
TEST(KQuantMatmul, PromptTilesEqualScalarBitwise) {
  if (!kernels::avx2_available()) GTEST_SKIP() << "no AVX2 on this machine";
  const std::int64_t cols = 512;
  for (GgmlType t : {GgmlType::q5_0, GgmlType::q4_k, GgmlType::q6_k}) {
    for (std::int64_t rows : {1, 2, 5, 6, 7, 13, 50}) {
      const auto wb = random_matrix(t, rows, cols, static_cast<unsigned>(60 + rows));
      const auto* w = reinterpret_cast<const std::byte*>(wb.data());
      const std::size_t rb = row_size(t, cols);
      for (std::int64_t nx : {3, 8, 9, 19}) {
        std::vector<float> x(static_cast<std::size_t>(nx * cols));
        for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::cos(0.37f * static_cast<float>(i));
        std::vector<float> want(static_cast<std::size_t>(nx * rows)), got(want.size());
        kernels::gemm_dq_scalar(t, w, rb, rows, x.data(), cols, nx, cols, want.data(), rows);
        kernels::gemm_dq_avx2(t, w, rb, rows, x.data(), cols, nx, cols, got.data(), rows);
        EXPECT_EQ(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)), 0)
            << "avx2 " << ggml_type_name(t) << " rows " << rows << " batch " << nx;
        if (kernels::avx512_vnni_available()) {
          std::fill(got.begin(), got.end(), 0.0f);
          kernels::gemm_dq_avx512(t, w, rb, rows, x.data(), cols, nx, cols, got.data(), rows);
          EXPECT_EQ(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)), 0)
              << "avx512 " << ggml_type_name(t) << " rows " << rows << " batch " << nx;
        }
      }
    }
  }
}

// RepackedWeights copies the block types with rows-layout kernels as they are (into its huge
// pages; the file's pages are handed back slice by slice): same bytes, same layout, the same
// products bit for bit, and every row handed to `copied` once.
TEST(KQuantMatmul, PlacedWeightsAreCopiedAsTheyAre) {
  const std::int64_t cols = 512;
  for (GgmlType t : kQ16UnitTypes) {
    const std::int64_t rows = 4 * 700 + 3;  // several 1 MiB slices for the K-quants; not a multiple of 4
    const auto wb = random_matrix(t, rows, cols, 77);
    const WeightMatrix original{t, wb.data(), rows, cols, row_size(t, cols)};
    WeightMatrix placed = original;
    std::int64_t handed_rows = 0;
    const void* next = wb.data();
    RepackedWeights store;
    ASSERT_TRUE(store
                    .repack({&placed},
                            [&](const WeightMatrix& part) {
                              EXPECT_EQ(part.data, next) << ggml_type_name(t);
                              next = static_cast<const std::byte*>(part.data) +
                                     static_cast<std::size_t>(part.rows) * original.row_bytes;
                              handed_rows += part.rows;
                            })
                    .is_ok());
    if (store.bytes() == 0) GTEST_SKIP() << "KALLPA_REPACK=0 turns placement off";
    EXPECT_EQ(store.bytes(), wb.size()) << ggml_type_name(t);
    EXPECT_EQ(placed.layout, WeightLayout::rows) << ggml_type_name(t);
    EXPECT_NE(placed.data, original.data) << ggml_type_name(t);
    EXPECT_EQ(std::memcmp(placed.data, wb.data(), wb.size()), 0) << ggml_type_name(t);
    EXPECT_EQ(handed_rows, rows) << ggml_type_name(t);
    std::vector<float> x(static_cast<std::size_t>(cols));
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.11f * static_cast<float>(i));
    MatmulOptions o;
    o.activations = MatmulOptions::Activations::q16;
    std::vector<float> want(static_cast<std::size_t>(rows)), got(want.size());
    ASSERT_TRUE(matmul(original, x.data(), 1, cols, want.data(), rows, o).is_ok());
    ASSERT_TRUE(matmul(placed, x.data(), 1, cols, got.data(), rows, o).is_ok());
    EXPECT_EQ(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)), 0) << ggml_type_name(t);
  }
}

TEST(KQuantMatmul, GroupEqualsSeparateProducts) {
  const std::int64_t cols = 256;
  const auto a = random_matrix(GgmlType::q4_k, 24, cols, 1);
  const auto b = random_matrix(GgmlType::q6_k, 40, cols, 2);
  WeightMatrix wa{GgmlType::q4_k, a.data(), 24, cols, row_size(GgmlType::q4_k, cols), WeightLayout::rows};
  WeightMatrix wb{GgmlType::q6_k, b.data(), 40, cols, row_size(GgmlType::q6_k, cols), WeightLayout::rows};
  std::vector<float> x(static_cast<std::size_t>(3 * cols));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::sin(static_cast<float>(i));
  std::vector<float> ya(3 * 24), yb(3 * 40), ga(3 * 24), gb(3 * 40);
  ASSERT_TRUE(matmul(wa, x.data(), 3, cols, ya.data(), 24).is_ok());
  ASSERT_TRUE(matmul(wb, x.data(), 3, cols, yb.data(), 40).is_ok());
  const MatmulJob jobs[] = {{&wa, ga.data(), 24}, {&wb, gb.data(), 40}};
  ASSERT_TRUE(matmul_group(jobs, x.data(), 3, cols).is_ok());
  EXPECT_EQ(ya, ga);
  EXPECT_EQ(yb, gb);
}

TEST(KQuantMatmul, RejectsRepackedLayoutAndBadShapes) {
  const auto b = random_matrix(GgmlType::q4_k, 4, 256, 1);
  WeightMatrix w{GgmlType::q4_k, b.data(), 4, 256, row_size(GgmlType::q4_k, 256), WeightLayout::rows4};
  std::vector<float> x(256), y(4);
  EXPECT_EQ(matmul(w, x.data(), 1, 256, y.data(), 4).code(), ErrorCode::invalid_argument);
  w.layout = WeightLayout::rows;
  w.cols = 128;  // not a whole super-block
  EXPECT_EQ(matmul(w, x.data(), 1, 256, y.data(), 4).code(), ErrorCode::invalid_argument);
}

}  // namespace
