// The case generator. The full cross-product of the contract's features is millions of cases, so
// the bulk of the matrix is a covering design: every pair of feature values (dtype x head dim,
// head dim x paged-16, softcap x GQA-8, ...) appears in at least one case of each round, built
// greedily (AETG) from a fixed seed. The full matrix runs several rounds with different seeds, so
// most triples are covered too; the quick one runs one. Hand-written lists add what pairs cannot
// express: the contract's edge rules, and a few long (>= 1000) sequences.
//
// Everything is deterministic and platform-independent (our own RNG, no floating point in
// decisions), so names are stable: a failing case can be named in a bug report and rerun.
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "conformance/rng.h"
#include "kallpa/conformance.h"

namespace kallpa::conformance {
namespace {

using detail::Rng;

// Per-case work bound: sum over sequences of Sq * Skv * Hq * (D + Dv) multiply-adds. The oracle is
// a double-precision triple loop, so this is what keeps the full suite to seconds per backend.
constexpr double kWorkBudget = 1.2e7;
// More sequences in a batch add little coverage once there are a few; they stop at this.
constexpr double kBatchBudget = 3e6;

struct HeadDims {
  std::int32_t d, dv;
};
const std::vector<HeadDims> kHeadDims = {{8, 8},     {40, 40},   {64, 64}, {80, 80},  {96, 96}, {112, 112}, {128, 128},
                                         {160, 160}, {256, 256}, {64, 32}, {128, 64}, {40, 80}, {16, 8}};

struct Lengths {
  std::int32_t sq, skv;
};
// Around the tile sizes kernels use (63/64/65, 127/129), decode (Sq = 1), chunked prefill
// (Sq < Skv) and Sq > Skv, where bottom-right causal alignment leaves the first rows empty.
const std::vector<Lengths> kLengths = {{1, 1},     {2, 2},   {7, 7},  {63, 63}, {64, 64}, {65, 65},  {127, 129},
                                       {129, 127}, {1, 129}, {1, 65}, {7, 127}, {65, 7},  {16, 256}, {129, 129}};

enum class Mask { none, causal, left, right, both, causal_left };
constexpr int kMasks = 6;

struct Heads {
  std::int32_t hq, hkv;
};
// GQA ratios 1, 3 and 8, each with one KV head (MQA) and with several.
const std::vector<Heads> kHeads = {{1, 1}, {4, 4}, {3, 1}, {6, 2}, {8, 1}, {16, 2}};

struct Layout {
  QLayout q;
  KvLayout kv;
  std::int32_t page;
};
const std::vector<Layout> kLayouts = {{QLayout::dense, KvLayout::dense, 0},   {QLayout::packed, KvLayout::packed, 0},
                                      {QLayout::packed, KvLayout::paged, 1},  {QLayout::packed, KvLayout::paged, 7},
                                      {QLayout::packed, KvLayout::paged, 16}, {QLayout::packed, KvLayout::paged, 256},
                                      {QLayout::dense, KvLayout::paged, 16},  {QLayout::dense, KvLayout::paged, 7},
                                      {QLayout::dense, KvLayout::packed, 0}};

constexpr DType kDTypes[] = {DType::f32, DType::f16, DType::bf16};

// Factor order of a row in the covering design.
enum Factor { kDType, kDims, kLen, kMask, kHeadsF, kLayout, kSoftcap, kAlibi, kLse, kPadded, kScale, kFactors };

std::vector<int> factor_sizes() {
  std::vector<int> s(kFactors, 2);
  s[kDType] = 3;
  s[kDims] = static_cast<int>(kHeadDims.size());
  s[kLen] = static_cast<int>(kLengths.size());
  s[kMask] = kMasks;
  s[kHeadsF] = static_cast<int>(kHeads.size());
  s[kLayout] = static_cast<int>(kLayouts.size());
  return s;
}

using Row = std::vector<int>;  // one value index per factor, -1 = not chosen yet

// Work of a (partial) row with its single base sequence; unchosen factors count at their cheapest.
double row_work(const Row& row) {
  double len = 1.0, heads = 1.0, dims = 16.0;
  if (row[kLen] >= 0) {
    const Lengths& l = kLengths[static_cast<std::size_t>(row[kLen])];
    len = static_cast<double>(l.sq) * l.skv;
  }
  if (row[kHeadsF] >= 0) heads = kHeads[static_cast<std::size_t>(row[kHeadsF])].hq;
  if (row[kDims] >= 0) {
    const HeadDims& d = kHeadDims[static_cast<std::size_t>(row[kDims])];
    dims = d.d + d.dv;
  }
  return len * heads * dims;
}

bool feasible(const Row& row) { return row_work(row) <= kWorkBudget; }

// Which pairs (factor a = value x, factor b = value y) are covered so far.
class PairCover {
 public:
  explicit PairCover(std::vector<int> sizes) : sizes_(std::move(sizes)) {
    const int n = static_cast<int>(sizes_.size());
    base_.assign(static_cast<std::size_t>(n * n), 0);
    std::size_t total = 0;
    for (int a = 0; a < n; ++a) {
      for (int b = a + 1; b < n; ++b) {
        base_[static_cast<std::size_t>(a * n + b)] = total;
        total += static_cast<std::size_t>(sizes_[static_cast<std::size_t>(a)] * sizes_[static_cast<std::size_t>(b)]);
      }
    }
    covered_.assign(total, 0);
    // Pairs no case within the work budget can hold are not owed.
    for (int a = 0; a < n; ++a) {
      for (int b = a + 1; b < n; ++b) {
        for (int x = 0; x < size(a); ++x) {
          for (int y = 0; y < size(b); ++y) {
            Row r(static_cast<std::size_t>(n), -1);
            r[static_cast<std::size_t>(a)] = x;
            r[static_cast<std::size_t>(b)] = y;
            if (!feasible(r)) covered_[index(a, x, b, y)] = 1;
          }
        }
      }
    }
    remaining_ = static_cast<std::size_t>(std::count(covered_.begin(), covered_.end(), 0));
  }

