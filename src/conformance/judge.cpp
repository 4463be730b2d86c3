#include "conformance/judge.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include <fmt/format.h>

#include "conformance/sampling.h"

namespace kallpa::conformance::detail {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

enum class Miss { none, want_nan, want_inf, got_nan, got_inf, too_far };

// Whether `got` stands for `want`. Sets *err to |got - want| when both are finite.
Miss classify(double got, double want, double atol, double rtol, double* err) {
  *err = 0.0;
  if (std::isnan(want)) return std::isnan(got) ? Miss::none : Miss::want_nan;
  if (std::isinf(want)) return got == want ? Miss::none : Miss::want_inf;
  if (std::isnan(got)) return Miss::got_nan;
  if (std::isinf(got)) return Miss::got_inf;
  *err = std::abs(got - want);
  return *err <= atol + rtol * std::abs(want) ? Miss::none : Miss::too_far;
}

// Formatting is only paid for the one failure a result reports.
std::string explain(Miss miss, double want, double err, double atol, double rtol) {
  switch (miss) {
    case Miss::none: return {};
    case Miss::want_nan: return "the reference is NaN (NaN must propagate)";
    case Miss::want_inf: return fmt::format("the reference is {}", want);
    case Miss::got_nan: return "NaN where the reference is finite";
    case Miss::got_inf: return "infinite where the reference is finite";
    case Miss::too_far: return fmt::format("error {:.3g} > allowed {:.3g}", err, atol + rtol * std::abs(want));
  }
  return {};
}

std::string describe_o(const CaseData& data, const OutputRow& r, std::int64_t c) {
  return data.describe_o(logical_row(data, r), r.head, c);
}
std::string describe_lse(const CaseData& data, const OutputRow& r) {
  return data.describe_lse(logical_row(data, r), r.head);
}

std::string values(double got, double want) { return fmt::format("got {:.9g}, want {:.9g}", got, want); }

// Self-check limits: how far naive same-dtype attention may stray from the reference before we
// call it a disagreement. Generous multiples of the tolerances: the point is to catch a broken
// oracle (which would otherwise inflate every case's allowance), not to grade the naive code.
double self_check_limit(DType dtype) noexcept {
  const Tolerance t = tolerance_for(dtype);
  return 8.0 * t.atol;
}

}  // namespace

Bounds bounds_for(const CaseData& data, std::span<const OutputRow> rows, const ExactRows& ref,
                  const NaiveOutput& naive) {
  Bounds b;
  const Tolerance tol = tolerance_for(data.spec.dtype);
  b.rtol = tol.rtol;
  if (ref.o.size() != naive.o.size() || ref.lse.size() != naive.lse.size()) {
    b.self_check_failure = fmt::format("reference has {} outputs, the suite expects {}", ref.o.size(), naive.o.size());
    return b;
  }
  const std::int64_t dv = data.dv;
  const double limit = self_check_limit(data.spec.dtype);
  double err = 0.0;
  for (std::size_t n = 0; n < ref.o.size() && b.self_check_failure.empty(); ++n) {
    const Miss miss = classify(naive.o[n], ref.o[n], limit, 0.0, &err);
    if (miss != Miss::none) {
      const std::string why = explain(miss, ref.o[n], err, limit, 0.0);
      const auto e = static_cast<std::int64_t>(n);
      b.self_check_failure = fmt::format(
          "self-check: naive {}-precision attention and the reference disagree at {}: naive {:.9g}, "
          "reference {:.9g} ({})",
          dtype_name(data.spec.dtype), describe_o(data, rows[static_cast<std::size_t>(e / dv)], e % dv), naive.o[n],
          ref.o[n], why);
    }
    b.naive_error_o = std::max(b.naive_error_o, err);
  }
  for (std::size_t n = 0; n < ref.lse.size() && b.self_check_failure.empty(); ++n) {
    const Miss miss = classify(naive.lse[n], ref.lse[n], limit, tol.rtol, &err);
    if (miss != Miss::none) {
      const std::string why = explain(miss, ref.lse[n], err, limit, tol.rtol);
      b.self_check_failure = fmt::format(
          "self-check: naive attention and the reference disagree at {}: naive {:.9g}, reference "
          "{:.9g} ({})",
          describe_lse(data, rows[n]), naive.lse[n], ref.lse[n], why);
    }
    b.naive_error_lse = std::max(b.naive_error_lse, err);
  }
  b.atol_o = std::max(tol.atol, tol.naive_multiple * b.naive_error_o);
  b.atol_lse = std::max(tol.atol, tol.naive_multiple * b.naive_error_lse);
  return b;
}

