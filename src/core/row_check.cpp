#include "core/row_check.h"

#include <algorithm>
#include <cmath>
#include <new>

#include <fmt/format.h>

#include "kallpa/conformance.h"
#include "kallpa/half.h"

namespace kallpa::detail {
namespace {

std::uint64_t splitmix64(std::uint64_t& state) noexcept {
  std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Largest |v| over the keys row (b, i) of head h sees: the scale of its output.
double v_scale(const ValidatedProblem& vp, std::int32_t b, std::int64_t i, std::int32_t h) noexcept {
  const AttentionProblem& p = vp.problem();
  const int vr = p.v.rank;
  const std::int64_t hs = p.v.stride[static_cast<std::size_t>(vr - 2)],
                     ds = p.v.stride[static_cast<std::size_t>(vr - 1)];
  const std::int64_t kvh = h / vp.group_size();
  const auto keys = vp.visible_keys(b, i);
  double m = 0.0;
  for (std::int64_t j = keys.first; j <= keys.last; ++j) {
    const std::int64_t base = vp.v_row_offset(b, j) + kvh * hs;
    for (std::int64_t c = 0; c < vp.head_dim_v(); ++c) {
      const double x = std::abs(static_cast<double>(load_f32(p.v.dtype, p.v.data, base + c * ds)));
      if (std::isfinite(x)) m = std::max(m, x);
    }
  }
  return m;
}

// The judge's element rule; empty when `got` stands for `want`.
std::string miss(double got, double want, double atol, double rtol, double* err) {
  *err = 0.0;
  if (std::isnan(want)) return std::isnan(got) ? std::string() : "the reference is NaN (NaN must propagate)";
  if (std::isinf(want)) return got == want ? std::string() : fmt::format("the reference is {}", want);
  if (std::isnan(got)) return "NaN where the reference is finite";
  if (std::isinf(got)) return "infinite where the reference is finite";
  *err = std::abs(got - want);
  const double allowed = atol + rtol * std::abs(want);
  return *err <= allowed ? std::string() : fmt::format("error {:.3g} > allowed {:.3g}", *err, allowed);
}

}  // namespace

std::vector<OutputRow> sample_rows(const ValidatedProblem& vp, std::size_t count, bool longest, std::uint64_t seed) {
  std::vector<OutputRow> rows;
  const std::int64_t total = vp.total_q() * vp.hq();
  if (total <= 0 || count == 0) return rows;
  if (static_cast<std::uint64_t>(total) <= count) {
    for (std::int32_t b = 0; b < vp.batch(); ++b) {
      for (std::int64_t i = 0; i < vp.seqlen_q(b); ++i) {
        for (std::int32_t h = 0; h < vp.hq(); ++h) rows.push_back({b, i, h});
      }
    }
    return rows;
  }
  std::uint64_t state = seed;
  if (longest) {
    std::int32_t best = -1;
    for (std::int32_t b = 0; b < vp.batch(); ++b) {
      if (vp.seqlen_q(b) > 0 && (best < 0 || vp.seqlen_k(b) > vp.seqlen_k(best))) best = b;
    }
    const auto h = static_cast<std::int32_t>(splitmix64(state) % static_cast<std::uint64_t>(vp.hq()));
    rows.push_back({best, vp.seqlen_q(best) - 1, h});
  }
  // Uniform over all rows of the batch: a logical row index, then its sequence by a scan.
  while (rows.size() < count) {
    auto r = static_cast<std::int64_t>(splitmix64(state) % static_cast<std::uint64_t>(total));
    const auto h = static_cast<std::int32_t>(r % vp.hq());
    r /= vp.hq();
    std::int32_t b = 0;
    while (r >= vp.seqlen_q(b)) r -= vp.seqlen_q(b++);
    rows.push_back({b, r, h});
  }
  return rows;
}

RowCheck check_rows(const ValidatedProblem& vp, const AttentionOracle* oracle, std::vector<OutputRow> rows) {
  RowCheck out;
  const AttentionProblem& p = vp.problem();
  if (p.o.device.kind != DeviceKind::cpu || p.q.device.kind != DeviceKind::cpu) {
    // The oracle reads q, k and v on the host; copying a whole KV cache back per check would cost
    // more than the call it checks.
    out.verdict = RowCheck::Verdict::unverifiable;
    out.detail = fmt::format("tensors on {}, not in host memory", p.o.device.to_string());
    return out;
  }
  if (oracle == nullptr) {
    out.verdict = RowCheck::Verdict::unverifiable;
    out.detail = "no oracle registered";
    return out;
  }
  ExactRows want;
  try {
    want = oracle->compute_rows(vp, rows);
  } catch (const std::bad_alloc&) {
    out.verdict = RowCheck::Verdict::unverifiable;
    out.detail = "out of memory computing the reference rows";
    return out;
  }
  const conformance::Tolerance tol = conformance::tolerance_for(p.o.dtype);
  const int orank = p.o.rank;
  const std::int64_t o_hs = p.o.stride[static_cast<std::size_t>(orank - 2)];
  const std::int64_t o_ds = p.o.stride[static_cast<std::size_t>(orank - 1)];
  const std::int64_t dv = vp.head_dim_v();
  for (std::size_t n = 0; n < rows.size(); ++n) {
    const OutputRow& r = rows[n];
    const auto keys = vp.visible_keys(r.sequence, r.query);
    const double size_factor =
        std::sqrt(std::max(1.0, static_cast<double>(std::max<std::int64_t>(keys.last - keys.first + 1, 0)) / 4096.0));
    const double atol = tol.naive_multiple * tol.atol * size_factor;
    const std::int64_t base = vp.o_row_offset(r.sequence, r.query) + r.head * o_hs;
    // Compares the row at an absolute tolerance of atol * scale; the first miss, or empty.
    auto compare = [&](double scale, double* max_err) {
      std::string first;
      for (std::int64_t c = 0; c < dv; ++c) {
        const double got = load_f32(p.o.dtype, p.o.data, base + c * o_ds);
        const double ref = want.o[n * static_cast<std::size_t>(dv) + static_cast<std::size_t>(c)];
        double err = 0.0;
        std::string why = miss(got, ref, atol * scale, tol.rtol, &err);
        *max_err = std::max(*max_err, err);
        if (!why.empty() && first.empty()) {
          first = fmt::format("o at sequence {}, query {}, head {}, column {}: got {:.9g}, want {:.9g} ({})",
                              r.sequence, r.query, r.head, c, got, ref, why);
        }
      }
      return first;
    };
    double row_error = 0.0;
    std::string why = compare(1.0, &row_error);
    // The row's value scale costs a pass over its keys, as much as the oracle's row: only paid
    // when the row misses at scale 1, which a right answer with |v| <= 1 never does.
    if (!why.empty()) {
      const double scale = v_scale(vp, r.sequence, r.query, r.head);
      if (scale > 1.0) {
        row_error = 0.0;
        why = compare(scale, &row_error);
      }
    }
    out.max_error = std::max(out.max_error, row_error);
    if (!why.empty() && out.verdict == RowCheck::Verdict::passed) {
      out.verdict = RowCheck::Verdict::mismatch;
      out.detail = std::move(why);
    }
    if (!p.lse.present()) continue;
    const double got = static_cast<const float*>(p.lse.data)[vp.lse_offset(r.sequence, r.head, r.query)];
    double err = 0.0;
    const std::string lse_why = miss(got, want.lse[n], atol, tol.rtol, &err);
    out.max_error = std::max(out.max_error, err);
    if (!lse_why.empty() && out.verdict == RowCheck::Verdict::passed) {
      out.verdict = RowCheck::Verdict::mismatch;
      out.detail = fmt::format("lse at sequence {}, query {}, head {}: got {:.9g}, want {:.9g} ({})", r.sequence,
                               r.query, r.head, got, want.lse[n], lse_why);
    }
  }
  out.rows = std::move(rows);
  return out;
}

}  // namespace kallpa::detail
