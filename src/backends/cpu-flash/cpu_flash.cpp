// cpu-flash driver: support verdicts, the work plans (each sequence's tasks and splits from its own
// shape, the workspace) and the per-thread reuse of the last one, each sequence's decode kernel
// choice, the generic scalar path and the split-KV combine. The SIMD kernels live in prefill.cpp and decode_*.cpp.
#include "backends/cpu-flash/cpu_flash.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <string_view>
#include <vector>

#include "backends/cpu-flash/flash_internal.h"
#include "core/parallel.h"
#include "kallpa/half.h"
#include "kallpa/registry.h"

namespace kallpa::cpu_flash {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float load_f(const TensorView& t, std::int64_t idx) noexcept {
  switch (t.dtype) {
    case DType::f16: return f16_to_f32(static_cast<const std::uint16_t*>(t.data)[idx]);
    case DType::bf16: return bf16_to_f32(static_cast<const std::uint16_t*>(t.data)[idx]);
    case DType::f32: break;
  }
  return static_cast<const float*>(t.data)[idx];
}

inline void store_f(const TensorView& t, std::int64_t idx, float v) noexcept {
  switch (t.dtype) {
    case DType::f16: static_cast<std::uint16_t*>(t.data)[idx] = f32_to_f16(v); return;
    case DType::bf16: static_cast<std::uint16_t*>(t.data)[idx] = f32_to_bf16(v); return;
    case DType::f32: break;
  }
  static_cast<float*>(t.data)[idx] = v;
}

inline std::int64_t head_stride(const TensorView& t) { return t.stride[static_cast<std::size_t>(t.rank - 2)]; }
inline std::int64_t dim_stride(const TensorView& t) { return t.stride[static_cast<std::size_t>(t.rank - 1)]; }

// ---------------------------------------------------------------------------------------------
// Generic path: one query row at a time, scalar online softmax over its visible keys.

Status run_generic(const ValidatedProblem& vp, int max_threads) {
  const AttentionProblem& p = vp.problem();
  const std::int32_t hq = vp.hq();
  const std::int32_t group = vp.group_size();
  const std::int64_t d = vp.head_dim();
  const std::int64_t dv = vp.head_dim_v();
  const float scale = vp.scale();
  const float softcap = p.softcap;
  constexpr std::int64_t kRowsPerTask = 32;

  struct Item {
    std::int32_t b;
    std::int32_t h;
    std::int64_t i0;
  };
  std::vector<Item> items;
  for (std::int32_t b = 0; b < vp.batch(); ++b) {
    const std::int64_t sq = vp.seqlen_q(b);
    for (std::int32_t h = 0; h < hq; ++h)
      for (std::int64_t i0 = 0; i0 < sq; i0 += kRowsPerTask) items.push_back({b, h, i0});
  }
  const std::int64_t qhs = head_stride(p.q), qds = dim_stride(p.q);
  const std::int64_t khs = head_stride(p.k), kds = dim_stride(p.k);
  const std::int64_t vhs = head_stride(p.v), vds = dim_stride(p.v);
  const std::int64_t ohs = head_stride(p.o), ods = dim_stride(p.o);

  auto task = [&](std::int64_t t, int /*worker*/) {
    const Item it = items[static_cast<std::size_t>(t)];
    const std::int64_t sq = vp.seqlen_q(it.b);
    const std::int64_t skv = vp.seqlen_k(it.b);
    const std::int32_t kvh = it.h / group;
    const float slope = p.alibi_slopes ? p.alibi_slopes[it.h] : 0.0f;
    std::vector<float> qf(static_cast<std::size_t>(d));
    std::vector<float> acc(static_cast<std::size_t>(dv));
    const std::int64_t i1 = std::min(sq, it.i0 + kRowsPerTask);
    for (std::int64_t i = it.i0; i < i1; ++i) {
      const std::int64_t qoff = vp.q_row_offset(it.b, i) + it.h * qhs;
      for (std::int64_t x = 0; x < d; ++x) qf[static_cast<std::size_t>(x)] = load_f(p.q, qoff + x * qds);
      std::fill(acc.begin(), acc.end(), 0.0f);
      float m = kNegInf;
      float l = 0.0f;
      const auto range = vp.visible_keys(it.b, i);
      const std::int64_t pos = i + skv - sq;
      for (std::int64_t j = range.first; j <= range.last; ++j) {
        const std::int64_t koff = vp.k_row_offset(it.b, j) + kvh * khs;
        float s = 0.0f;
        for (std::int64_t x = 0; x < d; ++x) s += qf[static_cast<std::size_t>(x)] * load_f(p.k, koff + x * kds);
        s *= scale;
        if (softcap > 0.0f) s = softcap * std::tanh(s / softcap);
        if (p.alibi_slopes) s -= slope * static_cast<float>(std::llabs(pos - j));
        if (s > m) {
          const float alpha = m == kNegInf ? 0.0f : std::exp(m - s);
          l *= alpha;
          for (auto& a : acc) a *= alpha;
          m = s;
        }
        const float pj = std::exp(s - (m == kNegInf ? 0.0f : m));  // NaN stays NaN; -inf gives 0
        l += pj;
        const std::int64_t voff = vp.v_row_offset(it.b, j) + kvh * vhs;
        for (std::int64_t x = 0; x < dv; ++x) acc[static_cast<std::size_t>(x)] += pj * load_f(p.v, voff + x * vds);
      }
      const std::int64_t ooff = vp.o_row_offset(it.b, i) + it.h * ohs;
      if (l == 0.0f) {  // no visible key, or all visible scores -inf
        for (std::int64_t x = 0; x < dv; ++x) store_f(p.o, ooff + x * ods, 0.0f);
        if (p.lse.present()) static_cast<float*>(p.lse.data)[vp.lse_offset(it.b, it.h, i)] = kNegInf;
      } else {
        const float inv = 1.0f / l;
        for (std::int64_t x = 0; x < dv; ++x) store_f(p.o, ooff + x * ods, acc[static_cast<std::size_t>(x)] * inv);
        if (p.lse.present()) static_cast<float*>(p.lse.data)[vp.lse_offset(it.b, it.h, i)] = m + std::log(l);
      }
    }
  };
  parallel::ThreadPool::global().parallel_for(static_cast<std::int64_t>(items.size()), task, max_threads);
  return Status::ok();
}

// ---------------------------------------------------------------------------------------------
// Split-KV combine: merges the partial (m, l, o) of each split of a query tile.

void combine_rows(const ValidatedProblem& vp, const Plan& plan, const Combine& c, const std::byte* partials) {
  const AttentionProblem& p = vp.problem();
  const std::int64_t dv = vp.head_dim_v();
  const std::int64_t rows_max = plan.rows_max;
  const std::int64_t ohs = head_stride(p.o), ods = dim_stride(p.o);
  const std::int32_t group = vp.group_size();
  std::vector<float> acc(static_cast<std::size_t>(dv));
  for (std::int64_t pi = 0; pi < c.rows.ni; ++pi) {
    for (std::int32_t hh = 0; hh < c.rows.nh; ++hh) {
      const std::int64_t r = pi * c.rows.nh + hh;
      float mx = kNegInf;
      bool nan = false;
      for (std::int32_t s = 0; s < c.splits; ++s) {
        const auto* slot = reinterpret_cast<const float*>(partials + static_cast<std::size_t>(c.first_partial + s) *
                                                                         plan.partial_bytes);
        const float ms = slot[r];
        if (std::isnan(ms)) nan = true;
        else mx = std::max(mx, ms);
      }
      const float muse = nan ? std::numeric_limits<float>::quiet_NaN() : (mx == kNegInf ? 0.0f : mx);
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
      const std::int32_t h = c.rows.kvh * group + c.rows.h0 + hh;
      const std::int64_t i = c.rows.i0 + pi;
      const std::int64_t ooff = vp.o_row_offset(c.rows.b, i) + h * ohs;
      if (l == 0.0f) {
        for (std::int64_t x = 0; x < dv; ++x) store_f(p.o, ooff + x * ods, 0.0f);
        if (p.lse.present()) static_cast<float*>(p.lse.data)[vp.lse_offset(c.rows.b, h, i)] = kNegInf;
      } else {
        const float inv = 1.0f / l;
        for (std::int64_t x = 0; x < dv; ++x) store_f(p.o, ooff + x * ods, acc[static_cast<std::size_t>(x)] * inv);
        if (p.lse.present()) static_cast<float*>(p.lse.data)[vp.lse_offset(c.rows.b, h, i)] = muse + std::log(l);
      }
    }
  }
}

bool fast_applicable(const ValidatedProblem& vp) noexcept {
  return vp.head_dim() <= kMaxFastHeadDim && vp.head_dim_v() <= kMaxFastHeadDim;
}

}  // namespace

