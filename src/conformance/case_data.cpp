#include "conformance/case_data.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include <fmt/format.h>

#include "conformance/rng.h"

namespace kallpa::conformance::detail {
namespace {

using Dims = std::array<std::int64_t, kMaxRank>;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Strides with a unit last dimension. Padded views leave gaps after every head-dim row, after
// every group of heads and after every outer slice; a third of them are also "head-major" (the
// buffer is [.., H, S, D] in memory but seen as [.., S, H, D]), which is what a caller gets by
// transposing instead of copying. Dimension roles: rank 4 = [outer, token, head, dim],
// rank 3 = [token, head, dim].
Dims make_strides(int rank, const Dims& shape, bool padded, Rng& rng) {
  Dims st{};
  const auto dim = static_cast<std::size_t>(rank - 1);
  const auto head = static_cast<std::size_t>(rank - 2);
  const auto tok = static_cast<std::size_t>(rank - 3);
  const std::int64_t pad_row = padded ? rng.range(1, 8) : 0;
  const std::int64_t pad_group = padded ? rng.range(0, 5) : 0;
  const std::int64_t pad_outer = padded ? rng.range(0, 9) : 0;
  const bool head_major = padded && rng.chance(0.35);
  st[dim] = 1;
  const std::int64_t row = shape[dim] + pad_row;
  std::int64_t inner = 0;
  if (!head_major) {
    st[head] = row;
    st[tok] = shape[head] * row + pad_group;
    inner = shape[tok] * st[tok];
  } else {
    st[tok] = row;
    st[head] = shape[tok] * row + pad_group;
    inner = shape[head] * st[head];
  }
  if (rank == 4) st[0] = inner + pad_outer;
  return st;
}

// lse is [B, H, S] (dense) or [H, T] (packed), unit stride along the tokens.
Dims make_lse_strides(int rank, const Dims& shape, bool padded, Rng& rng) {
  Dims st{};
  if (rank == 2) {
    st[1] = 1;
    st[0] = shape[1] + (padded ? rng.range(1, 6) : 0);
  } else {
    st[2] = 1;
    st[1] = shape[2] + (padded ? rng.range(1, 6) : 0);
    st[0] = shape[1] * st[1] + (padded ? rng.range(0, 6) : 0);
  }
  return st;
}

// NaN, +inf, -inf in turn: what a stale KV cache or an uninitialised page may hold.
float special(std::int64_t n) noexcept {
  switch (n % 3) {
    case 0: return kNaN;
    case 1: return kInf;
    default: return -kInf;
  }
}

class Builder {
 public:
  Builder(const Case& c, CaseData& out) : c_(c), s_(c.spec), d_(out) {}

  void build() {
    check_spec();
    lengths();
    values();
    apply_edge();
    buffers();
    problem();
    snapshot();
  }

 private:
  [[noreturn]] void fail(const std::string& why) const {
    throw std::invalid_argument(fmt::format("case {}: {}", c_.name, why));
  }

  void check_spec() const {
    if (s_.seqlens_q.size() != s_.seqlens_k.size()) fail("seqlens_q/seqlens_k sizes");
    if (s_.hq < 1 || s_.hkv < 1 || s_.hq % s_.hkv != 0) fail("heads");
    if (s_.head_dim < 1 || s_.head_dim_v < 1) fail("head dims");
    const auto equal = [](const std::vector<std::int32_t>& v) {
      return v.empty() || std::all_of(v.begin(), v.end(), [&](std::int32_t x) { return x == v.front(); });
    };
    if (s_.q_layout == QLayout::dense && !equal(s_.seqlens_q)) fail("dense q needs equal seqlens_q");
    if (s_.kv_layout == KvLayout::dense && !equal(s_.seqlens_k)) fail("dense kv needs equal seqlens_k");
    if (s_.kv_layout == KvLayout::paged && s_.page_size < 1) fail("paged kv needs page_size >= 1");
    if (s_.spare_blocks < 0) fail("spare_blocks < 0");
    if (s_.sampled_rows < 0) fail("sampled_rows < 0");
  }

