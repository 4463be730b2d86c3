// The process group's transports (kallpa/process_group.h) and the ring's NCCL transport
// (backends/ring/nccl_comm.h, docs/scale-out.md). Asking for a transport that cannot run here fails
// with the reason and leaves the installed group alone; where a CUDA device is visible, NcclComm's
// collectives return every byte as sent, on one rank and on two ranks played by threads (one device
// each). Whether a device is visible is asked of the CUDA runtime here, not of the code under test.
#include <gtest/gtest.h>

#include <chrono>
#include <cstddef>
#include <string>
#include <thread>
#include <vector>

#include "kallpa/process_group.h"
#include "support/rank_bytes.h"
#include "support/thread_group.h"

#ifdef KALLPA_HAVE_NCCL
#include <cuda_runtime.h>

#include "backends/ring/nccl_comm.h"
#endif

namespace kallpa {
namespace {

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// Puts back the group a test found installed, as the process's other tests expect it.
class RestoreGroup {
 public:
  RestoreGroup() : saved_(process_group()) {}
  ~RestoreGroup() { set_process_group(saved_); }
  RestoreGroup(const RestoreGroup&) = delete;
  RestoreGroup& operator=(const RestoreGroup&) = delete;

 private:
  ProcessGroup* saved_;
};

TEST(ProcessGroupTransports, AnUnknownNameIsNotFoundAndChangesNothing) {
  RestoreGroup restore;
  ProcessGroup* before = process_group();
  const Status s = use_process_group_transport("carrier-pigeon");
  EXPECT_EQ(s.code(), ErrorCode::not_found) << s.to_string();
  EXPECT_TRUE(contains(s.message(), "no transport 'carrier-pigeon'")) << s.to_string();
#ifdef KALLPA_HAVE_RING
  EXPECT_TRUE(contains(s.message(), "this build has: mpi, nccl")) << s.to_string();
#else
  EXPECT_TRUE(contains(s.message(), "needs MPI at build time")) << s.to_string();
#endif
  EXPECT_EQ(process_group(), before);
}

#ifdef KALLPA_HAVE_NCCL
int visible_cuda_devices() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) return 0;
  return count;
}
#endif

#ifdef KALLPA_HAVE_RING
TEST(ProcessGroupTransports, TheRingOffersMpiAndNccl) {
  RestoreGroup restore;
  const std::vector<std::string> names = process_group_transports();
  EXPECT_EQ(names, (std::vector<std::string>{"mpi", "nccl"}));
  // Opening starts nothing: a single process gets a group of one rank without starting MPI.
  ASSERT_TRUE(use_process_group_transport("mpi"));
  ASSERT_NE(process_group(), nullptr);
  EXPECT_EQ(process_group()->transport(), "mpi");
  EXPECT_EQ(process_group()->size(), 1);
}

TEST(ProcessGroupTransports, NcclIsInstalledWhereItCanRunAndRefusedWithTheReasonElsewhere) {
  RestoreGroup restore;
  ProcessGroup* before = process_group();
  const Status s = use_process_group_transport("nccl");
#ifndef KALLPA_HAVE_NCCL
  EXPECT_EQ(s.code(), ErrorCode::unsupported) << s.to_string();
  EXPECT_TRUE(contains(s.message(), "built without NCCL")) << s.to_string();
  EXPECT_EQ(process_group(), before);
#else
  if (visible_cuda_devices() == 0) {
    EXPECT_EQ(s.code(), ErrorCode::unsupported) << s.to_string();
    EXPECT_EQ(s.field(), "nccl");
    EXPECT_TRUE(contains(s.message(), "no CUDA device is visible (cudaGetDeviceCount")) << s.to_string();
    EXPECT_EQ(process_group(), before);
  } else {
    ASSERT_TRUE(s) << s.to_string();
    ASSERT_NE(process_group(), nullptr);
    EXPECT_EQ(process_group()->transport(), "nccl");
    EXPECT_EQ(process_group()->rank(), 0);
    EXPECT_EQ(process_group()->size(), 1);
  }
#endif
}
#endif

#ifdef KALLPA_HAVE_NCCL
using ring::NcclComm;
constexpr std::chrono::seconds kTimeout{60};

// All-gathers and broadcasts from every root, over sizes from one byte to past the first staging
// buffers (so they grow), each byte compared with what its rank sent.
void round_trips(ProcessGroup& group) {
  const int n = group.size(), r = group.rank();
  const std::vector<std::size_t> sizes = {1, 3, 4096, (std::size_t{1} << 20) + 7, 64, std::size_t{3} << 20};
  for (std::size_t round = 0; round < sizes.size(); ++round) {
    const std::size_t bytes = sizes[round];
    const int k = static_cast<int>(round);
    const std::vector<unsigned char> mine = testing::rank_bytes(r, k, bytes);
    std::vector<unsigned char> all(bytes * static_cast<std::size_t>(n), 0xee);
    const Status s = group.all_gather(mine.data(), bytes, all.data());
    ASSERT_TRUE(s) << "rank " << r << ": " << s.to_string();
    for (int from = 0; from < n; ++from) {
      const std::vector<unsigned char> want = testing::rank_bytes(from, k, bytes);
      EXPECT_TRUE(std::equal(want.begin(), want.end(), all.begin() + static_cast<std::ptrdiff_t>(from * bytes)))
          << "rank " << r << ": all-gather of " << bytes << " bytes: rank " << from << "'s block differs";
    }
    for (int root = 0; root < n; ++root) {
      std::vector<unsigned char> data =
          r == root ? testing::rank_bytes(root, k + 100, bytes) : std::vector<unsigned char>(bytes);
      const Status b = group.broadcast(data.data(), bytes, root);
      ASSERT_TRUE(b) << "rank " << r << ": " << b.to_string();
      EXPECT_EQ(data, testing::rank_bytes(root, k + 100, bytes))
          << "rank " << r << ": broadcast of " << bytes << " bytes from rank " << root << " differs";
    }
  }
}

