// Running cases: build a case once (inputs, reference, naive bounds), then for each backend reset
// the outputs to poison, run it directly (not through the dispatcher), and check everything it
// could have got wrong: its status, its inputs, its workspace bounds, the guards around and
// between its outputs, and finally the numbers.
#include <algorithm>
#include <cstring>
#include <exception>
#include <functional>
#include <future>
#include <new>
#include <optional>

#include <fmt/format.h>

#include "conformance/case_data.h"
#include "conformance/judge.h"
#include "conformance/naive.h"
#include "conformance/sampling.h"
#include "kallpa/conformance.h"
#include "kallpa/device.h"
#include "kallpa/registry.h"

namespace kallpa::conformance {

// Output tolerances by input dtype. The output is stored in the input dtype, so one rounding of
// the result alone costs half an ulp: 2^-24 (f32), 2^-11 (f16), 2^-8 (bf16) relative.
//  * rtol: two full ulps for f16 (2^-9) and bf16 (2^-6), i.e. that rounding plus as much again for
//    a summation order different from the reference's; f32 gets 1e-5 (~80 ulps) because a 4k-key
//    row accumulated in f32 in any order can drift that far, and nothing is rounded afterwards.
//  * atol: values near zero, where relative error means nothing. A kernel may (as FlashAttention
//    does) round the probabilities to the dtype before P.V, which costs about one ulp of the
//    largest |v| (inputs lie in [-1, 1]): 2^-10 ~ 1e-3 for f16 -> 2e-3, 2^-7 ~ 7.8e-3 for
//    bf16 -> 1.6e-2. f32 kernels keep f32 probabilities; 1e-5 is ~100x their rounding error.
//  * naive_multiple 2 is FlashAttention's own rule: no worse than twice the error of attention
//    computed naively in the same dtype. It is what widens the bound where the dtype itself
//    forces error (huge logits, softcap, long rows), instead of loosening atol everywhere.
Tolerance tolerance_for(DType dtype) noexcept {
  switch (dtype) {
    case DType::f32: return {1e-5, 1e-5, 2.0};
    case DType::f16: return {2e-3, 0x1p-9, 2.0};
    case DType::bf16: return {1.6e-2, 0x1p-6, 2.0};
  }
  return {1e-5, 1e-5, 2.0};
}

namespace {

using detail::Bounds;
using detail::CaseData;

// A case made ready to run on any number of backends.
struct Prepared {
  const Case* c = nullptr;
  std::unique_ptr<CaseData> data;
  std::optional<ValidatedProblem> problem;
  std::vector<OutputRow> rows;  // the rows judged (sampling.h): all of them, or a sample
  ExactRows ref;
  Bounds bounds;
  std::string setup_failure;  // a suite (or core) bug: every backend fails the case with it
};

Prepared prepare(const Case& c, const AttentionOracle* oracle) {
  Prepared p;
  p.c = &c;
  if (oracle == nullptr) {
    p.setup_failure = "no oracle: no registered backend is the oracle (BackendRegistry::oracle())";
    return p;
  }
  try {
    p.data = detail::build_case_data(c);
    Result<ValidatedProblem> v = validate(p.data->problem);
    if (!v) {
      p.setup_failure = "suite bug: the generated problem does not validate: " + v.status().to_string();
      return p;
    }
    p.problem.emplace(std::move(v).value());
    p.rows = detail::judged_rows(*p.data);
    // ExactOutput's layout is ExactRows' over all rows in logical order, which all_rows() gives.
    if (p.rows.size() == static_cast<std::size_t>(p.data->total_q * p.data->hq)) {
      ExactOutput whole = oracle->compute_exact(*p.problem);
      p.ref.o = std::move(whole.o);
      p.ref.lse = std::move(whole.lse);
    } else {
      p.ref = oracle->compute_rows(*p.problem, p.rows);
    }
    p.bounds = detail::bounds_for(*p.data, p.rows, p.ref, detail::naive_attention(*p.data, p.rows));
    p.setup_failure = p.bounds.self_check_failure;
  } catch (const std::exception& e) {
    p.setup_failure = fmt::format("suite bug: could not build the case: {}", e.what());
  }
  return p;
}

// Scratch memory with a guard tail: a backend may use exactly what it asked for.
class GuardedWorkspace {
 public:
  explicit GuardedWorkspace(std::size_t bytes) : bytes_(bytes) {
    storage_.reset(static_cast<std::byte*>(::operator new[](bytes + kGuard, std::align_val_t{64})));
    std::memset(storage_.get() + bytes, 0x5a, kGuard);
  }
  Workspace workspace() const noexcept { return {storage_.get(), bytes_}; }
  bool guard_intact() const noexcept {
    const std::byte* g = storage_.get() + bytes_;
    return std::all_of(g, g + kGuard, [](std::byte x) { return x == std::byte{0x5a}; });
  }

