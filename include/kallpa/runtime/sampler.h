// Turning logits into the next token: logit bias, repetition, presence and frequency penalties,
// temperature, then top-k, top-p and min-p filters, then a seeded draw. Temperature 0 is greedy. The same seed and the
// same logits always give the same token. With a filter on, the draw walks the survivors from the most likely down;
// with none, it walks the whole vocabulary in id order (no sort needed).
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <utility>
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
  // OpenAI's penalties, subtracted from a token's logit: presence once if it was generated,
  // frequency once per time it was generated. 0: off.
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  // Added to the logits of these token ids before anything else (OpenAI's logit_bias; -100 bans a
  // token in practice, +100 all but forces it).
  std::vector<std::pair<std::int32_t, float>> logit_bias = {};
  std::uint64_t seed = 0;

  // Typed error naming the field for out-of-range values (negative temperature, top_p outside
  // (0, 1], min_p outside [0, 1], penalty <= 0, presence/frequency penalty not finite, a bias
  // not finite or on a negative id).
  Status validate() const;
};

// Sets the logits of the tokens `allowed` leaves out (see Sampler::sample) to -inf.
void apply_token_mask(std::span<float> logits, std::span<const std::uint32_t> allowed);

class Sampler {
 public:
  explicit Sampler(SamplingParams params);

  const SamplingParams& params() const noexcept { return params_; }
  // Picks a token from `logits` (modified in place by the mask, the bias and the penalties).
  // `recent` are the tokens generated or prompted so far, most recent last (the repetition
  // penalty's window); `generated` the ones sampled so far (presence and frequency penalties count
  // them, as OpenAI and vLLM do). Without `generated`, those penalties count the repetition window,
  // as llama.cpp's do. `allowed`, when not empty, is a token bitmask (bit id % 32 of word id / 32;
  // runtime/grammar.h): the tokens it leaves out get -inf before anything else, so no draw, greedy
  // or sampled, can pick them.
  std::int32_t sample(std::span<float> logits, std::span<const std::int32_t> recent,
                      std::span<const std::int32_t> generated, std::span<const std::uint32_t> allowed = {});
  // The same, with the presence and frequency penalties counting the repetition window.
  std::int32_t sample(std::span<float> logits, std::span<const std::int32_t> recent,
                      std::span<const std::uint32_t> allowed);
  std::int32_t sample(std::span<float> logits, std::span<const std::int32_t> recent);
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
  std::vector<std::int32_t> penalized_;  // the penalties' sorted token ids, reused across calls
};

}  // namespace kallpa::runtime
