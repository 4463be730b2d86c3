// The suite's random numbers. splitmix64 with our own range helpers, because the std::
// distributions differ between standard libraries: case names and data must be the same on every
// platform so that a failure reported on one machine reproduces on another.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace kallpa::conformance::detail {

class Rng {
 public:
  explicit Rng(std::uint64_t seed) noexcept : state_(seed) {}

  std::uint64_t next() noexcept {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }

  // Uniform in [0, n); the modulo bias is irrelevant for the small n used here.
  std::uint64_t below(std::uint64_t n) noexcept { return n == 0 ? 0 : next() % n; }
  // Uniform integer in [lo, hi].
  std::int64_t range(std::int64_t lo, std::int64_t hi) noexcept {
    return lo + static_cast<std::int64_t>(below(static_cast<std::uint64_t>(hi - lo + 1)));
  }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() noexcept { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  bool chance(double p) noexcept { return uniform() < p; }

  template <typename T>
  const T& pick(const std::vector<T>& items) noexcept {
    return items[static_cast<std::size_t>(below(items.size()))];
  }

  template <typename T>
  void shuffle(std::vector<T>& items) noexcept {
    for (std::size_t i = items.size(); i > 1; --i) {
      std::swap(items[i - 1], items[static_cast<std::size_t>(below(i))]);
    }
  }

  // An independent stream derived from this one's seed and a label, so that adding a draw in one
  // place does not change the data of every later case.
  static std::uint64_t mix(std::uint64_t a, std::uint64_t b) noexcept {
    Rng r(a ^ (b * 0xd1b54a32d192ed03ull));
    r.next();
    return r.next();
  }

 private:
  std::uint64_t state_;
};

}  // namespace kallpa::conformance::detail
