#include "kallpa/runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include <fmt/format.h>

namespace kallpa::runtime {

Status SamplingParams::validate() const {
  if (!(temperature >= 0.0f) || !std::isfinite(temperature)) {
    return Status::invalid("temperature", fmt::format("is {}, must be finite and >= 0", temperature));
  }
  if (!(top_p > 0.0f && top_p <= 1.0f)) return Status::invalid("top_p", fmt::format("is {}, must be in (0, 1]", top_p));
  if (!(min_p >= 0.0f && min_p <= 1.0f)) return Status::invalid("min_p", fmt::format("is {}, must be in [0, 1]", min_p));
  if (!(repetition_penalty > 0.0f) || !std::isfinite(repetition_penalty)) {
    return Status::invalid("repetition_penalty", fmt::format("is {}, must be finite and > 0", repetition_penalty));
  }
  if (repetition_window < 0) return Status::invalid("repetition_window", "must be >= 0");
  return {};
}

Sampler::Sampler(SamplingParams params) : params_(params), rng_(params.seed) {}

void Sampler::reset() { rng_.seed(params_.seed); }

std::int32_t Sampler::sample(std::span<float> logits, std::span<const std::int32_t> recent) {
  const auto vocab = static_cast<std::int32_t>(logits.size());
  if (vocab == 0) return -1;

  // CTRL-style penalty (as llama.cpp applies it): divide positive logits, multiply negative ones,
  // once per distinct token in the window.
  if (params_.repetition_penalty != 1.0f && params_.repetition_window > 0) {
    const std::size_t window = std::min<std::size_t>(recent.size(), static_cast<std::size_t>(params_.repetition_window));
    std::vector<std::int32_t> seen(recent.end() - static_cast<std::ptrdiff_t>(window), recent.end());
    std::sort(seen.begin(), seen.end());
    seen.erase(std::unique(seen.begin(), seen.end()), seen.end());
    for (std::int32_t id : seen) {
      if (id < 0 || id >= vocab) continue;
      float& l = logits[static_cast<std::size_t>(id)];
      l = l > 0.0f ? l / params_.repetition_penalty : l * params_.repetition_penalty;
    }
  }

  if (params_.temperature == 0.0f) {
    // Greedy; ties go to the lowest id so that the choice never depends on the platform.
    std::int32_t best = 0;
    for (std::int32_t i = 1; i < vocab; ++i) {
      if (logits[static_cast<std::size_t>(i)] > logits[static_cast<std::size_t>(best)]) best = i;
    }
    return best;
  }

  candidates_.clear();
  candidates_.reserve(logits.size());
  for (std::int32_t i = 0; i < vocab; ++i) {
    const float l = logits[static_cast<std::size_t>(i)];
    if (!std::isnan(l)) candidates_.push_back({l / params_.temperature, i});
  }
  if (candidates_.empty()) return 0;
  auto by_logit = [](const Candidate& a, const Candidate& b) { return a.logit > b.logit || (a.logit == b.logit && a.id < b.id); };

  std::size_t keep = candidates_.size();
  if (params_.top_k > 0 && static_cast<std::size_t>(params_.top_k) < keep) {
    keep = static_cast<std::size_t>(params_.top_k);
    std::partial_sort(candidates_.begin(), candidates_.begin() + static_cast<std::ptrdiff_t>(keep), candidates_.end(), by_logit);
  } else {
    std::sort(candidates_.begin(), candidates_.end(), by_logit);
  }
  candidates_.resize(keep);

  // Softmax over the survivors, in double so that long tails do not lose mass.
  std::vector<double> probs(keep);
  const float max_logit = candidates_[0].logit;
  double sum = 0.0;
  for (std::size_t i = 0; i < keep; ++i) {
    probs[i] = std::exp(static_cast<double>(candidates_[i].logit) - max_logit);
    sum += probs[i];
  }
  for (double& p : probs) p /= sum;

  if (params_.min_p > 0.0f) {
    const double floor = static_cast<double>(params_.min_p) * probs[0];
    std::size_t n = 1;
    while (n < keep && probs[n] >= floor) ++n;
    keep = n;
  }
  if (params_.top_p < 1.0f) {
    double cumulative = 0.0;
    std::size_t n = 0;
    while (n < keep) {
      cumulative += probs[n++];
      if (cumulative >= static_cast<double>(params_.top_p)) break;
    }
    keep = n;
  }

  double total = 0.0;
  for (std::size_t i = 0; i < keep; ++i) total += probs[i];
  // A uniform draw in [0, total) from the 53-bit mantissa: reproducible across libstdc++ versions,
  // unlike std::uniform_real_distribution's unspecified algorithm.
  const double u = static_cast<double>(rng_() >> 11) * (1.0 / 9007199254740992.0) * total;
  double acc = 0.0;
  for (std::size_t i = 0; i < keep; ++i) {
    acc += probs[i];
    if (u < acc) return candidates_[i].id;
  }
  return candidates_[keep - 1].id;
}

}  // namespace kallpa::runtime
