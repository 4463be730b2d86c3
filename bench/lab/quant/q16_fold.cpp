// Lab: the AVX2 batched Q16 product with the 4-row fold for every batch, against production.
//
// Production (gemm_q16_avx2, quant_kernels.h) picks its tile by shape: from 4 activation rows it
// puts 8 weight rows in the lanes of a vector (each 16-row group widened once per call, then swept
// by tiles of 4 activation rows); below that, and for the 4-row groups past the last group of 16,
// it keeps a weight row's 32 products in one register and folds four rows' halves with shuffles
// (gemm_q16_rows). This program keeps its own copy of the fold, runs it for every batch on weights
// in the repacked rows4 layout (the engine's decode layout), checks it bit for bit against the
// scalar reference, then times it against production on SmolLM2-135M's matrix shapes, one thread,
// on the same quantised activations. Both sides are single kernel calls: no thread pool, no task
// split.
//
//   cmake -S . -B build-lab -DCMAKE_BUILD_TYPE=Release -DKALLPA_BUILD_LAB=ON
//   cmake --build build-lab --target lab_quant_q16_fold
//   build-lab/bench/lab/quant/lab_quant_q16_fold
//
// Exit status: 0 when every check passes (timings are printed, never judged), 1 on a mismatch,
// 77 when the machine has no AVX2 (nothing to compare).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <immintrin.h>

#include "ops/quant_kernels.h"
#include "ops/repack.h"

namespace lab {

using kallpa::ops::BlockQ16x;
using kallpa::ops::GgmlType;
using kallpa::ops::kQK;
using kallpa::ops::kernels::block_geom;
using kallpa::ops::kernels::BlockGeom;

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

// --- a copy of production's folding tile (quant_dot_avx2.cpp), rows4 layout only ---

// The rows4 group of rows r0..r0+3 at block b: d[4], m[4] (Q4_1), then the 4 rows' quants.
template <GgmlType T>
const std::byte* group_block(const std::byte* w, std::size_t row_bytes, std::int64_t r0, std::int64_t b) {
  return w + static_cast<std::size_t>(r0) * row_bytes + static_cast<std::size_t>(b) * 4 * block_geom(T).bytes;
}

template <GgmlType T>
void load_scales4(const std::byte* p, float* d, float* m) {
  if constexpr (block_geom(T).has_m) {
    const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    _mm_storeu_ps(d, _mm256_castps256_ps128(dm));
    _mm_storeu_ps(m, _mm256_extractf128_ps(dm, 1));
  } else {
    const __m128 d4 = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    _mm_storeu_ps(d, d4);
    if constexpr (T == GgmlType::q4_0) _mm_storeu_ps(m, _mm_mul_ps(d4, _mm_set1_ps(-8.0f)));
  }
}

template <GgmlType T>
const std::byte* quants4(const std::byte* p, int r) {
  constexpr BlockGeom g = block_geom(T);
  return p + (g.has_m ? 16 : 8) + static_cast<std::size_t>(r) * g.qs_bytes;
}

template <GgmlType T>
void widen_block(const std::byte* qs, __m256i& w0, __m256i& w1) {
  if constexpr (T == GgmlType::q8_0) {
    w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16)));
  } else {
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    w0 = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0f));
    w1 = _mm256_srli_epi16(bytes, 4);
  }
}

inline __m256i fold_row_sums(const __m256i (&v)[4]) {
  const __m256i a = _mm256_add_epi32(_mm256_unpacklo_epi64(v[0], v[1]), _mm256_unpackhi_epi64(v[0], v[1]));
  const __m256i c = _mm256_add_epi32(_mm256_unpacklo_epi64(v[2], v[3]), _mm256_unpackhi_epi64(v[2], v[3]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, c, 0x20), _mm256_permute2x128_si256(a, c, 0x31));
}

inline __m256 pair_lanes(__m128 d4) { return _mm256_set_m128(_mm_unpackhi_ps(d4, d4), _mm_unpacklo_ps(d4, d4)); }

