// Kernel-level tests for cpu-flash: fast path vs generic path vs the f64 reference on tricky
// shapes, thread-count independence, edge rules, and the thread pool. The conformance suite covers
// the full case matrix separately.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <numeric>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "backends/cpu-flash/cpu_flash.h"
#include "backends/cpu-flash/flash_internal.h"
#include "backends/reference/reference.h"
#include "kallpa/half.h"

namespace kallpa {
namespace {

using cpu_flash::CpuFlashBackend;
using cpu_flash::Options;
using cpu_flash::Path;

struct Spec {
  DType dt = DType::f32;
  std::vector<std::int32_t> sq{16}, skv{16};
  std::int32_t hq = 2, hkv = 1, d = 64, dv = 64;
  QLayout ql = QLayout::dense;
  KvLayout kvl = KvLayout::dense;
  std::int32_t page = 16;
  bool padded = false;  // extra elements between heads and tokens
  bool causal = false;
  std::int64_t wl = -1, wr = -1;
  float softcap = 0.0f;
  bool alibi = false;
  bool lse = false;
  unsigned seed = 1;
  // > 0 (dense KV only): key row j of each sequence scaled by 1 + key_ramp * j, and key 2500 by 40x
  // more, so that scores rise along the keys (see DecodeRisingScoresMatchReference).
  float key_ramp = 0.0f;
};

// Owns the buffers of one problem. Not copyable: the views point into the buffers.
struct Built {
  std::vector<std::uint16_t> q16, k16, v16, o16;
  std::vector<float> q32, k32, v32, o32, lse, slopes;
  std::vector<std::int32_t> cu_q, cu_k, table, seqlens;
  AttentionProblem p;
  Built() = default;
  Built(const Built&) = delete;
  Built& operator=(const Built&) = delete;
};

// A view over n logical rows of h heads of dim x, padded when asked; returns the element count.
TensorView view(void* data, DType dt, std::vector<std::int64_t> shape, bool padded) {
  TensorView t;
  t.data = data;
  t.dtype = dt;
  t.rank = static_cast<int>(shape.size());
  std::int64_t stride = 1;
  for (int i = t.rank - 1; i >= 0; --i) {
    const auto u = static_cast<std::size_t>(i);
    t.shape[u] = shape[u];
    t.stride[u] = stride;
    stride = shape[u] * stride + (padded ? 3 : 0);
  }
  return t;
}

std::int64_t span_of(const TensorView& t) {
  std::int64_t n = 1;
  for (int i = 0; i < t.rank; ++i)
    if (t.shape[static_cast<std::size_t>(i)] == 0) return 1;
  for (int i = 0; i < t.rank; ++i)
    n += (t.shape[static_cast<std::size_t>(i)] - 1) * t.stride[static_cast<std::size_t>(i)];
  return n;
}

void fill(const Spec& s, TensorView& t, std::vector<std::uint16_t>& b16, std::vector<float>& b32, std::mt19937& rng,
          std::vector<std::int64_t> shape) {
  const bool half = s.dt != DType::f32;
  t = view(nullptr, s.dt, shape, s.padded);
  const auto n = static_cast<std::size_t>(span_of(t));
  std::normal_distribution<float> dist(0.0f, 1.0f);
  if (half) {
    b16.resize(n);
    for (auto& e : b16) e = s.dt == DType::f16 ? f32_to_f16(dist(rng)) : f32_to_bf16(dist(rng));
    t.data = b16.data();
  } else {
    b32.resize(n);
    for (auto& e : b32) e = dist(rng);
    t.data = b32.data();
  }
}

// Spec::key_ramp on a dense K (any dtype, padded or not).
void ramp_keys(const Spec& s, const TensorView& k, std::vector<std::uint16_t>& b16, std::vector<float>& b32) {
  ASSERT_EQ(s.kvl, KvLayout::dense);
  for (std::int64_t b = 0; b < k.shape[0]; ++b)
    for (std::int64_t j = 0; j < k.shape[1]; ++j) {
      const float scale = (1.0f + s.key_ramp * static_cast<float>(j)) * (j == 2500 ? 40.0f : 1.0f);
      for (std::int64_t h = 0; h < k.shape[2]; ++h)
        for (std::int64_t x = 0; x < k.shape[3]; ++x) {
          const auto at =
              static_cast<std::size_t>(b * k.stride[0] + j * k.stride[1] + h * k.stride[2] + x * k.stride[3]);
          if (s.dt == DType::f32) b32[at] *= scale;
          else if (s.dt == DType::f16) b16[at] = f32_to_f16(f16_to_f32(b16[at]) * scale);
          else b16[at] = f32_to_bf16(bf16_to_f32(b16[at]) * scale);
        }
    }
}

void build(const Spec& s, Built& out) {
  std::mt19937 rng(s.seed);
  const auto B = static_cast<std::int32_t>(s.sq.size());
  AttentionProblem& p = out.p;
  p.q_layout = s.ql;
  p.kv_layout = s.kvl;
  p.batch = B;
  const std::int64_t tq = std::accumulate(s.sq.begin(), s.sq.end(), std::int64_t{0});
  const std::int64_t tk = std::accumulate(s.skv.begin(), s.skv.end(), std::int64_t{0});
  out.cu_q.assign(1, 0);
  out.cu_k.assign(1, 0);
  for (std::int32_t b = 0; b < B; ++b) {
    out.cu_q.push_back(out.cu_q.back() + s.sq[static_cast<std::size_t>(b)]);
    out.cu_k.push_back(out.cu_k.back() + s.skv[static_cast<std::size_t>(b)]);
  }
  std::vector<std::int64_t> qshape, oshape, kshape, vshape;
  if (s.ql == QLayout::dense) {
    qshape = {B, s.sq[0], s.hq, s.d};
    oshape = {B, s.sq[0], s.hq, s.dv};
  } else {
    qshape = {tq, s.hq, s.d};
    oshape = {tq, s.hq, s.dv};
    p.cu_seqlens_q = out.cu_q.data();
  }
  if (s.kvl == KvLayout::dense) {
    kshape = {B, s.skv[0], s.hkv, s.d};
    vshape = {B, s.skv[0], s.hkv, s.dv};
  } else if (s.kvl == KvLayout::packed) {
    kshape = {tk, s.hkv, s.d};
    vshape = {tk, s.hkv, s.dv};
    p.cu_seqlens_k = out.cu_k.data();
  } else {
    std::int32_t max_blocks = 1;
    for (auto n : s.skv) max_blocks = std::max(max_blocks, (n + s.page - 1) / s.page);
    const std::int32_t nblocks = B * max_blocks;
    std::vector<std::int32_t> perm(static_cast<std::size_t>(nblocks));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    out.table = perm;
    out.seqlens = s.skv;
    p.block_table = out.table.data();
    p.max_blocks_per_seq = max_blocks;
    p.seqlens_k = out.seqlens.data();
    kshape = {nblocks, s.page, s.hkv, s.d};
    vshape = {nblocks, s.page, s.hkv, s.dv};
  }
  fill(s, p.q, out.q16, out.q32, rng, qshape);
  fill(s, p.k, out.k16, out.k32, rng, kshape);
  if (s.key_ramp > 0.0f) ramp_keys(s, p.k, out.k16, out.k32);
  fill(s, p.v, out.v16, out.v32, rng, vshape);
  fill(s, p.o, out.o16, out.o32, rng, oshape);
  if (s.lse) {
    if (s.ql == QLayout::dense) {
      out.lse.assign(static_cast<std::size_t>(B * s.hq * s.sq[0]), 0.0f);
      p.lse = make_contiguous_view(out.lse.data(), DType::f32, {B, s.hq, s.sq[0]});
    } else {
      out.lse.assign(static_cast<std::size_t>(s.hq * tq), 0.0f);
      p.lse = make_contiguous_view(out.lse.data(), DType::f32, {s.hq, tq});
    }
  }
  if (s.alibi) {
    for (std::int32_t h = 0; h < s.hq; ++h) out.slopes.push_back(std::pow(2.0f, -0.5f * static_cast<float>(h + 1)));
    p.alibi_slopes = out.slopes.data();
  }
  p.causal = s.causal;
  p.window_left = s.wl;
  p.window_right = s.wr;
  p.softcap = s.softcap;
}

// A problem of sq / skv query / key rows per sequence, hq / hkv heads and head dims d; the rest as
// Spec's defaults.
Spec shaped(std::vector<std::int32_t> sq, std::vector<std::int32_t> skv, std::int32_t hq, std::int32_t hkv,
            std::int32_t d) {
  Spec s;
  s.sq = std::move(sq);
  s.skv = std::move(skv);
  s.hq = hq;
  s.hkv = hkv;
  s.d = s.dv = d;
  return s;
}

double tol(DType dt) { return dt == DType::f32 ? 2e-4 : dt == DType::f16 ? 4e-3 : 3e-2; }

// Runs `backend` on a fresh copy of the problem; returns o in logical order and lse.
struct Out {
  std::vector<float> o, lse;
};

Out run(CpuFlashBackend& be, const Spec& s) {
  Built b;
  build(s, b);
  auto vp = validate(b.p);
  EXPECT_TRUE(vp.is_ok()) << vp.status().to_string();
  Out out;
  if (!vp.is_ok()) return out;
  std::vector<std::byte> ws(be.workspace_size(*vp) + 64);
  const Status st = be.run(*vp, {ws.data(), ws.size()});
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  const AttentionProblem& p = vp->problem();
  const std::int64_t ohs = p.o.stride[static_cast<std::size_t>(p.o.rank - 2)];
  const std::int64_t ods = p.o.stride[static_cast<std::size_t>(p.o.rank - 1)];
  for (std::int32_t bb = 0; bb < vp->batch(); ++bb)
    for (std::int64_t i = 0; i < vp->seqlen_q(bb); ++i)
      for (std::int32_t h = 0; h < vp->hq(); ++h) {
        for (std::int64_t x = 0; x < vp->head_dim_v(); ++x)
          out.o.push_back(static_cast<float>(reference::load(p.o, vp->o_row_offset(bb, i) + h * ohs + x * ods)));
        if (p.lse.present()) out.lse.push_back(static_cast<const float*>(p.lse.data)[vp->lse_offset(bb, h, i)]);
      }
  return out;
}

reference::Output64 ref(const Spec& s) {
  Built b;
  build(s, b);
  auto vp = validate(b.p);
  return reference::compute_f64(*vp);
}

bool same(double a, double b, double t) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  if (std::isinf(a) || std::isinf(b)) return a == b;
  return std::abs(a - b) <= t + t * std::abs(b);
}

void expect_close(const Out& got, const reference::Output64& want, const Spec& s, const char* what) {
  ASSERT_EQ(got.o.size(), want.o.size()) << what;
  const double t = tol(s.dt);
  for (std::size_t i = 0; i < got.o.size(); ++i)
    ASSERT_TRUE(same(got.o[i], want.o[i], t)) << what << " o[" << i << "] = " << got.o[i] << " want " << want.o[i];
  if (s.lse) {
    // reference lse is [total_q, hq] in logical order, like got.lse
    ASSERT_EQ(got.lse.size(), want.lse.size()) << what;
    for (std::size_t i = 0; i < got.lse.size(); ++i)
      ASSERT_TRUE(same(got.lse[i], want.lse[i], 1e-4))
          << what << " lse[" << i << "] = " << got.lse[i] << " want " << want.lse[i];
  }
}

std::string describe(const Spec& s) {
  std::string r = std::string(dtype_name(s.dt)) + " d" + std::to_string(s.d) + " dv" + std::to_string(s.dv) + " hq" +
                  std::to_string(s.hq) + "/" + std::to_string(s.hkv) + " sq";
  for (auto x : s.sq) r += std::to_string(x) + ",";
  r += " skv";
  for (auto x : s.skv) r += std::to_string(x) + ",";
  r += std::string(" q=") + std::string(q_layout_name(s.ql)) + " kv=" + std::string(kv_layout_name(s.kvl)) + " page" +
       std::to_string(s.page) + (s.causal ? " causal" : "") + " wl" + std::to_string(s.wl) + " wr" +
       std::to_string(s.wr) + (s.softcap > 0 ? " softcap" : "") + (s.alibi ? " alibi" : "") + (s.lse ? " lse" : "") +
       (s.padded ? " padded" : "");
  return r;
}

const char* decode_kernel_name(cpu_flash::DecodeKernel k) {
  switch (k) {
    case cpu_flash::DecodeKernel::automatic: return "automatic";
    case cpu_flash::DecodeKernel::by_head: return "by_head";
    case cpu_flash::DecodeKernel::grouped: return "grouped";
    case cpu_flash::DecodeKernel::lanes: return "lanes";
    case cpu_flash::DecodeKernel::lanes_half_dots: return "lanes_half_dots";
  }
  return "?";
}

// The automatic choice, each production decode kernel forced (whichever the rule would pick on
// this machine and shape), the lanes kernels in steps of 8, and the generic path.
void check_all_paths(const Spec& s) {
  SCOPED_TRACE(describe(s));
  using cpu_flash::DecodeKernel;
  CpuFlashBackend fast(Options{0, Path::fast});
  CpuFlashBackend by_head(Options{0, Path::fast, DecodeKernel::by_head});
  CpuFlashBackend grouped(Options{0, Path::fast, DecodeKernel::grouped});
  CpuFlashBackend lanes(Options{0, Path::fast, DecodeKernel::lanes});
  CpuFlashBackend half_dots(Options{0, Path::fast, DecodeKernel::lanes_half_dots});
  Options short_steps{0, Path::fast, DecodeKernel::lanes_half_dots};
  short_steps.decode_step = 8;
  CpuFlashBackend half_dots_step8(short_steps);
  CpuFlashBackend generic(Options{0, Path::generic});
  const auto want = ref(s);
  expect_close(run(fast, s), want, s, "fast");
  expect_close(run(by_head, s), want, s, "fast, decode by_head");
  expect_close(run(grouped, s), want, s, "fast, decode grouped");
  expect_close(run(lanes, s), want, s, "fast, decode lanes");
  expect_close(run(half_dots, s), want, s, "fast, decode lanes_half_dots");
  expect_close(run(half_dots_step8, s), want, s, "fast, decode lanes_half_dots, steps of 8");
  expect_close(run(generic, s), want, s, "generic");
}

TEST(CpuFlash, Registered) {
  CpuFlashBackend be;
  EXPECT_EQ(be.name(), "cpu-flash");
  ProblemSignature sig;
  EXPECT_TRUE(be.supports(sig).ok);
  sig.device = Device{DeviceKind::cuda, 0};
  const Support no = be.supports(sig);
  EXPECT_FALSE(no.ok);
  EXPECT_NE(no.why_not.find("cuda"), std::string::npos);
  EXPECT_FALSE(CpuFlashBackend::simd_target().empty());
}

TEST(CpuFlash, TrickyShapes) {
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    for (std::int32_t d : {8, 40, 64, 80, 128, 160}) {
      Spec s = shaped({65}, {129}, 3, 1, d);
      s.dt = dt;
      s.causal = true;
      s.lse = true;
      check_all_paths(s);
    }
  }
}

