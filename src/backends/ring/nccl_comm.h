// The ring's NCCL transport: a process group (kallpa/process_group.h) whose all-gathers and
// broadcasts run through NCCL on one CUDA device per rank. It starts over another group of the same
// ranks, its bootstrap (the ring's MPI group): rank 0 creates NCCL's unique id and the bootstrap
// broadcasts it, each rank takes the device of its rank among the ranks on its host, and the
// bootstrap also carries agree(). Callers pass host memory, which is staged to the device and back
// on a stream the group owns; every wait has the bootstrap's kind of deadline (KALLPA_RING_TIMEOUT
// seconds, default 60): on expiry the NCCL communicator is aborted and the error says what was
// awaited and from whom. After a failure the group is broken: later calls fail at once with the
// first failure, and buffers a transfer may still write into are never freed.
//
// This header names no CUDA or NCCL type, so that the ring's registration and the tests include it
// without the toolkit's headers; the file behind it is built only where NCCL's header was found at
// configure time (KALLPA_WITH_NCCL).
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include "kallpa/process_group.h"
#include "kallpa/status.h"

namespace kallpa::ring {

class NcclComm final : public ProcessGroup {
 public:
  // Ok when libnccl loads (it is loaded at run time, so that kallpa loads without it) and this
  // process sees a CUDA device; unsupported with the reason otherwise.
  static Status usable() noexcept;

  // A group of `bootstrap`'s ranks, which must outlive it. Nothing starts before the first
  // collective call. `timeout`: each call's deadline.
  NcclComm(ProcessGroup& bootstrap, std::chrono::duration<double> timeout);
  // Destroys the NCCL communicator (an intra-node collective: every rank on the host destroys its
  // own at the same time); a broken group's resources are left as they are.
  ~NcclComm() override;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const noexcept override;
  int size() const noexcept override;
  std::string_view transport() const noexcept override { return "nccl"; }
  // Through the bootstrap, whose check it is: a hash to rank 0 and a verdict back.
  Status agree(std::string_view what, std::string_view text) noexcept override;
  // ncclAllGather, in place in one device buffer of size() * bytes.
  Status all_gather(const void* mine, std::size_t bytes, void* all) noexcept override;
  // ncclBroadcast, in place.
  Status broadcast(void* data, std::size_t bytes, int root) noexcept override;
  // Seconds spent waiting on NCCL's transfers (staging copies included); agree()'s are the bootstrap's.
  double wait_seconds() const noexcept override;

  // Starts NCCL once (collective: every rank calls it, as the first collective call does); cheap
  // after. Fails on every rank alike when a host has more ranks than CUDA devices.
  Status start() noexcept;
  // The CUDA device this rank uses; -1 before start().
  int device() const noexcept;
  // The first failure, once the group is broken; empty while it works.
  std::string broken() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace kallpa::ring