// ---------------------------------------------------------------------------------------------

Plan make_plan(const ValidatedProblem& vp) {
  Plan plan;
  const std::int32_t group = vp.group_size();
  const std::int32_t hchunks = static_cast<std::int32_t>((group + kRowTarget - 1) / kRowTarget);
  const std::int32_t nh = (group + hchunks - 1) / hchunks;
  const std::int64_t mq = std::max<std::int64_t>(1, kRowTarget / nh);
  // A sequence whose tasks are fewer than this is split along its keys (when it has at least two
  // splits' worth of keys, kMinSplitKeys each), so that one long sequence still keeps the threads
  // busy. Counted per sequence, never per call: a sequence's splits, and so the order its keys are
  // summed in, do not depend on what else is in the batch.
  constexpr std::int64_t kParallelUnits = 32;
  constexpr std::int64_t kMinSplitKeys = 4 * kKeyTile;

  struct Base {
    std::int64_t i0, ni, k_begin, k_end;
    double cost;
  };
  std::vector<Base> bases;
  for (std::int32_t b = 0; b < vp.batch(); ++b) {
    const std::int64_t sq = vp.seqlen_q(b);
    if (sq == 0 || decode_shaped(vp, b)) continue;
    bases.clear();
    for (std::int64_t i0 = 0; i0 < sq; i0 += mq) {
      const std::int64_t ni = std::min(mq, sq - i0);
      std::int64_t lo = std::numeric_limits<std::int64_t>::max(), hi = -1;
      double keys = 0.0;
      for (std::int64_t i = i0; i < i0 + ni; ++i) {
        const auto r = vp.visible_keys(b, i);
        if (r.first > r.last) continue;
        lo = std::min(lo, r.first);
        hi = std::max(hi, r.last);
        keys += static_cast<double>(r.last - r.first + 1);
      }
      if (hi < 0) lo = hi = 0;  // no visible key: the task only writes zeros
      else ++hi;
      bases.push_back({i0, ni, lo, hi, keys});
    }
    const std::int64_t n_base = static_cast<std::int64_t>(bases.size()) * vp.hkv() * hchunks;
    const std::int64_t want_splits = std::max<std::int64_t>(1, kParallelUnits / n_base);

    for (const Base& base : bases) {
      const std::int64_t span = base.k_end - base.k_begin;
      std::int64_t splits = std::min<std::int64_t>(want_splits, span / kMinSplitKeys);
      if (splits < 2) splits = 1;
      const std::int64_t tiles = (span + kKeyTile - 1) / kKeyTile;
      const std::int64_t tiles_per_split = (tiles + splits - 1) / std::max<std::int64_t>(1, splits);
      if (splits > 1) splits = (tiles + tiles_per_split - 1) / tiles_per_split;
      for (std::int32_t kvh = 0; kvh < vp.hkv(); ++kvh) {
        for (std::int32_t hc = 0; hc < hchunks; ++hc) {
          Task t;
          t.b = b;
          t.kvh = kvh;
          t.h0 = hc * nh;
          t.nh = std::min(nh, group - hc * nh);
          t.i0 = base.i0;
          t.ni = base.ni;
          plan.rows_max = std::max(plan.rows_max, t.ni * t.nh);
          const double row_cost = static_cast<double>(vp.head_dim() + vp.head_dim_v()) * t.nh;
          if (splits == 1) {
            t.k_begin = base.k_begin;
            t.k_end = base.k_end;
            t.cost = base.cost * row_cost + 1.0;
            plan.tasks.push_back(t);
            continue;
          }
          Combine c;
          c.rows = t;
          c.first_partial = plan.n_partials;
          c.splits = static_cast<std::int32_t>(splits);
          for (std::int64_t sp = 0; sp < splits; ++sp) {
            Task st = t;
            st.k_begin = base.k_begin + sp * tiles_per_split * kKeyTile;
            st.k_end = std::min(base.k_end, st.k_begin + tiles_per_split * kKeyTile);
            st.partial = plan.n_partials++;
            st.cost = base.cost * row_cost / static_cast<double>(splits) + 1.0;
            plan.tasks.push_back(st);
          }
          plan.combines.push_back(c);
        }
      }
    }
  }
  // Head-major (consecutive tasks reuse the same K/V from L2), heaviest query tile first within a
  // head, so that the last tasks handed out are light ones and the threads finish together.
  std::stable_sort(plan.tasks.begin(), plan.tasks.end(), [](const Task& a, const Task& b) {
    if (a.b != b.b) return a.b < b.b;
    if (a.kvh != b.kvh) return a.kvh < b.kvh;
    if (a.h0 != b.h0) return a.h0 < b.h0;
    return a.cost > b.cost;
  });
  if (plan.tasks.empty()) return plan;
  const auto layout = scratch_layout(plan.rows_max, vp.head_dim(), vp.head_dim_v());
  plan.worker_bytes = layout.total;
  plan.partial_bytes =
      static_cast<std::size_t>(round_up((2 * plan.rows_max + plan.rows_max * vp.head_dim_v()) * 4, 64));
  return plan;
}