TEST(CpuFlash, FeatureMatrix) {
  std::mt19937 rng(7);
  auto pick = [&](auto... xs) -> std::common_type_t<decltype(xs)...> {  // by value (vector<bool>)
    std::vector<std::common_type_t<decltype(xs)...>> v{xs...};
    return v[std::uniform_int_distribution<std::size_t>(0, v.size() - 1)(rng)];
  };
  for (int n = 0; n < 80; ++n) {
    Spec s;
    s.seed = static_cast<unsigned>(n);
    s.dt = pick(DType::f32, DType::f16, DType::bf16);
    s.d = pick(8, 16, 40, 64, 96, 128);
    s.dv = pick(0, 0, 24, 64) == 0 ? s.d : pick(24, 64);
    const std::int32_t g = pick(1, 3, 8);
    s.hkv = pick(1, 2);
    s.hq = s.hkv * g;
    s.ql = pick(QLayout::dense, QLayout::packed);
    s.kvl = pick(KvLayout::dense, KvLayout::packed, KvLayout::paged);
    const int nb = pick(1, 3);
    s.sq.clear();
    s.skv.clear();
    const std::int32_t sq0 = pick(1, 2, 7, 63, 64, 65, 129, 300);
    const std::int32_t skv0 = pick(1, 7, 63, 64, 65, 129, 600);
    for (int b = 0; b < nb; ++b) {
      const bool ragged = s.ql == QLayout::packed && s.kvl != KvLayout::dense;
      s.sq.push_back(ragged ? pick(0, 1, sq0, 33) : sq0);
      s.skv.push_back(ragged || s.kvl == KvLayout::paged ? pick(0, 1, skv0, 130) : skv0);
    }
    if (s.ql == QLayout::dense) std::fill(s.sq.begin(), s.sq.end(), s.sq[0]);
    if (s.kvl == KvLayout::dense || s.ql == QLayout::dense) {
      // keep dense kv equal-length; dense q with paged kv may still have ragged kv
      if (s.kvl == KvLayout::dense) std::fill(s.skv.begin(), s.skv.end(), s.skv[0]);
    }
    s.page = pick(1, 7, 16, 256);
    s.padded = pick(false, true);
    s.causal = pick(false, true);
    if (pick(0, 1, 2) == 0) {
      s.wl = pick(-1, 0, 5, 100);
      s.wr = pick(-1, 0, 3);
    }
    s.softcap = pick(0.0f, 0.0f, 5.0f);
    s.alibi = pick(false, true);
    s.lse = pick(false, true);
    check_all_paths(s);
    if (HasFatalFailure()) return;
  }
}

