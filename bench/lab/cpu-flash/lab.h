// The cpu-flash kernel lab's common part: problems, the check against the reference (the f64
// oracle of the `reference` backend), drivers that run one kernel generation over the backend's
// own work plans, and the timing loop. Each lab program (decode_v5.cpp, ...) holds one earlier
// generation of a production kernel, checks it, then times it against the production kernel.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <limits>
#include <memory>
#include <new>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backends/cpu-flash/cpu_flash.h"
#include "backends/cpu-flash/flash_internal.h"
#include "backends/reference/reference.h"
#include "core/parallel.h"
#include "kallpa/attention.h"
#include "kallpa/half.h"

namespace kallpa::cpu_flash::lab {

// One problem shape: b sequences of sq queries against skv keys, hq / hkv heads of dim d, dense
// queries, dense or paged K/V (a shuffled block table), one dtype for every tensor.
struct Shape {
  std::int32_t b = 1, sq = 1, skv = 512, hq = 8, hkv = 8, d = 64;
  DType dt = DType::f16;
  std::int32_t page = 0;  // 0: dense K/V, else paged with pages of this many keys
  bool causal = false;

  std::string name() const {
    std::string n = "b=" + std::to_string(b) + ",sq=" + std::to_string(sq) + ",skv=" + std::to_string(skv) +
                    ",hq=" + std::to_string(hq) + ",hkv=" + std::to_string(hkv) + ",d=" + std::to_string(d) +
                    ",dtype=" + std::string(dtype_name(dt));
    if (page > 0) n += ",kv=paged,page=" + std::to_string(page);
    if (causal) n += ",causal";
    return n;
  }
};

// Owns the buffers of one problem (not copyable: the views point into them).
class Problem {
 public:
  explicit Problem(const Shape& s, unsigned seed = 1) {
    std::mt19937 rng(seed);
    const std::int64_t es = static_cast<std::int64_t>(dtype_size(s.dt));
    auto tensor = [&](std::vector<std::byte>& buf, std::initializer_list<std::int64_t> shape, bool random) {
      const std::int64_t n = std::accumulate(shape.begin(), shape.end(), std::int64_t{1}, std::multiplies<>());
      buf.assign(static_cast<std::size_t>(n * es), std::byte{0});
      if (random) {
        std::normal_distribution<float> dist(0.0f, 1.0f);
        for (std::int64_t i = 0; i < n; ++i) {
          const float x = dist(rng);
          std::byte* at = buf.data() + i * es;
          if (s.dt == DType::f32) {
            std::memcpy(at, &x, 4);
          } else {
            const std::uint16_t h = s.dt == DType::f16 ? f32_to_f16(x) : f32_to_bf16(x);
            std::memcpy(at, &h, 2);
          }
        }
      }
      return make_contiguous_view(buf.data(), s.dt, shape);
    };
    p_.batch = s.b;
    p_.q = tensor(q_, {s.b, s.sq, s.hq, s.d}, true);
    p_.o = tensor(o_, {s.b, s.sq, s.hq, s.d}, false);
    if (s.page == 0) {
      p_.kv_layout = KvLayout::dense;
      p_.k = tensor(k_, {s.b, s.skv, s.hkv, s.d}, true);
      p_.v = tensor(v_, {s.b, s.skv, s.hkv, s.d}, true);
    } else {
      const std::int32_t per_seq = (s.skv + s.page - 1) / s.page;
      const std::int32_t blocks = s.b * per_seq;
      table_.resize(static_cast<std::size_t>(blocks));
      std::iota(table_.begin(), table_.end(), 0);
      std::shuffle(table_.begin(), table_.end(), rng);
      seqlens_.assign(static_cast<std::size_t>(s.b), s.skv);
      p_.kv_layout = KvLayout::paged;
      p_.block_table = table_.data();
      p_.max_blocks_per_seq = per_seq;
      p_.seqlens_k = seqlens_.data();
      p_.k = tensor(k_, {blocks, s.page, s.hkv, s.d}, true);
      p_.v = tensor(v_, {blocks, s.page, s.hkv, s.d}, true);
    }
    lse_.assign(static_cast<std::size_t>(s.b) * static_cast<std::size_t>(s.hq) * static_cast<std::size_t>(s.sq), 0.0f);
    p_.lse = make_contiguous_view(lse_.data(), DType::f32, {s.b, s.hq, s.sq});
    p_.causal = s.causal;
  }
  Problem(const Problem&) = delete;
  Problem& operator=(const Problem&) = delete;

  const AttentionProblem& problem() const { return p_; }