  void lengths() {
    d_.spec = s_;
    d_.batch = static_cast<std::int32_t>(s_.seqlens_q.size());
    d_.hq = s_.hq;
    d_.hkv = s_.hkv;
    d_.d = s_.head_dim;
    d_.dv = s_.head_dim_v;
    d_.scale = s_.scale.value_or(1.0f / std::sqrt(static_cast<float>(s_.head_dim)));
    d_.cu_q.assign(1, 0);
    d_.cu_k.assign(1, 0);
    for (std::size_t b = 0; b < s_.seqlens_q.size(); ++b) {
      d_.cu_q.push_back(d_.cu_q.back() + s_.seqlens_q[b]);
      d_.cu_k.push_back(d_.cu_k.back() + s_.seqlens_k[b]);
    }
    d_.total_q = d_.cu_q.back();
    d_.total_k = d_.cu_k.back();
  }

  float draw(Rng& rng, float lo, float hi) const {
    return round_to(s_.dtype, lo + (hi - lo) * static_cast<float>(rng.uniform()));
  }

  void values() {
    Rng rng(Rng::mix(s_.seed, 1));
    const auto nq = static_cast<std::size_t>(d_.total_q * d_.hq * d_.d);
    const auto nk = static_cast<std::size_t>(d_.total_k * d_.hkv * d_.d);
    const auto nv = static_cast<std::size_t>(d_.total_k * d_.hkv * d_.dv);
    d_.q.resize(nq);
    d_.k.resize(nk);
    d_.v.resize(nv);
    if (s_.edge == Edge::huge_logits) {
      // Values on a coarse grid: dot products are exact and distinct scores differ by hundreds
      // of logits at scale 1e4, so the softmax is exactly one-hot (or an exact tie) for every
      // correct implementation, while an unshifted exp() overflows. Bounded so that f16 scores
      // stay finite: |q.k| * scale <= 0.25 * d * 1e4.
      static const std::vector<float> grid = {-0.5f, -0.25f, 0.0f, 0.25f, 0.5f};
      for (float& x : d_.q) x = rng.pick(grid);
      for (float& x : d_.k) x = rng.pick(grid);
    } else if (s_.edge == Edge::neg_inf_keys || s_.edge == Edge::all_neg_inf_row) {
      // q > 0 everywhere, so that a key of -inf scores exactly -inf (never 0 * inf = NaN).
      for (float& x : d_.q) x = draw(rng, 0.125f, 1.0f);
      for (float& x : d_.k) x = draw(rng, -1.0f, 1.0f);
    } else {
      for (float& x : d_.q) x = draw(rng, -1.0f, 1.0f);
      for (float& x : d_.k) x = draw(rng, -1.0f, 1.0f);
    }
    for (float& x : d_.v) x = draw(rng, -1.0f, 1.0f);
    if (s_.alibi) {
      // The slopes of the ALiBi paper: a geometric sequence 2^(-8/H), 2^(-16/H), ...
      for (std::int32_t h = 0; h < d_.hq; ++h) {
        d_.alibi.push_back(std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(d_.hq)));
      }
    }
  }

  void set_k_row(std::int64_t krow, std::int64_t h, float value) {
    for (std::int32_t c = 0; c < d_.d; ++c) d_.k[static_cast<std::size_t>((krow * d_.hkv + h) * d_.d + c)] = value;
  }