TEST(CpuFlash, DecodeSplitKv) {
  for (DType dt : {DType::f16, DType::bf16, DType::f32}) {
    Spec s = shaped({1}, {5000}, 4, 1, 128);
    s.dt = dt;
    s.lse = true;
    s.causal = true;
    check_all_paths(s);
    s.kvl = KvLayout::paged;
    s.page = 16;
    s.sq = {1, 1};
    s.skv = {3000, 70};
    check_all_paths(s);
  }
}

// Each decode kernel in `kernels`, forced, against the reference on every spec; stops at the first
// fatal failure. The lanes kernels run with each step: the one their geometry chooses, and 8 and 16
// keys fixed (Options::decode_step).
void expect_decode_kernels_match(const std::vector<Spec>& specs,
                                 std::initializer_list<cpu_flash::DecodeKernel> kernels) {
  using cpu_flash::DecodeKernel;
  for (const Spec& s : specs) {
    SCOPED_TRACE(describe(s));
    const auto want = ref(s);
    for (DecodeKernel k : kernels) {
      const bool stepped = k == DecodeKernel::lanes || k == DecodeKernel::lanes_half_dots;
      for (int step : {0, 8, 16}) {
        if (step != 0 && !stepped) continue;
        SCOPED_TRACE(std::string("decode ") + decode_kernel_name(k) + " step " + std::to_string(step));
        Options o{0, Path::fast, k};
        o.decode_step = step;
        CpuFlashBackend be(o);
        expect_close(run(be, s), want, s, "decode kernel");
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
  }
}

// Decode over a long dense f16 KV, 32/8 heads, D 128: many chunks, merged by the last one.
Spec long_dense_decode(std::int32_t skv) {
  return Spec{.dt = DType::f16, .sq = {1}, .skv = {skv}, .hq = 32, .hkv = 8, .d = 128, .dv = 128, .lse = true};
}

// Every decode kernel (by_head, grouped, lanes, lanes_half_dots) and the automatic choice against
// the reference on decode-shaped problems: GQA groups, paged caches (the engine's page 16, 3 KV
// heads), ragged batches, several query rows per sequence (speculative / chunked decode), masks,
// softcap, ALiBi, lse, padded strides, head dims that are not whole vectors (which every kernel
// runs through by_head's conversion to f32) and chunk splits with the merge.
TEST(CpuFlash, DecodeKernelsMatchReference) {
  using cpu_flash::DecodeKernel;
  std::vector<Spec> specs;
  for (DType dt : {DType::f16, DType::bf16, DType::f32}) {
    // The engine's shape: SmolLM2 decode through a paged f16 cache.
    specs.push_back({.dt = dt,
                     .sq = {1, 1, 1},
                     .skv = {37, 700, 1},
                     .hq = 9,
                     .hkv = 3,
                     .d = 64,
                     .dv = 64,
                     .ql = QLayout::packed,
                     .kvl = KvLayout::paged,
                     .page = 16,
                     .causal = true,
                     .lse = true});
  }
  specs.push_back(long_dense_decode(4100));
  // 4 queries x group 4 = 16 rows per KV head, causal + window, ALiBi, softcap.
  specs.push_back({.dt = DType::bf16,
                   .sq = {4},
                   .skv = {900},
                   .hq = 8,
                   .hkv = 2,
                   .d = 40,
                   .dv = 24,
                   .causal = true,
                   .wl = 300,
                   .softcap = 5.0f,
                   .alibi = true,
                   .lse = true});
  // Padded strides, ragged packed KV.
  specs.push_back({.dt = DType::f32,
                   .sq = {1, 2, 0},
                   .skv = {300, 33, 5},
                   .hq = 2,
                   .hkv = 2,
                   .d = 64,
                   .dv = 64,
                   .ql = QLayout::packed,
                   .kvl = KvLayout::packed,
                   .padded = true,
                   .wl = 50,
                   .wr = 0,
                   .lse = true});
  // The in-place kernels (unit strides, whole vectors) with every option: a group of 4.
  specs.push_back({.dt = DType::f16,
                   .sq = {3, 1},
                   .skv = {530, 61},
                   .hq = 8,
                   .hkv = 2,
                   .d = 64,
                   .dv = 64,
                   .ql = QLayout::packed,
                   .kvl = KvLayout::paged,
                   .page = 7,
                   .causal = true,
                   .wl = 200,
                   .softcap = 8.0f,
                   .alibi = true,
                   .lse = true});
  for (std::int32_t hq : {5, 6, 7}) {
    // GQA groups of 5, 6, 7: row groups of 2 and 3 plus a single row.
    specs.push_back({.dt = hq == 6 ? DType::bf16 : DType::f16,
                     .sq = {2},
                     .skv = {1000},
                     .hq = hq,
                     .hkv = 1,
                     .d = 64,
                     .dv = 64,
                     .causal = true,
                     .wl = hq == 7 ? 400 : -1,
                     .lse = true});
  }
  expect_decode_kernels_match(specs, {DecodeKernel::automatic, DecodeKernel::by_head, DecodeKernel::grouped,
                                      DecodeKernel::lanes, DecodeKernel::lanes_half_dots});
}

// The memory-order decode kernels (grouped, lanes, lanes_half_dots) and by_head against the
// reference over the contract their in-place kernels take: K/V dtypes f16/bf16/f32, GQA groups of
// 1, 3, 4 and 8 (one and two row groups of four), paged caches with odd page sizes, ragged lengths
// that end within a step (grouped: eight keys; lanes: one per lane), several queries per sequence,
// causal, windows, softcap, ALiBi and lse, and a long sequence split into chunks that are merged.
TEST(CpuFlash, DecodeInPlaceKernelsMatchReference) {
  using cpu_flash::DecodeKernel;
  std::vector<Spec> specs;
  int n = 0;
  for (DType dt : {DType::f16, DType::bf16, DType::f32})
    for (std::int32_t group : {1, 3, 4, 8}) {
      Spec s{.dt = dt,
             .sq = {1, group <= 4 ? 2 : 1, 1},
             .skv = {1000, 37, 3},
             .hq = 2 * group,
             .hkv = 2,
             .d = 64,
             .dv = 64,
             .ql = QLayout::packed,
             .kvl = KvLayout::paged,
             .page = n % 2 == 0 ? 5 : 13,
             .causal = true,
             .lse = true,
             .seed = static_cast<unsigned>(10 + n)};
      switch (n++ % 4) {
        case 0: break;
        case 1: s.softcap = 6.0f; break;
        case 2:
          s.alibi = true;
          s.wl = 150;
          break;
        default:
          s.wl = 64;
          s.wr = 0;
          s.softcap = 3.0f;
          s.alibi = true;
          break;
      }
      specs.push_back(s);
    }
  specs.push_back(long_dense_decode(5003));
  expect_decode_kernels_match(
      specs, {DecodeKernel::by_head, DecodeKernel::grouped, DecodeKernel::lanes, DecodeKernel::lanes_half_dots});
}

// Scores that rise along the keys (Spec::key_ramp), so that the grouped kernels' lazy rescaling
// (SoftmaxBelowRunningMax) meets blocks that stay within the running max's slack, with
// probabilities above 1, and blocks that exceed it (every few blocks, and once by far at key 2500),
// which take the exact path and rescale what the lazy blocks accumulated: every decode kernel,
// against the reference, with lse, for one and two query rows per sequence and a split into chunks.
TEST(CpuFlash, DecodeRisingScoresMatchReference) {
  using cpu_flash::DecodeKernel;
  std::vector<Spec> specs;
  for (DType dt : {DType::f32, DType::f16, DType::bf16})
    specs.push_back({.dt = dt,
                     .sq = {1},
                     .skv = {3000},
                     .hq = 8,
                     .hkv = 2,
                     .d = 64,
                     .dv = 64,
                     .lse = true,
                     .key_ramp = 1.0f / 400.0f});
  specs.push_back({.dt = DType::f16,
                   .sq = {2, 2},
                   .skv = {2700, 2700},
                   .hq = 12,
                   .hkv = 3,
                   .d = 128,
                   .dv = 128,
                   .causal = true,
                   .lse = true,
                   .key_ramp = 1.0f / 300.0f});
  expect_decode_kernels_match(specs, {DecodeKernel::automatic, DecodeKernel::by_head, DecodeKernel::grouped,
                                      DecodeKernel::lanes, DecodeKernel::lanes_half_dots});
}

// Builds s into b with a NaN at element `at` of its f32 buffer `buf` and runs `opts` on it in place.
void run_with_nan(const Spec& s, const Options& opts, Built& b, std::vector<float> Built::*buf, std::size_t at) {
  build(s, b);
  (b.*buf)[at] = std::numeric_limits<float>::quiet_NaN();
  auto vp = validate(b.p);
  ASSERT_TRUE(vp.is_ok()) << vp.status().to_string();
  CpuFlashBackend be(opts);
  ASSERT_TRUE(be.run(*vp, {}).is_ok());
}

// Expects o[i][h][x] of b (one f32 sequence of s, dense queries) NaN where nan(i, h, x) holds and
// finite elsewhere.
template <typename Pred>
void expect_nan_where(const Built& b, const Spec& s, Pred&& nan) {
  for (std::int32_t i = 0; i < s.sq[0]; ++i)
    for (std::int32_t h = 0; h < s.hq; ++h)
      for (std::int32_t x = 0; x < s.dv; ++x) {
        const float o = b.o32[static_cast<std::size_t>((i * s.hq + h) * s.dv + x)];
        if (nan(i, h, x)) EXPECT_TRUE(std::isnan(o)) << i << "," << h << "," << x;
        else EXPECT_TRUE(std::isfinite(o)) << i << "," << h << "," << x;
      }
}

// An f16 output is the f32 output rounded by f32_to_f16, bit for bit, on every SIMD target and
// for the decode kernels that write it (whole vectors through the target's conversion, the tail
// one by one): a conversion that truncates, saturates or flushes differs on about half the elements.
TEST(CpuFlash, DecodeF16OutputIsRoundedF32Output) {
  using cpu_flash::DecodeKernel;
  Spec s{.dt = DType::f16,
         .sq = {1, 2},
         .skv = {700, 90},
         .hq = 8,
         .hkv = 2,
         .d = 64,
         .dv = 72,
         .ql = QLayout::packed,
         .kvl = KvLayout::packed,
         .causal = true,
         .lse = true};
  for (const std::string& target : CpuFlashBackend::simd_targets()) {
    ASSERT_TRUE(CpuFlashBackend::force_simd_target(target));
    for (DecodeKernel k : {DecodeKernel::automatic, DecodeKernel::by_head, DecodeKernel::grouped, DecodeKernel::lanes,
                           DecodeKernel::lanes_half_dots}) {
      SCOPED_TRACE(target + " decode " + decode_kernel_name(k));
      Built b;
      build(s, b);
      CpuFlashBackend be(Options{0, Path::fast, k});
      auto vp = validate(b.p);
      ASSERT_TRUE(vp.is_ok()) << vp.status().to_string();
      ASSERT_TRUE(be.run(*vp, {}).is_ok());
      std::vector<float> o32(b.o16.size(), 0.0f);
      b.p.o.dtype = DType::f32;
      b.p.o.data = o32.data();
      auto vp32 = validate(b.p);
      ASSERT_TRUE(vp32.is_ok()) << vp32.status().to_string();
      ASSERT_TRUE(be.run(*vp32, {}).is_ok());
      int differ = 0;
      for (std::size_t e = 0; e < o32.size(); ++e) differ += b.o16[e] != f32_to_f16(o32[e]) ? 1 : 0;
      EXPECT_EQ(differ, 0) << "of " << o32.size();
    }
  }
  ASSERT_TRUE(CpuFlashBackend::force_simd_target(""));
}

// A NaN value that only the second of two queries can see, read by the decode kernels in place
// (D 16) and through scratch (D 20, not whole vectors of 8 or 16 lanes: converted to f32 first):
// only the rows of that query are NaN.
TEST(CpuFlash, DecodeNanOnlyWhereVisible) {
  using cpu_flash::DecodeKernel;
  for (DecodeKernel k : {DecodeKernel::automatic, DecodeKernel::by_head, DecodeKernel::grouped, DecodeKernel::lanes,
                         DecodeKernel::lanes_half_dots}) {
    for (std::int32_t d : {16, 20}) {
      SCOPED_TRACE(std::string(decode_kernel_name(k)) + " D " + std::to_string(d));
      Spec s = shaped({2}, {600}, 4, 1, d);
      s.causal = true;
      Built b;
      ASSERT_NO_FATAL_FAILURE(
          run_with_nan(s, Options{0, Path::fast, k}, b, &Built::v32, static_cast<std::size_t>(599 * d + 5)));
      expect_nan_where(b, s, [](std::int32_t i, std::int32_t, std::int32_t x) { return i == 1 && x == 5; });
    }
  }
}

TEST(CpuFlash, ThreadCountIndependent) {
  Spec s;
  s.dt = DType::bf16;
  s.d = s.dv = 128;
  s.sq = {300};
  s.skv = {2100};
  s.hq = 8;
  s.hkv = 2;
  s.causal = true;
  s.lse = true;
  for (int sq : {300, 1}) {
    s.sq = {sq};
    CpuFlashBackend one(Options{1, Path::fast});
    CpuFlashBackend two(Options{2, Path::fast});
    const Out a = run(one, s), b = run(two, s);
    ASSERT_EQ(a.o.size(), b.o.size());
    EXPECT_EQ(0, std::memcmp(a.o.data(), b.o.data(), a.o.size() * sizeof(float)));
    EXPECT_EQ(0, std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)));
  }
}

