// Attention problems from bytes, as an untrusted caller of the contract might pass them: a small
// spec (batch, lengths, heads, head dims incl. odd ones, dtypes, layouts, page size, causal,
// window, softcap, ALiBi, lse) with the harness's inputs, then the index arrays (cu_seqlens,
// seqlens_k, block table) overwritten from the input. validate() must refuse what is inconsistent
// with a typed error; what it accepts, each CPU backend must compute inside its buffers (ASan) and
// agree with `reference`: every row it owns written, NaN exactly where the reference has one.
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "fuzz_target.h"
#include "harness/problem_instance.h"
#include "kallpa/dispatcher.h"
#include "kallpa/half.h"

namespace {

using namespace kallpa;

ProblemSpec spec_from(FuzzBytes& in) {
  ProblemSpec s;
  const DType dtypes[] = {DType::f32, DType::f16, DType::bf16};
  s.batch = 1 + in.next() % 3;
  s.hkv = 1 + in.next() % 3;
  s.hq = s.hkv * (1 + in.next() % 3);
  s.head_dim = 1 + in.next() % 40;
  if (in.next() % 4 == 0) s.head_dim_v = 1 + in.next() % 40;
  s.seqlen_q = in.next() % 9;
  s.seqlen_k = in.next() % 17;
  s.dtype = dtypes[in.next() % 3];
  if (in.next() % 3 == 0) s.kv_dtype = dtypes[in.next() % 3];
  s.q_layout = in.next() % 2 ? QLayout::packed : QLayout::dense;
  const std::uint8_t kv = in.next() % 3;
  s.kv_layout = kv == 0 ? KvLayout::dense : kv == 1 ? KvLayout::packed : KvLayout::paged;
  s.page_size = 1 + in.next() % 5;
  const std::uint8_t flags = in.next();
  s.causal = flags & 1;
  s.alibi = flags & 2;
  s.lse = flags & 4;
  if (flags & 8) {
    s.window_left = static_cast<std::int64_t>(in.next() % 10) - 1;
    s.window_right = static_cast<std::int64_t>(in.next() % 10) - 1;
  }
  if (flags & 16) s.softcap = float(1 + in.next() % 50);
  return s;
}

// Overwrites an index array with small values from the input, some out of every valid range.
void overwrite(FuzzBytes& in, std::vector<std::int32_t>& values) {
  for (auto& v : values) v = static_cast<std::int32_t>(in.next() % 40) - 2;
}

struct Outputs {
  std::vector<float> o, lse;
};

// Rows of q (and o) that belong to a sequence: all for dense q, cu_seqlens_q[0..B) for packed.
std::vector<bool> owned_rows(const AttentionProblem& p, std::int64_t rows) {
  std::vector<bool> owned(static_cast<std::size_t>(rows), p.q_layout == QLayout::dense);
  if (p.q_layout == QLayout::packed) {
    for (std::int64_t r = p.cu_seqlens_q[0]; r < p.cu_seqlens_q[p.batch]; ++r)
      owned[static_cast<std::size_t>(r)] = true;
  }
  return owned;
}

// NaN in every output element first, so that an element a backend leaves unwritten cannot pass
// with the value an earlier run left there.
void poison(const AttentionProblem& p) {
  for (std::int64_t i = 0; i < p.o.numel(); ++i) store_f32(p.o.dtype, p.o.data, i, std::nanf(""));
  for (std::int64_t i = 0; p.lse.present() && i < p.lse.numel(); ++i)
    store_f32(DType::f32, p.lse.data, i, std::nanf(""));
}

Outputs read(const AttentionProblem& p) {
  Outputs out;
  for (std::int64_t i = 0; i < p.o.numel(); ++i) out.o.push_back(load_f32(p.o.dtype, p.o.data, i));
  for (std::int64_t i = 0; p.lse.present() && i < p.lse.numel(); ++i)
    out.lse.push_back(load_f32(DType::f32, p.lse.data, i));
  return out;
}

bool close(float got, float want, DType dtype) {
  if (std::isnan(want) || std::isnan(got)) return std::isnan(want) && std::isnan(got);
  if (std::isinf(want) || std::isinf(got)) return got == want;
  const double tol = dtype == DType::f32 ? 2e-3 : dtype == DType::f16 ? 2e-2 : 8e-2;
  return std::fabs(double(got) - double(want)) <= tol * (1.0 + std::fabs(double(want)));
}

void compare(const AttentionProblem& p, const Outputs& got, const Outputs& want) {
  // o: [B, Sq, Hq, Dv] or [total_q, Hq, Dv], contiguous: the row (token) is the leading index or
  // the two leading ones.
  const std::int64_t per_row = p.o.shape[p.o.rank - 2] * p.o.shape[p.o.rank - 1];
  const std::int64_t rows = static_cast<std::int64_t>(want.o.size()) / std::max<std::int64_t>(per_row, 1);
  const auto owned = owned_rows(p, rows);
  for (std::int64_t r = 0; r < rows; ++r) {
    if (!owned[static_cast<std::size_t>(r)]) continue;
    for (std::int64_t e = 0; e < per_row; ++e) {
      const auto i = static_cast<std::size_t>(r * per_row + e);
      FUZZ_CHECK(close(got.o[i], want.o[i], p.o.dtype), "o differs from the reference");
    }
  }
  // lse: [Hq, total_q] or [B, Hq, Sq]; owned columns as for o.
  if (!want.lse.empty()) {
    const std::int64_t hq = p.o.shape[p.o.rank - 2];
    for (std::size_t i = 0; i < want.lse.size(); ++i) {
      std::int64_t row;
      if (p.q_layout == QLayout::packed) {
        row = static_cast<std::int64_t>(i) % rows;
      } else {
        const std::int64_t sq = p.lse.shape[2];
        row = (static_cast<std::int64_t>(i) / (hq * sq)) * sq + static_cast<std::int64_t>(i) % sq;
      }
      if (!owned[static_cast<std::size_t>(row)]) continue;
      FUZZ_CHECK(close(got.lse[i], want.lse[i], DType::f32), "lse differs from the reference");
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzBytes in(data, size);
  const ProblemSpec spec = spec_from(in);
  auto inst = harness::ProblemInstance::create(spec, /*seed=*/in.next(), /*max_bytes=*/std::size_t{1} << 20);
  if (!inst) return 0;  // a spec the harness does not build (e.g. heads not a multiple)
  AttentionProblem p = (*inst)->problem();

  std::vector<std::int32_t> cu_q, cu_k, seqlens, table;
  const std::uint8_t tamper = in.next();
  if (p.cu_seqlens_q != nullptr) {
    cu_q.assign(p.cu_seqlens_q, p.cu_seqlens_q + p.batch + 1);
    if (tamper & 1) overwrite(in, cu_q);
    p.cu_seqlens_q = cu_q.data();
  }
  if (p.cu_seqlens_k != nullptr) {
    cu_k.assign(p.cu_seqlens_k, p.cu_seqlens_k + p.batch + 1);
    if (tamper & 2) overwrite(in, cu_k);
    p.cu_seqlens_k = cu_k.data();
  }
  if (p.seqlens_k != nullptr) {
    seqlens.assign(p.seqlens_k, p.seqlens_k + p.batch);
    if (tamper & 4) overwrite(in, seqlens);
    p.seqlens_k = seqlens.data();
  }
  if (p.block_table != nullptr) {
    table.assign(p.block_table, p.block_table + std::int64_t{p.batch} * p.max_blocks_per_seq);
    if (tamper & 8) overwrite(in, table);
    p.block_table = table.data();
  }
  if (tamper & 16) p.batch = std::max(0, p.batch - 1);  // fewer sequences than the arrays describe

  auto valid = validate(p);
  if (!valid) {
    FUZZ_CHECK(!valid.status().field().empty(), "a refused problem does not name the field at fault");
    return 0;
  }
  auto run = [&](const char* backend) -> std::optional<Outputs> {
    Dispatcher dispatcher({.backends = {backend}, .strict = true, .quarantine_after = 0});
    poison(p);
    if (Status s = dispatcher.run(p); !s) {
      // A backend may decline a problem it does not support; it may not fail on one it accepted.
      FUZZ_CHECK(s.code() == ErrorCode::unsupported, (std::string(backend) + " failed: " + s.to_string()).c_str());
      return std::nullopt;
    }
    return read(p);
  };
  const auto want = run("reference");
  FUZZ_CHECK(want.has_value(), "the reference declined a valid problem");
  for (const char* backend : {"cpu-flash", "cpu-gemm"}) {
    if (const auto got = run(backend)) compare(p, *got, *want);
  }
  return 0;
}