  void apply_edge() {
    Rng rng(Rng::mix(s_.seed, 2));
    switch (s_.edge) {
      case Edge::none:
      case Edge::all_masked:  // made by the lengths and window the generator chose
      case Edge::huge_logits: break;
      case Edge::neg_inf_keys:
        for (std::int64_t r = 0; r < d_.total_k; ++r) {
          for (std::int32_t h = 0; h < d_.hkv; ++h) {
            if (rng.chance(0.3)) set_k_row(r, h, -kInf);
          }
        }
        break;
      case Edge::all_neg_inf_row:
        // KV head 0 is all -inf: every row of its query heads sees only -inf scores. Elsewhere
        // the first keys of each sequence are -inf, so with a causal mask the first rows do too.
        for (std::int32_t b = 0; b < d_.batch; ++b) {
          for (std::int64_t j = 0; j < d_.seqlen_k(b); ++j) {
            for (std::int32_t h = 0; h < d_.hkv; ++h) {
              if (h == 0 || j < 3) set_k_row(d_.cu_k[b] + j, h, -kInf);
            }
          }
        }
        break;
      case Edge::nan_in_q:
        for (int n = 0; n < 2; ++n) {
          const auto row = rng.range(0, d_.total_q - 1);
          const auto h = rng.range(0, d_.hq - 1);
          const auto c = rng.range(0, d_.d - 1);
          d_.q[static_cast<std::size_t>((row * d_.hq + h) * d_.d + c)] = kNaN;
        }
        break;
      case Edge::nan_in_masked_kv:
        // Keys no query of their sequence can see hold NaN/Inf in k and v.
        for (std::int32_t b = 0; b < d_.batch; ++b) {
          const std::int64_t sq = d_.seqlen_q(b), skv = d_.seqlen_k(b);
          std::vector<bool> seen(static_cast<std::size_t>(skv), false);
          for (std::int64_t i = 0; i < sq; ++i) {
            const KeyRange r = contract_visible_keys(s_, sq, skv, i);
            for (std::int64_t j = std::max<std::int64_t>(r.first, 0); j <= std::min(r.last, skv - 1); ++j) {
              seen[static_cast<std::size_t>(j)] = true;
            }
          }
          for (std::int64_t j = 0; j < skv; ++j) {
            if (seen[static_cast<std::size_t>(j)]) continue;
            const std::int64_t krow = d_.cu_k[b] + j;
            for (std::int32_t h = 0; h < d_.hkv; ++h) {
              set_k_row(krow, h, special(j));
              for (std::int32_t c = 0; c < d_.dv; ++c) {
                d_.v[static_cast<std::size_t>((krow * d_.hkv + h) * d_.dv + c)] = special(j + c + 1);
              }
            }
          }
        }
        break;
    }
  }

  // What sits in KV memory that belongs to no key (paged slack, packed tail rows): large finite
  // values, so reading them unmasked is a gross error, or NaN/Inf for the masked-KV edge case.
  float filler(Rng& rng, std::int64_t n) const {
    if (s_.edge == Edge::nan_in_masked_kv) return special(n);
    return round_to(s_.dtype, rng.chance(0.5) ? 48.0f : -40.0f);
  }