DecodePlan make_decode_plan(const ValidatedProblem& vp) {
  DecodePlan plan;
  std::int64_t total = 0;  // keys of every decode sequence
  const double key_bytes = vp.hkv() * (vp.head_dim() * static_cast<double>(dtype_size(vp.problem().k.dtype)) +
                                       vp.head_dim_v() * static_cast<double>(dtype_size(vp.problem().v.dtype)));
  for (std::int32_t b = 0; b < vp.batch(); ++b) {
    const std::int64_t sq = vp.seqlen_q(b);
    if (sq == 0 || !decode_shaped(vp, b)) continue;
    std::int64_t lo = std::numeric_limits<std::int64_t>::max(), hi = -1;
    for (std::int64_t i = 0; i < sq; ++i) {
      const auto r = vp.visible_keys(b, i);
      if (r.first > r.last) continue;
      lo = std::min(lo, r.first);
      hi = std::max(hi, r.last);
    }
    if (hi < 0) lo = hi = 0;  // no visible key: the task only writes zeros
    else ++hi;
    const std::int64_t span = hi - lo;
    DecodeTask t;
    t.b = b;
    t.kv_bytes = static_cast<double>(span) * key_bytes;
    plan.kv_bytes += t.kv_bytes;
    plan.seq_kv_bytes_max = std::max(plan.seq_kv_bytes_max, t.kv_bytes);
    plan.rows_max = std::max<std::int64_t>(plan.rows_max, sq * vp.hq());
    // Chunks from the sequence's own span (never the batch or the thread count), so its keys are
    // summed in the same order alone, batched, and on any number of threads.
    const std::int64_t chunk = decode_chunk_keys(span);
    std::int64_t n = std::max<std::int64_t>(1, (span + chunk - 1) / chunk);
    const std::int64_t per = n == 1 ? span : round_up((span + n - 1) / n, kDecodeBlock);
    if (n > 1) n = (span + per - 1) / per;
    t.chunks = static_cast<std::int32_t>(n);
    if (n > 1) {
      t.first_slot = plan.n_slots;
      t.counter = static_cast<std::int32_t>(plan.n_counters++);
      plan.n_slots += n;
    }
    for (std::int64_t c = 0; c < n; ++c) {
      t.chunk = static_cast<std::int32_t>(c);
      t.k_begin = lo + c * per;
      t.k_end = n == 1 ? hi : std::min(hi, t.k_begin + per);
      plan.chunks.push_back(t);
    }
    total += span;
  }
  if (plan.chunks.empty()) return plan;
  // Runs of about as many keys as the call's chunks would hold if they were sized over the whole
  // call: one sequence alone runs one chunk per task (its chunks are that size), a batch of many
  // runs whole sequences or long parts of them, with the scheduling overhead of few tasks.
  const std::int64_t run_keys = decode_chunk_keys(total);
  for (std::size_t c = 0; c < plan.chunks.size();) {
    const DecodeTask& head = plan.chunks[c];
    const std::int64_t per = std::max<std::int64_t>(1, head.k_end - head.k_begin);
    const std::int64_t group = std::max<std::int64_t>(1, run_keys / per);
    const auto count = static_cast<std::int32_t>(std::min<std::int64_t>(group, head.chunks - head.chunk));
    plan.runs.push_back({static_cast<std::int32_t>(c), count});
    c += static_cast<std::size_t>(count);
  }
  // Longest runs first, so that the last tasks handed out are short and the threads finish together.
  auto run_cost = [&](const DecodeRun& r) {
    const DecodeTask& first = plan.chunks[static_cast<std::size_t>(r.first)];
    const DecodeTask& last = plan.chunks[static_cast<std::size_t>(r.first + r.count - 1)];
    return (last.k_end - first.k_begin) * vp.seqlen_q(first.b);
  };
  std::stable_sort(plan.runs.begin(), plan.runs.end(),
                   [&](const DecodeRun& a, const DecodeRun& b) { return run_cost(a) > run_cost(b); });
  plan.worker_bytes = decode_layout(plan.rows_max, vp.head_dim(), vp.head_dim_v()).total;
  plan.slot_bytes = static_cast<std::size_t>(round_up((2 * plan.rows_max + plan.rows_max * vp.head_dim_v()) * 4, 64));
  return plan;
}

