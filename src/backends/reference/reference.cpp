// The reference backend: the contract's definition written as plain loops in double precision.
// Every other backend is judged against compute_f64(), so this file favours obviousness.
#include "backends/reference/reference.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kallpa/backend.h"
#include "kallpa/half.h"
#include "kallpa/registry.h"

namespace kallpa::reference {

double load(const TensorView& t, std::int64_t index) noexcept { return load_f32(t.dtype, t.data, index); }

void store(const TensorView& t, std::int64_t index, double value) noexcept {
  store_f32(t.dtype, t.data, index, static_cast<float>(value));
}

namespace {

// The exact answer for query i of sequence b, head h: writes dv values to o_row and the row's
// log-sum-exp to lse (left alone, -inf, when no key is visible). `scores` is reused scratch.
void exact_row(const ValidatedProblem& vp, std::int32_t b, std::int64_t i, std::int64_t h, double* o_row, double& lse,
               std::vector<double>& scores) {
  const AttentionProblem& p = vp.problem();
  const std::int64_t d = vp.head_dim(), dv = vp.head_dim_v();
  const int qr = p.q.rank, kr = p.k.rank;
  const std::int64_t q_hs = p.q.stride[static_cast<std::size_t>(qr - 2)];
  const std::int64_t q_ds = p.q.stride[static_cast<std::size_t>(qr - 1)];
  const std::int64_t k_hs = p.k.stride[static_cast<std::size_t>(kr - 2)];
  const std::int64_t k_ds = p.k.stride[static_cast<std::size_t>(kr - 1)];
  const std::int64_t v_hs = p.v.stride[static_cast<std::size_t>(kr - 2)];
  const std::int64_t v_ds = p.v.stride[static_cast<std::size_t>(kr - 1)];
  const double neg_inf = -std::numeric_limits<double>::infinity();

  const auto keys = vp.visible_keys(b, i);
  const std::int64_t pos = i + vp.seqlen_k(b) - vp.seqlen_q(b);
  const std::int64_t kvh = h / vp.group_size();
  const std::int64_t q_base = vp.q_row_offset(b, i) + h * q_hs;
  scores.clear();
  double max_score = neg_inf;  // over the non-NaN scores
  bool has_nan = false;
  for (std::int64_t j = keys.first; j <= keys.last; ++j) {
    const std::int64_t k_base = vp.k_row_offset(b, j) + kvh * k_hs;
    double dot = 0.0;
    for (std::int64_t c = 0; c < d; ++c) dot += load(p.q, q_base + c * q_ds) * load(p.k, k_base + c * k_ds);
    double s = static_cast<double>(vp.scale()) * dot;
    if (p.softcap > 0.0f) s = p.softcap * std::tanh(s / p.softcap);
    if (p.alibi_slopes) s -= static_cast<double>(p.alibi_slopes[h]) * static_cast<double>(std::llabs(pos - j));
    scores.push_back(s);
    if (std::isnan(s)) has_nan = true;
    else max_score = std::max(max_score, s);
  }
  // No visible key, or every visible score is -inf: the contract's zero row.
  if (scores.empty() || (!has_nan && max_score == neg_inf)) return;
  double sum = 0.0;
  for (double& s : scores) {
    s = std::exp(s - max_score);  // NaN stays NaN
    sum += s;
  }
  for (std::size_t n = 0; n < scores.size(); ++n) {
    const std::int64_t j = keys.first + static_cast<std::int64_t>(n);
    const std::int64_t v_base = vp.v_row_offset(b, j) + kvh * v_hs;
    const double w = scores[n] / sum;
    for (std::int64_t c = 0; c < dv; ++c) o_row[c] += w * load(p.v, v_base + c * v_ds);
  }
  lse = max_score + std::log(sum);
}

}  // namespace

Output64 compute_f64(const ValidatedProblem& vp) {
  const std::int64_t hq = vp.hq(), dv = vp.head_dim_v();
  Output64 out;
  out.o.assign(static_cast<std::size_t>(vp.total_q() * hq * dv), 0.0);
  out.lse.assign(static_cast<std::size_t>(vp.total_q() * hq), -std::numeric_limits<double>::infinity());
  std::vector<double> scores;
  std::int64_t row = 0;  // logical row over the batch
  for (std::int32_t b = 0; b < vp.batch(); ++b) {
    for (std::int64_t i = 0; i < vp.seqlen_q(b); ++i, ++row) {
      for (std::int64_t h = 0; h < hq; ++h) {
        exact_row(vp, b, i, h, &out.o[static_cast<std::size_t>((row * hq + h) * dv)],
                  out.lse[static_cast<std::size_t>(row * hq + h)], scores);
      }
    }
  }
  return out;
}

ExactRows compute_rows_f64(const ValidatedProblem& vp, std::span<const OutputRow> rows) {
  const std::int64_t dv = vp.head_dim_v();
  ExactRows out;
  out.o.assign(rows.size() * static_cast<std::size_t>(dv), 0.0);
  out.lse.assign(rows.size(), -std::numeric_limits<double>::infinity());
  std::vector<double> scores;
  for (std::size_t n = 0; n < rows.size(); ++n) {
    exact_row(vp, rows[n].sequence, rows[n].query, rows[n].head, &out.o[n * static_cast<std::size_t>(dv)], out.lse[n],
              scores);
  }
  return out;
}

namespace {

class ReferenceBackend final : public AttentionBackend, public AttentionOracle {
 public:
  std::string_view name() const noexcept override { return "reference"; }
  std::string_view version() const noexcept override { return "1.0.0"; }
  DeviceKind device_kind() const noexcept override { return DeviceKind::cpu; }
  int priority() const noexcept override { return 0; }
  std::string_view description() const noexcept override {
    return "the oracle: plain loops, double accumulation, every feature of the contract";
  }

