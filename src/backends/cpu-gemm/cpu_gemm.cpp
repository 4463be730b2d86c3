// cpu-gemm: attention the way a user writes it with a framework on the CPU — per query block,
// scores by one BLAS GEMM, a row softmax, then a second GEMM for the values. It is the honest
// baseline the fast kernels are measured against, and a second opinion in conformance.
//
// Memory stays O(block x Skv), never O(Sq x Skv): queries are processed in blocks, and for GQA
// the query heads that share a KV head are stacked into one GEMM so K/V are gathered once.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>

#include "core/parallel.h"
#include "kallpa/backend.h"
#include "kallpa/half.h"
#include "kallpa/registry.h"

namespace kallpa {
namespace {

constexpr std::int64_t kQueryBlock = 64;  // queries per block (times the GQA group in rows)

float load_f32(const TensorView& t, std::int64_t index) noexcept { return kallpa::load_f32(t.dtype, t.data, index); }
void store_f32(const TensorView& t, std::int64_t index, float value) noexcept {
  kallpa::store_f32(t.dtype, t.data, index, value);
}

// Scratch layout, all f32: K and V of one (sequence, kv head), a query block, its scores and
// its output rows.
struct Scratch {
  float* k;
  float* v;
  float* q;
  float* s;
  float* o;
};

struct Sizes {
  std::size_t k, v, q, s, o;
  std::size_t total() const { return (k + v + q + s + o) * sizeof(float) + 5 * 64; }
};

Sizes sizes_for(const ValidatedProblem& vp) {
  const auto skv = static_cast<std::size_t>(std::max<std::int64_t>(vp.max_seqlen_k(), 1));
  const auto rows = static_cast<std::size_t>(kQueryBlock * vp.group_size());
  const auto d = static_cast<std::size_t>(vp.head_dim()), dv = static_cast<std::size_t>(vp.head_dim_v());
  return {skv * d, skv * dv, rows * d, rows * skv, rows * dv};
}

float* carve(char*& cursor, std::size_t floats) {
  auto* p = reinterpret_cast<float*>(cursor);
  cursor += (floats * sizeof(float) + 63) / 64 * 64;
  return p;
}

class CpuGemmBackend final : public AttentionBackend {
 public:
  std::string_view name() const noexcept override { return "cpu-gemm"; }
  std::string_view version() const noexcept override { return "1.0.0"; }
  DeviceKind device_kind() const noexcept override { return DeviceKind::cpu; }
  int priority() const noexcept override { return 20; }
  std::string_view description() const noexcept override {
    return "framework-style baseline: OpenBLAS GEMM for scores, row softmax, GEMM for values";
  }

  Support supports(const ProblemSignature& sig) const noexcept override {
    if (sig.device.kind != DeviceKind::cpu) return Support::no("cpu-gemm runs on host memory only");
    return Support::yes();
  }

  std::size_t workspace_size(const ValidatedProblem& vp) const noexcept override { return sizes_for(vp).total(); }

  Status run(const ValidatedProblem& vp, Workspace ws) noexcept override {
    const Sizes sz = sizes_for(vp);
    if (ws.bytes < sz.total()) {
      return Status(ErrorCode::internal, "workspace", "smaller than cpu-gemm's workspace_size()");
    }
    // OpenBLAS keeps its own threads; size them like every other CPU kernel (KALLPA_THREADS).
    static std::once_flag threads_set;
    std::call_once(threads_set, [] { openblas_set_num_threads(parallel::default_num_threads()); });
    char* cursor = static_cast<char*>(ws.data);
    Scratch scratch{carve(cursor, sz.k), carve(cursor, sz.v), carve(cursor, sz.q), carve(cursor, sz.s),
                    carve(cursor, sz.o)};
    for (std::int32_t b = 0; b < vp.batch(); ++b) {
      for (std::int32_t kvh = 0; kvh < vp.hkv(); ++kvh) run_head(vp, b, kvh, scratch);
    }
    return {};
  }