CallPlan make_call_plan(const ValidatedProblem& vp) {
  CallPlan plan;
  plan.tiled = make_plan(vp);
  plan.decode = make_decode_plan(vp);
  plan.worker_bytes = std::max(plan.tiled.worker_bytes, plan.decode.worker_bytes);
  return plan;
}

bool decode_steps_crowd_l1(const ValidatedProblem& vp) {
  const AttentionProblem& p = vp.problem();
  const std::size_t row_axis = p.kv_layout == KvLayout::packed ? 0 : 1;
  // One query row per KV head (MHA) takes its short steps in narrower passes, which cost more
  // with K/V in L1: worth it only where the sets are fuller.
  const int most = vp.group_size() >= 2 ? 2 : 4;
  auto crowded = [&](const TensorView& t, std::int64_t dim) {
    const auto es = static_cast<std::int64_t>(dtype_size(t.dtype));
    return step_lines_per_set(t.stride[row_axis] * es, dim * es, kDecodeLongStepKeys) > most;
  };
  return crowded(p.k, vp.head_dim()) || crowded(p.v, vp.head_dim_v());
}

bool decode_short_steps(const ValidatedProblem& vp, double kv_bytes) {
  return kv_bytes > kDecodeShortStepsMinBytes && decode_steps_crowd_l1(vp);
}