  std::size_t remaining() const { return remaining_; }

  // New pairs `row` would cover between factor f and every chosen factor (all when f < 0).
  int gain(const Row& row, int f = -1) const {
    const int n = static_cast<int>(sizes_.size());
    int g = 0;
    for (int a = 0; a < n; ++a) {
      for (int b = a + 1; b < n; ++b) {
        if (f >= 0 && a != f && b != f) continue;
        const int x = row[static_cast<std::size_t>(a)], y = row[static_cast<std::size_t>(b)];
        if (x >= 0 && y >= 0 && !covered_[index(a, x, b, y)]) ++g;
      }
    }
    return g;
  }

  void cover(const Row& row) {
    const int n = static_cast<int>(sizes_.size());
    for (int a = 0; a < n; ++a) {
      for (int b = a + 1; b < n; ++b) {
        auto& c = covered_[index(a, row[static_cast<std::size_t>(a)], b, row[static_cast<std::size_t>(b)])];
        if (!c) {
          c = 1;
          --remaining_;
        }
      }
    }
  }

  // A random uncovered pair, written into `row`.
  void seed_row(Rng& rng, Row& row) const {
    const std::size_t start = static_cast<std::size_t>(rng.below(covered_.size()));
    std::size_t k = start;
    while (covered_[k]) k = (k + 1) % covered_.size();
    const int n = static_cast<int>(sizes_.size());
    for (int a = 0; a < n; ++a) {
      for (int b = a + 1; b < n; ++b) {
        const std::size_t lo = base_[static_cast<std::size_t>(a * n + b)];
        const std::size_t len = static_cast<std::size_t>(size(a) * size(b));
        if (k >= lo && k < lo + len) {
          row[static_cast<std::size_t>(a)] = static_cast<int>((k - lo) / static_cast<std::size_t>(size(b)));
          row[static_cast<std::size_t>(b)] = static_cast<int>((k - lo) % static_cast<std::size_t>(size(b)));
          return;
        }
      }
    }
  }

 private:
  int size(int f) const { return sizes_[static_cast<std::size_t>(f)]; }
  std::size_t index(int a, int x, int b, int y) const {
    const int n = static_cast<int>(sizes_.size());
    return base_[static_cast<std::size_t>(a * n + b)] + static_cast<std::size_t>(x * size(b) + y);
  }

