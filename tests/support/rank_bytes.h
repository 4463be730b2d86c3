// The bytes a rank sends in one round of a transport test: they differ by rank, round and position,
// so that a block put at another rank's offset, a stale staging buffer or a short copy shows.
// Shared by the in-process transport tests (tests/nccl_comm_test.cpp) and the program mpirun starts
// (tests/ring/transport_roundtrip.cpp).
#pragma once

#include <cstddef>
#include <vector>

namespace kallpa::testing {

inline std::vector<unsigned char> rank_bytes(int rank, int round, std::size_t bytes) {
  std::vector<unsigned char> v(bytes);
  for (std::size_t i = 0; i < bytes; ++i) {
    v[i] = static_cast<unsigned char>(
        (i * 131 + static_cast<std::size_t>(rank) * 71 + static_cast<std::size_t>(round) * 29 + (i >> 8)) & 0xff);
  }
  return v;
}

}  // namespace kallpa::testing