DecodeFacts decode_facts(const ValidatedProblem& vp, double kv_bytes) {
  const AttentionProblem& p = vp.problem();
  DecodeFacts f;
  f.simd_lanes = decode_lane_keys();
  f.amd = cpu_is_amd();
  // As the kernels' KvInPlace: unit element strides, head dims of whole vectors, one dtype.
  f.kv_in_place = dim_stride(p.k) == 1 && dim_stride(p.v) == 1 && vp.head_dim() % f.simd_lanes == 0 &&
                  vp.head_dim_v() % f.simd_lanes == 0 && p.k.dtype == p.v.dtype;
  f.kv_bytes = kv_bytes;
  // Judged only where it can matter (the rule reads it beyond kDecodeShortStepsMinBytes).
  f.steps_crowd_l1 = kv_bytes > kDecodeShortStepsMinBytes && decode_steps_crowd_l1(vp);
  return f;
}

namespace {

// The facts of a problem that make_plan and make_decode_plan read (through visible_keys too), and
// nothing else: two problems with equal keys have equal plans.
struct PlanKey {
  std::int32_t batch = -1, hq = 0, hkv = 0, d = 0, dv = 0;
  DType kdt = DType::f32, vdt = DType::f32;
  bool causal = false;
  std::int64_t window_left = 0, window_right = 0;
  std::vector<std::int64_t> lengths;  // seqlen_q(b), seqlen_k(b) for each sequence