 private:
  std::vector<std::byte> q_, k_, v_, o_;
  std::vector<float> lse_;
  std::vector<std::int32_t> table_, seqlens_;
  AttentionProblem p_;
};

// Runs a kernel on a validated problem (its output goes to the problem's o and lse).
using Runner = std::function<void(const ValidatedProblem&)>;

// The largest error of o and lse against the f64 reference, relative to the tolerance of the dtype
// (as the conformance suite's: <= 1 passes).
inline double error_vs_reference(const ValidatedProblem& vp) {
  const reference::Output64 want = reference::compute_f64(vp);
  const AttentionProblem& p = vp.problem();
  const double tol = p.o.dtype == DType::f32 ? 2e-4 : p.o.dtype == DType::f16 ? 4e-3 : 3e-2;
  const std::int64_t ohs = p.o.stride[static_cast<std::size_t>(p.o.rank - 2)];
  double worst = 0.0;
  std::size_t at = 0, lat = 0;
  for (std::int32_t b = 0; b < vp.batch(); ++b)
    for (std::int64_t i = 0; i < vp.seqlen_q(b); ++i)
      for (std::int32_t h = 0; h < vp.hq(); ++h) {
        for (std::int64_t x = 0; x < vp.head_dim_v(); ++x) {
          const double got = reference::load(p.o, vp.o_row_offset(b, i) + h * ohs + x);
          const double w = want.o[at++];
          if (std::isnan(got) != std::isnan(w)) return std::numeric_limits<double>::infinity();
          if (!std::isnan(w)) worst = std::max(worst, std::abs(got - w) / (tol + tol * std::abs(w)));
        }
        const double got_lse = static_cast<const float*>(p.lse.data)[vp.lse_offset(b, h, i)];
        const double w_lse = want.lse[lat++];
        if (std::isinf(w_lse) || std::isnan(w_lse)) {
          if (!(got_lse == w_lse || (std::isnan(got_lse) && std::isnan(w_lse))))
            return std::numeric_limits<double>::infinity();
        } else {
          worst = std::max(worst, std::abs(got_lse - w_lse) / (1e-4 + 1e-4 * std::abs(w_lse)));
        }
      }
  return worst;
}

// Runs `kernel` on every shape and compares with the reference; prints one line per shape and
// returns false on the first mismatch.
inline bool check(const char* what, const std::vector<Shape>& shapes, const Runner& kernel) {
  for (const Shape& s : shapes) {
    Problem pr(s);
    auto vp = validate(pr.problem());
    if (!vp.is_ok()) {
      std::printf("check %-14s %s: invalid problem: %s\n", what, s.name().c_str(), vp.status().to_string().c_str());
      return false;
    }
    kernel(*vp);
    const double err = error_vs_reference(*vp);
    const bool ok = err <= 1.0;
    std::printf("check %-14s %-60s %s (error %.3f of the tolerance)\n", what, s.name().c_str(), ok ? "ok" : "MISMATCH",
                err);
    if (!ok) return false;
  }
  return true;
}

// Median wall time of `reps` runs after one warm-up run, in milliseconds.
inline double time_ms(const ValidatedProblem& vp, const Runner& kernel, int reps) {
  kernel(vp);
  std::vector<double> ms;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    kernel(vp);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Times the lab kernel and the production backend (options) alternately on each shape, and prints
// both medians.
inline void bench(const char* lab_name, const Runner& lab_kernel, const char* prod_name, Options prod,
                  const std::vector<Shape>& shapes, int reps) {
  CpuFlashBackend backend(prod);
  const Runner production = [&backend](const ValidatedProblem& vp) {
    std::vector<std::byte> ws(backend.workspace_size(vp) + 64);
    const Status st = backend.run(vp, {ws.data(), ws.size()});
    if (!st.is_ok()) std::printf("production run failed: %s\n", st.to_string().c_str());
  };
  for (const Shape& s : shapes) {
    Problem pr(s);
    auto vp = validate(pr.problem());
    if (!vp.is_ok()) continue;
    double lab_ms = 1e300, prod_ms = 1e300;
    for (int round = 0; round < 3; ++round) {  // alternated, best median of three rounds each
      lab_ms = std::min(lab_ms, time_ms(*vp, lab_kernel, reps));
      prod_ms = std::min(prod_ms, time_ms(*vp, production, reps));
    }
    std::printf("time  %-60s %s %.3f ms, %s %.3f ms (lab/production %.2f)\n", s.name().c_str(), lab_name, lab_ms,
                prod_name, prod_ms, lab_ms / prod_ms);
  }
}

// 64-byte aligned scratch.
struct Scratch {
  std::unique_ptr<std::byte[]> mem;
  std::byte* base = nullptr;
  explicit Scratch(std::size_t bytes) : mem(new std::byte[bytes + 64]) {
    const auto addr = reinterpret_cast<std::uintptr_t>(mem.get());
    base = mem.get() + (64 - addr % 64) % 64;
  }
};

// A decode task function with the signature of the production ones (run_decode_by_head, ...).
using DecodeTaskFn = void (*)(const ValidatedProblem&, const DecodePlan&, const DecodeTask&, void*, std::byte*,
                              std::int32_t*);

// Runs a decode kernel over the backend's decode plan on every thread of the pool, one chunk per task.
inline void run_decode(const ValidatedProblem& vp, DecodeTaskFn task_fn) {
  const DecodePlan plan = make_decode_plan(vp);
  auto& pool = parallel::ThreadPool::global();
  const int threads = pool.threads_for(0);
  Scratch mem(plan.workspace_bytes(threads));
  std::byte* const base = mem.base;
  std::byte* slots = base + static_cast<std::size_t>(threads) * plan.worker_bytes;
  auto* counters = reinterpret_cast<std::int32_t*>(slots + static_cast<std::size_t>(plan.n_slots) * plan.slot_bytes);
  std::fill(counters, counters + plan.n_counters, 0);
  pool.parallel_for(
      static_cast<std::int64_t>(plan.chunks.size()),
      [&](std::int64_t t, int worker) {
        task_fn(vp, plan, plan.chunks[static_cast<std::size_t>(t)],
                base + static_cast<std::size_t>(worker) * plan.worker_bytes, slots, counters);
      },
      threads);
}

// A prefill task function: one task of the tiled plan, writing o/lse or its partial slot.
using PrefillTaskFn = void (*)(const ValidatedProblem&, const Plan&, const Task&, void*, float*);

// Merges the partial (m, l, o) of each split of a query tile (the backend's split-KV combine).
inline void combine_rows(const ValidatedProblem& vp, const Plan& plan, const Combine& c, const std::byte* partials) {
  const AttentionProblem& p = vp.problem();
  const std::int64_t dv = vp.head_dim_v();
  const std::int64_t rows_max = plan.rows_max;
  const std::int64_t ohs = p.o.stride[static_cast<std::size_t>(p.o.rank - 2)];
  const std::int64_t ods = p.o.stride[static_cast<std::size_t>(p.o.rank - 1)];
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<float> acc(static_cast<std::size_t>(dv));
  for (std::int64_t pi = 0; pi < c.rows.ni; ++pi) {
    for (std::int32_t hh = 0; hh < c.rows.nh; ++hh) {
      const std::int64_t r = pi * c.rows.nh + hh;
      float mx = neg_inf;
      bool nan = false;
      for (std::int32_t s = 0; s < c.splits; ++s) {
        const auto* slot = reinterpret_cast<const float*>(partials + static_cast<std::size_t>(c.first_partial + s) *
                                                                         plan.partial_bytes);
        if (std::isnan(slot[r])) nan = true;
        else mx = std::max(mx, slot[r]);
      }
      const float muse = nan ? std::numeric_limits<float>::quiet_NaN() : (mx == neg_inf ? 0.0f : mx);
      float l = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (std::int32_t s = 0; s < c.splits; ++s) {
        const auto* slot = reinterpret_cast<const float*>(partials + static_cast<std::size_t>(c.first_partial + s) *
                                                                         plan.partial_bytes);
        const float w = std::exp(slot[r] - muse);
        l += w * slot[rows_max + r];
        const float* o = slot + 2 * rows_max + r * dv;
        for (std::int64_t x = 0; x < dv; ++x) acc[static_cast<std::size_t>(x)] += w * o[x];
      }
      const std::int32_t h = c.rows.kvh * vp.group_size() + c.rows.h0 + hh;
      const std::int64_t i = c.rows.i0 + pi;
      const std::int64_t ooff = vp.o_row_offset(c.rows.b, i) + h * ohs;
      const bool empty = l == 0.0f;
      for (std::int64_t x = 0; x < dv; ++x)
        reference::store(p.o, ooff + x * ods, empty ? 0.0 : static_cast<double>(acc[static_cast<std::size_t>(x)] / l));
      if (p.lse.present())
        static_cast<float*>(p.lse.data)[vp.lse_offset(c.rows.b, h, i)] = empty ? neg_inf : muse + std::log(l);
    }
  }
}

// Runs a prefill kernel over the backend's tiled plan on every thread of the pool.
inline void run_prefill(const ValidatedProblem& vp, PrefillTaskFn task_fn) {
  const Plan plan = make_plan(vp);
  auto& pool = parallel::ThreadPool::global();
  const int threads = pool.threads_for(0);
  Scratch mem(plan.workspace_bytes(threads));
  std::byte* const base = mem.base;
  std::byte* partials = base + static_cast<std::size_t>(threads) * plan.worker_bytes;
  pool.parallel_for(
      static_cast<std::int64_t>(plan.tasks.size()),
      [&](std::int64_t t, int worker) {
        const Task& task = plan.tasks[static_cast<std::size_t>(t)];
        float* partial =
            task.partial < 0
                ? nullptr
                : reinterpret_cast<float*>(partials + static_cast<std::size_t>(task.partial) * plan.partial_bytes);
        task_fn(vp, plan, task, base + static_cast<std::size_t>(worker) * plan.worker_bytes, partial);
      },
      threads);
  pool.parallel_for(
      static_cast<std::int64_t>(plan.combines.size()),
      [&](std::int64_t c, int) { combine_rows(vp, plan, plan.combines[static_cast<std::size_t>(c)], partials); },
      threads);
}

}  // namespace kallpa::cpu_flash::lab