  std::vector<int> sizes_;
  std::vector<std::size_t> base_;
  std::vector<std::uint8_t> covered_;
  std::size_t remaining_ = 0;
};

// AETG: each new row starts from an uncovered pair and picks, factor by factor in random order,
// the value covering the most new pairs; the best of a few candidate rows is kept.
std::vector<Row> covering_rows(std::uint64_t seed) {
  const std::vector<int> sizes = factor_sizes();
  PairCover cover(sizes);
  Rng rng(seed);
  std::vector<Row> rows;
  constexpr int kCandidates = 12;
  while (cover.remaining() > 0) {
    Row best;
    int best_gain = -1;
    for (int cand = 0; cand < kCandidates; ++cand) {
      Row row(sizes.size(), -1);
      cover.seed_row(rng, row);
      std::vector<int> order;
      for (int f = 0; f < kFactors; ++f) {
        if (row[static_cast<std::size_t>(f)] < 0) order.push_back(f);
      }
      rng.shuffle(order);
      for (int f : order) {
        const auto uf = static_cast<std::size_t>(f);
        // Most gain first; among equal gains the cheaper row (the oracle's time is the suite's
        // cost), then chance.
        int chosen = -1, chosen_gain = -1, ties = 0;
        double chosen_work = 0.0;
        for (int x = 0; x < sizes[uf]; ++x) {
          row[uf] = x;
          if (!feasible(row)) continue;
          const int g = cover.gain(row, f);
          const double w = row_work(row);
          if (g > chosen_gain || (g == chosen_gain && w < chosen_work)) {
            chosen = x;
            chosen_gain = g;
            chosen_work = w;
            ties = 1;
          } else if (g == chosen_gain && w == chosen_work && rng.below(static_cast<std::uint64_t>(++ties)) == 0) {
            chosen = x;
          }
        }
        row[uf] = chosen;
      }
      const int g = cover.gain(row);
      if (g > best_gain) {
        best = row;
        best_gain = g;
      }
    }
    cover.cover(best);
    rows.push_back(std::move(best));
  }
  return rows;
}

double spec_work(const CaseSpec& s) {
  double pairs = 0.0;
  for (std::size_t b = 0; b < s.seqlens_q.size(); ++b) pairs += static_cast<double>(s.seqlens_q[b]) * s.seqlens_k[b];
  return pairs * s.hq * (s.head_dim + s.head_dim_v);
}

CaseSpec spec_from_row(const Row& row, Rng& rng) {
  auto at = [&](Factor f) { return static_cast<std::size_t>(row[static_cast<std::size_t>(f)]); };
  CaseSpec s;
  s.dtype = kDTypes[at(kDType)];
  s.head_dim = kHeadDims[at(kDims)].d;
  s.head_dim_v = kHeadDims[at(kDims)].dv;
  s.hq = kHeads[at(kHeadsF)].hq;
  s.hkv = kHeads[at(kHeadsF)].hkv;
  const Layout& layout = kLayouts[at(kLayout)];
  s.q_layout = layout.q;
  s.kv_layout = layout.kv;
  s.page_size = layout.page;
  const Lengths base = kLengths[at(kLen)];
  s.seqlens_q = {base.sq};
  s.seqlens_k = {base.skv};

  // A batch: dense tensors repeat the base lengths; packed/paged ones vary them per sequence,
  // with empty sequences and Sq > Skv among them, as long as the work stays within budget.
  const bool ragged_q = s.q_layout == QLayout::packed;
  const bool ragged_k = s.kv_layout != KvLayout::dense;
  const double work_of_base = spec_work(s);
  const std::int64_t want = ragged_q || ragged_k ? rng.range(1, 4) : rng.range(1, 2);
  for (std::int64_t b = 1; b < want; ++b) {
    std::int32_t sq = base.sq, skv = base.skv;
    if (ragged_q) {
      const std::vector<std::int32_t> options = {0, 1, base.sq, static_cast<std::int32_t>(rng.range(1, base.sq))};
      sq = rng.pick(options);
    }
    if (ragged_k) {
      const std::vector<std::int32_t> options = {0, 1, base.skv, static_cast<std::int32_t>(rng.range(1, base.skv + 8))};
      skv = rng.pick(options);
    }
    s.seqlens_q.push_back(sq);
    s.seqlens_k.push_back(skv);
    if (spec_work(s) > std::max(kBatchBudget, work_of_base)) {
      s.seqlens_q.pop_back();
      s.seqlens_k.pop_back();
      break;
    }
  }

  const std::int32_t skv = base.skv;
  const std::vector<std::int64_t> lefts = {0, 1, 3, 16, std::max(1, skv / 2)};
  const std::vector<std::int64_t> rights = {0, 1, 5, std::max(1, skv / 3)};
  switch (static_cast<Mask>(row[kMask])) {
    case Mask::none: break;
    case Mask::causal: s.causal = true; break;
    case Mask::left: s.window_left = rng.pick(lefts); break;
    case Mask::right: s.window_right = rng.pick(rights); break;
    case Mask::both:
      s.window_left = rng.pick(lefts);
      s.window_right = rng.pick(rights);
      break;
    case Mask::causal_left:
      s.causal = true;
      s.window_left = rng.pick(std::vector<std::int64_t>{0, 1, 15, 64});
      break;
  }
  if (row[kSoftcap]) s.softcap = rng.pick(std::vector<float>{1.5f, 4.0f, 10.0f});
  s.alibi = row[kAlibi] != 0;
  s.lse = row[kLse] != 0;
  s.padded_strides = row[kPadded] != 0;
  if (row[kScale]) {
    const float k = rng.pick(std::vector<float>{0.25f, 2.0f, 4.0f});
    s.scale = k / std::sqrt(static_cast<float>(s.head_dim));
  }
  if (ragged_q && rng.chance(0.25)) s.q_tail_rows = static_cast<std::int32_t>(rng.range(1, 3));
  if (s.kv_layout == KvLayout::packed && rng.chance(0.3)) s.kv_tail_rows = static_cast<std::int32_t>(rng.range(1, 4));
  if (s.kv_layout == KvLayout::paged && rng.chance(0.5))
    s.table_stride_pad = static_cast<std::int32_t>(rng.range(1, 5));
  s.seed = rng.next();
  return s;
}

// ---- hand-written cases -------------------------------------------------------------------

struct Shape {
  QLayout q = QLayout::dense;
  KvLayout kv = KvLayout::dense;
  std::int32_t page = 0;
  std::vector<std::int32_t> sq, skv;
  std::int32_t hq = 1, hkv = 1, d = 64, dv = 64;
};

CaseSpec make(DType dtype, const Shape& sh) {
  CaseSpec s;
  s.dtype = dtype;
  s.q_layout = sh.q;
  s.kv_layout = sh.kv;
  s.page_size = sh.page;
  s.seqlens_q = sh.sq;
  s.seqlens_k = sh.skv;
  s.hq = sh.hq;
  s.hkv = sh.hkv;
  s.head_dim = sh.d;
  s.head_dim_v = sh.dv;
  s.lse = true;
  return s;
}

Shape dense(std::int32_t b, std::int32_t sq, std::int32_t skv, std::int32_t hq, std::int32_t hkv, std::int32_t d) {
  return {QLayout::dense,
          KvLayout::dense,
          0,
          std::vector<std::int32_t>(static_cast<std::size_t>(b), sq),
          std::vector<std::int32_t>(static_cast<std::size_t>(b), skv),
          hq,
          hkv,
          d,
          d};
}

Shape packed(std::vector<std::int32_t> sq, std::vector<std::int32_t> skv, std::int32_t hq, std::int32_t hkv,
             std::int32_t d) {
  return {QLayout::packed, KvLayout::packed, 0, std::move(sq), std::move(skv), hq, hkv, d, d};
}

Shape paged(std::int32_t page, std::vector<std::int32_t> sq, std::vector<std::int32_t> skv, std::int32_t hq,
            std::int32_t hkv, std::int32_t d) {
  return {QLayout::packed, KvLayout::paged, page, std::move(sq), std::move(skv), hq, hkv, d, d};
}

// One variant of an edge case: the shape, and what to change in the spec.
struct EdgeVariant {
  Shape shape;
  bool causal = false;
  std::int64_t wl = -1, wr = -1;
  bool padded = false;
  bool alibi = false;
  float softcap = 0.0f;
  std::int32_t table_pad = 0, kv_tail = 0;
};

std::vector<CaseSpec> edge_specs(bool quick) {
  std::map<Edge, std::vector<EdgeVariant>> variants;
  variants[Edge::all_masked] = {
      {dense(1, 65, 7, 4, 2, 64), true},               // Sq > Skv, causal
      {packed({5, 3, 7}, {0, 9, 4}, 3, 1, 40), true},  // an empty KV sequence
      {paged(7, {4, 6, 2}, {0, 3, 9}, 2, 1, 80), true, 2, -1, true},
      {dense(2, 9, 4, 2, 2, 64), false, 0, 0},          // a 0:0 window before the keys
      {dense(1, 20, 5, 1, 1, 32), false, -1, 0, true},  // right-only window
  };
  variants[Edge::huge_logits] = {
      {dense(1, 64, 64, 2, 1, 8)},
      {packed({33, 17}, {40, 17}, 2, 2, 16), true},
      {paged(16, {1, 1}, {300, 77}, 4, 1, 8), false, -1, -1, true},
      {dense(1, 129, 129, 1, 1, 16), true, 31, -1},
  };
  variants[Edge::neg_inf_keys] = {
      {dense(1, 65, 65, 4, 4, 64), true},
      {packed({12, 0, 30}, {20, 5, 30}, 6, 2, 40), false, -1, -1, true},
      {paged(16, {1, 1, 1}, {129, 16, 40}, 8, 1, 64), false, -1, -1, false, true},
      {{QLayout::packed, KvLayout::paged, 1, {9, 4}, {9, 11}, 3, 3, 96, 96}, true, 5, -1},
  };
  variants[Edge::all_neg_inf_row] = {
      {dense(1, 7, 7, 4, 2, 64), true},
      {paged(7, {5, 8}, {13, 8}, 3, 3, 80), false, -1, -1, true},
      {dense(1, 64, 64, 3, 1, 40)},  // MQA: every row is -inf
      {packed({16, 3}, {16, 20}, 2, 2, 128), true, 4, -1, false, true},
  };
  variants[Edge::nan_in_q] = {
      {dense(1, 63, 63, 4, 2, 64), true},
      {packed({9, 14, 1}, {9, 20, 3}, 6, 2, 96), false, -1, -1, true},
      {{QLayout::dense, KvLayout::paged, 16, {1, 1, 1}, {40, 100, 17}, 8, 1, 128, 128}},
      {dense(2, 7, 65, 3, 1, 80), true, 8, -1, false, false, 4.0f},
  };
  variants[Edge::nan_in_masked_kv] = {
      {dense(1, 7, 129, 2, 1, 64), true, 16, -1},  // keys before the window
      {packed({5, 9}, {40, 9}, 4, 2, 40), true, 8, -1, true, false, 0.0f, 0, 3},
      {paged(16, {3, 6}, {45, 70}, 2, 2, 64), true, 20, -1, false, false, 0.0f, 3},
      {paged(7, {4, 4}, {11, 23}, 3, 1, 112), false, -1, -1, true},  // page slack and spare blocks
      {{QLayout::dense, KvLayout::paged, 256, {1}, {300}, 4, 1, 64, 64}},
      {dense(1, 16, 64, 1, 1, 160), false, 2, 2},  // a window on both sides
  };

  std::vector<CaseSpec> out;
  std::uint64_t seed = 0xed9e;
  for (const auto& [edge, list] : variants) {
    const std::size_t count = quick ? std::min<std::size_t>(2, list.size()) : list.size();
    for (std::size_t n = 0; n < count; ++n) {
      const EdgeVariant& ev = list[n];
      for (DType dtype : kDTypes) {
        Shape sh = ev.shape;
        // Huge logits stay within f16's range only for short dot products (see case_data.cpp).
        if (edge == Edge::huge_logits && dtype == DType::f16) sh.d = sh.dv = std::min(sh.d, 16);
        CaseSpec s = make(dtype, sh);
        s.edge = edge;
        s.causal = ev.causal;
        s.window_left = ev.wl;
        s.window_right = ev.wr;
        s.padded_strides = ev.padded;
        s.alibi = ev.alibi;
        s.softcap = ev.softcap;
        s.table_stride_pad = ev.table_pad;
        s.kv_tail_rows = ev.kv_tail;
        if (edge == Edge::huge_logits) s.scale = 1e4f;
        s.seed = Rng::mix(seed, out.size());
        out.push_back(std::move(s));
      }
    }
  }
  return out;
}

// Sequences of 1000+ keys: split-KV decode, long prefill, chunked prefill. Small heads keep the
// double-precision oracle affordable.
std::vector<CaseSpec> long_specs(bool quick) {
  std::vector<CaseSpec> out;
  auto add = [&](DType dtype, const Shape& sh, auto&& tweak) {
    CaseSpec s = make(dtype, sh);
    s.lse = false;
    tweak(s);
    s.seed = Rng::mix(0x10a9, out.size());
    out.push_back(std::move(s));
  };
  add(DType::f32, dense(1, 1, 2048, 8, 1, 64), [](CaseSpec& s) { s.lse = true; });
  add(DType::bf16, {QLayout::dense, KvLayout::paged, 16, {1, 1}, {1500, 1031}, 4, 1, 128, 128}, [](CaseSpec& s) {
    s.lse = true;
    s.table_stride_pad = 2;
  });
  add(DType::f32, dense(1, 1024, 1024, 1, 1, 8), [](CaseSpec& s) { s.causal = true; });
  if (quick) return out;
  add(DType::f16, paged(256, {1, 1, 1}, {1024, 0, 1777}, 8, 2, 64), [](CaseSpec& s) { s.alibi = true; });
  add(DType::f16, dense(1, 1000, 1000, 1, 1, 16), [](CaseSpec& s) {
    s.causal = true;
    s.window_left = 64;
  });
  add(DType::bf16, packed({1031, 5}, {1031, 1200}, 1, 1, 8), [](CaseSpec& s) {
    s.causal = true;
    s.alibi = true;
  });
  add(DType::f16, {QLayout::packed, KvLayout::paged, 16, {63}, {1100}, 2, 2, 64, 64}, [](CaseSpec& s) {
    s.causal = true;
    s.lse = true;
  });
  add(DType::f32, dense(1, 1, 4096, 2, 1, 64), [](CaseSpec& s) { s.softcap = 4.0f; });
  add(DType::bf16, dense(1, 2, 1500, 1, 1, 256), [](CaseSpec& s) {
    s.causal = true;
    s.window_left = 256;
  });
  add(DType::f32, packed({1, 7, 1}, {1100, 1300, 5}, 3, 1, 80), [](CaseSpec& s) {
    s.causal = true;
    s.lse = true;
    s.padded_strides = true;
  });
  return out;
}

// ---- generated from the contract's field ranges ------------------------------------------
//
// attention.h defines every degenerate shape and the windows up to INT64_MAX. These cases are not
// picked by hand: they cross the values at and around each integer field's limits with causal
// on/off and the three KV layouts (dense, varlen, paged).

// The layouts every generated edge is crossed with: dense, varlen (packed q and kv), paged.
const std::vector<Layout> kEdgeLayouts = {{QLayout::dense, KvLayout::dense, 0},
                                          {QLayout::packed, KvLayout::packed, 0},
                                          {QLayout::packed, KvLayout::paged, 4}};

// A window bound's range is [-1, INT64_MAX] (attention.h). The values at and around each point
// where its meaning changes: unbounded (-1), the narrowest windows (0, 1), the width past which
// it hides nothing (Sq + Skv of the widest sequence, `span`), and the int32 and int64 limits
// where arithmetic on p_i +/- window overflows if not saturated.
std::vector<std::int64_t> window_values(std::int64_t span, bool quick) {
  constexpr std::int64_t i32 = std::numeric_limits<std::int32_t>::max();
  constexpr std::int64_t i64 = std::numeric_limits<std::int64_t>::max();
  if (quick) return {-1, 0, span, i32, i64};
  return {-1, 0, 1, span - 1, span, span + 1, i32 - 1, i32, i32 + 1, i64 - 1, i64};
}

CaseSpec edge_shape(const Layout& layout, std::vector<std::int32_t> sq, std::vector<std::int32_t> skv, DType dtype) {
  CaseSpec s;
  s.dtype = dtype;
  s.q_layout = layout.q;
  s.kv_layout = layout.kv;
  s.page_size = layout.page;
  s.seqlens_q = std::move(sq);
  s.seqlens_k = std::move(skv);
  s.hq = 2;
  s.hkv = 1;
  s.head_dim = s.head_dim_v = 16;
  s.lse = true;
  return s;
}

// Every window pair crossed with causal on/off and the layouts (the quick tier: the pair with one
// layout and causal setting in rotation). The sequences put query positions p_i on both sides of
// 0 (Sq > Skv and Sq < Skv, decode), where p_i - window_left and p_i + window_right overflow
// first.
std::vector<CaseSpec> window_limit_specs(bool quick) {
  std::vector<CaseSpec> out;
  const std::vector<std::int32_t> ragged_q = {5, 9, 1}, ragged_k = {9, 5, 12};
  const std::int64_t span = 9 + 12;  // the widest Sq + Skv of any layout below
  const std::vector<std::int64_t> values = window_values(span, quick);
  std::size_t pair = 0, n = 0;
  for (std::int64_t wl : values) {
    for (std::int64_t wr : values) {
      for (std::size_t li = 0; li < kEdgeLayouts.size(); ++li) {
        for (int causal = 0; causal < 2; ++causal) {
          // The quick tier: each pair once, its layout and causal setting in rotation.
          if (quick && li * 2 + static_cast<std::size_t>(causal) != pair % (2 * kEdgeLayouts.size())) continue;
          const Layout& layout = kEdgeLayouts[li];
          const bool dense = layout.q == QLayout::dense;
          // f32 only: the edge is in the index arithmetic, not the dtype, and fewer distinct
          // problems keep backends that compile per shape (pjrt) fast. Dense sequences have
          // Sq > Skv, so that query positions p_i run from Skv - Sq < 0 to Skv - 1 > 0.
          CaseSpec s = edge_shape(layout, ragged_q, ragged_k, DType::f32);
          if (dense) {
            s.seqlens_q = std::vector<std::int32_t>(2, 12);
            s.seqlens_k = std::vector<std::int32_t>(2, 9);
          }
          s.causal = causal != 0;
          s.window_left = wl;
          s.window_right = wr;
          s.seed = Rng::mix(0x3d9e, n++);
          out.push_back(std::move(s));
        }
      }
      ++pair;
    }
  }
  return out;
}

// Degenerate shapes (attention.h): the per-sequence lengths 0, 1 and an ordinary one for Sq and
// Skv, each alone and among ordinary sequences, crossed with causal and the layouts; the empty
// batch per layout; and zero blocks (a paged pool with no block at all, max_blocks_per_seq 0).
std::vector<CaseSpec> degenerate_specs(bool quick) {
  std::vector<CaseSpec> out;
  const std::vector<std::int32_t> lengths = {0, 1, 5};
  auto add = [&](CaseSpec s) {
    s.seed = Rng::mix(0xde9e, out.size());
    out.push_back(std::move(s));
  };
  std::size_t n = 0;
  for (const Layout& layout : kEdgeLayouts) {
    const bool dense = layout.q == QLayout::dense;
    for (int causal = 0; causal < 2; ++causal) {
      for (std::int32_t sq : lengths) {
        for (std::int32_t skv : lengths) {
          for (int among = 0; among < 2; ++among, ++n) {
            if (quick && n % 3 != 0) continue;
            std::vector<std::int32_t> q = {sq}, k = {skv};
            if (among && dense) q = {sq, sq}, k = {skv, skv};
            if (among && !dense) q = {4, sq, 3}, k = {6, skv, 9};
            CaseSpec s = edge_shape(layout, q, k, kDTypes[n % 3]);
            s.causal = causal != 0;
            add(std::move(s));
          }
        }
      }
      CaseSpec empty = edge_shape(layout, {}, {}, kDTypes[(n++) % 3]);
      empty.causal = causal != 0;
      add(std::move(empty));
      if (layout.kv == KvLayout::paged) {
        // Zero blocks: every sequence empty, a pool of no blocks, table rows of length 0.
        for (const std::vector<std::int32_t>& q : {std::vector<std::int32_t>{3}, std::vector<std::int32_t>{2, 0, 1}}) {
          CaseSpec s = edge_shape(layout, q, std::vector<std::int32_t>(q.size(), 0), kDTypes[(n++) % 3]);
          s.causal = causal != 0;
          s.spare_blocks = 0;
          add(std::move(s));
        }
      }
    }
  }
  return out;
}

// The size buckets the backends and the dispatcher switch at, each crossed on both sides:
//  * the power of two of the largest key count (the dispatcher's first-use buckets, pjrt's
//    executable buckets): 1024, 2048, 4096, 8192 and one past each;
//  * pjrt's key chunk (KALLPA_PJRT_CHUNK, 512 by default) and cpu-flash's split-KV minimum
//    (4 key tiles = 512): 512 and 513;
//  * cpu-flash's decode chunking (16 chunks of at least 256 keys: the chunk grows past 4096);
//  * decode vs prefill: Sq x group = 16 rows (cpu-flash's decode path limit) and 17, one query,
//    and a prefill block of 65 queries (past cpu-gemm's and opencl-flash's 64-row tiles and
//    cpu-flash's 32-query tasks).
// Prefill cases are judged on sampled rows; decode ones whole.
std::vector<CaseSpec> bucket_specs() {
  std::vector<CaseSpec> out;
  const std::vector<std::int32_t> keys = {512, 513, 1024, 1025, 2048, 2049, 4096, 4097, 8192, 8193};
  std::size_t n = 0;
  for (std::int32_t skv : keys) {
    struct Rows {
      std::int32_t sq, hq, hkv;
    };
    // One decode row per KV head; 16 and 17 rows per KV head (Sq x group); prefill.
    for (const Rows& r : {Rows{1, 8, 2}, Rows{2, 8, 1}, Rows{1, 17, 1}, Rows{65, 4, 1}}) {
      const Layout& layout = kEdgeLayouts[n % kEdgeLayouts.size()];
      CaseSpec s;
      s.dtype = kDTypes[n % 3];
      s.q_layout = layout.q;
      s.kv_layout = layout.kv;
      s.page_size = layout.kv == KvLayout::paged ? 16 : 0;
      s.seqlens_q = {r.sq};
      s.seqlens_k = {skv};
      if (layout.kv != KvLayout::dense) s.seqlens_q = {r.sq, 1}, s.seqlens_k = {skv, 7};
      s.hq = r.hq;
      s.hkv = r.hkv;
      s.head_dim = s.head_dim_v = 64;
      s.lse = n % 2 == 0;
      s.causal = r.sq > 1 || n % 4 == 1;
      if (n % 5 == 2) s.window_left = skv / 2;
      if (r.sq > 16) s.sampled_rows = 48;
      s.seed = Rng::mix(0xb0c4, n++);
      out.push_back(std::move(s));
    }
  }
  return out;
}

// The sizes that serve: 32k- and 128k-key decode and paged decode with GQA and windows, and long
// prefill over 32k keys, judged on sampled rows (the full tier).
std::vector<CaseSpec> serving_specs() {
  std::vector<CaseSpec> out;
  auto add = [&](DType dtype, const Shape& sh, auto&& tweak) {
    CaseSpec s = make(dtype, sh);
    s.lse = false;
    s.sampled_rows = 64;
    tweak(s);
    s.seed = Rng::mix(0x5e4f, out.size());
    out.push_back(std::move(s));
  };
  // Decode.
  add(DType::f16, dense(1, 1, 32768, 8, 2, 64), [](CaseSpec& s) { s.lse = true; });
  add(DType::f32, packed({1, 1}, {32769, 4095}, 8, 1, 64), [](CaseSpec& s) { s.window_left = 4096; });
  add(DType::bf16, dense(1, 1, 131072, 8, 2, 64), [](CaseSpec& s) { s.lse = true; });
  add(DType::f16, {QLayout::dense, KvLayout::paged, 16, {1, 1}, {131072, 100003}, 8, 1, 64, 64}, [](CaseSpec& s) {
    s.lse = true;
    s.table_stride_pad = 3;
  });
  add(DType::bf16, paged(256, {1, 1}, {131071, 65537}, 16, 2, 64), [](CaseSpec& s) {
    s.causal = true;
    s.window_left = 32768;
  });
  add(DType::f32, paged(16, {4}, {131072}, 8, 2, 64), [](CaseSpec& s) {  // speculative decode: 4 rows
    s.causal = true;
    s.window_left = 8191;
  });
  // Long prefill over 32k keys (chunked prefill: Sq < Skv).
  add(DType::f16, dense(1, 4096, 32768, 2, 1, 64), [](CaseSpec& s) {
    s.causal = true;
    s.lse = true;
    s.sampled_rows = 96;
  });
  add(DType::bf16, {QLayout::packed, KvLayout::paged, 16, {8192}, {32768}, 4, 1, 64, 64}, [](CaseSpec& s) {
    s.causal = true;
    s.window_left = 2048;
    s.sampled_rows = 96;
  });
  add(DType::f32, dense(1, 8192, 8192, 2, 1, 64), [](CaseSpec& s) {
    s.causal = true;
    s.window_left = 1024;
    s.sampled_rows = 96;
  });
  return out;
}

// ---- names --------------------------------------------------------------------------------

std::string join_lengths(const std::vector<std::int32_t>& v) {
  std::string out;
  for (std::size_t n = 0; n < v.size(); ++n) {
    if (n) out += '-';
    out += std::to_string(v[n]);
  }
  return out;
}

std::string_view edge_name(Edge e) {
  switch (e) {
    case Edge::none: return "none";
    case Edge::all_masked: return "all_masked";
    case Edge::huge_logits: return "huge_logits";
    case Edge::neg_inf_keys: return "neg_inf_keys";
    case Edge::all_neg_inf_row: return "all_neg_inf_row";
    case Edge::nan_in_q: return "nan_in_q";
    case Edge::nan_in_masked_kv: return "nan_in_masked_kv";
  }
  return "?";
}

// "f16/d80/sq65_skv129/h6:2/causal/qpacked/paged7/lse": everything that tells two cases apart
// except the random data.
std::string name_of(const CaseSpec& s) {
  std::vector<std::string> parts;
  parts.emplace_back(dtype_name(s.dtype));
  parts.push_back(s.head_dim == s.head_dim_v ? fmt::format("d{}", s.head_dim)
                                             : fmt::format("d{}v{}", s.head_dim, s.head_dim_v));
  const bool same = !s.seqlens_q.empty() &&
                    std::all_of(s.seqlens_q.begin(), s.seqlens_q.end(), [&](auto x) { return x == s.seqlens_q[0]; }) &&
                    std::all_of(s.seqlens_k.begin(), s.seqlens_k.end(), [&](auto x) { return x == s.seqlens_k[0]; });
  if (s.seqlens_q.empty()) {
    parts.emplace_back("b0");
  } else if (same) {
    parts.push_back(fmt::format("{}sq{}_skv{}", s.seqlens_q.size() > 1 ? fmt::format("b{}_", s.seqlens_q.size()) : "",
                                s.seqlens_q[0], s.seqlens_k[0]));
  } else {
    parts.push_back(fmt::format("sq{}_skv{}", join_lengths(s.seqlens_q), join_lengths(s.seqlens_k)));
  }
  parts.push_back(fmt::format("h{}:{}", s.hq, s.hkv));
  if (s.causal) parts.emplace_back("causal");
  if (s.window_left >= 0 || s.window_right >= 0)
    parts.push_back(fmt::format("win{}:{}", s.window_left, s.window_right));
  if (s.q_layout == QLayout::packed)
    parts.push_back(s.q_tail_rows ? fmt::format("qpacked+{}", s.q_tail_rows) : "qpacked");
  if (s.kv_layout == KvLayout::packed)
    parts.push_back(s.kv_tail_rows ? fmt::format("kvpacked+{}", s.kv_tail_rows) : "kvpacked");
  if (s.kv_layout == KvLayout::paged) {
    std::string p = fmt::format("paged{}", s.page_size);
    if (!s.permute_blocks) p += "_inorder";
    if (s.table_stride_pad) p += fmt::format("_stride+{}", s.table_stride_pad);
    if (s.spare_blocks != 2) p += fmt::format("_spare{}", s.spare_blocks);
    parts.push_back(std::move(p));
  }
  if (s.softcap > 0.0f) parts.push_back(fmt::format("softcap{:g}", s.softcap));
  if (s.alibi) parts.emplace_back("alibi");
  if (s.scale) parts.push_back(fmt::format("scale{:.4g}", *s.scale));
  if (s.padded_strides) parts.emplace_back("padded");
  if (s.lse) parts.emplace_back("lse");
  if (s.edge != Edge::none) parts.push_back(fmt::format("edge={}", edge_name(s.edge)));
  if (s.sampled_rows > 0) parts.push_back(fmt::format("sampled{}", s.sampled_rows));
  std::string out;
  for (const std::string& p : parts) {
    if (!out.empty()) out += '/';
    out += p;
  }
  return out;
}

}  // namespace

std::string_view tier_name(Tier tier) noexcept {
  switch (tier) {
    case Tier::quick: return "quick";
    case Tier::normal: return "normal";
    case Tier::full: return "full";
  }
  return "?";
}

std::vector<Case> generate_cases(Tier tier) {
  const bool quick = tier == Tier::quick;
  std::vector<CaseSpec> specs;
  const int rounds = quick ? 1 : 6;
  for (int round = 0; round < rounds; ++round) {
    const std::uint64_t seed = Rng::mix(0x6b616c6c7061ull, static_cast<std::uint64_t>(round));
    Rng rng(Rng::mix(seed, 1));
    for (const Row& row : covering_rows(seed)) specs.push_back(spec_from_row(row, rng));
  }
  for (CaseSpec& s : edge_specs(quick)) specs.push_back(std::move(s));
  for (CaseSpec& s : long_specs(quick)) specs.push_back(std::move(s));
  for (CaseSpec& s : degenerate_specs(quick)) specs.push_back(std::move(s));
  for (CaseSpec& s : window_limit_specs(quick)) specs.push_back(std::move(s));
  if (tier != Tier::quick) {
    for (CaseSpec& s : bucket_specs()) specs.push_back(std::move(s));
  }
  if (tier == Tier::full) {
    for (CaseSpec& s : serving_specs()) specs.push_back(std::move(s));
  }

  std::vector<Case> cases;
  std::map<std::string, int> seen;
  for (CaseSpec& s : specs) {
    std::string name = name_of(s);
    if (const int n = ++seen[name]; n > 1) name += fmt::format("#{}", n);
    cases.push_back({std::move(name), std::move(s)});
  }
  return cases;
}

// A few small cases that between them touch each layout, dtype and edge rule a broken kernel is
// likely to get wrong (including the decode shape the engine uses), cheap enough to run on every
// backend at start-up.
std::vector<Case> canary_cases() {
  std::vector<CaseSpec> specs;
  auto add = [&](DType dtype, const Shape& sh, auto&& tweak) {
    CaseSpec s = make(dtype, sh);
    s.lse = false;
    tweak(s);
    s.seed = Rng::mix(0xca4a, specs.size());
    specs.push_back(std::move(s));
  };
  add(DType::f32, dense(1, 17, 17, 4, 2, 64), [](CaseSpec& s) {
    s.causal = true;
    s.lse = true;
  });
  add(DType::f32, paged(7, {1, 1}, {20, 9}, 4, 2, 16), [](CaseSpec& s) { s.causal = true; });
  add(DType::f32, dense(1, 7, 13, 2, 1, 32), [](CaseSpec& s) {
    s.head_dim_v = 16;
    s.causal = true;
    s.softcap = 5.0f;
    s.alibi = true;
    s.lse = true;
  });
  add(DType::f16, packed({5, 1, 9}, {5, 12, 9}, 3, 1, 40), [](CaseSpec& s) {
    s.window_left = 4;
    s.window_right = 2;
    s.padded_strides = true;
    s.lse = true;
  });
  add(DType::bf16, paged(16, {1, 1}, {33, 70}, 8, 2, 128), [](CaseSpec& s) { s.causal = true; });
  add(DType::f32, dense(1, 9, 3, 2, 1, 16), [](CaseSpec& s) {
    s.causal = true;
    s.lse = true;
    s.edge = Edge::all_masked;
  });
  add(DType::f32, dense(1, 7, 40, 2, 1, 16), [](CaseSpec& s) {
    s.causal = true;
    s.window_left = 8;
    s.edge = Edge::nan_in_masked_kv;
  });
  add(DType::f16, dense(1, 16, 16, 2, 1, 8), [](CaseSpec& s) {
    s.scale = 1e4f;
    s.edge = Edge::huge_logits;
  });

  std::vector<Case> cases;
  for (CaseSpec& s : specs) {
    std::string name = name_of(s);
    cases.push_back({std::move(name), std::move(s)});
  }
  return cases;
}

}  // namespace kallpa::conformance
