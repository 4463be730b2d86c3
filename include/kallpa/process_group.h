// The processes one run spans: the ranks of an MPI job (`mpirun -np N kallpa ...`). A backend that
// carries work across processes (ring, docs/scale-out.md) installs its group at load time; the
// front ends use it through this interface to print once and to check that every rank was started
// alike, and the model spreads one sequence over it (context parallelism), without naming the
// transport. The same backend offers the transports a group can run over (MPI; NCCL on GPUs), which
// a front end chooses by name.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "kallpa/status.h"

namespace kallpa {

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;

  virtual int rank() const noexcept = 0;
  virtual int size() const noexcept = 0;
  // The transport, for messages: "mpi", "nccl".
  virtual std::string_view transport() const noexcept = 0;

  // Collective: every rank passes its own `text` (its command line, a model file's hash). Ok on
  // every rank when all agree; otherwise invalid_argument on every rank, with `what` as the field,
  // naming the first rank whose text differs from rank 0's. Also fails (naming the rank) when a
  // rank does not join within the group's deadline.
  virtual Status agree(std::string_view what, std::string_view text) noexcept = 0;

  // The collectives of a computation spread over the ranks (context-parallel generation,
  // docs/scale-out.md). Every rank makes the same calls in the same order with the same sizes;
  // each wait has the group's deadline, and a rank that does not answer in time is named in the
  // error (backend_lost: the peer process died or stalls), after which the group is broken and
  // every later call fails at once.
  //
  // All-gather: every rank passes `bytes` bytes at `mine`; `all` (size() * bytes) receives rank k's
  // at offset k * bytes, its own included. `mine` and `all` must not overlap.
  virtual Status all_gather(const void* mine, std::size_t bytes, void* all) noexcept = 0;
  // Broadcast: rank `root`'s `bytes` bytes at `data` replace every other rank's.
  virtual Status broadcast(void* data, std::size_t bytes, int root) noexcept = 0;
  // Seconds this rank has spent waiting on the group's transfers since it started: the time
  // communication (and waiting for slower ranks) adds to a computation, not hidden behind it.
  virtual double wait_seconds() const noexcept = 0;
};

// The process group of this run, or nullptr when it is a single process.
ProcessGroup* process_group() noexcept;
// Installs the group (a transport's registration does this once, at load time); nullptr removes it.
void set_process_group(ProcessGroup* group) noexcept;

// A transport's group for this process, or why it cannot run here (not built, no device). Opening
// starts nothing that needs the other ranks: a group starts at its first collective call.
using ProcessGroupOpener = Result<ProcessGroup*> (*)() noexcept;
// Offers a transport by name; the backend that carries it calls this at load time. A second
// transport of the same name replaces the first.
void add_process_group_transport(std::string_view name, ProcessGroupOpener open);
// The transports offered, in the order they were added.
std::vector<std::string> process_group_transports();
// Installs the named transport's group as process_group(). not_found when no transport has that
// name (the message lists those there are); otherwise the transport's own error, and the group
// installed before stays.
Status use_process_group_transport(std::string_view name) noexcept;

}  // namespace kallpa