  bool matches(const ValidatedProblem& vp) const noexcept {
    const AttentionProblem& p = vp.problem();
    if (batch != vp.batch() || hq != vp.hq() || hkv != vp.hkv() || d != vp.head_dim() || dv != vp.head_dim_v() ||
        kdt != p.k.dtype || vdt != p.v.dtype || causal != p.causal || window_left != p.window_left ||
        window_right != p.window_right)
      return false;
    for (std::int32_t b = 0; b < batch; ++b) {
      if (lengths[2 * static_cast<std::size_t>(b)] != vp.seqlen_q(b) ||
          lengths[2 * static_cast<std::size_t>(b) + 1] != vp.seqlen_k(b))
        return false;
    }
    return true;
  }
  void assign(const ValidatedProblem& vp) {
    const AttentionProblem& p = vp.problem();
    batch = -1;  // invalid until complete (an allocation below may throw)
    lengths.resize(2 * static_cast<std::size_t>(vp.batch()));
    for (std::int32_t b = 0; b < vp.batch(); ++b) {
      lengths[2 * static_cast<std::size_t>(b)] = vp.seqlen_q(b);
      lengths[2 * static_cast<std::size_t>(b) + 1] = vp.seqlen_k(b);
    }
    hq = vp.hq();
    hkv = vp.hkv();
    d = vp.head_dim();
    dv = vp.head_dim_v();
    kdt = p.k.dtype;
    vdt = p.v.dtype;
    causal = p.causal;
    window_left = p.window_left;
    window_right = p.window_right;
    batch = vp.batch();
  }
};

// Each calling thread's last plan of each kind, with its key. The dispatcher asks workspace_size()
// and then calls run() on the same thread with the same problem: the plan workspace_size() built
// is the one run() uses, and a model's layers, which repeat a shape, reuse it. Per thread, so
// concurrent calls never share one; the key holds everything a plan depends on, so a plan is only
// reused for a problem it was built for.
template <typename PlanT>
struct CachedPlan {
  PlanKey key;
  PlanT plan;
};

template <typename PlanT, typename Make>
PlanT& plan_for(CachedPlan<PlanT>& cached, const ValidatedProblem& vp, Make&& make) {
  if (!cached.key.matches(vp)) {
    cached.key.batch = -1;
    cached.plan = make(vp);
    cached.key.assign(vp);
  }
  return cached.plan;
}

const CallPlan& call_plan(const ValidatedProblem& vp) {
  thread_local CachedPlan<CallPlan> cached;
  return plan_for(cached, vp, make_call_plan);
}

}  // namespace