  void buffers() {
    Rng rng(Rng::mix(s_.seed, 3));
    const bool q_packed = s_.q_layout == QLayout::packed;
    const std::int64_t b = d_.batch;
    // An empty batch (attention.h, degenerate shapes) has dense extents of 0 too.
    const std::int64_t sq0 = b > 0 ? s_.seqlens_q.front() : 0, skv0 = b > 0 ? s_.seqlens_k.front() : 0;

    Dims qshape{}, oshape{}, kshape{}, vshape{};
    int q_rank = 4, kv_rank = 4;
    if (q_packed) {
      q_rank = 3;
      const std::int64_t rows = d_.total_q + s_.q_tail_rows;
      qshape = {rows, d_.hq, d_.d, 0};
      oshape = {rows, d_.hq, d_.dv, 0};
    } else {
      qshape = {b, sq0, d_.hq, d_.d};
      oshape = {b, sq0, d_.hq, d_.dv};
    }
    switch (s_.kv_layout) {
      case KvLayout::dense:
        kshape = {b, skv0, d_.hkv, d_.d};
        vshape = {b, skv0, d_.hkv, d_.dv};
        break;
      case KvLayout::packed: {
        kv_rank = 3;
        const std::int64_t rows = d_.total_k + s_.kv_tail_rows;
        kshape = {rows, d_.hkv, d_.d, 0};
        vshape = {rows, d_.hkv, d_.dv, 0};
        break;
      }
      case KvLayout::paged: {
        paged_table(rng);
        const std::int64_t blocks = static_cast<std::int64_t>(pool_blocks_);
        kshape = {blocks, d_.page, d_.hkv, d_.d};
        vshape = {blocks, d_.page, d_.hkv, d_.dv};
        break;
      }
    }
    const DType dt = s_.dtype;
    d_.qb = std::make_unique<GuardedBuffer>(dt, q_rank, qshape, make_strides(q_rank, qshape, s_.padded_strides, rng));
    d_.kb = std::make_unique<GuardedBuffer>(dt, kv_rank, kshape, make_strides(kv_rank, kshape, s_.padded_strides, rng));
    d_.vb = std::make_unique<GuardedBuffer>(dt, kv_rank, vshape, make_strides(kv_rank, vshape, s_.padded_strides, rng));
    d_.ob = std::make_unique<GuardedBuffer>(dt, q_rank, oshape, make_strides(q_rank, oshape, s_.padded_strides, rng));
    if (s_.lse) {
      const int rank = q_packed ? 2 : 3;
      const Dims shape = q_packed ? Dims{d_.hq, qshape[0], 0, 0} : Dims{b, d_.hq, sq0, 0};
      d_.lseb = std::make_unique<GuardedBuffer>(DType::f32, rank, shape,
                                                make_lse_strides(rank, shape, s_.padded_strides, rng));
    }
    for (GuardedBuffer* g : {d_.qb.get(), d_.kb.get(), d_.vb.get()}) g->fill_outside_with_nan();
    scatter(rng);
  }

  // A pool with two spare blocks, handed out in a random order (when permute_blocks), so that a
  // backend that indexes the pool by sequence position instead of through the table reads the
  // wrong keys. Unused table entries and the padding between rows point at the spare blocks,
  // which hold filler: valid ids, wrong data.
  void paged_table(Rng& rng) {
    d_.page = s_.page_size;
    std::vector<std::int64_t> need;
    std::int64_t total = 0, most = 0;
    for (std::int32_t b = 0; b < d_.batch; ++b) {
      need.push_back((d_.seqlen_k(b) + d_.page - 1) / d_.page);
      total += need.back();
      most = std::max(most, need.back());
    }
    const std::int64_t kSpare = s_.spare_blocks;
    pool_blocks_ = static_cast<std::size_t>(total + kSpare);
    std::vector<std::int32_t> order(pool_blocks_);
    for (std::size_t n = 0; n < order.size(); ++n) order[n] = static_cast<std::int32_t>(n);
    if (s_.permute_blocks) rng.shuffle(order);
    // Without spare blocks a table row may be as short as the longest sequence needs: 0 for a
    // batch of empty sequences over an empty pool (zero blocks).
    d_.max_blocks = static_cast<std::int32_t>(kSpare > 0 ? std::max<std::int64_t>(most + rng.range(0, 1), 1) : most);
    d_.table_stride = d_.max_blocks + s_.table_stride_pad;
    d_.block_table.assign(static_cast<std::size_t>(d_.table_stride * d_.batch), 0);
    std::size_t next = 0;
    for (std::int32_t b = 0; b < d_.batch; ++b) {
      for (std::int64_t n = 0; n < d_.table_stride; ++n) {
        std::int32_t id;
        if (n < need[static_cast<std::size_t>(b)]) {
          id = order[next++];
        } else if (kSpare == 0) {
          id = 0;  // past the sequence's keys: never read, and there is no spare block to name
        } else {
          id = order[pool_blocks_ - 1 - static_cast<std::size_t>(rng.below(static_cast<std::uint64_t>(kSpare)))];
        }
        d_.block_table[static_cast<std::size_t>(b * d_.table_stride + n)] = id;
      }
      d_.seqlens_k.push_back(static_cast<std::int32_t>(d_.seqlen_k(b)));
    }
  }