inline __m256 accumulate_block(const __m256i* w, const BlockQ16x& xb, __m256 d8, __m256 acc) {
  const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.qs));
  const __m256i xc = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.qs + 16));
  __m256i v[4];
  for (int r = 0; r < 4; ++r) {
    v[r] = _mm256_add_epi32(_mm256_madd_epi16(w[2 * r], xa), _mm256_madd_epi16(w[2 * r + 1], xc));
  }
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(fold_row_sums(v)), _mm256_mul_ps(d8, _mm256_broadcast_ss(&xb.d)), acc);
}

inline void store_row_sums(__m256 acc, __m128 macc, float* y) {
  _mm_storeu_ps(y, _mm_add_ps(_mm_hadd_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1)), macc));
}

constexpr std::int64_t kWideBlockVectors = 8;
constexpr std::int64_t kWideBlockFloats = 12;

template <GgmlType T, int NX>
__attribute__((noinline)) void tile_wide(const __m256i* wide, const float* scales, const BlockQ16x* xq, std::int64_t nb,
                                         __m256 (&acc_out)[4], __m128 (&macc_out)[4]) {
  constexpr bool has_m = T != GgmlType::q8_0;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, m01 = a0, m23 = a0;
  for (std::int64_t b = 0; b < nb; ++b) {
    const __m256i* wb = wide + b * kWideBlockVectors;
    const float* sb = scales + b * kWideBlockFloats;
    const __m256 d8 = _mm256_loadu_ps(sb);
    auto row = [&](std::int64_t x, __m256& acc) { acc = accumulate_block(wb, xq[x * nb + b], d8, acc); };
    auto constant_terms = [&](std::int64_t x, __m256& macc) {
      const __m128 s0 = _mm_broadcast_ss(&xq[x * nb + b].s);
      const __m128 s1 = x + 1 < NX ? _mm_broadcast_ss(&xq[(x + 1) * nb + b].s) : _mm_setzero_ps();
      macc =
          _mm256_fmadd_ps(_mm256_broadcast_ps(reinterpret_cast<const __m128*>(sb + 8)), _mm256_set_m128(s1, s0), macc);
    };
    row(0, a0);
    if constexpr (NX > 1) row(1, a1);
    if constexpr (NX > 2) row(2, a2);
    if constexpr (NX > 3) row(3, a3);
    if constexpr (has_m) {
      constant_terms(0, m01);
      if constexpr (NX > 2) constant_terms(2, m23);
    }
  }
  acc_out[0] = a0;
  acc_out[1] = a1;
  acc_out[2] = a2;
  acc_out[3] = a3;
  macc_out[0] = _mm256_castps256_ps128(m01);
  macc_out[1] = _mm256_extractf128_ps(m01, 1);
  macc_out[2] = _mm256_castps256_ps128(m23);
  macc_out[3] = _mm256_extractf128_ps(m23, 1);
}

// Every 4-row group of a rows4 matrix (nw % 4 == 0): widened once, swept by tiles of up to 4
// activation rows.
template <GgmlType T>
void gemm_q16_fold_all(const std::byte* w, std::size_t row_bytes, std::int64_t nw, const BlockQ16x* xq, std::int64_t nx,
                       std::int64_t k, float* y, std::int64_t ldy) {
  const std::int64_t nb = k / kQK;
  static std::vector<std::int16_t> wide_buf;
  static std::vector<float> scale_buf;
  wide_buf.resize(static_cast<std::size_t>(nb * kWideBlockVectors * 16));
  scale_buf.resize(static_cast<std::size_t>(nb * kWideBlockFloats));
  auto* const wide = reinterpret_cast<__m256i*>(wide_buf.data());
  float* const scales = scale_buf.data();
  for (std::int64_t r0 = 0; r0 < nw; r0 += 4) {
    for (std::int64_t b = 0; b < nb; ++b) {
      const std::byte* p = group_block<T>(w, row_bytes, r0, b);
      alignas(16) float d[4], m[4] = {};
      load_scales4<T>(p, d, m);
      float* sb = scales + b * kWideBlockFloats;
      _mm256_storeu_ps(sb, pair_lanes(_mm_load_ps(d)));
      _mm_storeu_ps(sb + 8, _mm_load_ps(m));
      for (int r = 0; r < 4; ++r) {
        __m256i lo, hi;
        widen_block<T>(quants4<T>(p, r), lo, hi);
        _mm256_storeu_si256(wide + b * kWideBlockVectors + 2 * r, lo);
        _mm256_storeu_si256(wide + b * kWideBlockVectors + 2 * r + 1, hi);
      }
    }
    for (std::int64_t x = 0; x < nx; x += 4) {
      const BlockQ16x* xt = xq + x * nb;
      const std::int64_t n = std::min<std::int64_t>(4, nx - x);
      __m256 acc[4];
      __m128 macc[4];
      switch (n) {
        case 4: tile_wide<T, 4>(wide, scales, xt, nb, acc, macc); break;
        case 3: tile_wide<T, 3>(wide, scales, xt, nb, acc, macc); break;
        case 2: tile_wide<T, 2>(wide, scales, xt, nb, acc, macc); break;
        default: tile_wide<T, 1>(wide, scales, xt, nb, acc, macc); break;
      }
      for (std::int64_t i = 0; i < n; ++i) store_row_sums(acc[i], macc[i], y + (x + i) * ldy + r0);
    }
  }
}