TEST(CpuFlash, FullyMaskedRows) {
  Spec s;
  s.sq = {40};
  s.skv = {20};  // with causal, the first 20 query rows see no key
  s.causal = true;
  s.lse = true;
  s.d = s.dv = 32;
  for (Path path : {Path::fast, Path::generic}) {
    CpuFlashBackend be(Options{0, path});
    const Out out = run(be, s);
    for (std::int64_t i = 0; i < 20; ++i)
      for (std::int32_t h = 0; h < s.hq; ++h) {
        EXPECT_EQ(out.lse[static_cast<std::size_t>(i * s.hq + h)], -std::numeric_limits<float>::infinity());
        for (std::int64_t x = 0; x < s.dv; ++x)
          EXPECT_EQ(out.o[static_cast<std::size_t>((i * s.hq + h) * s.dv + x)], 0.0f);
      }
    EXPECT_TRUE(std::isfinite(out.o.back()));
  }
  check_all_paths(s);
}

// Every path.
std::vector<Options> every_path() { return {Options{0, Path::fast}, Options{0, Path::generic}}; }

// NaN stored in a value only the last query row can see (causal): only that row is NaN.
TEST(CpuFlash, NanOnlyWhereVisible) {
  for (std::int32_t sq : {64, 1}) {
    for (const Options& path : every_path()) {
      Spec s = shaped({sq}, {64}, 1, 1, 16);
      s.causal = true;
      Built b;
      ASSERT_NO_FATAL_FAILURE(run_with_nan(s, path, b, &Built::v32, 63 * 16 + 5));
      expect_nan_where(b, s, [&](std::int32_t i, std::int32_t, std::int32_t x) { return i == sq - 1 && x == 5; });
    }
  }
}