  std::int64_t q_off(const GuardedBuffer& g, std::int32_t b, std::int64_t i, std::int64_t h) const {
    const Dims& st = g.stride();
    if (s_.q_layout == QLayout::packed) return (d_.cu_q[b] + i) * st[0] + h * st[1];
    return b * st[0] + i * st[1] + h * st[2];
  }

  std::int64_t kv_off(const GuardedBuffer& g, std::int32_t b, std::int64_t j, std::int64_t h) const {
    const Dims& st = g.stride();
    switch (s_.kv_layout) {
      case KvLayout::packed: return (d_.cu_k[b] + j) * st[0] + h * st[1];
      case KvLayout::paged: {
        const std::int64_t block = d_.block_table[static_cast<std::size_t>(b * d_.table_stride + j / d_.page)];
        return block * st[0] + (j % d_.page) * st[1] + h * st[2];
      }
      case KvLayout::dense: break;
    }
    return b * st[0] + j * st[1] + h * st[2];
  }

  void scatter(Rng& rng) {
    GuardedBuffer& qb = *d_.qb;
    GuardedBuffer& kb = *d_.kb;
    GuardedBuffer& vb = *d_.vb;
    const DType dt = s_.dtype;
    for (std::int32_t b = 0; b < d_.batch; ++b) {
      for (std::int64_t i = 0; i < d_.seqlen_q(b); ++i) {
        const std::int64_t row = d_.cu_q[b] + i;
        for (std::int64_t h = 0; h < d_.hq; ++h) {
          const std::int64_t base = q_off(qb, b, i, h);
          for (std::int64_t c = 0; c < d_.d; ++c) {
            store_element(qb.data(), dt, base + c, d_.q[static_cast<std::size_t>((row * d_.hq + h) * d_.d + c)]);
          }
        }
      }
    }
    // Rows after the last packed sequence: ordinary-looking values, never part of any result.
    for (std::int64_t r = d_.total_q; r < d_.total_q + s_.q_tail_rows; ++r) {
      for (std::int64_t h = 0; h < d_.hq; ++h) {
        for (std::int64_t c = 0; c < d_.d; ++c) {
          store_element(qb.data(), dt, r * qb.stride()[0] + h * qb.stride()[1] + c, draw(rng, -1.0f, 1.0f));
        }
      }
    }
    // KV memory that holds no key gets filler first; the keys then overwrite their own slots.
    if (s_.kv_layout != KvLayout::dense) {
      const Dims& ks = kb.stride();
      const Dims& vs = vb.stride();
      const std::int64_t rows = s_.kv_layout == KvLayout::paged ? static_cast<std::int64_t>(pool_blocks_) * d_.page
                                                                : d_.total_k + s_.kv_tail_rows;
      std::int64_t n = 0;
      for (std::int64_t r = 0; r < rows; ++r) {
        const std::int64_t kbase =
            s_.kv_layout == KvLayout::paged ? (r / d_.page) * ks[0] + (r % d_.page) * ks[1] : r * ks[0];
        const std::int64_t vbase =
            s_.kv_layout == KvLayout::paged ? (r / d_.page) * vs[0] + (r % d_.page) * vs[1] : r * vs[0];
        const std::int64_t hs_k = s_.kv_layout == KvLayout::paged ? ks[2] : ks[1];
        const std::int64_t hs_v = s_.kv_layout == KvLayout::paged ? vs[2] : vs[1];
        for (std::int64_t h = 0; h < d_.hkv; ++h) {
          for (std::int64_t c = 0; c < d_.d; ++c) store_element(kb.data(), dt, kbase + h * hs_k + c, filler(rng, n++));
          for (std::int64_t c = 0; c < d_.dv; ++c) store_element(vb.data(), dt, vbase + h * hs_v + c, filler(rng, n++));
        }
      }
    }
    for (std::int32_t b = 0; b < d_.batch; ++b) {
      for (std::int64_t j = 0; j < d_.seqlen_k(b); ++j) {
        const std::int64_t row = d_.cu_k[b] + j;
        for (std::int64_t h = 0; h < d_.hkv; ++h) {
          const std::int64_t kbase = kv_off(kb, b, j, h);
          const std::int64_t vbase = kv_off(vb, b, j, h);
          for (std::int64_t c = 0; c < d_.d; ++c) {
            store_element(kb.data(), dt, kbase + c, d_.k[static_cast<std::size_t>((row * d_.hkv + h) * d_.d + c)]);
          }
          for (std::int64_t c = 0; c < d_.dv; ++c) {
            store_element(vb.data(), dt, vbase + c, d_.v[static_cast<std::size_t>((row * d_.hkv + h) * d_.dv + c)]);
          }
        }
      }
    }
  }

