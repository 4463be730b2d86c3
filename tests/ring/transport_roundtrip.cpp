// The process group's collectives across the ranks of an MPI job (tests/ring/transport_test.py):
//
//   mpirun -np N kallpa_transport_roundtrip TRANSPORT    # mpi or nccl
//   kallpa_transport_roundtrip --probe                   # what the test's skip decisions read
//
// selects the transport, all-gathers and broadcasts (from every root) blocks from one byte to a few
// MiB whose every byte depends on the sending rank and the round, and compares every byte received;
// then agree() on equal texts, and on a text that differs on the last rank. Exit status: 0 when all
// of it holds (rank 0 prints a summary), 1 at the first difference or error (naming the rank). The
// probe prints "nccl built, N CUDA devices" or "nccl not built", read from the CUDA runtime here
// rather than from the transport under test.
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "kallpa/process_group.h"
#include "kallpa/status.h"
#include "support/rank_bytes.h"

#ifdef KALLPA_HAVE_NCCL
#include <cuda_runtime.h>
#endif

namespace {

int fail(int rank, const std::string& what) {
  fmt::print(stderr, "rank {}: FAIL: {}\n", rank, what);
  return 1;
}

int probe() {
#ifdef KALLPA_HAVE_NCCL
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  fmt::print("nccl built, {} CUDA devices\n", count);
#else
  fmt::print("nccl not built\n");
#endif
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kallpa;
  if (argc != 2) {
    fmt::print(stderr, "usage: kallpa_transport_roundtrip mpi|nccl|--probe\n");
    return 2;
  }
  const std::string transport = argv[1];
  if (transport == "--probe") return probe();
  if (Status s = use_process_group_transport(transport); !s) return fail(0, s.to_string());
  ProcessGroup& group = *process_group();
  const int n = group.size(), r = group.rank();
  if (group.transport() != transport) {
    return fail(r, fmt::format("asked for {}, the group's transport is {}", transport, group.transport()));
  }

  const std::vector<std::size_t> sizes = {0, 1, 3, 4096, (std::size_t{1} << 20) + 7, 64, std::size_t{3} << 20};
  int gathers = 0, broadcasts = 0;
  for (std::size_t round = 0; round < sizes.size(); ++round) {
    const std::size_t bytes = sizes[round];
    const int k = static_cast<int>(round);
    const std::vector<unsigned char> mine = kallpa::testing::rank_bytes(r, k, bytes);
    std::vector<unsigned char> all(bytes * static_cast<std::size_t>(n) + 1, 0xee);
    if (Status s = group.all_gather(mine.data(), bytes, all.data()); !s) return fail(r, s.to_string());
    for (int from = 0; from < n; ++from) {
      const std::vector<unsigned char> want = kallpa::testing::rank_bytes(from, k, bytes);
      if (!std::equal(want.begin(), want.end(), all.begin() + static_cast<std::ptrdiff_t>(from * bytes))) {
        return fail(r, fmt::format("all-gather of {} bytes: rank {}'s block differs", bytes, from));
      }
    }
    if (all.back() != 0xee) return fail(r, fmt::format("all-gather of {} bytes wrote past its end", bytes));
    ++gathers;
    for (int root = 0; root < n; ++root) {
      std::vector<unsigned char> data =
          r == root ? kallpa::testing::rank_bytes(root, k + 100, bytes) : std::vector<unsigned char>(bytes);
      if (Status s = group.broadcast(data.data(), bytes, root); !s) return fail(r, s.to_string());
      if (data != kallpa::testing::rank_bytes(root, k + 100, bytes)) {
        return fail(r, fmt::format("broadcast of {} bytes from rank {} differs", bytes, root));
      }
      ++broadcasts;
    }
  }
  if (Status s = group.agree("text", "same"); !s) return fail(r, "agree on equal texts: " + s.to_string());
  if (n > 1) {
    const Status s = group.agree("text", r == n - 1 ? "other" : "same");
    const std::string want = fmt::format("rank {}'s text differs from rank 0's", n - 1);
    if (s.code() != ErrorCode::invalid_argument || s.message().find(want) == std::string::npos) {
      return fail(r, fmt::format("agree on a text that differs on rank {}: got '{}'", n - 1, s.to_string()));
    }
  }
  if (r == 0) {
    fmt::print("transport {}, {} rank{}: {} all-gathers and {} broadcasts byte-exact, agree() holds\n", transport, n,
               n == 1 ? "" : "s", gathers, broadcasts);
  }
  return 0;
}