TEST(CpuFlash, NanInQueryRow) {
  for (const Options& path : every_path()) {
    Spec s = shaped({33}, {200}, 2, 1, 16);
    s.lse = true;
    Built b;
    ASSERT_NO_FATAL_FAILURE(run_with_nan(s, path, b, &Built::q32, (5 * 2 + 1) * 16 + 3));  // row 5, head 1
    const auto bad = [](std::int32_t i, std::int32_t h) { return i == 5 && h == 1; };
    expect_nan_where(b, s, [&](std::int32_t i, std::int32_t h, std::int32_t) { return bad(i, h); });
    for (std::int32_t i = 0; i < 33; ++i)
      for (std::int32_t h = 0; h < 2; ++h)
        EXPECT_EQ(bad(i, h), std::isnan(b.lse[static_cast<std::size_t>(h * 33 + i)])) << i << "," << h;
  }
}

// The online softmax's exp (FastExp) on every SIMD target: a few ulp of std::exp where a softmax weight
// can matter, exactly 0 for -inf (masked keys) and far below, NaN kept.
TEST(CpuFlash, FastExpMatchesStdExp) {
  std::vector<float> x;
  for (float v = -100.0f; v <= 1.0f; v += 0.001953125f) x.push_back(v);
  for (float v : {0.0f, -0.0f, -1e-30f, -85.99f, -86.01f, -1e30f, 80.0f}) x.push_back(v);
  x.push_back(-std::numeric_limits<float>::infinity());
  x.push_back(std::numeric_limits<float>::quiet_NaN());
  std::vector<float> y(x.size());
  for (const std::string& target : CpuFlashBackend::simd_targets()) {
    SCOPED_TRACE(target);
    ASSERT_TRUE(CpuFlashBackend::force_simd_target(target));
    for (std::size_t n : {x.size(), std::size_t{5}}) {  // whole vectors and a partial one
      std::fill(y.begin(), y.end(), -1.0f);
      cpu_flash::fast_exp(x.data(), y.data(), n);
      for (std::size_t i = 0; i < n; ++i) {
        const double want = std::exp(static_cast<double>(x[i]));
        if (std::isnan(x[i])) {
          EXPECT_TRUE(std::isnan(y[i]));
        } else if (x[i] < -86.0f) {
          EXPECT_EQ(y[i], 0.0f) << x[i];
        } else {
          EXPECT_LE(std::abs(y[i] - want), 4.8e-7 * want) << "exp(" << x[i] << ") = " << y[i] << " want " << want;
        }
      }
    }
  }
  CpuFlashBackend::force_simd_target("");
}

// The lanes kernels take steps of 8 keys where one head's rows of a 16-key step crowd an L1 set
// (more than two lines of 64 bytes in one of 64 sets; four for MHA): rows 1 KiB apart put 4 lines
// in a set, 2 KiB 8, 4 KiB all 16 rows' first lines; 384 bytes (3 KV heads of D64 f16) spread
// them out. Only calls that read more than kDecodeShortStepsMinBytes of K/V.
TEST(CpuFlash, ShortDecodeStepsWhereRowsCrowdL1Sets) {
  EXPECT_EQ(cpu_flash::step_lines_per_set(1024, 128, 16), 4);
  EXPECT_EQ(cpu_flash::step_lines_per_set(2048, 256, 16), 8);
  EXPECT_EQ(cpu_flash::step_lines_per_set(4096, 128, 16), 16);
  EXPECT_EQ(cpu_flash::step_lines_per_set(384, 128, 16), 1);
  EXPECT_EQ(cpu_flash::step_lines_per_set(-1024, 128, 16), 4);
  EXPECT_EQ(cpu_flash::step_lines_per_set(1024, 128, 8), 2);
  EXPECT_EQ(cpu_flash::step_lines_per_set(0, 128, 16), 1);   // one row read 16 times
  EXPECT_EQ(cpu_flash::step_lines_per_set(64, 128, 16), 1);  // overlapping rows: 17 consecutive lines
  auto short_steps = [](Spec s) {
    Built b;
    build(s, b);
    auto vp = validate(b.p);
    EXPECT_TRUE(vp.is_ok()) << vp.status().to_string();
    return vp.is_ok() && cpu_flash::decode_short_steps(*vp, 1e9);
  };
  EXPECT_TRUE(short_steps({.dt = DType::f16, .sq = {1}, .skv = {64}, .hq = 32, .hkv = 8, .d = 64, .dv = 64}));
  EXPECT_TRUE(short_steps({.dt = DType::bf16, .sq = {1}, .skv = {64}, .hq = 32, .hkv = 8, .d = 128, .dv = 128}));
  EXPECT_TRUE(short_steps({.dt = DType::f32, .sq = {1}, .skv = {64}, .hq = 8, .hkv = 8, .d = 64, .dv = 64}));
  EXPECT_TRUE(short_steps({.dt = DType::f16, .sq = {1}, .skv = {64}, .hq = 8, .hkv = 8, .d = 128, .dv = 128}));
  // MHA needs more than four lines in a set (its short steps run narrower passes).
  EXPECT_FALSE(short_steps({.dt = DType::f16, .sq = {1}, .skv = {64}, .hq = 8, .hkv = 8, .d = 64, .dv = 64}));
  EXPECT_FALSE(short_steps({.dt = DType::f16,
                            .sq = {1},
                            .skv = {64},
                            .hq = 9,
                            .hkv = 3,
                            .d = 64,
                            .dv = 64,
                            .kvl = KvLayout::paged,
                            .page = 16}));
  EXPECT_FALSE(short_steps({.dt = DType::f16, .sq = {1}, .skv = {64}, .hq = 8, .hkv = 2, .d = 64, .dv = 64}));
  // A call whose K/V stays in cache keeps 16 whatever its geometry.
  Built b;
  build({.dt = DType::f16, .sq = {1}, .skv = {64}, .hq = 32, .hkv = 8, .d = 64, .dv = 64}, b);
  auto vp = validate(b.p);
  ASSERT_TRUE(vp.is_ok()) << vp.status().to_string();
  EXPECT_FALSE(cpu_flash::decode_short_steps(*vp, cpu_flash::kDecodeShortStepsMinBytes));
  EXPECT_TRUE(cpu_flash::decode_short_steps(*vp, 2 * cpu_flash::kDecodeShortStepsMinBytes));
}