 private:
  static void run_head(const ValidatedProblem& vp, std::int32_t b, std::int32_t kvh, const Scratch& w) {
    const AttentionProblem& p = vp.problem();
    const std::int64_t sq = vp.seqlen_q(b), skv = vp.seqlen_k(b);
    const std::int64_t d = vp.head_dim(), dv = vp.head_dim_v(), group = vp.group_size();
    const auto axis = [](const TensorView& t, int from_end) {
      return t.stride[static_cast<std::size_t>(t.rank - from_end)];
    };
    if (sq == 0) return;

    // Gather this head's keys and values once, as dense f32 rows (resolves packed/paged/strided).
    for (std::int64_t j = 0; j < skv; ++j) {
      const std::int64_t kb = vp.k_row_offset(b, j) + kvh * axis(p.k, 2);
      const std::int64_t vb = vp.v_row_offset(b, j) + kvh * axis(p.v, 2);
      for (std::int64_t c = 0; c < d; ++c) w.k[j * d + c] = load_f32(p.k, kb + c * axis(p.k, 1));
      for (std::int64_t c = 0; c < dv; ++c) w.v[j * dv + c] = load_f32(p.v, vb + c * axis(p.v, 1));
    }

    for (std::int64_t i0 = 0; i0 < sq; i0 += kQueryBlock) {
      const std::int64_t nq = std::min(kQueryBlock, sq - i0);
      const std::int64_t rows = nq * group;  // row r = (query i0 + r / group, head kvh*group + r % group)
      // Keys any query of the block can see; the GEMM covers only that span.
      std::int64_t first = skv, last = -1;
      for (std::int64_t i = i0; i < i0 + nq; ++i) {
        const auto r = vp.visible_keys(b, i);
        if (r.first <= r.last) {
          first = std::min(first, r.first);
          last = std::max(last, r.last);
        }
      }
      const std::int64_t span = last >= first ? last - first + 1 : 0;

      for (std::int64_t r = 0; r < rows; ++r) {
        const std::int64_t i = i0 + r / group, h = kvh * group + r % group;
        const std::int64_t qb = vp.q_row_offset(b, i) + h * axis(p.q, 2);
        for (std::int64_t c = 0; c < d; ++c) w.q[r * d + c] = load_f32(p.q, qb + c * axis(p.q, 1));
      }
      if (span > 0) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rows), static_cast<int>(span),
                    static_cast<int>(d), vp.scale(), w.q, static_cast<int>(d), w.k + first * d, static_cast<int>(d),
                    0.0f, w.s, static_cast<int>(span));
      }
      softmax_rows(vp, b, kvh, i0, first, span, w.s, rows, w.o);
      if (span > 0 && v_has_nonfinite(w.v + first * dv, span * dv)) {
        // A GEMM would multiply masked probabilities (0) by Inf/NaN values and get NaN, but the
        // contract says masked keys are never read: accumulate over each row's visible keys.
        for (std::int64_t r = 0; r < rows; ++r) {
          const auto vis = vp.visible_keys(b, i0 + r / group);
          float* orow = w.o + r * dv;
          std::fill(orow, orow + dv, 0.0f);
          for (std::int64_t j = std::max(vis.first, first); j <= std::min(vis.last, last); ++j) {
            const float pj = w.s[r * span + (j - first)];
            for (std::int64_t c = 0; c < dv; ++c) orow[c] += pj * w.v[j * dv + c];
          }
        }
      } else if (span > 0) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(rows), static_cast<int>(dv),
                    static_cast<int>(span), 1.0f, w.s, static_cast<int>(span), w.v + first * dv, static_cast<int>(dv),
                    0.0f, w.o, static_cast<int>(dv));
      }
      for (std::int64_t r = 0; r < rows; ++r) {
        const std::int64_t i = i0 + r / group, h = kvh * group + r % group;
        const std::int64_t ob = vp.o_row_offset(b, i) + h * axis(p.o, 2);
        // Rows with no visible key were zeroed by softmax_rows (P = 0, so O = 0 too).
        for (std::int64_t c = 0; c < dv; ++c) store_f32(p.o, ob + c * axis(p.o, 1), w.o[r * dv + c]);
      }
    }
  }

  // Applies softcap, ALiBi and the mask to a block of scores, then turns each row into
  // probabilities. Writes lse when requested.
  static bool v_has_nonfinite(const float* v, std::int64_t n) {
    for (std::int64_t e = 0; e < n; ++e) {
      if (!std::isfinite(v[e])) return true;
    }
    return false;
  }

  static void softmax_rows(const ValidatedProblem& vp, std::int32_t b, std::int32_t kvh, std::int64_t i0,
                           std::int64_t first, std::int64_t span, float* s, std::int64_t rows, float* o) {
    const AttentionProblem& p = vp.problem();
    const std::int64_t sq = vp.seqlen_q(b), skv = vp.seqlen_k(b), group = vp.group_size();
    const float neg_inf = -std::numeric_limits<float>::infinity();
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t i = i0 + r / group;
      const auto head = static_cast<std::int32_t>(kvh * group + r % group);
      float* row = s + r * span;
      const auto vis = vp.visible_keys(b, i);
      const std::int64_t pos = i + skv - sq;
      const float slope = p.alibi_slopes ? p.alibi_slopes[head] : 0.0f;
      float max_score = neg_inf;
      bool has_nan = false;
      for (std::int64_t n = 0; n < span; ++n) {
        const std::int64_t j = first + n;
        if (j < vis.first || j > vis.last) {
          row[n] = neg_inf;
          continue;
        }
        float x = row[n];
        if (p.softcap > 0.0f) x = p.softcap * std::tanh(x / p.softcap);
        if (p.alibi_slopes) x -= slope * static_cast<float>(std::llabs(pos - j));
        row[n] = x;
        if (std::isnan(x)) has_nan = true;
        else max_score = std::max(max_score, x);
      }
      float lse = neg_inf;
      if (!has_nan && max_score == neg_inf) {
        // No visible key or all scores -inf: the contract's zero row.
        std::fill(row, row + span, 0.0f);
        std::fill(o + r * vp.head_dim_v(), o + (r + 1) * vp.head_dim_v(), 0.0f);
      } else {
        float sum = 0.0f;
        for (std::int64_t n = 0; n < span; ++n) {
          const std::int64_t j = first + n;
          const float e = (j < vis.first || j > vis.last) ? 0.0f : std::exp(row[n] - max_score);
          row[n] = e;
          sum += e;
        }
        const float inv = 1.0f / sum;
        for (std::int64_t n = 0; n < span; ++n) row[n] *= inv;
        lse = max_score + std::log(sum);
      }
      if (p.lse.present()) {
        static_cast<float*>(p.lse.data)[vp.lse_offset(b, head, i)] = lse;
      }
    }
  }
};

KALLPA_REGISTER_BACKEND(CpuGemmBackend);

}  // namespace
}  // namespace kallpa
