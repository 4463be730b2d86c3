// Memory for one case's tensors: each view lives inside a larger allocation with guard regions
// before and after it, and (for padded strides) gaps between its rows. Everything that is not an
// element of the view is "outside". Outputs keep a known byte pattern outside, so any stray write
// shows up as a changed byte; inputs hold NaN outside, so any stray read poisons a result.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kallpa/tensor.h"

namespace kallpa::conformance::detail {

// Scalar access to an element of any dtype (index in elements from `base`).
double load_element(const void* base, DType dtype, std::int64_t index) noexcept;
void store_element(void* base, DType dtype, std::int64_t index, float value) noexcept;
std::uint32_t element_bits(const void* base, DType dtype, std::int64_t index) noexcept;
void store_element_bits(void* base, DType dtype, std::int64_t index, std::uint32_t bits) noexcept;
// `value` as the dtype holds it (round to nearest even).
float round_to(DType dtype, float value) noexcept;
// A NaN with a payload no arithmetic produces: an output element that still holds it was never
// written. (A plain NaN would not do: NaN is also a legitimate output for NaN inputs.)
std::uint32_t poison_bits(DType dtype) noexcept;
std::uint32_t quiet_nan_bits(DType dtype) noexcept;

class GuardedBuffer {
 public:
  static constexpr std::size_t kGuardBytes = 256;  // a multiple of 64: the view stays 64-aligned

  GuardedBuffer(DType dtype, int rank, const std::array<std::int64_t, kMaxRank>& shape,
                const std::array<std::int64_t, kMaxRank>& stride);

  TensorView view() const noexcept;
  void* data() const noexcept { return data_; }
  DType dtype() const noexcept { return dtype_; }
  const std::array<std::int64_t, kMaxRank>& stride() const noexcept { return stride_; }

  // Outputs: pattern outside, `bits` in every element.
  void reset_output(std::uint32_t element_bits_value) noexcept;
  // Inputs: NaN outside; elements are written afterwards by the caller.
  void fill_outside_with_nan() noexcept;

  // Describes the first outside byte that lost its pattern ("guard after the view, +12 bytes",
  // "stride gap at element offset 340"), or nothing when all are intact.
  std::optional<std::string> find_stray_write() const;

  // A copy of all bytes (view and outside), to prove that a backend left its inputs alone.
  std::vector<std::byte> snapshot() const;
  void restore(const std::vector<std::byte>& before) noexcept;
  // Describes the first byte that differs from `before`, or nothing.
  std::optional<std::string> find_change(const std::vector<std::byte>& before) const;

 private:
  struct Free {
    void operator()(std::byte* p) const noexcept;
  };
  static std::byte pattern(std::size_t position) noexcept;
  std::string describe_byte(std::size_t position) const;

  DType dtype_;
  int rank_;
  std::array<std::int64_t, kMaxRank> shape_{};
  std::array<std::int64_t, kMaxRank> stride_{};
  std::size_t esize_;
  std::int64_t span_ = 0;                 // elements from the first to one past the last of the view
  std::vector<std::uint8_t> is_element_;  // per position in the span
  std::size_t bytes_ = 0;
  std::unique_ptr<std::byte[], Free> storage_;
  std::byte* data_ = nullptr;
};

}  // namespace kallpa::conformance::detail