// The decode kernel rule (choose_decode_kernel) on the facts of each machine class and shape.
TEST(CpuFlash, DecodeKernelRule) {
  using cpu_flash::DecodeChoice;
  using cpu_flash::DecodeFacts;
  using cpu_flash::DecodeKernel;
  constexpr double MiB = 1024.0 * 1024.0;
  auto pick = [](int lanes, bool amd, bool in_place, double bytes, bool crowd) {
    return cpu_flash::choose_decode_kernel(DecodeFacts{lanes, amd, in_place, bytes, crowd});
  };
  // AVX-512: lanes (Intel) or lanes_half_dots (AMD), in cache and streamed alike.
  EXPECT_EQ(pick(16, false, true, 0.5 * MiB, false), (DecodeChoice{DecodeKernel::lanes, false}));
  EXPECT_EQ(pick(16, false, true, 256 * MiB, false), (DecodeChoice{DecodeKernel::lanes, false}));
  EXPECT_EQ(pick(16, true, true, 0.5 * MiB, false), (DecodeChoice{DecodeKernel::lanes_half_dots, false}));
  EXPECT_EQ(pick(16, true, true, 256 * MiB, false), (DecodeChoice{DecodeKernel::lanes_half_dots, false}));
  // ... in steps of 8 keys where more than 8 MiB of K/V crowd the L1 sets.
  EXPECT_EQ(pick(16, true, true, 256 * MiB, true), (DecodeChoice{DecodeKernel::lanes_half_dots, true}));
  EXPECT_EQ(pick(16, false, true, 9 * MiB, true), (DecodeChoice{DecodeKernel::lanes, true}));
  EXPECT_EQ(pick(16, false, true, 8 * MiB, true), (DecodeChoice{DecodeKernel::lanes, false}));
  // AVX2 and narrower: by_head up to 1 MiB of K/V, grouped beyond, never short steps.
  for (int lanes : {8, 4, 1}) {
    for (bool amd : {false, true}) {
      EXPECT_EQ(pick(lanes, amd, true, 1 * MiB, true), (DecodeChoice{DecodeKernel::by_head, false}));
      EXPECT_EQ(pick(lanes, amd, true, 1 * MiB + 1, true), (DecodeChoice{DecodeKernel::grouped, false}));
      EXPECT_EQ(pick(lanes, amd, true, 256 * MiB, false), (DecodeChoice{DecodeKernel::grouped, false}));
    }
  }
  // Layouts that cannot be read in place: by_head everywhere.
  for (int lanes : {16, 8})
    for (double bytes : {0.5 * MiB, 256 * MiB})
      EXPECT_EQ(pick(lanes, true, false, bytes, true), (DecodeChoice{DecodeKernel::by_head, false}));

  // The facts of real calls on this machine, and the automatic path runs what the rule picks.
  const int lanes = cpu_flash::decode_lane_keys();
  auto facts = [&](const Spec& s) {
    Built b;
    build(s, b);
    auto vp = validate(b.p);
    EXPECT_TRUE(vp.is_ok()) << vp.status().to_string();
    return cpu_flash::decode_facts(*vp, cpu_flash::make_decode_plan(*vp).seq_kv_bytes_max);
  };
  const Spec gqa{.dt = DType::f16, .sq = {1}, .skv = {4096}, .hq = 32, .hkv = 8, .d = 64, .dv = 64, .lse = true};
  const DecodeFacts f = facts(gqa);
  EXPECT_EQ(f.simd_lanes, lanes);
  EXPECT_EQ(f.amd, cpu_flash::cpu_is_amd());
  EXPECT_TRUE(f.kv_in_place);
  EXPECT_EQ(f.kv_bytes, 4096.0 * 8 * (64 * 2 + 64 * 2));
  Spec padded = gqa;  // gaps between heads and keys: still unit strides along the head dim
  padded.padded = true;
  EXPECT_TRUE(facts(padded).kv_in_place);
  Spec odd_dim = gqa;
  odd_dim.d = odd_dim.dv = 20;
  EXPECT_EQ(facts(odd_dim).kv_in_place, lanes <= 4);
  for (std::int32_t skv : {1000, 20000}) {
    Spec s = gqa;
    s.skv = {skv};
    const DecodeChoice choice = cpu_flash::choose_decode_kernel(facts(s));
    SCOPED_TRACE(std::string("rule: ") + decode_kernel_name(choice.kernel));
    CpuFlashBackend automatic(Options{0, Path::fast});
    CpuFlashBackend chosen(Options{0, Path::fast, choice.kernel, choice.short_steps ? 8 : 16});
    const Out a = run(automatic, s), c = run(chosen, s);
    ASSERT_EQ(a.o.size(), c.o.size());
    EXPECT_EQ(0, std::memcmp(a.o.data(), c.o.data(), a.o.size() * sizeof(float)));
    EXPECT_EQ(0, std::memcmp(a.lse.data(), c.lse.data(), a.lse.size() * sizeof(float)));
  }
}

// run() reuses the plan that workspace_size() built for the same shape on the same thread, and
// never one built for another: each problem below differs from the one before it in one fact a
// plan depends on, runs right after the other's workspace_size() (with its own scratch), and must
// match the reference and a run of its own, bit for bit.
TEST(CpuFlash, PlanOnlyReusedForItsShape) {
  Spec decode{.dt = DType::f16,
              .sq = {1, 1},
              .skv = {3000, 70},
              .hq = 9,
              .hkv = 3,
              .d = 64,
              .dv = 64,
              .ql = QLayout::packed,
              .kvl = KvLayout::paged,
              .page = 16,
              .causal = true,
              .lse = true};
  std::vector<Spec> specs{decode};
  specs.push_back(specs.back());
  specs.back().skv = {3000, 71};  // a sequence length
  specs.push_back(specs.back());
  specs.back().sq = {1, 2};  // a query count (decode-shaped still)
  specs.push_back(specs.back());
  specs.back().wl = 100;  // a window
  specs.push_back(specs.back());
  specs.back().causal = false;
  specs.push_back(specs.back());
  specs.back().hq = 6;  // the heads
  specs.push_back(specs.back());
  specs.back().dt = DType::bf16;
  Spec prefill = shaped({300}, {700}, 4, 2, 64);
  prefill.causal = true;
  prefill.lse = true;
  specs.push_back(prefill);
  specs.push_back(prefill);
  specs.back().skv = {900};
  specs.push_back(prefill);
  specs.back().wr = 0;
  specs.back().wl = 64;
  CpuFlashBackend be(Options{0, Path::fast});
  for (std::size_t n = 1; n < specs.size(); ++n) {
    const Spec& s = specs[n];
    SCOPED_TRACE(describe(s));
    Built before, b;
    build(specs[n - 1], before);
    build(s, b);
    auto vp_before = validate(before.p);
    auto vp = validate(b.p);
    ASSERT_TRUE(vp_before.is_ok() && vp.is_ok());
    EXPECT_GT(be.workspace_size(*vp_before), 0u);
    ASSERT_TRUE(be.run(*vp, {}).is_ok());
    const Out alone = run(be, s);  // workspace_size() for its own shape, then run()
    // o is unpadded, so its storage order is Out's logical order.
    const std::size_t n_o = s.dt == DType::f32 ? b.o32.size() : b.o16.size();
    ASSERT_EQ(alone.o.size(), n_o);
    for (std::size_t e = 0; e < n_o; ++e) {
      const float got = s.dt == DType::f32   ? b.o32[e]
                        : s.dt == DType::f16 ? f16_to_f32(b.o16[e])
                                             : bf16_to_f32(b.o16[e]);
      ASSERT_EQ(std::memcmp(&got, &alone.o[e], sizeof(float)), 0) << e;
    }
    expect_close(alone, ref(s), s, "after another shape's workspace_size");
  }
}

