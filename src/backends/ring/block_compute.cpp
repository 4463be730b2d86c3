// How a (rows, keys) pair becomes sub-problems of the contract. The contract aligns masks
// bottom-right: in a sub-problem of n rows and L keys, row k sits at position k + L - n. Taking
// rows [i0, i1) and keys [ka, kb) of a sequence therefore shifts every row's position relative to
// the keys by the same c = P1 + 1 - kb (P1: the last row's position in the whole problem). The
// causal bound and the windows shift with it (window_right + c, window_left - c); only ALiBi's
// |p - j| does not, and is handled apart where c != 0 (see run_alibi_after/run_alibi_before).
#include "backends/ring/block_compute.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <new>
#include <string>

#include <fmt/format.h>

#include "kallpa/half.h"

namespace kallpa::ring {
namespace {

#define RING_TRY(expr)                         \
  do {                                         \
    if (Status st_ = (expr); !st_) return st_; \
  } while (0)

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

TensorView view(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                std::initializer_list<std::int64_t> stride) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.rank = static_cast<int>(shape.size());
  std::copy(shape.begin(), shape.end(), t.shape.begin());
  std::copy(stride.begin(), stride.end(), t.stride.begin());
  return t;
}

std::int64_t last_stride(const TensorView& t, int from_end) {
  return t.stride[static_cast<std::size_t>(t.rank - from_end)];
}

// Merges rows of (src_o, src_lse) into (dst_o, dst_lse); lse is [rows, hq], o [rows, hq, dv].
void merge_rows(float* dst_o, float* dst_lse, const float* src_o, const float* src_lse, std::int64_t rows,
                std::int64_t hq, std::int64_t dv) {
  for (std::int64_t r = 0; r < rows * hq; ++r) {
    const float l2 = src_lse[r];
    if (l2 == kNegInf) continue;  // the partial saw no key: adds nothing
    float* o1 = dst_o + r * dv;
    const float* o2 = src_o + r * dv;
    const float l1 = dst_lse[r];
    if (l1 == kNegInf) {
      std::memcpy(o1, o2, static_cast<std::size_t>(dv) * sizeof(float));
      dst_lse[r] = l2;
      continue;
    }
    // A NaN lse on either side makes m, the weights and so the row NaN.
    const float m = l1 > l2 ? l1 : l2;
    const float w1 = std::exp(l1 - m);
    const float w2 = std::exp(l2 - m);
    const float inv = 1.0f / (w1 + w2);
    for (std::int64_t d = 0; d < dv; ++d) o1[d] = (w1 * o1[d] + w2 * o2[d]) * inv;
    dst_lse[r] = m + std::log(w1 + w2);
  }
}

struct Geometry {
  std::int32_t seq;
  std::int64_t offset;  // p_i = i + offset
  std::int64_t hq, hkv, d, dv;
};

class PairRunner {
 public:
  PairRunner(AttentionBackend& local, const ValidatedProblem& vp, BlockScratch& scratch)
      : local_(local), vp_(vp), p_(vp.problem()), s_(scratch) {}