 private:
  static constexpr std::size_t kGuard = 256;
  struct Free {
    void operator()(std::byte* p) const noexcept { ::operator delete[](p, std::align_val_t{64}); }
  };
  std::size_t bytes_;
  std::unique_ptr<std::byte[], Free> storage_;
};

// Stages the case onto the backend's device (device.h): every buffer is mirrored whole, guard
// regions and stride gaps included, so that after the outputs and inputs are downloaded back over
// the host buffers the host-side checks see exactly what the kernel did on the device. Index
// arrays and ALiBi slopes stay on the host, as the contract has them. Returns the failure, or "".
std::string run_on_device(AttentionBackend& backend, DeviceMemory& memory, CaseData& data, Workspace ws, bool& lost) {
  const std::string where = memory.device().to_string();
  Result<StagedProblem> staged = StagedProblem::stage(memory, data.problem, detail::GuardedBuffer::kGuardBytes);
  if (!staged) return fmt::format("could not stage the case onto {}: {}", where, staged.status().to_string());
  Result<ValidatedProblem> vp = validate(staged->problem());
  if (!vp) return "suite bug: the staged problem does not validate: " + vp.status().to_string();
  const Status status = backend.run(*vp, ws);
  if (!status) {
    lost = status.code() == ErrorCode::backend_lost;
    return "run() failed: " + status.to_string();
  }
  if (Status s = staged->download_outputs(); !s) {
    return fmt::format("could not download o/lse from {}: {}", where, s.to_string());
  }
  if (Status s = staged->download_inputs(); !s) {
    return fmt::format("could not download q/k/v from {}: {}", where, s.to_string());
  }
  return {};
}

CaseResult run_prepared(AttentionBackend& backend, Prepared& p) {
  CaseResult r;
  r.backend = std::string(backend.name());
  r.case_name = p.c->name;
  auto fail = [&](std::string why) {
    r.passed = false;
    r.failure = std::move(why);
    return r;
  };
  if (!p.setup_failure.empty()) return fail(p.setup_failure);
  const ValidatedProblem& vp = *p.problem;
  CaseData& data = *p.data;
  r.allowed_error = p.bounds.atol_o;

  // A device backend is asked about the case as it will see it: on its device.
  const bool on_device = backend.device_kind() != DeviceKind::cpu;
  DeviceMemory* memory = on_device ? backend.device_memory() : nullptr;
  ProblemSignature sig = vp.signature();
  if (on_device) sig.device = memory != nullptr ? memory->device() : Device{backend.device_kind(), 0};
  Support support = backend.supports(sig);
  if (support.ok && on_device && memory == nullptr) {
    support = Support::no(fmt::format("runs on {} but exposes no device memory to stage the case onto",
                                      device_kind_name(backend.device_kind())));
  }
  if (!support.ok) {
    r.skipped = true;
    r.skip_reason = support.why_not.empty() ? "unsupported (no reason given)" : support.why_not;
    return r;
  }
  data.ob->reset_output(detail::poison_bits(data.spec.dtype));
  if (data.lseb) data.lseb->reset_output(detail::poison_bits(DType::f32));
  const std::size_t ws_bytes = backend.workspace_size(vp);
  std::optional<GuardedWorkspace> ws;
  try {
    ws.emplace(ws_bytes);
  } catch (const std::bad_alloc&) {
    return fail(fmt::format("could not allocate the {} workspace bytes the backend asked for", ws_bytes));
  }

  if (!on_device) {
    const Status status = backend.run(vp, ws->workspace());
    if (!status) {
      r.lost = status.code() == ErrorCode::backend_lost;
      return fail("run() failed: " + status.to_string());
    }
  } else if (std::string why = run_on_device(backend, *memory, data, ws->workspace(), r.lost); !why.empty()) {
    return fail(std::move(why));
  }
  if (auto what = detail::find_input_change(data)) {
    detail::restore_inputs(data);
    return fail("the backend modified its input " + *what);
  }
  if (!ws->guard_intact()) {
    return fail(fmt::format("out-of-bounds write past the end of the workspace ({} bytes requested)", ws_bytes));
  }
  if (auto where = data.ob->find_stray_write()) return fail("out-of-bounds write at o: " + *where);
  if (data.lseb) {
    if (auto where = data.lseb->find_stray_write()) return fail("out-of-bounds write at lse: " + *where);
  }
  const detail::Verdict verdict = detail::judge_outputs(data, p.rows, p.ref, p.bounds);
  r.max_abs_error = verdict.max_abs_error;
  r.passed = verdict.passed;
  r.failure = verdict.failure;
  return r;
}

}  // namespace

std::size_t Report::passed() const {
  return static_cast<std::size_t>(
      std::count_if(results.begin(), results.end(), [](const CaseResult& r) { return !r.skipped && r.passed; }));
}

std::size_t Report::failed() const {
  return static_cast<std::size_t>(
      std::count_if(results.begin(), results.end(), [](const CaseResult& r) { return !r.skipped && !r.passed; }));
}

std::size_t Report::skipped() const {
  return static_cast<std::size_t>(
      std::count_if(results.begin(), results.end(), [](const CaseResult& r) { return r.skipped; }));
}

double Report::max_abs_error() const {
  double m = 0.0;
  for (const CaseResult& r : results) {
    if (!r.skipped) m = std::max(m, r.max_abs_error);
  }
  return m;
}

namespace {
const AttentionOracle* oracle_or_global(const AttentionOracle* oracle) {
  return oracle != nullptr ? oracle : BackendRegistry::global().oracle();
}
}  // namespace

CaseResult run_case(AttentionBackend& backend, const Case& c, const AttentionOracle* oracle) {
  Prepared p = prepare(c, oracle_or_global(oracle));
  return run_prepared(backend, p);
}

std::vector<Report> run_suites(const std::vector<AttentionBackend*>& backends, const std::vector<Case>& cases,
                               const std::function<void(const CaseResult&)>& progress, const AttentionOracle* oracle) {
  oracle = oracle_or_global(oracle);
  std::vector<Report> reports(backends.size());
  for (std::size_t n = 0; n < backends.size(); ++n) {
    reports[n].backend = std::string(backends[n]->name());
    reports[n].results.reserve(cases.size());
  }
  // Two-stage pipeline: the next case's inputs and double-precision reference are built on a
  // second thread while the backends run the current one. The oracle is most of the suite's
  // cost, so this nearly halves the wall time on two cores and costs nothing on one.
  std::future<Prepared> next;
  if (!cases.empty()) next = std::async(std::launch::async, prepare, std::cref(cases.front()), oracle);
  std::vector<bool> lost(backends.size(), false);
  std::size_t live = backends.size();
  for (std::size_t c = 0; c < cases.size(); ++c) {
    Prepared p = next.get();
    if (c + 1 < cases.size() && live > 0) {
      next = std::async(std::launch::async, prepare, std::cref(cases[c + 1]), oracle);
    }
    for (std::size_t n = 0; n < backends.size(); ++n) {
      if (lost[n]) {
        ++reports[n].not_run;
        continue;
      }
      reports[n].results.push_back(run_prepared(*backends[n], p));
      if (progress) progress(reports[n].results.back());
      if (reports[n].results.back().lost) {
        lost[n] = true;
        --live;
      }
    }
    if (live == 0) {
      for (Report& r : reports) r.not_run += cases.size() - c - 1;
      break;
    }
  }
  return reports;
}

Report run_suite(AttentionBackend& backend, const std::vector<Case>& cases,
                 const std::function<void(const CaseResult&)>& progress, const AttentionOracle* oracle) {
  return std::move(run_suites({&backend}, cases, progress, oracle).front());
}

}  // namespace kallpa::conformance
