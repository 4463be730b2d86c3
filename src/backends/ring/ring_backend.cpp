#include "backends/ring/ring_backend.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <new>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "backends/ring/mpi_comm.h"
#include "kallpa/process_group.h"
#include "kallpa/registry.h"
#ifdef KALLPA_RING_NCCL
#include "backends/ring/nccl_comm.h"
#endif

namespace kallpa::ring {
namespace {

#define RING_TRY(expr)                         \
  do {                                         \
    if (Status st_ = (expr); !st_) return st_; \
  } while (0)

constexpr int kReduceTag = 100;
constexpr int kGatherTag = 20000;

int mod(int a, int n) { return ((a % n) + n) % n; }

// What every rank must agree on before a call's messages can match: the whole problem's geometry
// and parameters (not its data).
std::string fingerprint(const ValidatedProblem& vp) {
  const AttentionProblem& p = vp.problem();
  std::string text = vp.signature().to_string();
  text += fmt::format("|b={}|scale={}|wl={}|wr={}|softcap={}|", vp.batch(), vp.scale(), p.window_left, p.window_right,
                      p.softcap);
  for (std::int32_t b = 0; b < vp.batch(); ++b) text += fmt::format("{}:{},", vp.seqlen_q(b), vp.seqlen_k(b));
  if (p.alibi_slopes != nullptr) {
    for (std::int32_t h = 0; h < vp.hq(); ++h) text += fmt::format("{},", p.alibi_slopes[h]);
  }
  return text;
}

}  // namespace

RingBackend::RingBackend(MpiComm& comm, std::string local)
    : comm_(comm),
      local_name_(std::move(local)),
      description_(fmt::format("context-parallel attention over {} MPI ranks (zig-zag key shards, lse-merged ring); "
                               "blocks by {}",
                               comm.size(), local_name_)) {}

Support RingBackend::supports(const ProblemSignature& sig) const noexcept {
  if (sig.device.kind != DeviceKind::cpu) {
    return Support::no("ring runs on host memory; the tensors are on " + sig.device.to_string());
  }
  return Support::yes();
}

std::vector<BackendCounter> RingBackend::counters() const {
  return {{"ring_calls", "Collective attention calls run by this rank.", BackendCounter::Kind::counter,
           static_cast<double>(calls_.load())},
          {"ring_bytes_sent", "Bytes this rank sent to its ring neighbour.", BackendCounter::Kind::counter,
           static_cast<double>(bytes_sent_.load())},
          {"ring_compute_seconds", "Seconds this rank's local backend spent on blocks.", BackendCounter::Kind::counter,
           compute_seconds_.load()},
          {"ring_wait_seconds", "Seconds this rank waited on transfers (not hidden behind compute).",
           BackendCounter::Kind::counter, comm_.wait_seconds()}};
}

Status RingBackend::run(const ValidatedProblem& problem, Workspace /*workspace*/) noexcept {
  std::lock_guard lock(mu_);
  try {
    return run_locked(problem);
  } catch (const std::bad_alloc&) {
    return Status(ErrorCode::out_of_memory, "ring", "out of memory for the ring's buffers");
  } catch (const std::exception& e) {
    return Status(ErrorCode::internal, "ring", e.what());
  }
}

Status RingBackend::run_locked(const ValidatedProblem& vp) {
  RING_TRY(comm_.start());
  AttentionBackend* local = BackendRegistry::global().find(local_name_);
  if (local == nullptr || local == this) {
    return Status(ErrorCode::not_found, "KALLPA_RING_LOCAL",
                  fmt::format("the ring's local backend '{}' is not registered", local_name_));
  }
  if (Support s = local->supports(vp.signature()); !s.ok) {
    return Status(ErrorCode::unsupported, "ring", fmt::format("local backend {}: {}", local_name_, s.why_not));
  }
  RING_TRY(comm_.agree("problem", fingerprint(vp)));
  calls_.fetch_add(1, std::memory_order_relaxed);

  const int n = comm_.size(), r = comm_.rank();
  const int left = mod(r - 1, n), right = mod(r + 1, n);
  std::vector<Shard> shards;
  shards.reserve(static_cast<std::size_t>(n));
  for (int t = 0; t < n; ++t) shards.push_back(shard_of(vp, t, n));
  offsets_.assign(static_cast<std::size_t>(n) + 1, 0);
  std::size_t largest = 0;
  for (int t = 0; t < n; ++t) {
    const std::size_t f = block_floats(shards[static_cast<std::size_t>(t)].total_rows, vp);
    offsets_[static_cast<std::size_t>(t) + 1] = offsets_[static_cast<std::size_t>(t)] + f;
    largest = std::max(largest, f);
  }
  for (auto& b : bufs_) {
    if (b.size() < largest) b.resize(largest);
  }
  if (gathered_.size() < offsets_.back()) gathered_.resize(offsets_.back());
  float* local_buf = bufs_[0].data();
  float* recv_buf = bufs_[1].data();
  float* send_buf = bufs_[2].data();

  // Reduce-scatter: at step s this rank adds its keys' part of block t = r - 1 - s to the partial
  // that arrives from the left, computing before it waits, and passes the sum to the right; after
  // n steps block r holds every rank's part.
  MPI_Request send = MPI_REQUEST_NULL;
  using clock = std::chrono::steady_clock;
  for (int s = 0; s < n; ++s) {
    const int t = mod(r - 1 - s, n);
    const Shard& rows = shards[static_cast<std::size_t>(t)];
    const std::size_t floats = block_floats(rows.total_rows, vp);
    MPI_Request recv = MPI_REQUEST_NULL;
    if (s > 0) RING_TRY(comm_.irecv(recv_buf, floats * sizeof(float), left, kReduceTag + s, &recv));
    float* target = s == n - 1 ? gathered_.data() + offsets_[static_cast<std::size_t>(r)] : local_buf;
    const auto c0 = clock::now();
    clear_block(target, rows.total_rows, vp);
    RING_TRY(accumulate_block(*local, vp, rows, shards[static_cast<std::size_t>(r)], target, scratch_));
    compute_seconds_.store(compute_seconds_.load() + std::chrono::duration<double>(clock::now() - c0).count());
    if (s > 0) {
      RING_TRY(comm_.wait(&recv, left, "partial result"));
      merge_block(target, recv_buf, rows.total_rows, vp);
    }
    if (s < n - 1) {
      if (send != MPI_REQUEST_NULL) RING_TRY(comm_.wait(&send, right, "partial result hand-over"));
      RING_TRY(refine_block(*local, vp, shards[static_cast<std::size_t>(r)],
                            gathered_.data() + offsets_[static_cast<std::size_t>(r)], scratch_));
      std::swap(send_buf, local_buf);
      RING_TRY(comm_.isend(send_buf, floats * sizeof(float), right, kReduceTag + s + 1, &send));
      bytes_sent_.fetch_add(floats * sizeof(float), std::memory_order_relaxed);
    }
  }
  if (send != MPI_REQUEST_NULL) RING_TRY(comm_.wait(&send, right, "partial result hand-over"));
  RING_TRY(refine_block(*local, vp, shards[static_cast<std::size_t>(r)],
                        gathered_.data() + offsets_[static_cast<std::size_t>(r)], scratch_));

  // All-gather round the ring: at step s pass on block r - s and take block r - s - 1.
  for (int s = 0; s + 1 < n; ++s) {
    const int out = mod(r - s, n), in = mod(r - s - 1, n);
    const auto o = static_cast<std::size_t>(out), i = static_cast<std::size_t>(in);
    MPI_Request recv = MPI_REQUEST_NULL, sent = MPI_REQUEST_NULL;
    RING_TRY(comm_.irecv(gathered_.data() + offsets_[i], (offsets_[i + 1] - offsets_[i]) * sizeof(float), left,
                         kGatherTag + s, &recv));
    RING_TRY(comm_.isend(gathered_.data() + offsets_[o], (offsets_[o + 1] - offsets_[o]) * sizeof(float), right,
                         kGatherTag + s, &sent));
    bytes_sent_.fetch_add((offsets_[o + 1] - offsets_[o]) * sizeof(float), std::memory_order_relaxed);
    RING_TRY(comm_.wait(&recv, left, "output block"));
    RING_TRY(comm_.wait(&sent, right, "output block hand-over"));
  }
  for (std::size_t t = 0; t < shards.size(); ++t) write_block(vp, shards[t], gathered_.data() + offsets_[t]);
  return Status::ok();
}

namespace {

Result<ProcessGroup*> open_mpi() noexcept {
  try {
    return &MpiComm::instance();
  } catch (const std::bad_alloc&) {
    return Status(ErrorCode::out_of_memory, "transport", "out of memory");
  }
}

// NCCL's group starts over the MPI group of the same ranks. It lives as long as the process: its
// destruction is an intra-node collective, which would hang a rank whose peers left on an error,
// and the process's exit frees what it holds.
Result<ProcessGroup*> open_nccl() noexcept {
#ifdef KALLPA_RING_NCCL
  if (Status s = NcclComm::usable(); !s) return s;
  try {
    MpiComm& mpi = MpiComm::instance();
    static NcclComm* const comm = new NcclComm(mpi, mpi.timeout());
    return comm;
  } catch (const std::bad_alloc&) {
    return Status(ErrorCode::out_of_memory, "transport", "out of memory");
  }
#else
  return Status(ErrorCode::unsupported, "nccl",
                "this kallpa was built without NCCL (it needs the CUDA toolkit, MPI and NCCL's header and "
                "library at configure time: KALLPA_WITH_NCCL, docs/scale-out.md)");
#endif
}

// Offers the transports in every process, so that asking for one says at once whether it can run
// here; registers the ring and installs the MPI group only in a job of more than one rank. MPI
// itself starts at the first collective call, so a process that never makes one never starts it.
const bool g_registered = [] {
  add_process_group_transport("mpi", open_mpi);
  add_process_group_transport("nccl", open_nccl);
  if (MpiComm::launcher_size() < 2) return false;
  MpiComm& comm = MpiComm::instance();
  const char* local = std::getenv("KALLPA_RING_LOCAL");
  (void)BackendRegistry::global().add(
      std::make_unique<RingBackend>(comm, local != nullptr && *local != '\0' ? local : "cpu-flash"));
  set_process_group(&comm);
  return true;
}();

}  // namespace

}  // namespace kallpa::ring