  // Adds rows [i0, i1) x keys [ka, kb) of sequence `seq` to dst (rows of a block, from row i0).
  Status run(std::int32_t seq, std::int64_t i0, std::int64_t i1, std::int64_t ka, std::int64_t kb, float* dst_o,
             float* dst_lse) {
    g_ = {seq, vp_.seqlen_k(seq) - vp_.seqlen_q(seq), vp_.hq(), vp_.hkv(), vp_.head_dim(), vp_.head_dim_v()};
    const std::int64_t first_row = i0;
    const std::int64_t right = p_.causal ? 0 : vp_.window_right();  // -1: unbounded
    const std::int64_t left = vp_.window_left();
    // Rows that see none of [ka, kb): past the left window, or short of the right one.
    if (left >= 0) i1 = std::min(i1, kb - 1 + left - g_.offset + 1);
    if (right >= 0) i0 = std::max(i0, ka - right - g_.offset);
    if (i1 <= i0) return Status::ok();
    const std::int64_t p_first = i0 + g_.offset, p_last = i1 - 1 + g_.offset;
    if (right >= 0) kb = std::min(kb, p_last + 1 + right);  // keys no row can see
    if (kb <= ka) return Status::ok();
    const std::int64_t c = p_last + 1 - kb;
    const std::int64_t n = i1 - i0;

    RING_TRY(keys(ka, kb));
    float* o = dst_o + (i0 - first_row) * g_.hq * g_.dv;
    float* lse = dst_lse + (i0 - first_row) * g_.hq;
    if (p_.alibi_slopes == nullptr || c == 0) {
      const std::int64_t wr = c == 0 ? vp_.window_right() : (right < 0 ? -1 : right + c);
      const std::int64_t wl = c == 0 ? left : (left < 0 ? -1 : left - c);
      return call(q_rows(i0), n, 1, kb - ka, c == 0 && p_.causal, wl, wr, o, lse, nullptr);
    }
    // ALiBi with a shift: split until every row lies after all keys, or before all of them.
    if (c > 0) {
      if (p_first < kb) {  // rows up to position kb - 1 align with the keys; the rest come after
        const std::int64_t split = kb - g_.offset;
        RING_TRY(run(seq, i0, split, ka, kb, o, lse));
        return run(seq, split, i1, ka, kb, o + (split - i0) * g_.hq * g_.dv, lse + (split - i0) * g_.hq);
      }
      return alibi_after(i0, i1, ka, kb, left, o, lse);
    }
    if (p_last >= ka) {  // keys up to the last row's position align with the rows; the rest lie after
      RING_TRY(run(seq, i0, i1, ka, p_last + 1, o, lse));
      return run(seq, i0, i1, p_last + 1, kb, o, lse);
    }
    return alibi_before(i0, i1, ka, kb, left, right, o, lse);
  }

 private:
  const unsigned char* q_rows(std::int64_t i) const {
    return static_cast<const unsigned char*>(p_.q.data) +
           vp_.q_row_offset(g_.seq, i) * static_cast<std::int64_t>(dtype_size(p_.q.dtype));
  }
  std::int64_t q_row_stride() const { return p_.q_layout == QLayout::packed ? p_.q.stride[0] : p_.q.stride[1]; }

  // Points k_/v_ (and their strides) at keys [ka, kb): in place for dense and packed layouts,
  // gathered for a paged one, whose rows are not evenly strided.
  Status keys(std::int64_t ka, std::int64_t kb) {
    const std::int64_t len = kb - ka;
    if (p_.kv_layout != KvLayout::paged) {
      const std::int64_t ek = static_cast<std::int64_t>(dtype_size(p_.k.dtype));
      k_ = static_cast<const unsigned char*>(p_.k.data) + vp_.k_row_offset(g_.seq, ka) * ek;
      v_ = static_cast<const unsigned char*>(p_.v.data) + vp_.v_row_offset(g_.seq, ka) * ek;
      k_row_ = p_.kv_layout == KvLayout::packed ? p_.k.stride[0] : p_.k.stride[1];
      v_row_ = p_.kv_layout == KvLayout::packed ? p_.v.stride[0] : p_.v.stride[1];
      k_hs_ = last_stride(p_.k, 2), k_ds_ = last_stride(p_.k, 1);
      v_hs_ = last_stride(p_.v, 2), v_ds_ = last_stride(p_.v, 1);
      return Status::ok();
    }
    const std::size_t e = dtype_size(p_.k.dtype);
    gather(
        p_.k, ka, len, g_.d, s_.k, [&](std::int64_t j) { return vp_.k_row_offset(g_.seq, j); }, e);
    gather(
        p_.v, ka, len, g_.dv, s_.v, [&](std::int64_t j) { return vp_.v_row_offset(g_.seq, j); }, e);
    k_ = s_.k.data(), v_ = s_.v.data();
    k_row_ = g_.hkv * g_.d, k_hs_ = g_.d, k_ds_ = 1;
    v_row_ = g_.hkv * g_.dv, v_hs_ = g_.dv, v_ds_ = 1;
    return Status::ok();
  }

