#include "attention_binding.h"

#include <fmt/format.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kallpa/attention.h"
#include "kallpa/dispatcher.h"
#include "kallpa/registry.h"
#include "status_error.h"
#include "tensor_view.h"

namespace kallpa::python {
namespace {

namespace nb = nanobind;

// Index arrays and ALiBi slopes live in host memory (attention.h); the Python wrapper hands them
// over as contiguous int32 / float32 arrays.
using IndexArray = nb::ndarray<const std::int32_t, nb::device::cpu>;
using SlopeArray = nb::ndarray<const float, nb::ndim<1>, nb::device::cpu, nb::c_contig>;

// Everything one call names, as the Python wrapper passes it.
struct CallArgs {
  AnyArray q, k, v;
  OutArray out;
  std::optional<OutArray> lse;
  bool causal = false;
  std::int64_t window_left = -1;
  std::int64_t window_right = -1;
  float softcap = 0.0f;
  std::optional<float> scale;
  std::optional<SlopeArray> alibi_slopes;
  std::optional<IndexArray> cu_seqlens_q, cu_seqlens_k, block_table, seqlens_k;
};

std::int64_t length_of(const IndexArray& a, const char* name) {
  if (a.ndim() != 1) {
    throw_invalid(name, fmt::format("must be one-dimensional, has {} dimensions", a.ndim()),
                  fmt::format("{}", a.ndim()));
  }
  if (a.stride(0) != 1 && a.shape(0) > 1)
    throw_invalid(name, "must be contiguous", fmt::format("stride {}", a.stride(0)));
  return static_cast<std::int64_t>(a.shape(0));
}

void expect_length(const IndexArray& a, const char* name, std::int64_t batch, std::int64_t expected) {
  const std::int64_t n = length_of(a, name);
  if (n != expected) {
    throw_invalid(name, fmt::format("has {} entries; a batch of {} needs {}", n, batch, expected),
                  fmt::format("{}", n));
  }
}

// The contract's problem over the caller's arrays (no copies), with the lengths of the index
// arrays checked here: the contract takes bare pointers, so only the binding can see their sizes.
AttentionProblem make_problem(const CallArgs& a) {
  AttentionProblem p;
  p.q = to_view(a.q, "q");
  p.k = to_view(a.k, "k");
  p.v = to_view(a.v, "v");
  p.o = to_view(a.out, "out");
  if (a.lse) p.lse = to_view(*a.lse, "lse");
  p.causal = a.causal;
  p.window_left = a.window_left;
  p.window_right = a.window_right;
  p.softcap = a.softcap;
  p.scale = a.scale;

  p.q_layout = a.cu_seqlens_q ? QLayout::packed : QLayout::dense;
  p.kv_layout = a.block_table ? KvLayout::paged : a.cu_seqlens_k ? KvLayout::packed : KvLayout::dense;
  if (a.block_table && a.cu_seqlens_k) {
    throw_invalid("cu_seqlens_k", "is for packed k/v; a paged cache (block_table) takes seqlens_k", "given");
  }
  if (a.seqlens_k && !a.block_table) {
    throw_invalid("seqlens_k", "is for a paged cache and needs block_table", "given");
  }
  if (a.block_table && !a.seqlens_k) throw_invalid("seqlens_k", "is required with block_table", "None");

  // The batch: from cu_seqlens_q for packed q, else from q's first dimension.
  std::int64_t batch = 0;
  if (a.cu_seqlens_q) {
    const std::int64_t n = length_of(*a.cu_seqlens_q, "cu_seqlens_q");
    if (n < 1) throw_invalid("cu_seqlens_q", "needs at least one entry (batch + 1)", "0");
    batch = n - 1;
    p.cu_seqlens_q = a.cu_seqlens_q->data();
  } else if (p.q.rank >= 1) {
    batch = p.q.shape[0];
  }
  if (batch > std::numeric_limits<std::int32_t>::max()) {
    throw_invalid("batch", "exceeds the contract's int32 batch", fmt::format("{}", batch));
  }
  if (p.q_layout == QLayout::packed || p.kv_layout != KvLayout::dense) p.batch = static_cast<std::int32_t>(batch);

  if (a.cu_seqlens_k) {
    expect_length(*a.cu_seqlens_k, "cu_seqlens_k", batch, batch + 1);
    p.cu_seqlens_k = a.cu_seqlens_k->data();
  }
  if (a.block_table) {
    const IndexArray& t = *a.block_table;
    if (t.ndim() != 2) {
      throw_invalid("block_table", fmt::format("must be [batch, max_blocks], has {} dimensions", t.ndim()),
                    fmt::format("{}", t.ndim()));
    }
    if (static_cast<std::int64_t>(t.shape(0)) != batch) {
      throw_invalid("block_table", fmt::format("has {} rows for a batch of {}", t.shape(0), batch),
                    fmt::format("{}", t.shape(0)));
    }
    if (t.shape(1) > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max())) {
      throw_invalid("block_table", "has more blocks per sequence than int32 counts", fmt::format("{}", t.shape(1)));
    }
    if (t.shape(1) > 1 && t.stride(1) != 1) {
      throw_invalid("block_table", "rows must be contiguous", fmt::format("stride {}", t.stride(1)));
    }
    p.block_table = t.data();
    p.max_blocks_per_seq = static_cast<std::int32_t>(t.shape(1));
    p.block_table_stride = t.shape(0) > 1 ? t.stride(0) : 0;
    expect_length(*a.seqlens_k, "seqlens_k", batch, batch);
    p.seqlens_k = a.seqlens_k->data();
  }
  if (a.alibi_slopes) {
    const std::int64_t hq = p.q.rank >= 2 ? p.q.shape[static_cast<std::size_t>(p.q.rank - 2)] : 0;
    if (static_cast<std::int64_t>(a.alibi_slopes->shape(0)) != hq) {
      throw_invalid("alibi_slopes", fmt::format("has {} slopes for {} query heads", a.alibi_slopes->shape(0), hq),
                    fmt::format("{}", a.alibi_slopes->shape(0)));
    }
    p.alibi_slopes = a.alibi_slopes->data();
  }
  return p;
}

// One dispatcher per (explicit backend list, strict), over the global registry, made on first use
// and kept for the life of the process: a dispatcher caches its choices per problem signature.
class Dispatchers {
 public:
  Dispatcher& get(const std::optional<std::vector<std::string>>& names, bool strict) {
    std::lock_guard lock(mu_);
    if (!base_) {
      Result<DispatchOptions> env = DispatchOptions::from_env();
      check(env.status());
      base_ = std::move(*env);
    }
    DispatchOptions options = *base_;
    std::string key = "env";
    if (names) {
      if (names->empty()) throw_invalid("backend", "names no backend", "[]");
      for (const std::string& name : *names) {
        if (Status s = BackendRegistry::global().require(name, "backend"); !s) throw StatusError(s, name);
      }
      options.backends = *names;
      key = fmt::format("{}", fmt::join(*names, ","));
    }
    options.strict = options.strict || strict;
    key += options.strict ? "/strict" : "";
    auto& slot = dispatchers_[key];
    if (!slot) slot = std::make_unique<Dispatcher>(options);
    return *slot;
  }

