#include "kallpa/runtime/sampler.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>

#include <fmt/format.h>

#include "ops/vector_exp.h"

namespace kallpa::runtime {

Status SamplingParams::validate() const {
  if (!(temperature >= 0.0f) || !std::isfinite(temperature)) {
    return Status::invalid("temperature", fmt::format("is {}, must be finite and >= 0", temperature));
  }
  if (!(top_p > 0.0f && top_p <= 1.0f)) return Status::invalid("top_p", fmt::format("is {}, must be in (0, 1]", top_p));
  if (!(min_p >= 0.0f && min_p <= 1.0f))
    return Status::invalid("min_p", fmt::format("is {}, must be in [0, 1]", min_p));
  if (!(repetition_penalty > 0.0f) || !std::isfinite(repetition_penalty)) {
    return Status::invalid("repetition_penalty", fmt::format("is {}, must be finite and > 0", repetition_penalty));
  }
  if (repetition_window < 0) return Status::invalid("repetition_window", "must be >= 0");
  if (!std::isfinite(presence_penalty)) return Status::invalid("presence_penalty", "must be finite");
  if (!std::isfinite(frequency_penalty)) return Status::invalid("frequency_penalty", "must be finite");
  for (const auto& [id, bias] : logit_bias) {
    if (id < 0) return Status::invalid("logit_bias", fmt::format("token id {} is negative", id));
    if (!std::isfinite(bias))
      return Status::invalid("logit_bias", fmt::format("the bias of token {} is not finite", id));
  }
  return {};
}

Sampler::Sampler(SamplingParams params) : params_(params), rng_(params.seed) {}

namespace {

// The greedy choice: the largest logit, ties to the lowest id so that the choice never depends on
// the platform, NaN passed over (a NaN first would otherwise compare below nothing and win); 0
// when every logit is NaN.
std::int32_t argmax_lowest_id(std::span<const float> logits) {
  std::int32_t best = -1;
  for (std::size_t i = 0; i < logits.size(); ++i) {
    const float l = logits[i];
    if (!std::isnan(l) && (best < 0 || l > logits[static_cast<std::size_t>(best)])) best = static_cast<std::int32_t>(i);
  }
  return best < 0 ? 0 : best;
}

}  // namespace

void apply_token_mask(std::span<float> logits, std::span<const std::uint32_t> allowed) {
  constexpr float kMasked = -std::numeric_limits<float>::infinity();
  // Whole words at a time: most of a grammar's mask words are all-allowed or all-refused.
  const std::size_t words = std::min(allowed.size(), (logits.size() + 31) / 32);
  for (std::size_t w = 0; w < words; ++w) {
    const std::uint32_t bits = allowed[w];
    if (bits == 0xffffffffu) continue;
    const std::size_t begin = w * 32, end = std::min(logits.size(), begin + 32);
    for (std::size_t i = begin; i < end; ++i) {
      if ((bits >> (i - begin) & 1u) == 0) logits[i] = kMasked;
    }
  }
  // Tokens past the mask's end are not in it, so not allowed.
  std::fill(logits.begin() + static_cast<std::ptrdiff_t>(std::min(logits.size(), words * 32)), logits.end(), kMasked);
}

double Sampler::uniform_below(double total) {
  // From the 53-bit mantissa: reproducible across libstdc++ versions, unlike
  // std::uniform_real_distribution's unspecified algorithm.
  return static_cast<double>(rng_() >> 11) * (1.0 / 9007199254740992.0) * total;
}

std::int32_t Sampler::draw_unfiltered(std::span<const float> logits) {
  // With every token a candidate, no order by probability is needed: the draw walks the
  // vocabulary in id order, first over block sums and then within one block, so a step costs a
  // few linear passes over the logits and no sort (which would dominate at a 49k vocabulary).
  const std::size_t vocab = logits.size();
  const float max_logit = ops::max_ignoring_nan(logits.data(), static_cast<std::int64_t>(vocab));
  // +inf dominates every finite logit, and all -inf (or all NaN) leaves nothing to weigh.
  if (std::isinf(max_logit)) return argmax_lowest_id(logits);
  // Weights exp((l - max) / T), exactly 0 for NaN and for what falls below f32's range (so a
  // masked token can never be drawn); the maximum weighs 1, so the total is at least 1.
  exps_.resize(vocab);
  ops::shifted_exp(logits.data(), exps_.data(), static_cast<std::int64_t>(vocab), max_logit,
                   1.0f / params_.temperature);

  // Block sums: f32 within a block of kSampleBlock (8 lanes, a fixed order on every machine),
  // f64 across blocks so that a long tail keeps its mass.
  const std::size_t blocks = (vocab + kSampleBlock - 1) / kSampleBlock;
  block_sums_.resize(blocks);
  double total = 0.0;
  for (std::size_t b = 0; b < blocks; ++b) {
    const std::size_t begin = b * kSampleBlock, end = std::min(vocab, begin + kSampleBlock);
    float lanes[8] = {};
    std::size_t i = begin;
    for (; i + 8 <= end; i += 8) {
      for (std::size_t j = 0; j < 8; ++j) lanes[j] += exps_[i + j];
    }
    for (; i < end; ++i) lanes[0] += exps_[i];
    const double sum =
        double((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + double((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    block_sums_[b] = sum;
    total += sum;
  }

  const double u = uniform_below(total);
  double acc = 0.0;
  std::size_t b = 0;
  while (b + 1 < blocks && acc + block_sums_[b] <= u) acc += block_sums_[b++];
  // Within the block the running sum is taken in another order than the block's own, so rounding
  // may leave u just past its end: then the block's last token of non-zero weight is drawn.
  const std::size_t begin = b * kSampleBlock, end = std::min(vocab, begin + kSampleBlock);
  std::size_t last_weighted = end;
  for (std::size_t i = begin; i < end; ++i) {
    if (exps_[i] == 0.0f) continue;
    last_weighted = i;
    acc += double(exps_[i]);
    if (u < acc) return static_cast<std::int32_t>(i);
  }
  if (last_weighted != end) return static_cast<std::int32_t>(last_weighted);
  // Only reachable when rounding put u past the last block with weight (its sum is 0 here).
  std::size_t i = vocab;
  while (i > 0 && exps_[i - 1] == 0.0f) --i;
  return static_cast<std::int32_t>(i > 0 ? i - 1 : 0);
}

void Sampler::sort_by_logit(std::size_t from, std::size_t to, std::size_t vocab) {
  const auto first = candidates_.begin() + static_cast<std::ptrdiff_t>(from);
  const auto last = candidates_.begin() + static_cast<std::ptrdiff_t>(to);
  if (to - from < 4096) {  // the passes below cost O(vocab) whatever the range
    std::sort(first, last, ByLogit{});
    return;
  }
  // Back into id order first (ids are distinct and below vocab: one pass through positions by
  // id), so that stable radix passes on the logit alone leave ties in id order, as ByLogit does.
  const std::size_t n = to - from;
  position_by_id_.assign(vocab, -1);
  for (std::size_t i = from; i < to; ++i)
    position_by_id_[static_cast<std::size_t>(candidates_[i].id)] = static_cast<std::int64_t>(i);
  radix_in_.clear();
  for (std::int64_t pos : position_by_id_) {
    if (pos >= 0) radix_in_.push_back(candidates_[static_cast<std::size_t>(pos)]);
  }
  // Descending logit as an ascending unsigned key: IEEE order made monotone, then reversed;
  // -0 counts as +0, as the comparison does. Candidates are never NaN.
  auto key = [](float logit) {
    std::uint32_t u = std::bit_cast<std::uint32_t>(logit);
    if (u == 0x80000000u) u = 0;
    u = (u & 0x80000000u) != 0 ? ~u : u | 0x80000000u;
    return ~u;
  };
  radix_out_.resize(n);
  for (int shift = 0; shift < 32; shift += 8) {
    std::size_t start[257] = {};
    for (const Candidate& c : radix_in_) ++start[((key(c.logit) >> shift) & 0xff) + 1];
    for (int d = 0; d < 256; ++d) start[d + 1] += start[d];
    for (const Candidate& c : radix_in_) radix_out_[start[(key(c.logit) >> shift) & 0xff]++] = c;
    radix_in_.swap(radix_out_);
  }
  std::copy(radix_in_.begin(), radix_in_.end(), first);
}

void Sampler::reset() { rng_.seed(params_.seed); }

std::int32_t Sampler::sample(std::span<float> logits, std::span<const std::int32_t> recent) {
  return sample(logits, recent, std::span<const std::uint32_t>());
}

std::int32_t Sampler::sample(std::span<float> logits, std::span<const std::int32_t> recent,
                             std::span<const std::uint32_t> allowed) {
  const std::size_t window = std::min<std::size_t>(recent.size(), static_cast<std::size_t>(params_.repetition_window));
  return sample(logits, recent, recent.subspan(recent.size() - window), allowed);
}

std::int32_t Sampler::sample(std::span<float> logits, std::span<const std::int32_t> recent,
                             std::span<const std::int32_t> generated, std::span<const std::uint32_t> allowed) {
  const auto vocab = static_cast<std::int32_t>(logits.size());
  if (vocab == 0) return -1;
  if (!allowed.empty()) apply_token_mask(logits, allowed);

  // Ids outside the vocabulary are skipped: the server refuses them, a library caller gets no
  // effect rather than a write out of bounds.
  for (const auto& [id, bias] : params_.logit_bias) {
    if (id >= 0 && id < vocab) logits[static_cast<std::size_t>(id)] += bias;
  }
  if ((params_.presence_penalty != 0.0f || params_.frequency_penalty != 0.0f) && !generated.empty()) {
    std::vector<std::int32_t>& counted = penalized_;
    counted.assign(generated.begin(), generated.end());
    std::sort(counted.begin(), counted.end());
    for (std::size_t i = 0; i < counted.size();) {
      std::size_t j = i;
      while (j < counted.size() && counted[j] == counted[i]) ++j;
      const std::int32_t id = counted[i];
      if (id >= 0 && id < vocab) {
        logits[static_cast<std::size_t>(id)] -=
            params_.presence_penalty + params_.frequency_penalty * static_cast<float>(j - i);
      }
      i = j;
    }
  }

  // CTRL-style penalty (as llama.cpp applies it): divide positive logits, multiply negative ones,
  // once per distinct token in the window.
  if (params_.repetition_penalty != 1.0f && params_.repetition_window > 0) {
    const std::size_t window =
        std::min<std::size_t>(recent.size(), static_cast<std::size_t>(params_.repetition_window));
    std::vector<std::int32_t>& seen = penalized_;
    seen.assign(recent.end() - static_cast<std::ptrdiff_t>(window), recent.end());
    std::sort(seen.begin(), seen.end());
    seen.erase(std::unique(seen.begin(), seen.end()), seen.end());
    for (std::int32_t id : seen) {
      if (id < 0 || id >= vocab) continue;
      float& l = logits[static_cast<std::size_t>(id)];
      l = l > 0.0f ? l / params_.repetition_penalty : l * params_.repetition_penalty;
    }
  }

  // A temperature so small that its inverse overflows is greedy in the limit, and would turn
  // the scaled logits into inf - inf.
  if (params_.temperature == 0.0f || !std::isfinite(1.0f / params_.temperature)) {
    return argmax_lowest_id(logits);
  }

  const bool filtered = (params_.top_k > 0 && params_.top_k < vocab) || params_.top_p < 1.0f || params_.min_p > 0.0f;
  if (!filtered) return draw_unfiltered(logits);

  candidates_.clear();
  candidates_.reserve(logits.size());
  for (std::int32_t i = 0; i < vocab; ++i) {
    const float l = logits[static_cast<std::size_t>(i)];
    if (!std::isnan(l)) candidates_.push_back({l / params_.temperature, i});
  }
  if (candidates_.empty()) return 0;

  // The candidates are only ever consumed from the most likely down, and almost all of the mass
  // sits in the first few dozen of a 49k vocabulary, so they are sorted lazily: sorted(n) makes the
  // first n the n most likely, in order (the same prefix a full sort gives, as the order is total).
  std::size_t keep = candidates_.size();
  std::size_t sorted = 0;
  auto sort_prefix = [&](std::size_t n) {
    n = std::min(n, keep);
    if (n <= sorted) return;
    n = std::min(keep, std::max({n, sorted * 4, std::size_t{32}}));  // geometric: O(V log n) in all
    if (n > std::min<std::size_t>(1024, keep / 8)) {
      // A deep walk (a flat distribution under top-p): the rest sorted in linear time, which
      // beats more partial_sorts by far on a 49k vocabulary (bench/results/sampler.md).
      sort_by_logit(sorted, keep, static_cast<std::size_t>(vocab));
      n = keep;
    } else {
      std::partial_sort(candidates_.begin() + static_cast<std::ptrdiff_t>(sorted),
                        candidates_.begin() + static_cast<std::ptrdiff_t>(n),
                        candidates_.begin() + static_cast<std::ptrdiff_t>(keep), ByLogit{});
    }
    sorted = n;
  };
  if (params_.top_k > 0 && static_cast<std::size_t>(params_.top_k) < keep) {
    sort_prefix(static_cast<std::size_t>(params_.top_k));
    keep = static_cast<std::size_t>(params_.top_k);
    sorted = keep;
  }

  // Softmax over the survivors: exps in f32 (vectorised: a 49k vocabulary per token per stream
  // otherwise costs a millisecond), summed in double so that long tails do not lose mass.
  float max_logit = candidates_[0].logit;
  for (std::size_t i = 1; i < keep; ++i) max_logit = std::max(max_logit, candidates_[i].logit);
  exps_.resize(keep);
  for (std::size_t i = 0; i < keep; ++i) exps_[i] = candidates_[i].logit - max_logit;
  ops::exp_inplace(exps_.data(), static_cast<std::int64_t>(keep));
  double sum = 0.0;
  for (std::size_t i = 0; i < keep; ++i) {
    // Below e^-87 (f32's normal range; -inf logits included) the probability is 0.
    const double p = candidates_[i].logit - max_logit < -87.0f ? 0.0 : double(exps_[i]);
    candidates_[i].prob = p;
    sum += p;
  }
  for (std::size_t i = 0; i < keep; ++i) candidates_[i].prob /= sum;

  if (params_.min_p > 0.0f) {
    // The most likely token has probability 1 / sum; keep everything at or above the floor (a
    // set, so no order is needed), the most likely always.
    const double floor = static_cast<double>(params_.min_p) * (1.0 / sum);
    auto unsorted_begin = candidates_.begin() + static_cast<std::ptrdiff_t>(sorted);
    auto kept_end = std::partition(unsorted_begin, candidates_.begin() + static_cast<std::ptrdiff_t>(keep),
                                   [&](const Candidate& c) { return c.prob >= floor; });
    // A sorted prefix stays a sorted prefix: its survivors are a prefix of it.
    std::size_t n = 0;
    while (n < sorted && candidates_[n].prob >= floor) ++n;
    if (n < sorted) {
      keep = std::max<std::size_t>(1, n);
      sorted = keep;
    } else {
      keep = std::max<std::size_t>(1, static_cast<std::size_t>(kept_end - candidates_.begin()));
    }
  }
  if (params_.top_p < 1.0f) {
    double cumulative = 0.0;
    std::size_t n = 0;
    while (n < keep) {
      sort_prefix(n + 1);
      cumulative += candidates_[n++].prob;
      if (cumulative >= static_cast<double>(params_.top_p)) break;
    }
    keep = n;
  }

  double total = 0.0;
  for (std::size_t i = 0; i < keep; ++i) total += candidates_[i].prob;
  const double u = uniform_below(total);
  double acc = 0.0;
  for (std::size_t i = 0; i < keep; ++i) {
    sort_prefix(i + 1);
    acc += candidates_[i].prob;
    if (u < acc) return candidates_[i].id;
  }
  sort_prefix(keep);
  return candidates_[keep - 1].id;
}

}  // namespace kallpa::runtime
