// Counts the bytes the process holds through operator new, and the high-water mark since the
// last reset, so that a benchmark can report the extra memory a call needed.
#pragma once

#include <cstddef>

namespace kallpa::harness {

std::size_t heap_bytes_in_use() noexcept;
// Starts a new high-water mark at the current level.
void reset_heap_peak() noexcept;
// Highest level since the last reset.
std::size_t heap_peak_bytes() noexcept;

}  // namespace kallpa::harness