  Support supports(const ProblemSignature& sig) const noexcept override {
    if (sig.device.kind != DeviceKind::cpu) return Support::no("reference runs on host memory only");
    return Support::yes();
  }

  const AttentionOracle* oracle() const noexcept override { return this; }
  ExactOutput compute_exact(const ValidatedProblem& vp) const override { return compute_f64(vp); }
  ExactRows compute_rows(const ValidatedProblem& vp, std::span<const OutputRow> rows) const override {
    return compute_rows_f64(vp, rows);
  }

  Status run(const ValidatedProblem& vp, Workspace) noexcept override {
    try {
      const Output64 r = compute_f64(vp);
      write(vp, r);
      return {};
    } catch (const std::bad_alloc&) {
      return Status(ErrorCode::out_of_memory, "reference", "out of memory for the double-precision result");
    }
  }

 private:
  static void write(const ValidatedProblem& vp, const Output64& r) {
    const AttentionProblem& p = vp.problem();
    const std::int64_t hq = vp.hq(), dv = vp.head_dim_v();
    const int orank = p.o.rank;
    const std::int64_t o_hs = p.o.stride[static_cast<std::size_t>(orank - 2)];
    const std::int64_t o_ds = p.o.stride[static_cast<std::size_t>(orank - 1)];
    std::int64_t row = 0;
    for (std::int32_t b = 0; b < vp.batch(); ++b) {
      for (std::int64_t i = 0; i < vp.seqlen_q(b); ++i, ++row) {
        for (std::int64_t h = 0; h < hq; ++h) {
          const std::int64_t base = vp.o_row_offset(b, i) + h * o_hs;
          for (std::int64_t c = 0; c < dv; ++c) {
            store(p.o, base + c * o_ds, r.o[static_cast<std::size_t>((row * hq + h) * dv + c)]);
          }
          if (p.lse.present()) {
            static_cast<float*>(p.lse.data)[vp.lse_offset(b, static_cast<std::int32_t>(h), i)] =
                static_cast<float>(r.lse[static_cast<std::size_t>(row * hq + h)]);
          }
        }
      }
    }
  }
};

KALLPA_REGISTER_BACKEND(ReferenceBackend);

}  // namespace
}  // namespace kallpa::reference