 private:
  std::mutex mu_;
  std::optional<DispatchOptions> base_;
  std::map<std::string, std::unique_ptr<Dispatcher>> dispatchers_;
};

Dispatchers& dispatchers() {
  static Dispatchers d;
  return d;
}

void run_attention(const CallArgs& args, const std::optional<std::vector<std::string>>& backends, bool strict) {
  const AttentionProblem problem = make_problem(args);
  Dispatcher& dispatcher = dispatchers().get(backends, strict);
  Status status;
  {
    // The arrays stay referenced by `args` while the GIL is released; other Python threads run.
    nb::gil_scoped_release release;
    status = dispatcher.run(problem);
  }
  check(status);
}

using VerdictTuple = std::tuple<std::string, std::string, bool, bool, int, std::string>;

std::pair<std::string, std::vector<VerdictTuple>> explain(const CallArgs& args,
                                                          const std::optional<std::vector<std::string>>& backends,
                                                          bool strict) {
  const AttentionProblem problem = make_problem(args);
  Dispatcher& dispatcher = dispatchers().get(backends, strict);
  Result<ValidatedProblem> valid = validate(problem);
  check(valid.status());
  const ProblemSignature& sig = valid->signature();
  std::vector<Verdict> verdicts;
  {
    nb::gil_scoped_release release;  // the first call runs the canaries of the device's backends
    dispatcher.registry().ensure_checked(sig.device.kind);
    verdicts = dispatcher.explain(sig);
  }
  std::vector<VerdictTuple> out;
  for (const Verdict& v : verdicts) {
    out.emplace_back(v.backend, std::string(health_name(v.health)), v.supported, v.selected, v.rank, v.reason);
  }
  return {sig.to_string(), std::move(out)};
}

using BackendTuple = std::tuple<std::string, std::string, std::string, int, std::string, std::string, std::string,
                                std::uint64_t, std::vector<std::string>>;

std::vector<BackendTuple> list_backends() {
  BackendRegistry& registry = BackendRegistry::global();
  std::vector<BackendInfo> infos;
  {
    nb::gil_scoped_release release;
    registry.ensure_checked();
    infos = registry.list();
  }
  std::vector<BackendTuple> out;
  for (const BackendInfo& info : infos) {
    const AttentionBackend& b = *info.backend;
    out.emplace_back(std::string(b.name()), std::string(b.version()), std::string(device_kind_name(b.device_kind())),
                     b.priority(), std::string(b.description()), std::string(health_name(info.health)),
                     info.health_reason, info.run_failures, info.quarantined_buckets);
  }
  return out;
}

}  // namespace

