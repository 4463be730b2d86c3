// ring: context-parallel attention across the ranks of an MPI job (docs/scale-out.md). Every rank
// calls run() with the same problem; each computes with a local backend the attention of every
// query row over the keys it owns (zig-zag chunks, zigzag.h), and the partial results travel round
// the ring, merged by log-sum-exp at each hop, while the next block computes (a reduce-scatter);
// a ring all-gather then gives every rank the whole output. It registers only in a job of more than
// one rank, with a priority below every other backend, so it runs only when named: a collective call
// must be made by every rank alike, which automatic choice cannot promise.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "backends/ring/block_compute.h"
#include "kallpa/backend.h"

namespace kallpa::ring {

class MpiComm;

class RingBackend final : public AttentionBackend {
 public:
  // `local`: the backend that computes each rank's blocks (KALLPA_RING_LOCAL, default cpu-flash).
  RingBackend(MpiComm& comm, std::string local);

  std::string_view name() const noexcept override { return "ring"; }
  std::string_view version() const noexcept override { return "0.1.0"; }
  DeviceKind device_kind() const noexcept override { return DeviceKind::cpu; }
  int priority() const noexcept override { return -100; }
  std::string_view description() const noexcept override { return description_; }
  Support supports(const ProblemSignature& signature) const noexcept override;
  Status run(const ValidatedProblem& problem, Workspace workspace) noexcept override;
  std::vector<BackendCounter> counters() const override;

 private:
  Status run_locked(const ValidatedProblem& problem);

  MpiComm& comm_;
  std::string local_name_;
  std::string description_;
  std::mutex mu_;  // one collective call at a time
  // Kept for the process's life: after a failed wait a receive may still land in them.
  std::vector<float> bufs_[3];
  std::vector<float> gathered_;
  BlockScratch scratch_;
  std::vector<std::size_t> offsets_;
  std::atomic<std::uint64_t> calls_{0};
  std::atomic<std::uint64_t> bytes_sent_{0};
  std::atomic<double> compute_seconds_{0.0};
};

}  // namespace kallpa::ring