void fold_all(GgmlType t, const std::byte* w, std::size_t row_bytes, std::int64_t nw, const BlockQ16x* xq,
              std::int64_t nx, std::int64_t k, float* y, std::int64_t ldy) {
  switch (t) {
    case GgmlType::q8_0: gemm_q16_fold_all<GgmlType::q8_0>(w, row_bytes, nw, xq, nx, k, y, ldy); return;
    case GgmlType::q4_0: gemm_q16_fold_all<GgmlType::q4_0>(w, row_bytes, nw, xq, nx, k, y, ldy); return;
    default: gemm_q16_fold_all<GgmlType::q4_1>(w, row_bytes, nw, xq, nx, k, y, ldy); return;
  }
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// --- check, then time ---

std::uint64_t next(std::uint64_t& s) {
  s += 0x9e3779b97f4a7c15ULL;
  std::uint64_t z = s;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
std::vector<float> values(std::uint64_t seed, std::size_t n, float scale) {
  std::vector<float> v(n);
  for (float& f : v) f = scale * (static_cast<float>(next(seed) >> 40) / 16777216.0f * 2.0f - 1.0f);
  return v;
}

struct Matrix {
  GgmlType type;
  std::int64_t rows, cols;
  std::size_t row_bytes;
  std::vector<std::byte> packed;  // rows4
};

Matrix make_matrix(GgmlType t, std::int64_t rows, std::int64_t cols) {
  namespace m = kallpa::ops;
  const std::size_t row_bytes = m::row_size(t, cols);
  std::vector<std::byte> plain(row_bytes * static_cast<std::size_t>(rows));
  const auto wf = values(static_cast<std::uint64_t>(rows * 7919 + cols),
                         plain.size() / row_bytes * static_cast<std::size_t>(cols), 0.05f);
  for (std::int64_t r = 0; r < rows; ++r) {
    (void)m::quantize_row(t, wf.data() + r * cols, plain.data() + static_cast<std::size_t>(r) * row_bytes, cols);
  }
  Matrix out{t, rows, cols, row_bytes, std::vector<std::byte>(plain.size())};
  const m::WeightMatrix wm{t, plain.data(), rows, cols, row_bytes};
  auto r4 = m::repack_rows4(wm, out.packed.data());
  if (!r4) {
    std::fprintf(stderr, "repack_rows4: %s\n", r4.status().message().c_str());
    std::exit(1);
  }
  return out;
}

// Seconds per call of f and g, each the median of 9 rounds of enough calls to take ~20 ms, the
// rounds of f and g alternated so that a change in the machine's load hits both alike.
template <typename F, typename G>
std::pair<double, double> time_pair(F&& f, G&& g) {
  using clock = std::chrono::steady_clock;
  int calls = 1;
  for (;;) {
    const auto t0 = clock::now();
    for (int i = 0; i < calls; ++i) f();
    if (std::chrono::duration<double>(clock::now() - t0).count() > 0.02 || calls > (1 << 20)) break;
    calls *= 2;
  }
  auto round = [&](auto& fn) {
    const auto t0 = clock::now();
    for (int i = 0; i < calls; ++i) fn();
    return std::chrono::duration<double>(clock::now() - t0).count() / calls;
  };
  std::vector<double> tf, tg;
  for (int r = 0; r < 9; ++r) {
    tf.push_back(round(f));
    tg.push_back(round(g));
  }
  std::sort(tf.begin(), tf.end());
  std::sort(tg.begin(), tg.end());
  return {tf[tf.size() / 2], tg[tg.size() / 2]};
}

}  // namespace lab

int main() {
  namespace k = kallpa::ops::kernels;
  using kallpa::ops::GgmlType;
  if (!k::avx2_available()) {
    std::printf("no AVX2 on this machine: nothing to compare\n");
    return 77;
  }
  struct Shape {
    GgmlType type;
    std::int64_t rows, cols;
  };
  // SmolLM2-135M: q/o, k/v, gate/up, down (Q4_1), and a Q8_0 and a Q4_0 matrix for the other
  // block types.
  const Shape shapes[] = {{GgmlType::q4_1, 576, 576},  {GgmlType::q4_1, 192, 576}, {GgmlType::q4_1, 1536, 576},
                          {GgmlType::q4_1, 576, 1536}, {GgmlType::q8_0, 576, 576}, {GgmlType::q4_0, 576, 576}};
  bool ok = true;
  std::printf("%-6s %-10s %5s %12s %12s %8s\n", "type", "rows x k", "batch", "fold us", "prod us", "fold/prod");
  for (const Shape& s : shapes) {
    const lab::Matrix w = lab::make_matrix(s.type, s.rows, s.cols);
    for (std::int64_t batch : {2, 4, 5, 8, 16}) {
      const std::int64_t nb = s.cols / kallpa::ops::kQK;
      const auto x = lab::values(static_cast<std::uint64_t>(batch), static_cast<std::size_t>(batch * s.cols), 1.0f);
      std::vector<kallpa::ops::BlockQ16x> xq(static_cast<std::size_t>(batch * nb));
      for (std::int64_t b = 0; b < batch; ++b)
        k::quantize_row_q16x_avx2(x.data() + b * s.cols, xq.data() + b * nb, s.cols);
      const auto* wp = w.packed.data();
      const auto layout = kallpa::ops::WeightLayout::rows4;
      std::vector<float> ref(static_cast<std::size_t>(batch * s.rows)), fold(ref.size()), prod(ref.size());
      k::gemm_q16_scalar(s.type, layout, wp, w.row_bytes, s.rows, xq.data(), batch, s.cols, ref.data(), s.rows);
      lab::fold_all(s.type, wp, w.row_bytes, s.rows, xq.data(), batch, s.cols, fold.data(), s.rows);
      k::gemm_q16_avx2(s.type, layout, wp, w.row_bytes, s.rows, xq.data(), batch, s.cols, prod.data(), s.rows);
      const bool fold_ok = std::memcmp(ref.data(), fold.data(), ref.size() * sizeof(float)) == 0;
      const bool prod_ok = std::memcmp(ref.data(), prod.data(), ref.size() * sizeof(float)) == 0;
      if (!fold_ok || !prod_ok) {
        std::printf("MISMATCH %s %lldx%lld batch %lld:%s%s\n", std::string(kallpa::ops::ggml_type_name(s.type)).c_str(),
                    static_cast<long long>(s.rows), static_cast<long long>(s.cols), static_cast<long long>(batch),
                    fold_ok ? "" : " fold", prod_ok ? "" : " production");
        ok = false;
        continue;
      }
      const auto [t_fold, t_prod] = lab::time_pair(
          [&] { lab::fold_all(s.type, wp, w.row_bytes, s.rows, xq.data(), batch, s.cols, fold.data(), s.rows); },
          [&] {
            k::gemm_q16_avx2(s.type, layout, wp, w.row_bytes, s.rows, xq.data(), batch, s.cols, prod.data(), s.rows);
          });
      std::printf("%-6s %4lldx%-5lld %5lld %12.1f %12.1f %8.2f\n",
                  std::string(kallpa::ops::ggml_type_name(s.type)).c_str(), static_cast<long long>(s.rows),
                  static_cast<long long>(s.cols), static_cast<long long>(batch), t_fold * 1e6, t_prod * 1e6,
                  t_fold / t_prod);
    }
  }
  std::printf(ok ? "all checks passed (bit for bit against gemm_q16_scalar)\n" : "CHECKS FAILED\n");
  return ok ? 0 : 1;
}