  void problem() {
    AttentionProblem& p = d_.problem;
    p.q_layout = s_.q_layout;
    p.kv_layout = s_.kv_layout;
    p.q = d_.qb->view();
    p.k = d_.kb->view();
    p.v = d_.vb->view();
    p.o = d_.ob->view();
    if (d_.lseb) p.lse = d_.lseb->view();
    p.batch = d_.batch;
    if (s_.q_layout == QLayout::packed) {
      d_.cu_q_arg = d_.cu_q;
      p.cu_seqlens_q = d_.cu_q_arg.data();
    }
    if (s_.kv_layout == KvLayout::packed) {
      d_.cu_k_arg = d_.cu_k;
      p.cu_seqlens_k = d_.cu_k_arg.data();
    }
    if (s_.kv_layout == KvLayout::paged) {
      p.block_table = d_.block_table.data();
      // Without padding, alternate between the explicit stride and 0 ("max_blocks_per_seq").
      p.block_table_stride = s_.table_stride_pad > 0 || (s_.seed & 1) ? d_.table_stride : 0;
      p.max_blocks_per_seq = d_.max_blocks;
      p.seqlens_k = d_.seqlens_k.data();
    }
    p.scale = s_.scale;
    p.causal = s_.causal;
    p.window_left = s_.window_left;
    p.window_right = s_.window_right;
    p.softcap = s_.softcap;
    if (s_.alibi) p.alibi_slopes = d_.alibi.data();
  }

  void snapshot() {
    d_.q_before = d_.qb->snapshot();
    d_.k_before = d_.kb->snapshot();
    d_.v_before = d_.vb->snapshot();
    d_.cu_q_before = d_.cu_q_arg;
    d_.cu_k_before = d_.cu_k_arg;
    d_.table_before = d_.block_table;
    d_.seqlens_before = d_.seqlens_k;
    d_.alibi_before = d_.alibi;
  }

  const Case& c_;
  const CaseSpec& s_;
  CaseData& d_;
  std::size_t pool_blocks_ = 0;
};

}  // namespace

KeyRange contract_visible_keys(const CaseSpec& spec, std::int64_t sq, std::int64_t skv, std::int64_t i) noexcept {
  // Written so that no window, up to INT64_MAX, can overflow: a bound is applied only when it
  // cuts inside [0, Skv), and then p_i +/- window lies inside that range too (-Sq <= p_i < Skv).
  const std::int64_t pos = i + skv - sq;
  KeyRange r{0, skv - 1};
  if (spec.causal && pos < r.last) r.last = pos;
  if (spec.window_right >= 0 && spec.window_right < r.last - pos) r.last = pos + spec.window_right;
  if (spec.window_left >= 0 && spec.window_left < pos - r.first) r.first = pos - spec.window_left;
  return r;
}

std::int64_t CaseData::o_offset(std::int32_t b, std::int64_t i, std::int64_t h, std::int64_t c) const noexcept {
  const Dims& st = ob->stride();
  if (spec.q_layout == QLayout::packed) return (cu_q[b] + i) * st[0] + h * st[1] + c * st[2];
  return b * st[0] + i * st[1] + h * st[2] + c * st[3];
}