  template <typename RowOffset>
  void gather(const TensorView& t, std::int64_t ka, std::int64_t len, std::int64_t dim, std::vector<unsigned char>& out,
              RowOffset row_offset, std::size_t e) {
    out.resize(static_cast<std::size_t>(len * g_.hkv * dim) * e);
    const auto* src = static_cast<const unsigned char*>(t.data);
    const std::int64_t hs = last_stride(t, 2), ds = last_stride(t, 1);
    std::size_t at = 0;
    for (std::int64_t j = ka; j < ka + len; ++j) {
      const std::int64_t row = row_offset(j);
      for (std::int64_t h = 0; h < g_.hkv; ++h) {
        for (std::int64_t x = 0; x < dim; ++x, at += e) {
          std::memcpy(out.data() + at, src + static_cast<std::size_t>(row + h * hs + x * ds) * e, e);
        }
      }
    }
  }

  // One call of the local backend: `batch` sequences of `rows` query rows each (q rows read from
  // `q` at the problem's strides, batch after batch), all over the same `len` keys from k_/v_;
  // the partial goes to s_.part and is merged into (o, lse), rows in q's order. With `alibi_shift`
  // the lse of row r, head h gains slopes[h] * alibi_shift[r] (the ALiBi term the shifted origin
  // left out).
  Status call(const unsigned char* q, std::int64_t rows, std::int64_t batch, std::int64_t len, bool causal,
              std::int64_t wl, std::int64_t wr, float* o, float* lse, const std::vector<double>* alibi_shift,
              std::int64_t q_row_stride_override = -1, std::int64_t keep_rows = -1) {
    const std::int64_t total = rows * batch;
    const std::int64_t part_floats = total * g_.hq * (g_.dv + 1);
    if (s_.part.size() < static_cast<std::size_t>(part_floats)) s_.part.resize(static_cast<std::size_t>(part_floats));
    float* po = s_.part.data();
    float* pl = po + total * g_.hq * g_.dv;
    const std::int64_t qrs = q_row_stride_override >= 0 ? q_row_stride_override : q_row_stride();
    const std::int64_t qhs = q_row_stride_override >= 0 ? g_.d : last_stride(p_.q, 2);
    const std::int64_t qds = q_row_stride_override >= 0 ? 1 : last_stride(p_.q, 1);

    AttentionProblem sub;
    sub.q = view(const_cast<unsigned char*>(q), p_.q.dtype, {batch, rows, g_.hq, g_.d}, {rows * qrs, qrs, qhs, qds});
    sub.k = view(const_cast<unsigned char*>(k_), p_.k.dtype, {batch, len, g_.hkv, g_.d}, {0, k_row_, k_hs_, k_ds_});
    sub.v = view(const_cast<unsigned char*>(v_), p_.v.dtype, {batch, len, g_.hkv, g_.dv}, {0, v_row_, v_hs_, v_ds_});
    sub.o = view(po, DType::f32, {batch, rows, g_.hq, g_.dv}, {rows * g_.hq * g_.dv, g_.hq * g_.dv, g_.dv, 1});
    sub.lse = view(pl, DType::f32, {batch, g_.hq, rows}, {rows * g_.hq, 1, g_.hq});
    sub.scale = vp_.scale();
    sub.causal = causal;
    sub.window_left = wl;
    sub.window_right = wr;
    sub.softcap = p_.softcap;
    sub.alibi_slopes = p_.alibi_slopes;
    Result<ValidatedProblem> vsub = validate(sub);
    if (!vsub)
      return Status(ErrorCode::internal, "ring", "a block's sub-problem is invalid: " + vsub.status().to_string());
    const std::size_t ws = local_.workspace_size(*vsub);
    if (s_.workspace.size() < ws + 64) s_.workspace.resize(ws + 64);
    void* base = s_.workspace.data();
    std::size_t space = s_.workspace.size();
    void* aligned = ws > 0 ? std::align(64, ws, base, space) : nullptr;
    if (Status st = local_.run(*vsub, Workspace{aligned, ws}); !st) {
      return Status(st.code(), st.field(), fmt::format("ring's local backend {}: {}", local_.name(), st.message()));
    }
    if (alibi_shift != nullptr) {
      for (std::int64_t r = 0; r < total; ++r) {
        for (std::int64_t h = 0; h < g_.hq; ++h) {
          float& l = pl[r * g_.hq + h];
          l = static_cast<float>(l +
                                 static_cast<double>(p_.alibi_slopes[h]) * (*alibi_shift)[static_cast<std::size_t>(r)]);
        }
      }
    }
    const std::int64_t keep = keep_rows >= 0 ? keep_rows : total;
    merge_rows(o, lse, po, pl, keep, g_.hq, g_.dv);
    return Status::ok();
  }

