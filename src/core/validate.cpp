// validate(): the only way to obtain a ValidatedProblem, so no backend ever sees an invalid one.
// Every check names the field and the offending value, because the caller's first question on an
// error is "which of my tensors, which dimension".
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "kallpa/attention.h"

namespace kallpa {
namespace {

Status bad(std::string field, std::string message) { return Status::invalid(std::move(field), std::move(message)); }

bool valid_dtype(DType d) { return d == DType::f32 || d == DType::f16 || d == DType::bf16; }

// Byte span [begin, end) a view touches; empty when it has no elements.
struct Span {
  std::uintptr_t begin = 0;
  std::uintptr_t end = 0;
  bool empty() const { return begin == end; }
};

// Checks rank, non-negative extents and strides, and that the furthest element's byte offset
// neither overflows nor wraps the address space.
Status check_view(const TensorView& t, const char* name, int rank, Span* span) {
  if (!valid_dtype(t.dtype)) {
    return bad(fmt::format("{}.dtype", name), fmt::format("unknown dtype code {}", static_cast<int>(t.dtype)));
  }
  if (t.rank != rank) {
    return bad(fmt::format("{}.rank", name), fmt::format("is {}, expected {}", t.rank, rank));
  }
  std::int64_t max_offset = 0;
  bool empty = false;
  for (int i = 0; i < rank; ++i) {
    const auto d = static_cast<std::size_t>(i);
    if (t.shape[d] < 0) {
      return bad(fmt::format("{}.shape[{}]", name, i), fmt::format("is negative ({})", t.shape[d]));
    }
    if (t.stride[d] < 0) {
      return bad(fmt::format("{}.stride[{}]", name, i),
                 fmt::format("is negative ({}); negative strides are not supported", t.stride[d]));
    }
    if (t.shape[d] == 0) empty = true;
  }
  if (!empty) {
    for (int i = 0; i < rank; ++i) {
      const auto d = static_cast<std::size_t>(i);
      std::int64_t term = 0;
      if (__builtin_mul_overflow(t.shape[d] - 1, t.stride[d], &term) ||
          __builtin_add_overflow(max_offset, term, &max_offset)) {
        return bad(fmt::format("{}.stride[{}]", name, i),
                   fmt::format("extent {} x stride {} overflows a 64-bit offset", t.shape[d], t.stride[d]));
      }
    }
  }
  // A view with no elements is never dereferenced, so it may be null (an empty std::vector's data).
  if (!t.present() && !empty) return bad(fmt::format("{}.data", name), "is null");
  std::int64_t bytes = 0;
  if (__builtin_mul_overflow(max_offset + 1, static_cast<std::int64_t>(dtype_size(t.dtype)), &bytes)) {
    return bad(fmt::format("{}.shape", name), "byte extent overflows a 64-bit offset");
  }
  const auto begin = reinterpret_cast<std::uintptr_t>(t.data);
  std::uintptr_t end = 0;
  if (__builtin_add_overflow(begin, static_cast<std::uintptr_t>(bytes), &end)) {
    return bad(fmt::format("{}.data", name), "view wraps around the address space");
  }
  if (t.device.index < 0) {
    return bad(fmt::format("{}.device", name), fmt::format("device index {} is negative", t.device.index));
  }
  *span = empty ? Span{} : Span{begin, end};
  return {};
}

// An output view must not write one element twice: sorted by stride, each dimension must step
// past everything the smaller ones cover.
Status check_no_self_overlap(const TensorView& t, const char* name) {
  struct Dim {
    std::int64_t extent, stride;
    int index;
  };
  std::array<Dim, kMaxRank> dims{};  // no heap: validate() runs on every dispatch
  std::size_t n = 0;
  for (int i = 0; i < t.rank; ++i) {
    const auto d = static_cast<std::size_t>(i);
    if (t.shape[d] == 0) return {};
    if (t.shape[d] > 1) dims[n++] = {t.shape[d], t.stride[d], i};
  }
  for (std::size_t i = 1; i < n; ++i) {  // insertion sort by stride; at most 4 dims
    for (std::size_t j = i; j > 0 && dims[j].stride < dims[j - 1].stride; --j) std::swap(dims[j], dims[j - 1]);
  }
  std::int64_t covered = 1;  // elements spanned by the dims so far, in units of elements
  for (std::size_t i = 0; i < n; ++i) {
    const Dim& d = dims[i];
    if (d.stride < covered) {
      return bad(fmt::format("{}.stride[{}]", name, d.index),
                 fmt::format("stride {} makes elements of the output overlap", d.stride));
    }
    covered = d.stride * d.extent;  // no overflow: check_view bounded (extent-1)*stride
  }
  return {};
}

bool overlaps(const Span& a, const Span& b) { return !a.empty() && !b.empty() && a.begin < b.end && b.begin < a.end; }

// cu_seqlens: B+1 non-decreasing offsets from 0, ending within the packed tensor's T rows.
Status check_offsets(const std::int32_t* cu, const char* name, std::int32_t batch, std::int64_t rows,
                     std::int64_t* max_len) {
  if (cu == nullptr) return bad(name, "is null but the layout is packed");
  if (cu[0] != 0) return bad(fmt::format("{}[0]", name), fmt::format("is {}, must be 0", cu[0]));
  *max_len = 0;
  for (std::int32_t b = 0; b < batch; ++b) {
    if (cu[b + 1] < cu[b]) {
      return bad(fmt::format("{}[{}]", name, b + 1),
                 fmt::format("is {}, less than the previous offset {}", cu[b + 1], cu[b]));
    }
    *max_len = std::max<std::int64_t>(*max_len, cu[b + 1] - cu[b]);
  }
  if (cu[batch] > rows) {
    return bad(fmt::format("{}[{}]", name, batch),
               fmt::format("is {}, beyond the {} rows of the packed tensor", cu[batch], rows));
  }
  return {};
}

Status expect_dim(const TensorView& t, const char* name, int dim, std::int64_t want, const char* what) {
  const std::int64_t got = t.shape[static_cast<std::size_t>(dim)];
  if (got != want) {
    return bad(fmt::format("{}.shape[{}]", name, dim), fmt::format("is {}, expected {} ({})", got, want, what));
  }
  return {};
}

#define KALLPA_TRY(expr)                        \
  do {                                          \
    Status kallpa_status_ = (expr);             \
    if (!kallpa_status_) return kallpa_status_; \
  } while (0)

}  // namespace

Result<ValidatedProblem> validate(const AttentionProblem& p) {
  if (p.contract_version != kAttentionContractVersion) {
    return bad("contract_version",
               fmt::format("is {}, this library implements version {}", p.contract_version, kAttentionContractVersion));
  }
  const bool q_packed = p.q_layout == QLayout::packed;
  if (p.q_layout != QLayout::dense && !q_packed) return bad("q_layout", "unknown layout");
  if (p.kv_layout != KvLayout::dense && p.kv_layout != KvLayout::packed && p.kv_layout != KvLayout::paged) {
    return bad("kv_layout", "unknown layout");
  }
  const bool kv_packed = p.kv_layout == KvLayout::packed;
  const bool kv_paged = p.kv_layout == KvLayout::paged;

  const int q_rank = q_packed ? 3 : 4;
  const int kv_rank = kv_packed ? 3 : 4;
  Span q_span, k_span, v_span, o_span, lse_span;
  KALLPA_TRY(check_view(p.q, "q", q_rank, &q_span));
  KALLPA_TRY(check_view(p.k, "k", kv_rank, &k_span));
  KALLPA_TRY(check_view(p.v, "v", kv_rank, &v_span));
  KALLPA_TRY(check_view(p.o, "o", q_rank, &o_span));

  const int qh = q_rank - 2, qd = q_rank - 1, kh = kv_rank - 2, kd = kv_rank - 1;
  const std::int64_t hq = p.q.shape[static_cast<std::size_t>(qh)];
  const std::int64_t d = p.q.shape[static_cast<std::size_t>(qd)];
  const std::int64_t hkv = p.k.shape[static_cast<std::size_t>(kh)];
  const std::int64_t dv = p.v.shape[static_cast<std::size_t>(kd)];
  constexpr std::int64_t kMaxHeadsOrDim = std::numeric_limits<std::int32_t>::max();
  if (hq < 1 || hq > kMaxHeadsOrDim)
    return bad(fmt::format("q.shape[{}]", qh), fmt::format("query heads {} out of range", hq));
  if (d < 1 || d > kMaxHeadsOrDim)
    return bad(fmt::format("q.shape[{}]", qd), fmt::format("head dim {} out of range", d));
  if (hkv < 1 || hkv > kMaxHeadsOrDim)
    return bad(fmt::format("k.shape[{}]", kh), fmt::format("kv heads {} out of range", hkv));
  if (dv < 1 || dv > kMaxHeadsOrDim)
    return bad(fmt::format("v.shape[{}]", kd), fmt::format("value head dim {} out of range", dv));
  if (hq % hkv != 0) {
    return bad("k.shape[" + std::to_string(kh) + "]",
               fmt::format("query heads {} are not a multiple of kv heads {}", hq, hkv));
  }
  KALLPA_TRY(expect_dim(p.k, "k", kd, d, "head dim of q"));
  KALLPA_TRY(expect_dim(p.v, "v", kh, hkv, "kv heads of k"));
  KALLPA_TRY(expect_dim(p.o, "o", qh, hq, "query heads of q"));
  KALLPA_TRY(expect_dim(p.o, "o", qd, dv, "value head dim of v"));
  KALLPA_TRY(expect_dim(p.v, "v", 0, p.k.shape[0], kv_paged ? "blocks of k" : kv_packed ? "rows of k" : "batch of k"));
  if (!kv_packed) KALLPA_TRY(expect_dim(p.v, "v", 1, p.k.shape[1], kv_paged ? "page size of k" : "kv length of k"));
  KALLPA_TRY(expect_dim(p.o, "o", 0, p.q.shape[0], q_packed ? "rows of q" : "batch of q"));
  if (!q_packed) KALLPA_TRY(expect_dim(p.o, "o", 1, p.q.shape[1], "query length of q"));

  if (p.k.dtype != p.v.dtype) {
    return bad("v.dtype", fmt::format("is {}, but k is {}; k and v must share a dtype", dtype_name(p.v.dtype),
                                      dtype_name(p.k.dtype)));
  }
  for (const auto& [t, name] : {std::pair{&p.k, "k"}, std::pair{&p.v, "v"}, std::pair{&p.o, "o"}}) {
    if (!(t->device == p.q.device)) {
      return bad(fmt::format("{}.device", name),
                 fmt::format("is {}, but q is on {}", t->device.to_string(), p.q.device.to_string()));
    }
  }

  // Batch size: from q when it is dense, from `batch` otherwise.
  std::int64_t batch = 0;
  if (!q_packed) {
    batch = p.q.shape[0];
    if (p.batch != 0 && p.batch != batch) {
      return bad("batch", fmt::format("is {}, but q has batch {}", p.batch, batch));
    }
  } else {
    if (p.batch < 0) return bad("batch", fmt::format("is negative ({})", p.batch));
    batch = p.batch;
  }
  if (batch > std::numeric_limits<std::int32_t>::max() - 1) {
    return bad("batch", fmt::format("{} is too large", batch));
  }
  if (p.kv_layout == KvLayout::dense) KALLPA_TRY(expect_dim(p.k, "k", 0, batch, "batch"));

  // Index arrays given for a layout that does not use them are a caller mistake worth naming.
  if (!q_packed && p.cu_seqlens_q) return bad("cu_seqlens_q", "is set but q_layout is dense");
  if (!kv_packed && p.cu_seqlens_k) return bad("cu_seqlens_k", "is set but kv_layout is not packed");
  if (!kv_paged && (p.page_versions || p.kv_pool_id != 0)) {
    return bad(p.page_versions ? "page_versions" : "kv_pool_id", "is set but kv_layout is not paged");
  }
  if ((p.page_versions == nullptr) != (p.kv_pool_id == 0)) {
    return bad(p.page_versions ? "kv_pool_id" : "page_versions",
               "page_versions and kv_pool_id are set together or not at all");
  }
  if (!kv_paged && (p.block_table || p.seqlens_k)) {
    return bad(p.block_table ? "block_table" : "seqlens_k", "is set but kv_layout is not paged");
  }

  ValidatedProblem vp;
  const auto b32 = static_cast<std::int32_t>(batch);
  std::int64_t max_sq = 0, max_skv = 0;
  if (q_packed) {
    if (batch > 0) KALLPA_TRY(check_offsets(p.cu_seqlens_q, "cu_seqlens_q", b32, p.q.shape[0], &max_sq));
  } else {
    max_sq = batch > 0 ? p.q.shape[1] : 0;
    vp.dense_sq_ = p.q.shape[1];
  }
  std::int32_t page = 0;
  if (kv_packed) {
    if (batch > 0) KALLPA_TRY(check_offsets(p.cu_seqlens_k, "cu_seqlens_k", b32, p.k.shape[0], &max_skv));
  } else if (kv_paged) {
    const std::int64_t blocks = p.k.shape[0];
    if (p.k.shape[1] < 1 || p.k.shape[1] > std::numeric_limits<std::int32_t>::max()) {
      return bad("k.shape[1]", fmt::format("page size {} out of range", p.k.shape[1]));
    }
    page = static_cast<std::int32_t>(p.k.shape[1]);
    if (p.max_blocks_per_seq < 0) {
      return bad("max_blocks_per_seq", fmt::format("is negative ({})", p.max_blocks_per_seq));
    }
    const std::int64_t row_stride = p.block_table_stride ? p.block_table_stride : p.max_blocks_per_seq;
    if (row_stride < p.max_blocks_per_seq) {
      return bad("block_table_stride",
                 fmt::format("is {}, less than max_blocks_per_seq {}", row_stride, p.max_blocks_per_seq));
    }
    std::int64_t table_extent = 0;
    if (__builtin_mul_overflow(row_stride, batch, &table_extent)) {
      return bad("block_table_stride", "block table extent overflows");
    }
    if (batch > 0 && !p.seqlens_k) return bad("seqlens_k", "is null but kv_layout is paged");
    if (batch > 0 && p.max_blocks_per_seq > 0 && !p.block_table) {
      return bad("block_table", "is null but kv_layout is paged");
    }
    const std::int64_t capacity = std::int64_t{p.max_blocks_per_seq} * page;
    for (std::int32_t b = 0; b < b32; ++b) {
      const std::int64_t len = p.seqlens_k[b];
      if (len < 0) return bad(fmt::format("seqlens_k[{}]", b), fmt::format("is negative ({})", len));
      if (len > capacity) {
        return bad(fmt::format("seqlens_k[{}]", b), fmt::format("is {}, more than max_blocks_per_seq {} x page size {}",
                                                                len, p.max_blocks_per_seq, page));
      }
      max_skv = std::max(max_skv, len);
      const std::int64_t used = (len + page - 1) / page;
      for (std::int64_t n = 0; n < used; ++n) {
        const std::int32_t block = p.block_table[b * row_stride + n];
        if (block < 0 || block >= blocks) {
          return bad(fmt::format("block_table[{}][{}]", b, n),
                     fmt::format("is block {}, outside the {} blocks of k", block, blocks));
        }
      }
    }
  } else {
    max_skv = batch > 0 ? p.k.shape[1] : 0;
    vp.dense_skv_ = p.k.shape[1];
  }

  // Scalar parameters.
  float scale = 1.0f / std::sqrt(static_cast<float>(d));
  if (p.scale) {
    if (!std::isfinite(*p.scale)) return bad("scale", fmt::format("is {}, must be finite", *p.scale));
    scale = *p.scale;
  }
  if (!std::isfinite(p.softcap) || p.softcap < 0.0f) {
    return bad("softcap", fmt::format("is {}, must be finite and >= 0 (0 = off)", p.softcap));
  }
  if (p.window_left < -1) return bad("window_left", fmt::format("is {}, must be >= -1", p.window_left));
  if (p.window_right < -1) return bad("window_right", fmt::format("is {}, must be >= -1", p.window_right));
  if (p.alibi_slopes) {
    for (std::int64_t h = 0; h < hq; ++h) {
      if (!std::isfinite(p.alibi_slopes[h])) {
        return bad(fmt::format("alibi_slopes[{}]", h), fmt::format("is {}, must be finite", p.alibi_slopes[h]));
      }
    }
  }

  // Optional logsumexp output.
  if (p.lse.present()) {
    KALLPA_TRY(check_view(p.lse, "lse", q_packed ? 2 : 3, &lse_span));
    if (p.lse.dtype != DType::f32) {
      return bad("lse.dtype", fmt::format("is {}, must be f32", dtype_name(p.lse.dtype)));
    }
    if (!(p.lse.device == p.q.device)) {
      return bad("lse.device", fmt::format("is {}, but q is on {}", p.lse.device.to_string(), p.q.device.to_string()));
    }
    if (q_packed) {
      KALLPA_TRY(expect_dim(p.lse, "lse", 0, hq, "query heads"));
      KALLPA_TRY(expect_dim(p.lse, "lse", 1, p.q.shape[0], "rows of q"));
    } else {
      KALLPA_TRY(expect_dim(p.lse, "lse", 0, batch, "batch"));
      KALLPA_TRY(expect_dim(p.lse, "lse", 1, hq, "query heads"));
      KALLPA_TRY(expect_dim(p.lse, "lse", 2, p.q.shape[1], "query length"));
    }
    KALLPA_TRY(check_no_self_overlap(p.lse, "lse"));
  }

  // Outputs: no element written twice, and no output aliasing an input or the other output.
  KALLPA_TRY(check_no_self_overlap(p.o, "o"));
  for (const auto& [span, name] : {std::pair{q_span, "q"}, std::pair{k_span, "k"}, std::pair{v_span, "v"}}) {
    if (overlaps(o_span, span)) return bad("o.data", fmt::format("output memory overlaps input {}", name));
    if (overlaps(lse_span, span)) return bad("lse.data", fmt::format("output memory overlaps input {}", name));
  }
  if (overlaps(o_span, lse_span)) return bad("lse.data", "overlaps the output o");

  // Derived facts.
  vp.p_ = p;
  vp.batch_ = b32;
  vp.scale_ = scale;
  vp.max_sq_ = max_sq;
  vp.max_skv_ = max_skv;
  // A window wider than max_sq + max_skv masks nothing more than that width does (attention.h), so
  // saturating it there keeps p_i +/- window far inside int64 for every backend's key arithmetic.
  const std::int64_t widest = max_sq + max_skv;
  vp.window_left_ = p.window_left < 0 ? -1 : std::min(p.window_left, widest);
  vp.window_right_ = p.window_right < 0 ? -1 : std::min(p.window_right, widest);
  for (std::int32_t b = 0; b < b32; ++b) {
    const std::int64_t sq = vp.seqlen_q(b);
    vp.total_q_ += sq;
    vp.pairs_ += static_cast<double>(sq) * static_cast<double>(vp.seqlen_k(b));
  }

  ProblemSignature& s = vp.sig_;
  s.device = p.q.device;
  s.q_dtype = p.q.dtype;
  s.kv_dtype = p.k.dtype;
  s.o_dtype = p.o.dtype;
  s.q_layout = p.q_layout;
  s.kv_layout = p.kv_layout;
  s.hq = static_cast<std::int32_t>(hq);
  s.hkv = static_cast<std::int32_t>(hkv);
  s.head_dim = static_cast<std::int32_t>(d);
  s.head_dim_v = static_cast<std::int32_t>(dv);
  s.page_size = page;
  s.causal = p.causal;
  s.window = p.window_left >= 0 || p.window_right >= 0;
  s.softcap = p.softcap > 0.0f;
  s.alibi = p.alibi_slopes != nullptr;
  s.lse = p.lse.present();
  auto unit = [](const TensorView& t) {
    const auto last = static_cast<std::size_t>(t.rank - 1);
    return t.stride[last] == 1 || t.shape[last] == 1;
  };
  s.unit_stride_last_dim = unit(p.q) && unit(p.k) && unit(p.v) && unit(p.o);
  return vp;
}

std::int64_t ValidatedProblem::seqlen_q(std::int32_t b) const noexcept {
  if (p_.q_layout == QLayout::packed) return p_.cu_seqlens_q[b + 1] - p_.cu_seqlens_q[b];
  return dense_sq_;
}

std::int64_t ValidatedProblem::seqlen_k(std::int32_t b) const noexcept {
  switch (p_.kv_layout) {
    case KvLayout::packed: return p_.cu_seqlens_k[b + 1] - p_.cu_seqlens_k[b];
    case KvLayout::paged: return p_.seqlens_k[b];
    case KvLayout::dense: break;
  }
  return dense_skv_;
}

std::int64_t ValidatedProblem::q_row_offset(std::int32_t b, std::int64_t i) const noexcept {
  if (p_.q_layout == QLayout::packed) return (p_.cu_seqlens_q[b] + i) * p_.q.stride[0];
  return b * p_.q.stride[0] + i * p_.q.stride[1];
}

std::int64_t ValidatedProblem::o_row_offset(std::int32_t b, std::int64_t i) const noexcept {
  if (p_.q_layout == QLayout::packed) return (p_.cu_seqlens_q[b] + i) * p_.o.stride[0];
  return b * p_.o.stride[0] + i * p_.o.stride[1];
}

std::int64_t ValidatedProblem::kv_row(const TensorView& t, std::int32_t b, std::int64_t j) const noexcept {
  switch (p_.kv_layout) {
    case KvLayout::packed: return (p_.cu_seqlens_k[b] + j) * t.stride[0];
    case KvLayout::paged: {
      const std::int64_t row_stride = p_.block_table_stride ? p_.block_table_stride : p_.max_blocks_per_seq;
      const std::int64_t page = sig_.page_size;
      const std::int64_t block = p_.block_table[b * row_stride + j / page];
      return block * t.stride[0] + (j % page) * t.stride[1];
    }
    case KvLayout::dense: break;
  }
  return b * t.stride[0] + j * t.stride[1];
}

std::int64_t ValidatedProblem::k_row_offset(std::int32_t b, std::int64_t j) const noexcept {
  return kv_row(p_.k, b, j);
}

std::int64_t ValidatedProblem::v_row_offset(std::int32_t b, std::int64_t j) const noexcept {
  return kv_row(p_.v, b, j);
}

std::int64_t ValidatedProblem::lse_offset(std::int32_t b, std::int32_t h, std::int64_t i) const noexcept {
  if (p_.q_layout == QLayout::packed) return h * p_.lse.stride[0] + (p_.cu_seqlens_q[b] + i) * p_.lse.stride[1];
  return b * p_.lse.stride[0] + h * p_.lse.stride[1] + i * p_.lse.stride[2];
}

ValidatedProblem::KeyRange ValidatedProblem::visible_keys(std::int32_t b, std::int64_t i) const noexcept {
  const std::int64_t skv = seqlen_k(b);
  const std::int64_t pos = i + skv - seqlen_q(b);  // bottom-right alignment
  KeyRange r{0, skv - 1};
  if (p_.causal) r.last = std::min(r.last, pos);
  if (window_right_ >= 0) r.last = std::min(r.last, pos + window_right_);
  if (window_left_ >= 0) r.first = std::max(r.first, pos - window_left_);
  return r;
}

}  // namespace kallpa