// Above reference (0): the default CPU backend. Passes the full conformance matrix.
int CpuFlashBackend::priority() const noexcept { return 100; }

Support CpuFlashBackend::supports(const ProblemSignature& sig) const noexcept {
  if (sig.device.kind != DeviceKind::cpu) {
    return Support::no("cpu-flash runs on the CPU; the tensors are on " + sig.device.to_string());
  }
  return Support::yes();
}

bool CpuFlashBackend::uses_fast_path(const ValidatedProblem& vp) const noexcept {
  return options_.path != Path::generic && fast_applicable(vp);
}

std::size_t CpuFlashBackend::workspace_size(const ValidatedProblem& vp) const noexcept {
  if (!uses_fast_path(vp) || vp.total_q() == 0) return 0;
  try {
    const int threads = parallel::ThreadPool::global().threads_for(options_.threads);
    return call_plan(vp).workspace_bytes(threads);
  } catch (...) {
    return 0;
  }
}

std::string CpuFlashBackend::simd_target() { return fast_target_name(); }
std::vector<std::string> CpuFlashBackend::simd_targets() { return fast_target_names(); }
bool CpuFlashBackend::force_simd_target(const std::string& name) { return force_fast_target(name); }

namespace {

// The dispatcher's workspace when it is big enough (the usual case: workspace_size() asked for
// `need`), else memory of our own in `owned`; 64-byte aligned for the SIMD tiles. nullptr when
// out of memory.
std::byte* scratch(Workspace workspace, std::size_t need, std::unique_ptr<std::byte[]>& owned) {
  std::byte* base = static_cast<std::byte*>(workspace.data);
  if (base == nullptr || workspace.bytes < need) {
    owned.reset(new (std::nothrow) std::byte[need]);
    if (!owned) return nullptr;
    base = owned.get();
  }
  const auto addr = reinterpret_cast<std::uintptr_t>(base);
  return base + (64 - addr % 64) % 64;
}

Status scratch_out_of_memory() {
  return Status(ErrorCode::out_of_memory, "workspace", "cpu-flash could not allocate scratch");
}

// The kernel that runs a sequence's chunks and its step: the rule's choice for the sequence (on
// the call's facts with the sequence's K/V bytes), or what `options` forces.
struct SequenceKernel {
  DecodeKernel kernel = DecodeKernel::by_head;
  bool short_steps = false;
};
SequenceKernel sequence_kernel(const Options& options, const ValidatedProblem& vp, double kv_bytes,
                               const DecodeFacts& call) {
  // steps_crowd_l1 was judged for the call's largest sequence; the rule reads it only beyond
  // kDecodeShortStepsMinBytes.
  DecodeFacts facts = call;
  facts.kv_bytes = kv_bytes;
  facts.steps_crowd_l1 = call.steps_crowd_l1 && kv_bytes > kDecodeShortStepsMinBytes;
  const DecodeChoice choice = choose_decode_kernel(facts);
  SequenceKernel k;
  k.kernel = options.decode == DecodeKernel::automatic ? choice.kernel : options.decode;
  if (options.decode_step != 0) k.short_steps = options.decode_step == 8;
  else if (options.decode == DecodeKernel::automatic) k.short_steps = choice.short_steps;
  else k.short_steps = decode_short_steps(vp, kv_bytes);
  return k;
}

}  // namespace