  // Rows all after keys [ka, kb): true distance p - j > 0 everywhere. Each row becomes a sequence of
  // its own whose one query sits on the last key, so |p' - j'| = p' - j' = (p - j) - (p - kb + 1),
  // and the lse gains -slope * (p - kb + 1). With a left window each row sees its own key range, so
  // it is a call of its own.
  Status alibi_after(std::int64_t i0, std::int64_t i1, std::int64_t ka, std::int64_t kb, std::int64_t left, float* o,
                     float* lse) {
    shift_.clear();
    if (left < 0) {
      for (std::int64_t i = i0; i < i1; ++i) shift_.push_back(-static_cast<double>(i + g_.offset - kb + 1));
      return call(q_rows(i0), 1, i1 - i0, kb - ka, false, -1, -1, o, lse, &shift_);
    }
    const unsigned char* k0 = k_;
    const unsigned char* v0 = v_;
    const std::int64_t ek = static_cast<std::int64_t>(dtype_size(p_.k.dtype));
    for (std::int64_t i = i0; i < i1; ++i) {
      const std::int64_t p = i + g_.offset;
      const std::int64_t first = std::max(ka, p - left);
      if (first >= kb) continue;
      k_ = k0 + (first - ka) * k_row_ * ek;
      v_ = v0 + (first - ka) * v_row_ * ek;
      shift_.assign(1, -static_cast<double>(p - kb + 1));
      RING_TRY(call(q_rows(i), 1, 1, kb - first, false, -1, -1, o + (i - i0) * g_.hq * g_.dv, lse + (i - i0) * g_.hq,
                    &shift_));
    }
    k_ = k0, v_ = v0;
    return Status::ok();
  }

  // Rows all before keys [ka, kb) (a non-causal problem): true distance j - p > 0 everywhere. The n
  // rows are followed by L = kb - ka dummy rows, which puts every real row at a negative position
  // (k - n for row k) so that |p' - j'| = j' - p' for all of them; that is the true distance plus
  // c', the same for every row, so the lse gains slope * c'. The dummy rows' outputs are dropped.
  Status alibi_before(std::int64_t i0, std::int64_t i1, std::int64_t ka, std::int64_t kb, std::int64_t left,
                      std::int64_t right, float* o, float* lse) {
    const std::int64_t n = i1 - i0, len = kb - ka;
    const std::int64_t rows = n + len;
    const std::size_t e = dtype_size(p_.q.dtype);
    const std::int64_t row_elems = g_.hq * g_.d;
    s_.q.assign(static_cast<std::size_t>(rows * row_elems) * e, 0);
    const std::int64_t qhs = last_stride(p_.q, 2), qds = last_stride(p_.q, 1);
    for (std::int64_t i = 0; i < n; ++i) {
      const unsigned char* src = q_rows(i0 + i);
      for (std::int64_t h = 0; h < g_.hq; ++h) {
        for (std::int64_t x = 0; x < g_.d; ++x) {
          std::memcpy(s_.q.data() + static_cast<std::size_t>(i * row_elems + h * g_.d + x) * e,
                      src + static_cast<std::size_t>(h * qhs + x * qds) * e, e);
        }
      }
    }
    const std::int64_t p_last = i1 - 1 + g_.offset;
    const std::int64_t cp = p_last + 1 - ka;  // true position - sub-problem position, every real row
    const std::int64_t wr = right < 0 ? -1 : right + cp;
    const std::int64_t wl = left < 0 ? -1 : left - cp;
    shift_.assign(static_cast<std::size_t>(rows), static_cast<double>(cp));
    return call(s_.q.data(), rows, 1, len, false, wl, wr, o, lse, &shift_, row_elems, n);
  }