TEST(CpuFlash, ConcurrentRuns) {
  Spec s;
  s.dt = DType::f16;
  s.sq = {100};
  s.skv = {300};
  s.hq = 4;
  s.hkv = 2;
  s.causal = true;
  CpuFlashBackend be(Options{0, Path::fast});
  const Out want = run(be, s);
  std::vector<std::thread> ts;
  std::atomic<int> mismatches{0};
  for (int k = 0; k < 3; ++k)
    ts.emplace_back([&] {
      for (int rep = 0; rep < 5; ++rep) {
        const Out got = run(be, s);
        if (std::memcmp(got.o.data(), want.o.data(), want.o.size() * sizeof(float)) != 0) ++mismatches;
      }
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(mismatches.load(), 0);
}

// Batch invariance: one sequence's results do not depend on what else is in the call.
//
// A batch is built as the engine builds one (llama_model.cpp): packed f32 queries, a paged K/V
// cache (blocks of 16 keys, each sequence's blocks scattered through the pool), causal. Each
// sequence's queries, keys and values come from its own seed, so the same sequence holds the same
// values wherever it lands in a batch.
struct InvariantSeq {
  std::int32_t sq = 1, skv = 1;  // query rows (the last sq positions) and keys
  unsigned seed = 1;
};

struct InvariantShape {
  DType kv = DType::f16;
  std::int32_t hq = 9, hkv = 3, d = 64;
  std::int64_t window_left = -1;
  float softcap = 0.0f;
};

struct InvariantBatch {
  std::vector<float> q, o, lse;
  std::vector<std::uint16_t> k16, v16;
  std::vector<float> k32, v32;
  std::vector<std::int32_t> cu_q, seqlens, table;
  AttentionProblem p;
};

void build_invariant(const InvariantShape& sh, const std::vector<InvariantSeq>& seqs, unsigned layout_seed,
                     InvariantBatch& out) {
  constexpr std::int32_t kPage = 16;
  const auto B = static_cast<std::int32_t>(seqs.size());
  std::int32_t max_blocks = 1, n_blocks = 0;
  out.cu_q.assign(1, 0);
  for (const InvariantSeq& s : seqs) {
    out.cu_q.push_back(out.cu_q.back() + s.sq);
    out.seqlens.push_back(s.skv);
    max_blocks = std::max(max_blocks, (s.skv + kPage - 1) / kPage);
    n_blocks += (s.skv + kPage - 1) / kPage;
  }
  // Every sequence's blocks at places in the pool that depend on the batch (layout_seed).
  std::vector<std::int32_t> where(static_cast<std::size_t>(n_blocks));
  std::iota(where.begin(), where.end(), 0);
  std::mt19937 layout(layout_seed);
  std::shuffle(where.begin(), where.end(), layout);
  out.table.assign(static_cast<std::size_t>(B * max_blocks), 0);
  const std::int64_t row = static_cast<std::int64_t>(sh.hkv) * sh.d;  // elements per key row
  const std::size_t pool = static_cast<std::size_t>(n_blocks) * kPage * static_cast<std::size_t>(row);
  const bool f32 = sh.kv == DType::f32;
  if (f32) {
    out.k32.assign(pool, 0.0f);
    out.v32.assign(pool, 0.0f);
  } else {
    out.k16.assign(pool, 0);
    out.v16.assign(pool, 0);
  }
  const std::int64_t total_q = out.cu_q.back();
  out.q.assign(static_cast<std::size_t>(total_q * sh.hq * sh.d), 0.0f);
  std::size_t next = 0;
  for (std::int32_t b = 0; b < B; ++b) {
    const InvariantSeq& s = seqs[static_cast<std::size_t>(b)];
    // Cheap values in [-2, 2) (a batch holds tens of thousands of keys): xorshift, the sequence's seed.
    std::uint64_t state = 0x9e3779b97f4a7c15ull * (s.seed + 1);
    auto dist = [&state] {
      state ^= state << 13;
      state ^= state >> 7;
      state ^= state << 17;
      return static_cast<float>(static_cast<std::int64_t>(state >> 40) - (1 << 23)) / static_cast<float>(1 << 22);
    };
    for (std::int64_t e = 0; e < static_cast<std::int64_t>(s.sq) * sh.hq * sh.d; ++e)
      out.q[static_cast<std::size_t>(out.cu_q[static_cast<std::size_t>(b)] * sh.hq * sh.d + e)] = dist();
    const std::int32_t blocks = (s.skv + kPage - 1) / kPage;
    for (std::int32_t n = 0; n < blocks; ++n) out.table[static_cast<std::size_t>(b * max_blocks + n)] = where[next++];
    for (std::int32_t j = 0; j < s.skv; ++j) {
      const std::int64_t at =
          (static_cast<std::int64_t>(out.table[static_cast<std::size_t>(b * max_blocks + j / kPage)]) * kPage +
           j % kPage) *
          row;
      for (std::int64_t x = 0; x < 2 * row; ++x) {
        const float val = dist();
        const auto e = static_cast<std::size_t>(at + x % row);
        if (f32) (x < row ? out.k32 : out.v32)[e] = val;
        else (x < row ? out.k16 : out.v16)[e] = sh.kv == DType::f16 ? f32_to_f16(val) : f32_to_bf16(val);
      }
    }
  }
  out.o.assign(out.q.size(), 0.0f);
  out.lse.assign(static_cast<std::size_t>(sh.hq * total_q), 0.0f);
  AttentionProblem& p = out.p;
  p.q_layout = QLayout::packed;
  p.kv_layout = KvLayout::paged;
  p.batch = B;
  p.q = make_contiguous_view(out.q.data(), DType::f32, {total_q, sh.hq, sh.d});
  p.o = make_contiguous_view(out.o.data(), DType::f32, {total_q, sh.hq, sh.d});
  p.lse = make_contiguous_view(out.lse.data(), DType::f32, {sh.hq, total_q});
  void* kd = f32 ? static_cast<void*>(out.k32.data()) : static_cast<void*>(out.k16.data());
  void* vd = f32 ? static_cast<void*>(out.v32.data()) : static_cast<void*>(out.v16.data());
  p.k = make_contiguous_view(kd, sh.kv, {n_blocks, kPage, sh.hkv, sh.d});
  p.v = make_contiguous_view(vd, sh.kv, {n_blocks, kPage, sh.hkv, sh.d});
  p.cu_seqlens_q = out.cu_q.data();
  p.block_table = out.table.data();
  p.max_blocks_per_seq = max_blocks;
  p.seqlens_k = out.seqlens.data();
  p.causal = true;
  p.window_left = sh.window_left;
  p.softcap = sh.softcap;
}

// Runs the batch on each backend in turn and returns sequence `which`'s o and lse from each, in
// its logical order.
std::vector<Out> run_invariant(std::initializer_list<CpuFlashBackend*> backends, const InvariantShape& sh,
                               const std::vector<InvariantSeq>& seqs, std::size_t which, unsigned layout_seed) {
  InvariantBatch batch;
  build_invariant(sh, seqs, layout_seed, batch);
  auto vp = validate(batch.p);
  EXPECT_TRUE(vp.is_ok()) << vp.status().to_string();
  std::vector<Out> outs;
  if (!vp.is_ok()) return outs;
  for (CpuFlashBackend* be : backends) {
    std::fill(batch.o.begin(), batch.o.end(), 0.0f);
    std::fill(batch.lse.begin(), batch.lse.end(), 0.0f);
    std::vector<std::byte> ws(be->workspace_size(*vp) + 64);
    const Status st = be->run(*vp, {ws.data(), ws.size()});
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    const std::int64_t total_q = batch.cu_q.back();
    const std::int64_t q0 = batch.cu_q[which], q1 = batch.cu_q[which + 1];
    Out& out = outs.emplace_back();
    for (std::int64_t i = q0; i < q1; ++i)
      for (std::int32_t h = 0; h < sh.hq; ++h) {
        const float* o = batch.o.data() + (i * sh.hq + h) * sh.d;
        out.o.insert(out.o.end(), o, o + sh.d);
        out.lse.push_back(batch.lse[static_cast<std::size_t>(h * total_q + i)]);
      }
  }
  return outs;
}

bool same_bits(const Out& a, const Out& b) {
  return a.o.size() == b.o.size() && a.lse.size() == b.lse.size() && !a.o.empty() &&
         std::memcmp(a.o.data(), b.o.data(), a.o.size() * sizeof(float)) == 0 &&
         std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)) == 0;
}

