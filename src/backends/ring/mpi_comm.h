// The ring's MPI transport and the process group (kallpa/process_group.h) it gives the front ends.
// One communicator, a duplicate of MPI_COMM_WORLD whose errors are returned rather than fatal;
// non-blocking sends and receives; and waits with a deadline (KALLPA_RING_TIMEOUT seconds, default
// 60), so that a rank that dies or stalls is reported by the ranks waiting on it, by number, instead
// of hanging them. After such a failure the communicator is broken: every later call fails at once
// with the first failure, the buffers of requests still pending are never freed, and MPI_Finalize
// is skipped at exit (it would wait on the dead rank).
#pragma once

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>

#include "kallpa/process_group.h"
#include "kallpa/status.h"

namespace kallpa::ring {

class MpiComm final : public ProcessGroup {
 public:
  // The job's size and this process's rank as the launcher's environment gives them
  // (OMPI_COMM_WORLD_SIZE/RANK, PMI_SIZE/RANK), read without starting MPI; 1 and 0 without one.
  static int launcher_size() noexcept;
  static int launcher_rank() noexcept;
  static MpiComm& instance();

  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return size_; }
  std::string_view transport() const noexcept override { return "mpi"; }
  Status agree(std::string_view what, std::string_view text) noexcept override;
  // Round the ring (size - 1 steps, each passing one rank's bytes to the right), the pattern whose
  // cost docs/scale-out.md models: every rank sends and receives (size - 1) * bytes.
  Status all_gather(const void* mine, std::size_t bytes, void* all) noexcept override;
  // Straight from the root to each rank: meant for a few bytes (a sampled token).
  Status broadcast(void* data, std::size_t bytes, int root) noexcept override;

  // Starts MPI once per process (MPI_Init_thread, the communicator, the error handler); cheap after.
  Status start();
  std::chrono::duration<double> timeout() const noexcept { return timeout_; }

  // Non-blocking transfers of `bytes` bytes; `tag` tells a call's messages apart.
  Status isend(const void* data, std::size_t bytes, int to, int tag, MPI_Request* request);
  Status irecv(void* data, std::size_t bytes, int from, int tag, MPI_Request* request);
  // Waits for `request` until the deadline; on failure names `peer` and says what was awaited.
  Status wait(MPI_Request* request, int peer, std::string_view what);

  // The first failure, once the communicator is broken; empty while it works.
  std::string broken() const;
  // Seconds spent waiting on transfers since the process started (the communication share).
  double wait_seconds() const noexcept override { return wait_seconds_.load(std::memory_order_relaxed); }

 private:
  MpiComm();
  Status fail(Status status);

  int rank_ = 0;
  int size_ = 1;
  std::chrono::duration<double> timeout_{60.0};
  std::mutex start_mu_;
  std::mutex collective_mu_;  // one group collective at a time, so that their messages pair in order
  bool started_ = false;
  MPI_Comm comm_ = MPI_COMM_NULL;
  mutable std::mutex broken_mu_;
  std::string broken_;  // under broken_mu_
  std::atomic<double> wait_seconds_{0.0};
};

}  // namespace kallpa::ring