  AttentionBackend& local_;
  const ValidatedProblem& vp_;
  const AttentionProblem& p_;
  BlockScratch& s_;
  Geometry g_{};
  const unsigned char* k_ = nullptr;
  const unsigned char* v_ = nullptr;
  std::int64_t k_row_ = 0, k_hs_ = 0, k_ds_ = 0, v_row_ = 0, v_hs_ = 0, v_ds_ = 0;
  std::vector<double> shift_;
};

void store(const TensorView& t, std::int64_t idx, float v) noexcept {
  switch (t.dtype) {
    case DType::f16: static_cast<std::uint16_t*>(t.data)[idx] = f32_to_f16(v); return;
    case DType::bf16: static_cast<std::uint16_t*>(t.data)[idx] = f32_to_bf16(v); return;
    case DType::f32: break;
  }
  static_cast<float*>(t.data)[idx] = v;
}

}  // namespace

void write_block(const ValidatedProblem& vp, const Shard& rows, const float* block) {
  const AttentionProblem& p = vp.problem();
  const std::int64_t hq = vp.hq(), dv = vp.head_dim_v();
  const std::int64_t ohs = last_stride(p.o, 2), ods = last_stride(p.o, 1);
  const float* lse = block + rows.total_rows * hq * dv;
  std::int64_t at = 0;
  for (const Span& span : rows.rows) {
    for (std::int64_t i = span.first; i < span.first + span.count; ++i, ++at) {
      const std::int64_t base = vp.o_row_offset(span.seq, i);
      for (std::int64_t h = 0; h < hq; ++h) {
        const float* src = block + (at * hq + h) * dv;
        for (std::int64_t d = 0; d < dv; ++d) store(p.o, base + h * ohs + d * ods, src[d]);
        if (p.lse.present()) {
          static_cast<float*>(p.lse.data)[vp.lse_offset(span.seq, static_cast<std::int32_t>(h), i)] = lse[at * hq + h];
        }
      }
    }
  }
}

Status refine_block(AttentionBackend& local, const ValidatedProblem& vp, const Shard& rows, float* block,
                    BlockScratch& scratch) {
  const std::int64_t no = rows.total_rows * vp.hq() * vp.head_dim_v();
  const float* lse = block + no;
  bool wide = false;
  for (std::int64_t r = 0; r < rows.total_rows * vp.hq() && !wide; ++r) {
    wide = std::isfinite(lse[r]) && std::fabs(lse[r]) > kMergeLseLimit;
  }
  if (!wide) return Status::ok();
  Shard all;
  for (const Span& span : rows.rows) {
    if (all.keys.empty() || all.keys.back().seq != span.seq) {
      const std::int64_t skv = vp.seqlen_k(span.seq);
      if (skv > 0) all.keys.push_back({span.seq, 0, skv});
    }
  }
  clear_block(block, rows.total_rows, vp);
  return accumulate_block(local, vp, rows, all, block, scratch);
}

void clear_block(float* block, std::int64_t rows, const ValidatedProblem& vp) {
  const std::int64_t no = rows * vp.hq() * vp.head_dim_v();
  std::fill(block, block + no, 0.0f);
  std::fill(block + no, block + no + rows * vp.hq(), kNegInf);
}

void merge_block(float* dst, const float* src, std::int64_t rows, const ValidatedProblem& vp) {
  const std::int64_t no = rows * vp.hq() * vp.head_dim_v();
  merge_rows(dst, dst + no, src, src + no, rows, vp.hq(), vp.head_dim_v());
}

Status accumulate_block(AttentionBackend& local, const ValidatedProblem& vp, const Shard& rows, const Shard& keys,
                        float* block, BlockScratch& scratch) {
  try {
    PairRunner runner(local, vp, scratch);
    const std::int64_t hq = vp.hq(), dv = vp.head_dim_v();
    float* lse_base = block + rows.total_rows * hq * dv;
    std::int64_t at = 0;
    for (const Span& r : rows.rows) {
      for (const Span& k : keys.keys) {
        if (k.seq != r.seq) continue;
        RING_TRY(runner.run(r.seq, r.first, r.first + r.count, k.first, k.first + k.count, block + at * hq * dv,
                            lse_base + at * hq));
      }
      at += r.count;
    }
    return Status::ok();
  } catch (const std::bad_alloc&) {
    return Status(ErrorCode::out_of_memory, "ring", "out of memory for a block's scratch buffers");
  }
}

}  // namespace kallpa::ring