std::int64_t CaseData::lse_offset(std::int32_t b, std::int64_t h, std::int64_t i) const noexcept {
  const Dims& st = lseb->stride();
  if (spec.q_layout == QLayout::packed) return h * st[0] + (cu_q[b] + i) * st[1];
  return b * st[0] + h * st[1] + i * st[2];
}

std::vector<std::int64_t> CaseData::tail_o_offsets() const {
  std::vector<std::int64_t> out;
  const Dims& st = ob->stride();
  for (std::int64_t r = total_q; r < total_q + spec.q_tail_rows; ++r) {
    for (std::int64_t h = 0; h < hq; ++h) {
      for (std::int64_t c = 0; c < dv; ++c) out.push_back(r * st[0] + h * st[1] + c * st[2]);
    }
  }
  return out;
}

std::vector<std::int64_t> CaseData::tail_lse_offsets() const {
  std::vector<std::int64_t> out;
  if (!lseb) return out;
  const Dims& st = lseb->stride();
  for (std::int64_t r = total_q; r < total_q + spec.q_tail_rows; ++r) {
    for (std::int64_t h = 0; h < hq; ++h) out.push_back(h * st[0] + r * st[1]);
  }
  return out;
}

std::string CaseData::describe_o(std::int64_t row, std::int64_t h, std::int64_t c) const {
  const auto b = static_cast<std::int32_t>(std::upper_bound(cu_q.begin(), cu_q.end(), row) - cu_q.begin() - 1);
  return fmt::format("o[b={},i={},h={},d={}]", b, row - cu_q[static_cast<std::size_t>(b)], h, c);
}

std::string CaseData::describe_lse(std::int64_t row, std::int64_t h) const {
  const auto b = static_cast<std::int32_t>(std::upper_bound(cu_q.begin(), cu_q.end(), row) - cu_q.begin() - 1);
  return fmt::format("lse[b={},h={},i={}]", b, h, row - cu_q[static_cast<std::size_t>(b)]);
}

std::unique_ptr<CaseData> build_case_data(const Case& c) {
  auto data = std::make_unique<CaseData>();
  Builder(c, *data).build();
  return data;
}

std::optional<std::string> find_input_change(const CaseData& d) {
  if (auto where = d.qb->find_change(d.q_before)) return "q (" + *where + ")";
  if (auto where = d.kb->find_change(d.k_before)) return "k (" + *where + ")";
  if (auto where = d.vb->find_change(d.v_before)) return "v (" + *where + ")";
  if (d.cu_q_arg != d.cu_q_before) return std::string("cu_seqlens_q");
  if (d.cu_k_arg != d.cu_k_before) return std::string("cu_seqlens_k");
  if (d.block_table != d.table_before) return std::string("block_table");
  if (d.seqlens_k != d.seqlens_before) return std::string("seqlens_k");
  if (d.alibi != d.alibi_before) return std::string("alibi_slopes");
  return std::nullopt;
}

void restore_inputs(CaseData& d) {
  d.qb->restore(d.q_before);
  d.kb->restore(d.k_before);
  d.vb->restore(d.v_before);
  // In place: the problem (and the ValidatedProblem made from it) point into these vectors.
  std::copy(d.cu_q_before.begin(), d.cu_q_before.end(), d.cu_q_arg.begin());
  std::copy(d.cu_k_before.begin(), d.cu_k_before.end(), d.cu_k_arg.begin());
  std::copy(d.table_before.begin(), d.table_before.end(), d.block_table.begin());
  std::copy(d.seqlens_before.begin(), d.seqlens_before.end(), d.seqlens_k.begin());
  std::copy(d.alibi_before.begin(), d.alibi_before.end(), d.alibi.begin());
}

}  // namespace kallpa::conformance::detail