void bind_attention(nb::module_& m) {
  m.attr("contract_version") = kAttentionContractVersion;

  nb::class_<CallArgs>(m, "_Call")
      .def(
          "__init__",
          [](CallArgs* self, AnyArray q, AnyArray k, AnyArray v, OutArray out, std::optional<OutArray> lse, bool causal,
             std::int64_t window_left, std::int64_t window_right, float softcap, std::optional<float> scale,
             std::optional<SlopeArray> alibi_slopes, std::optional<IndexArray> cu_seqlens_q,
             std::optional<IndexArray> cu_seqlens_k, std::optional<IndexArray> block_table,
             std::optional<IndexArray> seqlens_k) {
            new (self) CallArgs{std::move(q),
                                std::move(k),
                                std::move(v),
                                std::move(out),
                                std::move(lse),
                                causal,
                                window_left,
                                window_right,
                                softcap,
                                scale,
                                std::move(alibi_slopes),
                                std::move(cu_seqlens_q),
                                std::move(cu_seqlens_k),
                                std::move(block_table),
                                std::move(seqlens_k)};
          },
          nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("lse").none(), nb::arg("causal"),
          nb::arg("window_left"), nb::arg("window_right"), nb::arg("softcap"), nb::arg("scale").none(),
          nb::arg("alibi_slopes").none(), nb::arg("cu_seqlens_q").none(), nb::arg("cu_seqlens_k").none(),
          nb::arg("block_table").none(), nb::arg("seqlens_k").none());

  m.def("_attention", &run_attention, nb::arg("call"), nb::arg("backends").none(), nb::arg("strict"),
        "Runs one attention call through the dispatcher (GIL released while it runs).");
  m.def("_explain", &explain, nb::arg("call"), nb::arg("backends").none(), nb::arg("strict"),
        "The problem signature and every backend's verdict on it.");
  m.def("_backends", &list_backends, "Every registered backend, after the health check.");
}

}  // namespace kallpa::python
