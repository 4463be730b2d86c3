// The engine's op set on OpenCL (src/ops/opencl/opencl_ops.cpp) against the CPU ops and exact
// references: memory round trips and bad addresses, weight placement, embedding for every weight
// type, RMSNorm, matmul (every type, decode- and prompt-sized batches, row independence), RoPE at
// long positions with and without double, SwiGLU, add, gather and scatter (bit-exact f16/bf16
// rounding). Every test is skipped, with the reason, when this build or machine has no OpenCL
// device.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kallpa/dispatcher.h"
#include "kallpa/half.h"
#include "kallpa/ops/ops.h"
#include "kallpa/ops/quant.h"
#include "kallpa/registry.h"
#include "test_problem.h"

namespace kallpa {
namespace {

using ops::GgmlType;
using ops::Ops;
using ops::WeightMatrix;

const GgmlType kTypes[] = {GgmlType::f32,  GgmlType::f16,  GgmlType::bf16,
                           GgmlType::q8_0, GgmlType::q4_0, GgmlType::q4_1};

// The OpenCL ops, or why there are none (a skip); any other failure to make them fails the test.
struct OpenClOps {
  std::unique_ptr<Ops> ops;
  std::string why_not;
  Status error;
};

OpenClOps make_opencl() {
  OpenClOps o;
  Result<std::unique_ptr<Ops>> r = ops::make_ops("opencl");
  if (r) {
    o.ops = std::move(*r);
  } else if (r.status().code() == ErrorCode::unsupported) {
    o.why_not = r.status().to_string();
  } else {
    o.error = r.status();
  }
  return o;
}

#define REQUIRE_OPENCL_OPS(name)                                   \
  OpenClOps name##_made = make_opencl();                           \
  ASSERT_TRUE(name##_made.error) << name##_made.error.to_string(); \
  if (!name##_made.ops) GTEST_SKIP() << name##_made.why_not;       \
  Ops& name = *name##_made.ops

// One allocation of `ops`, freed on destruction.
class DeviceArray {
 public:
  DeviceArray(Ops& ops, std::size_t bytes) : ops_(&ops) {
    Result<void*> r = ops.allocate(bytes, "test array");
    EXPECT_TRUE(r) << r.status().to_string();
    if (r) p_ = *r;
  }
  template <typename T>
  DeviceArray(Ops& ops, const std::vector<T>& host) : DeviceArray(ops, host.size() * sizeof(T)) {
    const Status s = ops.upload(p_, host.data(), host.size() * sizeof(T));
    EXPECT_TRUE(s) << s.to_string();
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() { ops_->free(p_); }

  float* f() const { return static_cast<float*>(p_); }
  void* get() const { return p_; }
  template <typename T = float>
  std::vector<T> read(std::size_t n) const {
    std::vector<T> out(n);
    const Status s = ops_->download(out.data(), p_, n * sizeof(T));
    EXPECT_TRUE(s) << s.to_string();
    return out;
  }

 private:
  Ops* ops_;
  void* p_ = nullptr;
};

std::vector<float> random_floats(std::size_t n, unsigned seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// A host matrix of `type` made by quantising random values, and its dequantised values.
struct HostMatrix {
  std::vector<std::byte> bytes;
  std::vector<float> values;  // rows x cols, what the matrix holds exactly
  WeightMatrix w;
};

HostMatrix make_matrix(GgmlType type, std::int64_t rows, std::int64_t cols, unsigned seed) {
  HostMatrix m;
  const std::vector<float> src = random_floats(static_cast<std::size_t>(rows * cols), seed, 0.5f);
  const std::uint64_t row_bytes = ops::row_size(type, cols);
  m.bytes.resize(static_cast<std::size_t>(row_bytes * rows));
  m.values.resize(src.size());
  for (std::int64_t r = 0; r < rows; ++r) {
    EXPECT_TRUE(ops::quantize_row(type, src.data() + r * cols, m.bytes.data() + r * row_bytes, cols));
    EXPECT_TRUE(ops::dequantize_row(type, m.bytes.data() + r * row_bytes, m.values.data() + r * cols, cols));
  }
  m.w = WeightMatrix{type, m.bytes.data(), rows, cols, row_bytes, ops::WeightLayout::rows};
  return m;
}

// The device copy of a host matrix, kept alive with its holder.
struct Placed {
  WeightMatrix w;
  std::shared_ptr<const void> holder;
};

Placed place(Ops& ops, const WeightMatrix& host) {
  Placed p{host, nullptr};
  WeightMatrix* list[] = {&p.w};
  Result<std::shared_ptr<const void>> r = ops.place_weights(list, Ops::WeightUse::matmul, {});
  EXPECT_TRUE(r) << r.status().to_string();
  if (r) p.holder = *r;
  return p;
}

TEST(OpenClOps, IdentifiesItsDevice) {
  REQUIRE_OPENCL_OPS(cl);
  EXPECT_EQ(cl.version(), ops::kOpsVersion);
  EXPECT_EQ(cl.device().kind, DeviceKind::opencl);
  EXPECT_EQ(cl.device_name(), "opencl:" + std::to_string(cl.device().index));
  EXPECT_FALSE(cl.host_addressable());
  // Another index than the process's device is refused with the reason, not a crash.
  Result<std::unique_ptr<Ops>> other = ops::make_ops("opencl:" + std::to_string(cl.device().index + 1));
  ASSERT_FALSE(other);
  EXPECT_EQ(other.status().code(), ErrorCode::unsupported) << other.status().to_string();
}

TEST(OpenClOps, MemoryRoundTripsAndRefusesBadAddresses) {
  REQUIRE_OPENCL_OPS(cl);
  std::vector<std::uint8_t> in(3000);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = static_cast<std::uint8_t>(i * 13 + 7);
  DeviceArray a(cl, in), b(cl, in.size());
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a.get()) % 256, 0u);
  // copy with offsets on both sides, then download the whole destination back.
  ASSERT_TRUE(cl.copy(b.get(), a.get(), in.size()));
  ASSERT_TRUE(cl.copy(static_cast<std::byte*>(b.get()) + 1000, static_cast<std::byte*>(a.get()) + 17, 500));
  std::vector<std::uint8_t> expect = in;
  std::memcpy(expect.data() + 1000, in.data() + 17, 500);
  EXPECT_EQ(b.read<std::uint8_t>(in.size()), expect);

  std::vector<std::uint8_t> out(16);
  const Status past_end = cl.download(out.data(), static_cast<std::byte*>(a.get()) + 2990, 16);
  EXPECT_EQ(past_end.code(), ErrorCode::invalid_argument) << past_end.to_string();
  const Status host = cl.upload(out.data(), in.data(), 4);  // a host pointer is not a device address
  EXPECT_EQ(host.code(), ErrorCode::invalid_argument) << host.to_string();
  const Status bad_copy = cl.copy(b.get(), in.data(), 4);
  EXPECT_EQ(bad_copy.code(), ErrorCode::invalid_argument) << bad_copy.to_string();
  std::vector<float> x(8, 1.0f);
  const Status bad_add = cl.add(x.data(), b.f(), 8);
  EXPECT_EQ(bad_add.code(), ErrorCode::invalid_argument) << bad_add.to_string();

  Result<void*> huge = cl.allocate(std::size_t{1} << 62, "the KV cache");
  ASSERT_FALSE(huge);
  EXPECT_EQ(huge.status().code(), ErrorCode::out_of_memory);
  EXPECT_EQ(huge.status().field(), "the KV cache");
  cl.free(nullptr);
}

TEST(OpenClOps, PlaceWeightsSharesTiedMatricesAndRefusesWhatItCannotRun) {
  REQUIRE_OPENCL_OPS(cl);
  HostMatrix m = make_matrix(GgmlType::q8_0, 10, 64, 1);
  WeightMatrix a = m.w, b = m.w, norm{GgmlType::f32, nullptr, 1, 64, 256, ops::WeightLayout::rows};
  std::vector<float> norm_values = random_floats(64, 2);
  norm.data = norm_values.data();
  WeightMatrix* list[] = {&a, &b, &norm};
  Result<std::shared_ptr<const void>> held = cl.place_weights(list, Ops::WeightUse::lookup, {});
  ASSERT_TRUE(held) << held.status().to_string();
  EXPECT_EQ(a.data, b.data);  // one copy of the same host bytes
  EXPECT_NE(a.data, m.w.data);
  std::vector<std::byte> back(m.bytes.size());
  ASSERT_TRUE(cl.download(back.data(), a.data, back.size()));
  EXPECT_EQ(back, m.bytes);
  std::vector<float> norm_back(64);
  ASSERT_TRUE(cl.download(norm_back.data(), norm.data, 256));
  EXPECT_EQ(norm_back, norm_values);

  // Types without a kernel and repacked layouts are unsupported (the engine runs those on the
  // CPU), and nothing is rewritten.
  WeightMatrix q5{GgmlType::q5_0, m.bytes.data(), 2, 32, 22, ops::WeightLayout::rows};
  WeightMatrix repacked = m.w;
  repacked.layout = ops::WeightLayout::rows4;
  for (WeightMatrix* w : {&q5, &repacked}) {
    const void* before = w->data;
    WeightMatrix* one[] = {w};
    Result<std::shared_ptr<const void>> r = cl.place_weights(one, Ops::WeightUse::matmul, {});
    ASSERT_FALSE(r);
    EXPECT_EQ(r.status().code(), ErrorCode::unsupported) << r.status().to_string();
    EXPECT_EQ(w->data, before);
  }
  held->reset();
  // The holder freed the copies: their addresses are no longer device memory.
  EXPECT_EQ(cl.download(back.data(), a.data, 4).code(), ErrorCode::invalid_argument);
}

TEST(OpenClOps, EmbeddingMatchesTheCpuForEveryType) {
  REQUIRE_OPENCL_OPS(cl);
  std::unique_ptr<Ops> cpu = ops::make_cpu_ops();
  for (GgmlType type : kTypes) {
    SCOPED_TRACE(std::string(ops::ggml_type_name(type)));
    HostMatrix m = make_matrix(type, 37, 64, 11);
    Placed p = place(cl, m.w);
    const std::vector<std::int32_t> ids = {0, 36, 5, 5, 17};
    std::vector<float> want(ids.size() * 64);
    ASSERT_TRUE(cpu->embedding(m.w, ids, want.data()));
    DeviceArray out(cl, want.size() * 4);
    ASSERT_TRUE(cl.embedding(p.w, ids, out.f()));
    EXPECT_EQ(out.read(want.size()), want);

    const std::vector<std::int32_t> bad = {3, 37};
    const Status s = cl.embedding(p.w, bad, out.f());
    EXPECT_EQ(s.code(), ErrorCode::invalid_argument) << s.to_string();
    EXPECT_EQ(s.field(), "tokens");
  }
}

TEST(OpenClOps, RmsNormMatchesTheCpu) {
  REQUIRE_OPENCL_OPS(cl);
  std::unique_ptr<Ops> cpu = ops::make_cpu_ops();
  for (std::int64_t dim : {576, 100, 7}) {
    const std::int64_t rows = 5;
    std::vector<float> x = random_floats(static_cast<std::size_t>(rows * dim), 3, 2.0f);
    const std::vector<float> w = random_floats(static_cast<std::size_t>(dim), 4);
    std::vector<float> want(x.size());
    ASSERT_TRUE(cpu->rmsnorm(x.data(), w.data(), 1e-5f, want.data(), rows, dim));
    DeviceArray dx(cl, x), dw(cl, w), dy(cl, x.size() * 4);
    ASSERT_TRUE(cl.rmsnorm(dx.f(), dw.f(), 1e-5f, dy.f(), rows, dim));
    const std::vector<float> got = dy.read(x.size());
    for (std::size_t i = 0; i < x.size(); ++i)
      EXPECT_NEAR(got[i], want[i], 1e-6f * std::fabs(want[i])) << dim << " " << i;
    // In place (x and y alias).
    ASSERT_TRUE(cl.rmsnorm(dx.f(), dw.f(), 1e-5f, dx.f(), rows, dim));
    EXPECT_EQ(dx.read(x.size()), got);
  }
}

// y = x W^T in double over the exact (dequantised) weights, and sum_j |W x| per output: the scale
// f32 rounding errors are relative to.
void exact_product(const HostMatrix& m, const std::vector<float>& x, std::int64_t rows, std::vector<double>* y,
                   std::vector<double>* abs_sum) {
  const std::int64_t n = m.w.rows, k = m.w.cols;
  y->assign(static_cast<std::size_t>(rows * n), 0.0);
  abs_sum->assign(y->size(), 0.0);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t i = 0; i < n; ++i) {
      double s = 0.0, a = 0.0;
      for (std::int64_t j = 0; j < k; ++j) {
        const double p = double(m.values[static_cast<std::size_t>(i * k + j)]) * x[static_cast<std::size_t>(r * k + j)];
        s += p;
        a += std::fabs(p);
      }
      (*y)[static_cast<std::size_t>(r * n + i)] = s;
      (*abs_sum)[static_cast<std::size_t>(r * n + i)] = a;
    }
  }
}

TEST(OpenClOps, MatmulIsExactToF32RoundingForEveryTypeAndBatch) {
  REQUIRE_OPENCL_OPS(cl);
  std::unique_ptr<Ops> cpu = ops::make_cpu_ops();
  for (GgmlType type : kTypes) {
    // Plain-float rows need not be whole blocks of 32.
    const std::int64_t cols = type == GgmlType::f32 || type == GgmlType::f16 || type == GgmlType::bf16 ? 200 : 192;
    HostMatrix m = make_matrix(type, 70, cols, 21);
    Placed p = place(cl, m.w);
    for (auto [rows, decode] : {std::pair<std::int64_t, std::int64_t>{1, 1}, {3, 3}, {19, 3}, {67, 0}}) {
      SCOPED_TRACE(std::string(ops::ggml_type_name(type)) + " rows " + std::to_string(rows));
      const std::vector<float> x =
          random_floats(static_cast<std::size_t>(rows * cols), 22 + static_cast<unsigned>(rows));
      std::vector<double> exact, abs_sum;
      exact_product(m, x, rows, &exact, &abs_sum);
      DeviceArray dx(cl, x), dy(cl, static_cast<std::size_t>(rows * m.w.rows) * 4);
      ASSERT_TRUE(cl.matmul(p.w, dx.f(), rows, dy.f(), decode));
      const std::vector<float> got = dy.read(exact.size());
      std::vector<float> want(exact.size());
      ASSERT_TRUE(cpu->matmul(m.w, x.data(), rows, want.data(), decode));
      for (std::int64_t r = 0; r < rows; ++r) {
        float xmax = 0.0f;
        for (std::int64_t j = 0; j < cols; ++j)
          xmax = std::max(xmax, std::fabs(x[static_cast<std::size_t>(r * cols + j)]));
        for (std::int64_t i = 0; i < m.w.rows; ++i) {
          const auto at = static_cast<std::size_t>(r * m.w.rows + i);
          EXPECT_NEAR(got[at], exact[at], 2e-6 * abs_sum[at] + 1e-30) << "row " << r << " out " << i;
          // The CPU quantises the activations of quantised matrices' products (prompt and decode
          // rows alike) to 16-bit blocks: at most max|x| / 65534 per element, times sum |W|
          // (bounded here by sum |W x| / min|x| would be loose; use |W| directly).
          double wabs = 0.0;
          for (std::int64_t j = 0; j < cols; ++j) wabs += std::fabs(m.values[static_cast<std::size_t>(i * cols + j)]);
          const bool float_weights = type == GgmlType::f32 || type == GgmlType::f16 || type == GgmlType::bf16;
          const double tol = 4e-6 * abs_sum[at] + (float_weights ? 0.0 : wabs * xmax / 32767.0);
          EXPECT_NEAR(got[at], want[at], tol) << "vs cpu, row " << r << " out " << i;
        }
      }
    }
  }
}

TEST(OpenClOps, MatmulRowsDoNotDependOnTheirBatch) {
  REQUIRE_OPENCL_OPS(cl);
  for (GgmlType type : kTypes) {
    SCOPED_TRACE(std::string(ops::ggml_type_name(type)));
    const std::int64_t cols = 576, rows = 13;
    HostMatrix m = make_matrix(type, 45, cols, 31);
    Placed p = place(cl, m.w);
    const std::vector<float> x = random_floats(static_cast<std::size_t>(rows * cols), 32);
    DeviceArray dx(cl, x), dy(cl, static_cast<std::size_t>(rows * m.w.rows) * 4),
        one(cl, static_cast<std::size_t>(m.w.rows) * 4), three(cl, static_cast<std::size_t>(3 * m.w.rows) * 4);
    ASSERT_TRUE(cl.matmul(p.w, dx.f(), rows, dy.f(), 0));
    const std::vector<float> batch = dy.read(static_cast<std::size_t>(rows * m.w.rows));
    for (std::int64_t r = 0; r < rows; ++r) {
      ASSERT_TRUE(cl.matmul(p.w, dx.f() + r * cols, 1, one.f(), 1));
      const std::vector<float> alone = one.read(static_cast<std::size_t>(m.w.rows));
      EXPECT_TRUE(std::equal(alone.begin(), alone.end(), batch.begin() + r * m.w.rows)) << "row " << r;
    }
    ASSERT_TRUE(cl.matmul(p.w, dx.f() + 5 * cols, 3, three.f(), 3));
    const std::vector<float> small = three.read(static_cast<std::size_t>(3 * m.w.rows));
    EXPECT_TRUE(std::equal(small.begin(), small.end(), batch.begin() + 5 * m.w.rows));
  }
}

TEST(OpenClOps, MatmulGroupGivesWhatEachMatmulGives) {
  REQUIRE_OPENCL_OPS(cl);
  HostMatrix q = make_matrix(GgmlType::q8_0, 64, 128, 41), k = make_matrix(GgmlType::q4_1, 32, 128, 42);
  Placed pq = place(cl, q.w), pk = place(cl, k.w);
  const std::vector<float> x = random_floats(5 * 128, 43);
  DeviceArray dx(cl, x), yq(cl, 5 * 64 * 4), yk(cl, 5 * 32 * 4), zq(cl, 5 * 64 * 4);
  const ops::MatmulJob jobs[] = {{&pq.w, yq.f(), 64}, {&pk.w, yk.f(), 32}};
  ASSERT_TRUE(cl.matmul_group(jobs, dx.f(), 5, 2));
  ASSERT_TRUE(cl.matmul(pq.w, dx.f(), 5, zq.f(), 2));
  EXPECT_EQ(yq.read(5 * 64), zq.read(5 * 64));
}

void check_rope(Ops& cl, float tolerance) {
  std::unique_ptr<Ops> cpu = ops::make_cpu_ops();
  std::mt19937 rng(51);
  std::uniform_int_distribution<std::int32_t> pos_dist(0, 30000);
  for (float theta : {10000.0f, 100000.0f}) {
    for (std::int64_t n_rot : {64, 32}) {
      SCOPED_TRACE("theta " + std::to_string(theta) + " n_rot " + std::to_string(n_rot));
      const std::int64_t heads = 3, head_dim = 64, rows = 9;
      std::vector<std::int32_t> pos(rows);
      for (auto& p : pos) p = pos_dist(rng);
      pos[0] = 0;
      pos[1] = 29999;
      std::vector<float> x = random_floats(static_cast<std::size_t>(rows * heads * head_dim), 52);
      DeviceArray dx(cl, x);
      ASSERT_TRUE(cl.rope(dx.f(), pos, heads, head_dim, n_rot, theta));
      ASSERT_TRUE(cpu->rope(x.data(), pos, heads, head_dim, n_rot, theta));
      const std::vector<float> got = dx.read(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) {
        const std::size_t pair = i & ~std::size_t{1};
        const float scale = std::fabs(x[pair]) + std::fabs(x[pair + 1]);
        EXPECT_NEAR(got[i], x[i], tolerance * scale + 1e-30f) << i;
      }
    }
  }
}

TEST(OpenClOps, RopeMatchesTheCpuAtLongPositions) {
  REQUIRE_OPENCL_OPS(cl);
  check_rope(cl, 2e-7f);
}

TEST(OpenClOps, RopeWithoutDoubleStaysClose) {
  // The f32 path a device without cl_khr_fp64 takes: exact product, three-part 2*pi reduction.
  ::setenv("KALLPA_OPENCL_FP64", "0", 1);
  OpenClOps made = make_opencl();
  ::unsetenv("KALLPA_OPENCL_FP64");
  ASSERT_TRUE(made.error) << made.error.to_string();
  if (!made.ops) GTEST_SKIP() << made.why_not;
  check_rope(*made.ops, 1e-6f);
}

TEST(OpenClOps, SwigluAndAddMatchTheCpu) {
  REQUIRE_OPENCL_OPS(cl);
  std::unique_ptr<Ops> cpu = ops::make_cpu_ops();
  const std::size_t n = 3000;
  std::vector<float> gate = random_floats(n, 61, 4.0f), up = random_floats(n, 62);
  gate[0] = 100.0f;
  gate[1] = -100.0f;
  DeviceArray dg(cl, gate), du(cl, up), dout(cl, n * 4);
  ASSERT_TRUE(cl.swiglu(dg.f(), du.f(), dout.f(), static_cast<std::int64_t>(n)));
  std::vector<float> want(n);
  ASSERT_TRUE(cpu->swiglu(gate.data(), up.data(), want.data(), static_cast<std::int64_t>(n)));
  const std::vector<float> got = dout.read(n);
  for (std::size_t i = 0; i < n; ++i) {
    const double g = gate[i], exact = g / (1.0 + std::exp(-g)) * up[i];
    EXPECT_NEAR(got[i], exact, 1e-6 * std::fabs(exact) + 1e-30) << i;
    EXPECT_NEAR(got[i], want[i], 4e-6 * std::fabs(exact) + 1e-30) << i;
  }
  // In place over gate.
  ASSERT_TRUE(cl.swiglu(dg.f(), du.f(), dg.f(), static_cast<std::int64_t>(n)));
  EXPECT_EQ(dg.read(n), got);

  DeviceArray dx(cl, gate);
  ASSERT_TRUE(cl.add(dx.f(), du.f(), static_cast<std::int64_t>(n)));
  ASSERT_TRUE(cpu->add(gate.data(), up.data(), static_cast<std::int64_t>(n)));
  EXPECT_EQ(dx.read(n), gate);
}

TEST(OpenClOps, GatherRowsCopiesRowsAndRefusesBadOnes) {
  REQUIRE_OPENCL_OPS(cl);
  const std::int64_t dim = 96;
  const std::vector<float> x = random_floats(10 * dim, 71);
  const std::vector<std::int64_t> rows = {9, 0, 4, 4};
  DeviceArray dx(cl, x), dout(cl, rows.size() * dim * 4);
  ASSERT_TRUE(cl.gather_rows(dx.f(), rows, dim, dout.f()));
  const std::vector<float> got = dout.read(rows.size() * dim);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    EXPECT_TRUE(std::equal(got.begin() + static_cast<std::ptrdiff_t>(i * dim),
                           got.begin() + static_cast<std::ptrdiff_t>((i + 1) * dim), x.begin() + rows[i] * dim))
        << i;
  }
  for (const std::vector<std::int64_t>& bad : {std::vector<std::int64_t>{1, -1}, std::vector<std::int64_t>{10}}) {
    const Status s = cl.gather_rows(dx.f(), bad, dim, dout.f());
    EXPECT_EQ(s.code(), ErrorCode::invalid_argument) << s.to_string();
  }
}

TEST(OpenClOps, ScatterRowsRoundsLikeTheCpu) {
  REQUIRE_OPENCL_OPS(cl);
  std::unique_ptr<Ops> cpu = ops::make_cpu_ops();
  const std::int64_t dim = 64;
  std::vector<float> src = random_floats(3 * dim, 81, 3.0f);
  // The cases rounding gets wrong: NaN, infinities, overflow to inf, f16 subnormals and values
  // that round to zero, exact halfway points (ties to even), the largest finite values.
  const float special[] = {std::numeric_limits<float>::quiet_NaN(),
                           -std::numeric_limits<float>::infinity(),
                           std::numeric_limits<float>::infinity(),
                           65519.0f,
                           65520.0f,
                           -1e6f,
                           1e-5f,
                           -3e-7f,
                           6e-8f,
                           2.9e-8f,
                           1e-40f,
                           -0.0f,
                           1.0f + 0x1p-11f,
                           1.0f + 3 * 0x1p-11f,
                           1.0f + 0x1p-8f,
                           1.0f + 3 * 0x1p-8f,
                           3.4e38f,
                           std::bit_cast<float>(0x7f7fffffu),
                           5.96e-8f,
                           2.98e-8f};
  std::copy(std::begin(special), std::end(special), src.begin() + dim);
  const std::vector<std::int64_t> rows = {4, 1, 2};
  DeviceArray dsrc(cl, src);
  for (DType t : {DType::f32, DType::f16, DType::bf16}) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    const std::size_t bytes = 5 * dim * dtype_size(t);
    std::vector<std::byte> want(bytes, std::byte{0x5a});
    DeviceArray ddst(cl, want);
    ASSERT_TRUE(cl.scatter_rows(dsrc.f(), dim, ddst.get(), t, rows));
    ASSERT_TRUE(cpu->scatter_rows(src.data(), dim, want.data(), t, rows));
    const std::vector<std::byte> got = ddst.read<std::byte>(bytes);
    const auto diff = std::mismatch(got.begin(), got.end(), want.begin());
    EXPECT_TRUE(diff.first == got.end()) << "first differing byte: " << (diff.first - got.begin());
    // And the bits are half.h's, whatever the CPU ops do.
    if (t != DType::f32) {
      const std::vector<std::uint16_t> halves = ddst.read<std::uint16_t>(5 * dim);
      for (std::int64_t j = 0; j < dim; ++j) {
        const float v = src[static_cast<std::size_t>(dim + j)];
        EXPECT_EQ(halves[static_cast<std::size_t>(1 * dim + j)], t == DType::f16 ? f32_to_f16(v) : f32_to_bf16(v)) << j;
      }
    }
  }
  const std::vector<std::int64_t> outside = {5};
  DeviceArray small(cl, 5 * dim * 4);
  EXPECT_EQ(cl.scatter_rows(dsrc.f(), dim, small.get(), DType::f32, outside).code(), ErrorCode::invalid_argument);
}