TEST(NcclComm, OneRankReturnsEveryByteAsSent) {
  if (visible_cuda_devices() == 0) GTEST_SKIP() << "no CUDA device is visible: NCCL cannot run here";
  testing::ThreadGroup bootstrap(1);
  NcclComm comm(bootstrap.rank(0), kTimeout);
  EXPECT_EQ(comm.transport(), "nccl");
  EXPECT_EQ(comm.device(), -1);
  round_trips(comm);
  EXPECT_EQ(comm.device(), 0);
  EXPECT_GT(comm.wait_seconds(), 0.0);
  EXPECT_TRUE(comm.all_gather(nullptr, 0, nullptr));
  unsigned char byte = 7;
  const Status bad = comm.broadcast(&byte, 1, 1);
  EXPECT_EQ(bad.code(), ErrorCode::invalid_argument) << bad.to_string();
  EXPECT_TRUE(comm.agree("text", "same"));
  EXPECT_EQ(comm.broken(), "");
}

TEST(NcclComm, TwoRanksAsThreadsGetADeviceEachOrAreToldTheyShareOne) {
  const int devices = visible_cuda_devices();
  if (devices == 0) GTEST_SKIP() << "no CUDA device is visible: NCCL cannot run here";
  testing::ThreadGroup bootstrap(2);
  std::vector<Status> starts(2);
  std::vector<std::string> agreements(2);
  std::vector<int> placed(2, -1);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      NcclComm comm(bootstrap.rank(r), kTimeout);
      starts[static_cast<std::size_t>(r)] = comm.start();
      if (!starts[static_cast<std::size_t>(r)]) return;
      placed[static_cast<std::size_t>(r)] = comm.device();
      round_trips(comm);
      agreements[static_cast<std::size_t>(r)] = comm.agree("text", r == 1 ? "other" : "same").to_string();
    });
  }
  for (auto& t : ranks) t.join();
  if (devices >= 2) {
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(starts[static_cast<std::size_t>(r)]) << starts[static_cast<std::size_t>(r)].to_string();
      EXPECT_EQ(placed[static_cast<std::size_t>(r)], r);
      EXPECT_TRUE(contains(agreements[static_cast<std::size_t>(r)], "rank 1's text differs from rank 0's"))
          << agreements[static_cast<std::size_t>(r)];
    }
  } else {
    // One device, two ranks on one host: NCCL would refuse them; every rank is told why, alike.
    for (int r = 0; r < 2; ++r) {
      const Status& s = starts[static_cast<std::size_t>(r)];
      EXPECT_EQ(s.code(), ErrorCode::unsupported) << s.to_string();
      EXPECT_TRUE(contains(s.message(), "2 ranks on host ")) << s.to_string();
      EXPECT_TRUE(contains(s.message(), " share 1 CUDA device; NCCL needs a device of its own for each rank"))
          << s.to_string();
    }
  }
}

TEST(NcclComm, WithoutADeviceEveryRankIsToldWhyAndLaterCallsFailAtOnce) {
  if (visible_cuda_devices() > 0) GTEST_SKIP() << "a CUDA device is visible: the tests above run NCCL itself";
  testing::ThreadGroup bootstrap(2);
  std::vector<Status> first(2), second(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      NcclComm comm(bootstrap.rank(r), kTimeout);
      std::vector<unsigned char> mine(16, static_cast<unsigned char>(r)), all(32);
      first[static_cast<std::size_t>(r)] = comm.all_gather(mine.data(), mine.size(), all.data());
      second[static_cast<std::size_t>(r)] = comm.broadcast(mine.data(), mine.size(), 0);
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < 2; ++r) {
    const Status& s = first[static_cast<std::size_t>(r)];
    EXPECT_EQ(s.code(), ErrorCode::unsupported) << s.to_string();
    // Both ranks name rank 0, the first whose report says so: they reach one verdict.
    EXPECT_TRUE(contains(s.message(), "rank 0 on host ")) << s.to_string();
    EXPECT_TRUE(contains(s.message(), " cannot use NCCL: no CUDA device is visible (cudaGetDeviceCount"))
        << s.to_string();
    const Status& later = second[static_cast<std::size_t>(r)];
    EXPECT_EQ(later.code(), ErrorCode::backend_lost) << later.to_string();
    EXPECT_TRUE(contains(later.message(), "the NCCL group broke earlier: " + s.message())) << later.to_string();
  }
}
#endif

}  // namespace
}  // namespace kallpa
