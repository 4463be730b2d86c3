// Turning logits into the next token: repetition penalty, temperature, then top-k, top-p and
// min-p filters, then a seeded draw. Temperature 0 is greedy. The same seed and the same logits
// always give the same token. With a filter on, the draw walks the survivors from the most likely
// down; with none, it walks the whole vocabulary in id order (no sort needed).
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "kallpa/status.h"

namespace kallpa::runtime {

struct SamplingParams {
  float temperature = 0.8f;         // 0: greedy (argmax), ignoring the filters below
  std::int32_t top_k = 40;          // <= 0: off
  float top_p = 0.95f;              // 1: off
  float min_p = 0.05f;              // 0: off; keeps tokens with p >= min_p * p_max
  float repetition_penalty = 1.0f;  // 1: off; > 1 discourages tokens in the recent window
  std::int32_t repetition_window = 64;
  std::uint64_t seed = 0;

  // Typed error naming the field for out-of-range values (negative temperature, top_p outside
  // (0, 1], min_p outside [0, 1], penalty <= 0).
  Status validate() const;
};

// Sets the logits of the tokens `allowed` leaves out (see Sampler::sample) to -inf.
void apply_token_mask(std::span<float> logits, std::span<const std::uint32_t> allowed);

class Sampler {
 public:
  explicit Sampler(SamplingParams params);

  const SamplingParams& params() const noexcept { return params_; }
  // Picks a token from `logits` (modified in place by the penalty and the mask). `recent` are the
  // tokens generated or prompted so far, most recent last. `allowed`, when not empty, is a token
  // bitmask (bit id % 32 of word id / 32; runtime/grammar.h): the tokens it leaves out get -inf
  // before anything else, so no draw, greedy or sampled, can pick them.
  std::int32_t sample(std::span<float> logits, std::span<const std::int32_t> recent,
                      std::span<const std::uint32_t> allowed = {});
  // Restarts the random stream from the seed.
  void reset();

 private:
  struct Candidate {
    float logit;
    std::int32_t id;
    double prob = 0.0;
  };
  static constexpr std::size_t kSampleBlock = 256;
  // The draw when no filter is on: every token weighed, walked in id order (see sampler.cpp).
  std::int32_t draw_unfiltered(std::span<const float> logits);
  // The candidates' order: logit descending, then id (a type, so that the sorts inline it).
  struct ByLogit {
    bool operator()(const Candidate& a, const Candidate& b) const noexcept {
      return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
    }
  };
  // Sorts candidates_[from, to) by ByLogit; a long range in linear time (four stable radix
  // passes).
  void sort_by_logit(std::size_t from, std::size_t to, std::size_t vocab);
  // A uniform double in [0, total) from the next random number.
  double uniform_below(double total);

  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<Candidate> candidates_;  // reused across calls
  std::vector<float> exps_;
  std::vector<double> block_sums_;
  std::vector<std::int64_t> position_by_id_;  // sort_by_logit's scratch
  std::vector<Candidate> radix_in_, radix_out_;
};

}  // namespace kallpa::runtime
