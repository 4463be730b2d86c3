#include "harness/problem_instance.h"

#include <algorithm>
#include <cstring>
#include <new>
#include <numeric>
#include <random>

#include <fmt/format.h>

#include "core/parallel.h"
#include "kallpa/half.h"

namespace kallpa::harness {
namespace {

std::uint64_t splitmix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Seeded values of unit variance, close to normal (a sum of four uniforms, |x| < 3.47): benchmarks
// need realistic, reproducible inputs rather than exact normals, and std::normal_distribution is
// slow enough to dominate building the 1 GiB of K/V of a DRAM-sized decode
// (bench/results/bench-harness.md). Each chunk of elements has its own stream
// (splitmix64 of seed, tensor and index), and chunks run over the thread pool: the values depend
// on neither the number of threads nor the order they run in.
void fill_random(std::vector<std::byte, ThpAllocator<std::byte>>& bytes, DType dtype, std::int64_t count,
                 std::uint64_t seed, std::uint64_t tensor) {
  bytes.resize(static_cast<std::size_t>(count) * dtype_size(dtype));
  constexpr std::int64_t kChunk = std::int64_t{1} << 16;
  const std::uint64_t base = splitmix64(seed ^ splitmix64(tensor));
  std::byte* const out = bytes.data();
  auto fill = [&](std::int64_t chunk, int) {
    const std::int64_t end = std::min(count, (chunk + 1) * kChunk);
    for (std::int64_t n = chunk * kChunk; n < end; ++n) {
      const std::uint64_t h = splitmix64(base + static_cast<std::uint64_t>(n));
      const auto sum = static_cast<float>((h & 0xffff) + (h >> 16 & 0xffff) + (h >> 32 & 0xffff) + (h >> 48));
      const float x = (sum * (1.0f / 65536.0f) - 2.0f) * 1.7320508f;  // mean 0, variance 4/12 * 3
      switch (dtype) {
        case DType::f32: std::memcpy(out + n * 4, &x, 4); break;
        case DType::f16: {
          const std::uint16_t v = f32_to_f16(x);
          std::memcpy(out + n * 2, &v, 2);
          break;
        }
        case DType::bf16: {
          const std::uint16_t v = f32_to_bf16(x);
          std::memcpy(out + n * 2, &v, 2);
          break;
        }
      }
    }
  };
  const std::int64_t chunks = (count + kChunk - 1) / kChunk;
  if (chunks > 1) {
    parallel::ThreadPool::global().parallel_for(chunks, fill);
  } else if (chunks == 1) {
    fill(0, 0);
  }
}

}  // namespace

Result<std::unique_ptr<ProblemInstance>> ProblemInstance::create(const ProblemSpec& spec, std::uint64_t seed,
                                                                 std::size_t max_bytes) {
  std::unique_ptr<ProblemInstance> inst(new ProblemInstance());
  inst->spec_ = spec;
  const std::int64_t b = spec.batch, sq = spec.seqlen_q, skv = spec.seqlen_k;
  const std::int64_t hq = spec.hq, hkv = spec.effective_hkv(), d = spec.head_dim, dv = spec.effective_dv();
  const DType qt = spec.dtype, kvt = spec.effective_kv_dtype();
  const std::int64_t page = spec.page_size;
  const std::int64_t blocks_per_seq = spec.kv_layout == KvLayout::paged ? (skv + page - 1) / page : 0;
  const std::int64_t kv_rows = spec.kv_layout == KvLayout::paged ? b * blocks_per_seq * page : b * skv;

  const double need =
      static_cast<double>(b * sq * hq) * static_cast<double>(d + dv) * static_cast<double>(dtype_size(qt)) +
      static_cast<double>(kv_rows * hkv) * static_cast<double>(d + dv) * static_cast<double>(dtype_size(kvt));
  if (need > static_cast<double>(max_bytes)) {
    return Status(ErrorCode::out_of_memory, "spec",
                  fmt::format("[{}] needs {:.1f} GiB of tensors, over the {:.1f} GiB limit", spec.to_string(),
                              need / double(1 << 30), static_cast<double>(max_bytes) / double(1 << 30)));
  }

  try {
    fill_random(inst->q_, qt, b * sq * hq * d, seed, 1);
    fill_random(inst->k_, kvt, kv_rows * hkv * d, seed, 2);
    fill_random(inst->v_, kvt, kv_rows * hkv * dv, seed, 3);
    std::mt19937_64 rng(seed);
    inst->o_.assign(static_cast<std::size_t>(b * sq * hq * dv) * dtype_size(qt), std::byte{0});

    AttentionProblem& p = inst->problem_;
    p.q_layout = spec.q_layout;
    p.kv_layout = spec.kv_layout;
    p.causal = spec.causal;
    p.window_left = spec.window_left;
    p.window_right = spec.window_right;
    p.softcap = spec.softcap;
    p.scale = spec.scale;
    if (spec.q_layout == QLayout::packed) {
      p.q = make_contiguous_view(inst->q_.data(), qt, {b * sq, hq, d}, spec.device);
      p.o = make_contiguous_view(inst->o_.data(), qt, {b * sq, hq, dv}, spec.device);
      inst->cu_q_.resize(static_cast<std::size_t>(b + 1));
      for (std::int64_t i = 0; i <= b; ++i)
        inst->cu_q_[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i * sq);
      p.cu_seqlens_q = inst->cu_q_.data();
    } else {
      p.q = make_contiguous_view(inst->q_.data(), qt, {b, sq, hq, d}, spec.device);
      p.o = make_contiguous_view(inst->o_.data(), qt, {b, sq, hq, dv}, spec.device);
    }
    p.batch = static_cast<int>(b);
    switch (spec.kv_layout) {
      case KvLayout::dense:
        p.k = make_contiguous_view(inst->k_.data(), kvt, {b, skv, hkv, d}, spec.device);
        p.v = make_contiguous_view(inst->v_.data(), kvt, {b, skv, hkv, dv}, spec.device);
        break;
      case KvLayout::packed:
        p.k = make_contiguous_view(inst->k_.data(), kvt, {b * skv, hkv, d}, spec.device);
        p.v = make_contiguous_view(inst->v_.data(), kvt, {b * skv, hkv, dv}, spec.device);
        inst->cu_k_.resize(static_cast<std::size_t>(b + 1));
        for (std::int64_t i = 0; i <= b; ++i)
          inst->cu_k_[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i * skv);
        p.cu_seqlens_k = inst->cu_k_.data();
        break;
      case KvLayout::paged: {
        const std::int64_t blocks = b * blocks_per_seq;
        p.k = make_contiguous_view(inst->k_.data(), kvt, {blocks, page, hkv, d}, spec.device);
        p.v = make_contiguous_view(inst->v_.data(), kvt, {blocks, page, hkv, dv}, spec.device);
        // A permuted table, as a cache allocator would leave it after some churn.
        inst->block_table_.resize(static_cast<std::size_t>(blocks));
        std::iota(inst->block_table_.begin(), inst->block_table_.end(), 0);
        std::shuffle(inst->block_table_.begin(), inst->block_table_.end(), rng);
        inst->seqlens_k_.assign(static_cast<std::size_t>(b), static_cast<std::int32_t>(skv));
        p.block_table = inst->block_table_.data();
        p.max_blocks_per_seq = static_cast<std::int32_t>(blocks_per_seq);
        p.seqlens_k = inst->seqlens_k_.data();
        break;
      }
    }
    if (spec.lse) {
      inst->lse_.assign(static_cast<std::size_t>(b * sq * hq), 0.0f);
      p.lse = spec.q_layout == QLayout::packed
                  ? make_contiguous_view(inst->lse_.data(), DType::f32, {hq, b * sq}, spec.device)
                  : make_contiguous_view(inst->lse_.data(), DType::f32, {b, hq, sq}, spec.device);
    }
    if (spec.alibi) {
      // The usual geometric slopes 2^(-8 h / H).
      for (std::int64_t h = 0; h < hq; ++h) inst->alibi_.push_back(std::exp2(-8.0f * float(h + 1) / float(hq)));
      p.alibi_slopes = inst->alibi_.data();
    }
  } catch (const std::bad_alloc&) {
    return Status(ErrorCode::out_of_memory, "spec", fmt::format("could not allocate [{}]", spec.to_string()));
  }
  return inst;
}

double ProblemInstance::flops() const noexcept {
  double f = 4.0 * double(spec_.batch) * double(spec_.seqlen_q) * double(spec_.seqlen_k) * double(spec_.head_dim) *
             double(spec_.hq);
  if (spec_.causal && spec_.seqlen_q == spec_.seqlen_k) f *= 0.5;
  return f;
}

double ProblemInstance::kv_bytes() const noexcept {
  return double(spec_.batch) * double(spec_.seqlen_k) * double(spec_.effective_hkv()) *
         double(spec_.head_dim + spec_.effective_dv()) * double(dtype_size(spec_.effective_kv_dtype()));
}

}  // namespace kallpa::harness