// The ops and opencl-flash share one device memory: attention runs on what the ops allocated
// and filled (K and V entering their cache through scatter_rows, as the engine does).
TEST(OpenClOps, AttentionRunsOnWhatTheOpsAllocate) {
  REQUIRE_OPENCL_OPS(cl);
  const std::int64_t sq = 5, skv = 9, hq = 4, hkv = 2, d = 16;
  testing::DenseF32Problem host(1, sq, skv, hq, hkv, d);
  host.problem.causal = true;
  ASSERT_TRUE(BackendRegistry::global().find("reference")->run(*validate(host.problem), {}));

  DeviceArray q(cl, host.q), k_rows(cl, host.k), v_rows(cl, host.v), o(cl, host.o.size() * 4);
  DeviceArray k(cl, host.k.size() * 4), v(cl, host.v.size() * 4);
  // Rows in reverse order, scattered back into place.
  std::vector<std::int64_t> rows(static_cast<std::size_t>(skv));
  std::vector<float> k_reversed(host.k.size()), v_reversed(host.v.size());
  const std::int64_t dim = hkv * d;
  for (std::int64_t r = 0; r < skv; ++r) {
    rows[static_cast<std::size_t>(r)] = skv - 1 - r;
    std::copy_n(host.k.begin() + (skv - 1 - r) * dim, dim, k_reversed.begin() + r * dim);
    std::copy_n(host.v.begin() + (skv - 1 - r) * dim, dim, v_reversed.begin() + r * dim);
  }
  ASSERT_TRUE(cl.upload(k_rows.get(), k_reversed.data(), k_reversed.size() * 4));
  ASSERT_TRUE(cl.upload(v_rows.get(), v_reversed.data(), v_reversed.size() * 4));
  ASSERT_TRUE(cl.scatter_rows(k_rows.f(), dim, k.get(), DType::f32, rows));
  ASSERT_TRUE(cl.scatter_rows(v_rows.f(), dim, v.get(), DType::f32, rows));

  AttentionProblem p = host.problem;
  p.q = make_contiguous_view(q.get(), DType::f32, {1, sq, hq, d});
  p.k = make_contiguous_view(k.get(), DType::f32, {1, skv, hkv, d});
  p.v = make_contiguous_view(v.get(), DType::f32, {1, skv, hkv, d});
  p.o = make_contiguous_view(o.get(), DType::f32, {1, sq, hq, d});
  for (TensorView* t : {&p.q, &p.k, &p.v, &p.o}) t->device = cl.device();
  Dispatcher dispatcher({{"opencl-flash"}, /*strict=*/true});
  const Status s = dispatcher.run(p);
  ASSERT_TRUE(s) << s.to_string();
  const std::vector<float> got = o.read(host.o.size());
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], host.o[i], 2e-5) << i;
}

}  // namespace
}  // namespace kallpa