Status CpuFlashBackend::run(const ValidatedProblem& vp, Workspace workspace) noexcept {
  try {
    if (vp.total_q() == 0) return Status::ok();
    if (!uses_fast_path(vp)) return run_generic(vp, options_.threads);

    // One parallel_for over the tiled tasks (heavier, so first) and then the runs of decode chunks;
    // each sequence's tasks and chunks are its own plan's, whatever else the call holds.
    const CallPlan& plan = call_plan(vp);
    auto& pool = parallel::ThreadPool::global();
    const int threads = pool.threads_for(options_.threads);
    std::unique_ptr<std::byte[]> owned;
    std::byte* const base = scratch(workspace, plan.workspace_bytes(threads), owned);
    if (base == nullptr) return scratch_out_of_memory();
    std::byte* const partials = base + static_cast<std::size_t>(threads) * plan.worker_bytes;
    std::byte* const slots = partials + plan.partials_bytes();
    auto* const counters = reinterpret_cast<std::int32_t*>(slots + plan.slots_bytes());
    std::fill(counters, counters + plan.decode.n_counters, 0);
    const DecodeFacts call = plan.decode.runs.empty() ? DecodeFacts{} : decode_facts(vp, plan.decode.seq_kv_bytes_max);
    const auto n_tiled = static_cast<std::int64_t>(plan.tiled.tasks.size());

    pool.parallel_for(
        n_tiled + static_cast<std::int64_t>(plan.decode.runs.size()),
        [&](std::int64_t t, int worker) {
          void* const mine = base + static_cast<std::size_t>(worker) * plan.worker_bytes;
          if (t < n_tiled) {
            const Task& task = plan.tiled.tasks[static_cast<std::size_t>(t)];
            float* partial = task.partial < 0
                                 ? nullptr
                                 : reinterpret_cast<float*>(partials + static_cast<std::size_t>(task.partial) *
                                                                           plan.tiled.partial_bytes);
            run_fast_task(vp, plan.tiled, task, mine, partial);
            return;
          }
          const DecodeRun& run = plan.decode.runs[static_cast<std::size_t>(t - n_tiled)];
          const DecodeTask* chunk = plan.decode.chunks.data() + run.first;
          const SequenceKernel k = sequence_kernel(options_, vp, chunk->kv_bytes, call);
          for (std::int32_t c = 0; c < run.count; ++c) {
            DecodeTask task = chunk[c];
            task.short_steps = k.short_steps;
            task.prefetch_end = chunk[run.count - 1].k_end;
            switch (k.kernel) {
              case DecodeKernel::grouped: run_decode_grouped(vp, plan.decode, task, mine, slots, counters); break;
              case DecodeKernel::lanes: run_decode_lanes(vp, plan.decode, task, mine, slots, counters); break;
              case DecodeKernel::lanes_half_dots:
                run_decode_lanes_half_dots(vp, plan.decode, task, mine, slots, counters);
                break;
              case DecodeKernel::automatic:
              case DecodeKernel::by_head: run_decode_by_head(vp, plan.decode, task, mine, slots, counters); break;
            }
          }
        },
        threads);
    if (!plan.tiled.combines.empty()) {
      pool.parallel_for(
          static_cast<std::int64_t>(plan.tiled.combines.size()),
          [&](std::int64_t c, int) {
            combine_rows(vp, plan.tiled, plan.tiled.combines[static_cast<std::size_t>(c)], partials);
          },
          threads);
    }
    return Status::ok();
  } catch (const std::bad_alloc&) {
    return Status(ErrorCode::out_of_memory, "", "cpu-flash ran out of memory");
  } catch (const std::exception& e) {
    return Status(ErrorCode::internal, "", std::string("cpu-flash: ") + e.what());
  } catch (...) {
    return Status(ErrorCode::internal, "", "cpu-flash: unknown error");
  }
}

}  // namespace kallpa::cpu_flash

namespace {
using CpuFlashBackend = kallpa::cpu_flash::CpuFlashBackend;
KALLPA_REGISTER_BACKEND(CpuFlashBackend);
}  // namespace