// A sequence's o and lse are the same bits alone and in batches of decode steps and prompt chunks
// of any lengths, on one thread and on two: the decode path's chunks and kernel, and the tiled
// path's splits, follow from the sequence's own shape only (docs/cpu-flash.md), which is what
// lets the server promise the same text for the same seed alone or batched.
TEST(CpuFlash, BatchInvariant) {
  // Sequences under test: decode steps short and long (one chunk; several, merged), a
  // speculative-style step of 4 rows (still decode-shaped with a group of 3), prompt chunks that
  // alone split their keys (few query tiles), and a whole prompt.
  const std::vector<InvariantSeq> targets{{1, 37, 11},   {1, 700, 12},   {1, 3000, 13},  {1, 9000, 14},
                                          {4, 1500, 15}, {16, 2100, 16}, {64, 1200, 17}, {256, 256, 18}};
  // Others to batch them with: decode steps of many lengths, prompt chunks early and late.
  const std::vector<InvariantSeq> others{{1, 5, 21},     {1, 130, 22}, {1, 1024, 23},  {1, 4100, 24},
                                         {1, 12000, 25}, {2, 333, 26}, {256, 512, 27}, {64, 3000, 28},
                                         {1, 2047, 29},  {5, 260, 30}, {1, 64, 31},    {128, 128, 32}};
  // Batches around a target (at position `at`): the others' sublists and where the target goes.
  struct Mix {
    std::vector<std::size_t> with;  // indices into others
    std::size_t at;
  };
  const std::vector<Mix> mixes{
      {{0, 1, 2, 3, 4, 8, 10}, 3},                  // decode steps only
      {{6, 0, 1, 2, 3, 4, 5, 8, 9, 10}, 11},        // a prompt chunk first, decode steps after
      {{7, 11, 2, 4}, 0},                           // prompt chunks beside it
      {{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, 6},  // everything
  };
  const std::vector<InvariantShape> shapes{
      {},  // SmolLM2: 9/3 heads, D64, f16 cache
      {.kv = DType::bf16, .hq = 8, .hkv = 2, .d = 128, .window_left = 1000, .softcap = 30.0f},  // Gemma-like
      {.kv = DType::f32, .hq = 4, .hkv = 4, .d = 64},                                           // MHA, f32 cache
  };
  CpuFlashBackend one(Options{1, Path::automatic});
  CpuFlashBackend two(Options{2, Path::automatic});
  for (const InvariantShape& sh : shapes) {
    for (std::size_t t = 0; t < targets.size(); ++t) {
      const InvariantSeq& target = targets[t];
      SCOPED_TRACE("kv " + std::string(dtype_name(sh.kv)) + " heads " + std::to_string(sh.hq) + "/" +
                   std::to_string(sh.hkv) + " d" + std::to_string(sh.d) + ", sequence sq " + std::to_string(target.sq) +
                   " skv " + std::to_string(target.skv));
      const std::vector<Out> alone = run_invariant({&one, &two}, sh, {target}, 0, 1);
      ASSERT_EQ(alone.size(), 2u);
      ASSERT_FALSE(alone[0].o.empty());
      ASSERT_TRUE(same_bits(alone[0], alone[1])) << "alone, 2 threads";
      for (std::size_t m = 0; m < mixes.size(); ++m) {
        std::vector<InvariantSeq> batch;
        for (std::size_t w : mixes[m].with) batch.push_back(others[w]);
        const std::size_t at = std::min(mixes[m].at, batch.size());
        batch.insert(batch.begin() + static_cast<std::ptrdiff_t>(at), target);
        const std::vector<Out> batched = run_invariant({&one, &two}, sh, batch, at, static_cast<unsigned>(10 + m));
        ASSERT_EQ(batched.size(), 2u);
        for (int threads : {1, 2})
          EXPECT_TRUE(same_bits(alone[0], batched[static_cast<std::size_t>(threads - 1)]))
              << "batch " << m << " (" << batch.size() << " sequences), " << threads << " thread(s)";
      }
    }
  }
}

}  // namespace
}  // namespace kallpa

#include "kallpa/conformance.h"

namespace kallpa {
namespace {

// The registered backend runs the fast path; hold the generic path to the quick conformance
// matrix too, since it is the fallback for shapes the fast path declines.
TEST(CpuFlash, GenericPathPassesQuickConformance) {
  cpu_flash::CpuFlashBackend generic(cpu_flash::Options{0, cpu_flash::Path::generic});
  const auto report = conformance::run_suite(generic, conformance::generate_cases(conformance::Tier::quick));
  for (const auto& r : report.results) EXPECT_TRUE(r.passed || r.skipped) << r.case_name << ": " << r.failure;
  EXPECT_GT(report.passed(), 100u);
}

}  // namespace
}  // namespace kallpa

namespace kallpa {
namespace {

// The fast path is written once for every vector width; run it on each SIMD target this CPU can
// execute (e.g. AVX2, SSE4, SSSE3, EMU128) so that lane-count assumptions are caught even where
// the best target is the only one benchmarks exercise.
TEST(CpuFlash, EverySimdTarget) {
  const auto targets = cpu_flash::CpuFlashBackend::simd_targets();
  ASSERT_FALSE(targets.empty());
  std::string list;
  for (const std::string& t : targets) list += " " + t;
  std::printf("  cpu-flash SIMD targets on this CPU:%s\n", list.c_str());
  for (const std::string& target : targets) {
    ASSERT_TRUE(cpu_flash::CpuFlashBackend::force_simd_target(target)) << target;
    EXPECT_EQ(cpu_flash::CpuFlashBackend::simd_target(), target);
    SCOPED_TRACE(target);
    for (std::int32_t sq : {1, 5, 70}) {
      Spec s;
      s.dt = DType::f16;
      s.d = 72;
      s.dv = 40;
      s.sq = {sq};
      s.skv = {300};
      s.hq = 6;
      s.hkv = 2;
      s.causal = true;
      s.alibi = true;
      s.softcap = 4.0f;
      s.lse = true;
      s.wl = 200;
      CpuFlashBackend fast(Options{0, Path::fast});
      expect_close(run(fast, s), ref(s), s, "fast");
      if (sq > 5) continue;
      // Each decode kernel, forced: in place where the head dims are whole vectors of the target
      // (64 and 128 are for every target), else converted first (72 and 40 are not for AVX-512).
      using cpu_flash::DecodeKernel;
      for (DecodeKernel k :
           {DecodeKernel::by_head, DecodeKernel::grouped, DecodeKernel::lanes, DecodeKernel::lanes_half_dots}) {
        SCOPED_TRACE(decode_kernel_name(k));
        CpuFlashBackend forced(Options{0, Path::fast, k});
        for (std::int32_t d : {72, 64, 128}) {
          s.d = d;
          s.dv = d == 72 ? 40 : d;
          expect_close(run(forced, s), ref(s), s, "forced decode kernel");
        }
      }
      // Steps of 8 keys (AVX-512 only; elsewhere a step is the target's lanes either way).
      for (auto k : {DecodeKernel::lanes, DecodeKernel::lanes_half_dots}) {
        Options o{0, Path::fast, k};
        o.decode_step = 8;
        CpuFlashBackend stepped(o);
        s.d = s.dv = 64;
        expect_close(run(stepped, s), ref(s), s, "lanes kernel in steps of 8, D 64");
        s.d = s.dv = 128;
        expect_close(run(stepped, s), ref(s), s, "lanes kernel in steps of 8, D 128");
      }
    }
  }
  ASSERT_TRUE(cpu_flash::CpuFlashBackend::force_simd_target(""));
}

}  // namespace
}  // namespace kallpa
