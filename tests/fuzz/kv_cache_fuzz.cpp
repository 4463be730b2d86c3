// The paged KV cache with its prefix cache, as a state machine against a plain model: a byte
// stream drives add / extend (reserve + write) / publish / truncate / remove / attach_prefix on a
// small pool, and after every step each live sequence must still read back exactly what it wrote
// (or what attach_prefix promised: the K/V of the same tokens at the same positions), the block
// counts must add up, and a reserve that fails must change nothing. Sharing, copy-on-write,
// eviction of idle published blocks and running out of blocks all happen on a pool this small.
#include <algorithm>
#include <map>
#include <memory>
#include <vector>

#include "fuzz_target.h"
#include "kallpa/ops/kv_cache.h"

namespace {

using kallpa::ops::KvCache;
using kallpa::ops::SeqId;

constexpr std::int32_t kHeadKv = 1, kHeadDim = 2, kRow = kHeadKv * kHeadDim;

// What position `pos` holding `token` stores: small integers, exact in any storage type.
float key_value(std::int32_t token, std::int64_t pos, int e) { return float((token * 31 + pos * 7 + e) % 2048); }
float value_value(std::int32_t token, std::int64_t pos, int e) { return float((token * 17 + pos * 3 + 5 * e) % 2048); }

// Per live sequence: the token at each written position.
using Model = std::map<SeqId, std::vector<std::int32_t>>;

void check_contents(const KvCache& cache, const Model& model) {
  const std::int64_t page = cache.options().page_size;
  const auto k = cache.k_view(0), v = cache.v_view(0);
  const auto* kd = static_cast<const float*>(k.data);
  const auto* vd = static_cast<const float*>(v.data);
  for (const auto& [seq, toks] : model) {
    FUZZ_CHECK(cache.has(seq), "a live sequence is gone");
    const auto blocks = cache.blocks(seq);
    FUZZ_CHECK(cache.capacity(seq) == static_cast<std::int64_t>(blocks.size()) * page, "capacity != blocks * page");
    FUZZ_CHECK(cache.capacity(seq) >= static_cast<std::int64_t>(toks.size()), "written positions beyond capacity");
    for (std::size_t pos = 0; pos < toks.size(); ++pos) {
      const std::int64_t slot = cache.slot(blocks, static_cast<std::int64_t>(pos));
      FUZZ_CHECK(slot >= 0 && slot < cache.total_blocks() * page, "a slot outside the pool");
      // Blocks are strided in the views (the pool is block-major over the layers).
      const std::int64_t krow = slot / page * k.stride[0] + slot % page * k.stride[1];
      const std::int64_t vrow = slot / page * v.stride[0] + slot % page * v.stride[1];
      for (int e = 0; e < kRow; ++e) {
        FUZZ_CHECK(kd[krow + e] == key_value(toks[pos], static_cast<std::int64_t>(pos), e),
                   "a sequence reads back a K it did not write");
        FUZZ_CHECK(vd[vrow + e] == value_value(toks[pos], static_cast<std::int64_t>(pos), e),
                   "a sequence reads back a V it did not write");
      }
    }
  }
  FUZZ_CHECK(cache.used_blocks() + cache.free_blocks() == cache.total_blocks(), "block counts do not add up");
  FUZZ_CHECK(cache.cached_blocks() <= cache.free_blocks(), "more cached blocks than free ones");
}

void write_positions(KvCache& cache, SeqId seq, const std::vector<std::int32_t>& toks, std::size_t from) {
  const std::size_t n = toks.size() - from;
  if (n == 0) return;
  std::vector<float> k(n * kRow), v(n * kRow);
  for (std::size_t t = 0; t < n; ++t) {
    for (int e = 0; e < kRow; ++e) {
      k[t * kRow + e] = key_value(toks[from + t], static_cast<std::int64_t>(from + t), e);
      v[t * kRow + e] = value_value(toks[from + t], static_cast<std::int64_t>(from + t), e);
    }
  }
  const auto blocks = cache.blocks(seq);
  FUZZ_CHECK(
      cache.write(0, blocks, static_cast<std::int64_t>(from), k.data(), v.data(), static_cast<std::int64_t>(n)).is_ok(),
      "writing reserved positions failed");
}

std::vector<std::int32_t> token_run(FuzzBytes& in) {
  // Few distinct tokens, so that prompts share prefixes.
  std::vector<std::int32_t> toks(in.next() % 24);
  for (auto& t : toks) t = in.next() % 3;
  return toks;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzBytes in(data, size);
  kallpa::ops::KvCacheOptions options;
  options.page_size = 1 + in.next() % 6;
  options.max_tokens = 1 + in.next() % 48;
  options.dtype = kallpa::DType::f32;
  auto created = KvCache::create(1, kHeadKv, kHeadDim, options);
  FUZZ_CHECK(created.is_ok(), "a small cache cannot be created");
  KvCache& cache = **created;
  Model model;
  auto pick = [&](std::uint8_t b) -> SeqId {  // a live sequence, or -1
    if (model.empty()) return -1;
    auto it = model.begin();
    std::advance(it, b % model.size());
    return it->first;
  };
  for (int step = 0; step < 64 && !in.empty(); ++step) {
    const std::uint8_t op = in.next() % 6;
    const SeqId seq = pick(in.next());
    switch (op) {
      case 0:  // a new sequence
        if (model.size() < 6) model[cache.add_sequence()];
        break;
      case 1: {  // extend: reserve, then write the new positions
        if (seq < 0) break;
        auto& toks = model[seq];
        const auto more = token_run(in);
        const std::int64_t before_cap = cache.capacity(seq), before_free = cache.free_blocks();
        const auto want = static_cast<std::int64_t>(toks.size() + more.size());
        if (kallpa::Status s = cache.reserve(seq, want); !s) {
          FUZZ_CHECK(s.code() == kallpa::ErrorCode::out_of_memory, "reserve failed with an unexpected error");
          FUZZ_CHECK(cache.capacity(seq) == before_cap && cache.free_blocks() == before_free,
                     "a failed reserve changed the cache");
          break;
        }
        FUZZ_CHECK(cache.capacity(seq) >= want, "reserve succeeded without the room");
        const std::size_t from = toks.size();
        toks.insert(toks.end(), more.begin(), more.end());
        write_positions(cache, seq, toks, from);
        break;
      }
      case 2:  // publish every full block written so far
        if (seq >= 0) cache.publish(seq, model[seq]);
        break;
      case 3: {  // truncate
        if (seq < 0) break;
        auto& toks = model[seq];
        const std::int64_t want = in.next() % 32;
        const std::int64_t kept = cache.truncate(seq, want);
        const std::int64_t expect = std::min<std::int64_t>(want, static_cast<std::int64_t>(toks.size()));
        FUZZ_CHECK(kept <= std::max<std::int64_t>(want, 0), "truncate kept more than asked");
        FUZZ_CHECK(kept >= expect - options.page_size, "truncate dropped more than a partial block");
        toks.resize(static_cast<std::size_t>(std::min<std::int64_t>(kept, static_cast<std::int64_t>(toks.size()))));
        break;
      }
      case 4:  // remove
        if (seq < 0) break;
        cache.remove(seq);
        FUZZ_CHECK(!cache.has(seq), "a removed sequence is still there");
        model.erase(seq);
        break;
      default: {  // a new sequence that reuses a published prefix of its prompt
        if (model.size() >= 6) break;
        const SeqId fresh = cache.add_sequence();
        const auto prompt = token_run(in);
        const std::int64_t held = cache.attach_prefix(fresh, prompt);
        FUZZ_CHECK(held >= 0 && held % options.page_size == 0, "attach_prefix held a partial block");
        FUZZ_CHECK(held == 0 || held < static_cast<std::int64_t>(prompt.size()),
                   "attach_prefix left no token to compute");
        FUZZ_CHECK(cache.capacity(fresh) == held, "attach_prefix capacity != positions held");
        model[fresh].assign(prompt.begin(), prompt.begin() + held);
        break;
      }
    }
    check_contents(cache, model);
  }
  for (const auto& [seq, toks] : model) cache.remove(seq);
  FUZZ_CHECK(cache.used_blocks() == 0, "blocks still used after every sequence is removed");
  return 0;
}