Verdict judge_outputs(const CaseData& data, std::span<const OutputRow> rows, const ExactRows& ref,
                      const Bounds& bounds) {
  Verdict v;
  const DType dt = data.spec.dtype;
  const std::uint32_t poison = poison_bits(dt);
  const std::uint32_t lse_poison = poison_bits(DType::f32);
  const void* o = data.ob->data();
  const void* lse = data.lseb ? data.lseb->data() : nullptr;
  const std::int64_t dv = data.dv;
  auto fail = [&](std::string message) {
    if (v.passed) v.failure = std::move(message);
    v.passed = false;
  };

  for (std::size_t n = 0; n < rows.size(); ++n) {
    const OutputRow& r = rows[n];
    const std::int32_t b = r.sequence;
    const std::int64_t i = r.query, h = r.head;
    for (std::int64_t c = 0; c < dv; ++c) {
      const std::int64_t off = data.o_offset(b, i, h, c);
      const double want = ref.o[n * static_cast<std::size_t>(dv) + static_cast<std::size_t>(c)];
      if (element_bits(o, dt, off) == poison) {
        if (v.passed)
          fail(fmt::format("{} was never written (still holds the poison value); want {:.9g}", describe_o(data, r, c),
                           want));
        v.max_abs_error = kInf;
        continue;
      }
      const double got = load_element(o, dt, off);
      double err = 0.0;
      const Miss miss = classify(got, want, bounds.atol_o, bounds.rtol, &err);
      v.max_abs_error = std::max(v.max_abs_error, miss == Miss::none || miss == Miss::too_far ? err : kInf);
      if (miss != Miss::none && v.passed) {
        fail(fmt::format("{}: {} ({})", describe_o(data, r, c), values(got, want),
                         explain(miss, want, err, bounds.atol_o, bounds.rtol)));
      }
    }
    if (!lse) continue;
    const std::int64_t off = data.lse_offset(b, h, i);
    const double want = ref.lse[n];
    if (element_bits(lse, DType::f32, off) == lse_poison) {
      if (v.passed)
        fail(fmt::format("{} was never written (still holds the poison value); want {:.9g}", describe_lse(data, r),
                         want));
      v.max_abs_error = kInf;
      continue;
    }
    const double got = load_element(lse, DType::f32, off);
    double err = 0.0;
    const Miss miss = classify(got, want, bounds.atol_lse, bounds.rtol, &err);
    v.max_abs_error = std::max(v.max_abs_error, miss == Miss::none || miss == Miss::too_far ? err : kInf);
    if (miss != Miss::none && v.passed) {
      fail(fmt::format("{}: {} ({})", describe_lse(data, r), values(got, want),
                       explain(miss, want, err, bounds.atol_lse, bounds.rtol)));
    }
  }
  // On a sampled case the rows not judged must still have been written: an element left holding
  // the poison is a missed row whatever its value should have been.
  if (static_cast<std::int64_t>(rows.size()) < data.total_q * data.hq) {
    for (std::int32_t b = 0; b < data.batch && v.passed; ++b) {
      for (std::int64_t i = 0; i < data.seqlen_q(b) && v.passed; ++i) {
        for (std::int32_t h = 0; h < data.hq && v.passed; ++h) {
          const OutputRow r{b, i, h};
          for (std::int64_t c = 0; c < dv; ++c) {
            if (element_bits(o, dt, data.o_offset(b, i, h, c)) == poison) {
              fail(fmt::format("{} was never written (still holds the poison value)", describe_o(data, r, c)));
              v.max_abs_error = kInf;
              break;
            }
          }
          if (v.passed && lse && element_bits(lse, DType::f32, data.lse_offset(b, h, i)) == lse_poison) {
            fail(fmt::format("{} was never written (still holds the poison value)", describe_lse(data, r)));
            v.max_abs_error = kInf;
          }
        }
      }
    }
  }
  // Packed rows after cu_seqlens_q[B] belong to no sequence: writing them is a stray write.
  for (std::int64_t off : data.tail_o_offsets()) {
    if (element_bits(o, dt, off) != poison) {
      fail(
          fmt::format("out-of-bounds write: o element offset {} lies in a packed row after the last "
                      "sequence (cu_seqlens_q[B] = {})",
                      off, data.total_q));
      break;
    }
  }
  for (std::int64_t off : data.tail_lse_offsets()) {
    if (element_bits(lse, DType::f32, off) != lse_poison) {
      fail(
          fmt::format("out-of-bounds write: lse element offset {} lies in a packed row after the "
                      "last sequence (cu_seqlens_q[B] = {})",
                      off, data.total_q));
      break;
    }
  }
  return v;
}

}  // namespace kallpa::conformance::detail
