#include "backends/ring/mpi_comm.h"

#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "backends/ring/poll_pause.h"

namespace kallpa::ring {
namespace {

int env_int(const char* a, const char* b, int fallback) {
  for (const char* name : {a, b}) {
    if (const char* v = std::getenv(name)) {
      char* end = nullptr;
      const long x = std::strtol(v, &end, 10);
      if (end != v && *end == '\0' && x >= 0 && x <= INT_MAX) return static_cast<int>(x);
    }
  }
  return fallback;
}

std::uint64_t fnv1a(std::string_view text) {
  std::uint64_t h = 1469598103934665603ull;
  for (const char c : text) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h;
}

std::string mpi_error(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return fmt::format("MPI error {}", code);
  return std::string(text, static_cast<std::size_t>(len));
}

constexpr int kAgreeTag = 30001;
constexpr int kVerdictTag = 30002;
constexpr int kAllGatherTag = 40000;  // + step
constexpr int kBroadcastTag = 50000;

std::atomic<bool> g_skip_finalize{false};

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && !g_skip_finalize) MPI_Finalize();
}

}  // namespace

int MpiComm::launcher_size() noexcept { return env_int("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", 1); }
int MpiComm::launcher_rank() noexcept { return env_int("OMPI_COMM_WORLD_RANK", "PMI_RANK", 0); }

MpiComm& MpiComm::instance() {
  static MpiComm comm;
  return comm;
}

MpiComm::MpiComm() : rank_(launcher_rank()), size_(launcher_size()) {
  if (const char* v = std::getenv("KALLPA_RING_TIMEOUT")) {
    char* end = nullptr;
    const double s = std::strtod(v, &end);
    if (end != v && *end == '\0' && s > 0.0) timeout_ = std::chrono::duration<double>(s);
  }
}

std::string MpiComm::broken() const {
  std::lock_guard lock(broken_mu_);
  return broken_;
}

Status MpiComm::fail(Status status) {
  std::lock_guard lock(broken_mu_);
  if (broken_.empty()) broken_ = status.message();
  g_skip_finalize = true;
  return status;
}

Status MpiComm::start() {
  std::lock_guard lock(start_mu_);
  if (std::string b = broken(); !b.empty()) {
    return Status(ErrorCode::backend_lost, "ring", "the ring broke earlier: " + b);
  }
  if (started_) return Status::ok();
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    // The ring serialises its own calls; MULTIPLE lets any thread make them.
    const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS) return fail(Status(ErrorCode::backend_failure, "ring", "MPI_Init_thread: " + mpi_error(rc)));
    std::atexit(finalize_at_exit);
    if (provided < MPI_THREAD_SERIALIZED) {
      return fail(
          Status(ErrorCode::unsupported, "ring",
                 fmt::format("this MPI provides thread level {} (the ring needs MPI_THREAD_SERIALIZED)", provided)));
    }
  }
  if (MPI_Comm_dup(MPI_COMM_WORLD, &comm_) != MPI_SUCCESS ||
      MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN) != MPI_SUCCESS) {
    return fail(Status(ErrorCode::backend_failure, "ring", "could not set up the ring's MPI communicator"));
  }
  int rank = 0, size = 0;
  MPI_Comm_rank(comm_, &rank);
  MPI_Comm_size(comm_, &size);
  if (rank != rank_ || size != size_) {
    return fail(Status(
        ErrorCode::internal, "ring",
        fmt::format("MPI says rank {} of {}, the launcher's environment rank {} of {}", rank, size, rank_, size_)));
  }
  started_ = true;
  return Status::ok();
}

Status MpiComm::isend(const void* data, std::size_t bytes, int to, int tag, MPI_Request* request) {
  if (bytes > static_cast<std::size_t>(INT_MAX)) {
    return Status(ErrorCode::unsupported, "ring",
                  fmt::format("a message of {} bytes is over MPI's 2 GiB count", bytes));
  }
  const int rc = MPI_Isend(data, static_cast<int>(bytes), MPI_BYTE, to, tag, comm_, request);
  if (rc != MPI_SUCCESS) {
    return fail(Status(ErrorCode::backend_lost, "ring",
                       fmt::format("rank {}: sending to rank {} failed: {}", rank_, to, mpi_error(rc))));
  }
  return Status::ok();
}

Status MpiComm::irecv(void* data, std::size_t bytes, int from, int tag, MPI_Request* request) {
  if (bytes > static_cast<std::size_t>(INT_MAX)) {
    return Status(ErrorCode::unsupported, "ring",
                  fmt::format("a message of {} bytes is over MPI's 2 GiB count", bytes));
  }
  const int rc = MPI_Irecv(data, static_cast<int>(bytes), MPI_BYTE, from, tag, comm_, request);
  if (rc != MPI_SUCCESS) {
    return fail(Status(ErrorCode::backend_lost, "ring",
                       fmt::format("rank {}: receiving from rank {} failed: {}", rank_, from, mpi_error(rc))));
  }
  return Status::ok();
}

Status MpiComm::wait(MPI_Request* request, int peer, std::string_view what) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  const auto deadline = start + std::chrono::duration_cast<clock::duration>(timeout_);
  PollPause pause(start);
  for (;;) {
    int done = 0;
    const int rc = MPI_Test(request, &done, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) {
      return fail(Status(ErrorCode::backend_lost, "ring",
                         fmt::format("rank {}: {} with rank {} failed: {}", rank_, what, peer, mpi_error(rc))));
    }
    if (done) break;
    const auto now = clock::now();
    if (now >= deadline) {
      return fail(Status(ErrorCode::backend_lost, "ring",
                         fmt::format("rank {}: no {} with rank {} within {} s: rank {} died or stalls", rank_, what,
                                     peer, timeout_.count(), peer)));
    }
    pause(now);
  }
  wait_seconds_.store(wait_seconds() + std::chrono::duration<double>(clock::now() - start).count(),
                      std::memory_order_relaxed);
  return Status::ok();
}

Status MpiComm::agree(std::string_view what, std::string_view text) noexcept {
  try {
    if (Status s = start(); !s) return s;
    std::uint64_t mine = fnv1a(text);
    // Rank 0 collects every rank's hash and answers each with the verdict: -1 all agree, k >= 0
    // the first rank that differs, -(k + 2) rank k never sent its hash.
    std::int64_t verdict = -1;
    if (rank_ == 0) {
      std::vector<std::uint64_t> hashes(static_cast<std::size_t>(size_));
      std::vector<MPI_Request> req(static_cast<std::size_t>(size_), MPI_REQUEST_NULL);
      for (int k = 1; k < size_; ++k) {
        if (Status s = irecv(&hashes[static_cast<std::size_t>(k)], sizeof(std::uint64_t), k, kAgreeTag,
                             &req[static_cast<std::size_t>(k)]);
            !s)
          return s;
      }
      int joined = size_;
      Status missing;
      for (int k = 1; k < size_; ++k) {
        if (Status s = wait(&req[static_cast<std::size_t>(k)], k, fmt::format("{} check", what)); !s) {
          missing = s;
          verdict = -(k + 2);
          joined = k;
          break;
        }
        if (verdict == -1 && hashes[static_cast<std::size_t>(k)] != mine) verdict = k;
      }
      std::vector<MPI_Request> sends(static_cast<std::size_t>(size_), MPI_REQUEST_NULL);
      for (int k = 1; k < joined; ++k) {
        if (Status s = isend(&verdict, sizeof verdict, k, kVerdictTag, &sends[static_cast<std::size_t>(k)]); !s)
          return s;
      }
      for (int k = 1; k < joined; ++k) {
        if (Status s = wait(&sends[static_cast<std::size_t>(k)], k, fmt::format("{} verdict", what)); !s) return s;
      }
      if (!missing) return missing;
    } else {
      MPI_Request send = MPI_REQUEST_NULL, recv = MPI_REQUEST_NULL;
      if (Status s = isend(&mine, sizeof mine, 0, kAgreeTag, &send); !s) return s;
      if (Status s = irecv(&verdict, sizeof verdict, 0, kVerdictTag, &recv); !s) return s;
      if (Status s = wait(&send, 0, fmt::format("{} check", what)); !s) return s;
      if (Status s = wait(&recv, 0, fmt::format("{} verdict", what)); !s) return s;
    }
    if (verdict >= 0) {
      return Status::invalid(
          std::string(what),
          fmt::format("rank {}'s {} differs from rank 0's; every rank must be started alike", verdict, what));
    }
    if (verdict < -1) {
      return Status(ErrorCode::backend_failure, std::string(what),
                    fmt::format("rank {} did not join the {} check within {} s", -verdict - 2, what, timeout_.count()));
    }
    return Status::ok();
  } catch (...) {
    return Status(ErrorCode::out_of_memory, std::string(what), "out of memory");
  }
}

Status MpiComm::all_gather(const void* mine, std::size_t bytes, void* all) noexcept {
  try {
    if (Status s = start(); !s) return s;
    std::lock_guard lock(collective_mu_);
    auto* out = static_cast<std::byte*>(all);
    const auto block = [&](int k) { return out + static_cast<std::size_t>(k) * bytes; };
    if (bytes > 0) std::memcpy(block(rank_), mine, bytes);
    const int left = (rank_ + size_ - 1) % size_, right = (rank_ + 1) % size_;
    // Step s passes on block r - s (this rank's own at s = 0, then what arrived at step s - 1) and
    // takes block r - s - 1 from the left.
    for (int s = 0; s + 1 < size_; ++s) {
      const int send_block = (rank_ - s + 2 * size_) % size_, recv_block = (rank_ - s - 1 + 2 * size_) % size_;
      MPI_Request recv = MPI_REQUEST_NULL, send = MPI_REQUEST_NULL;
      if (Status st = irecv(block(recv_block), bytes, left, kAllGatherTag + s, &recv); !st) return st;
      if (Status st = isend(block(send_block), bytes, right, kAllGatherTag + s, &send); !st) return st;
      if (Status st = wait(&recv, left, "all-gather block"); !st) return st;
      if (Status st = wait(&send, right, "all-gather hand-over"); !st) return st;
    }
    return Status::ok();
  } catch (...) {
    return Status(ErrorCode::out_of_memory, "process group", "out of memory");
  }
}

Status MpiComm::broadcast(void* data, std::size_t bytes, int root) noexcept {
  try {
    if (root < 0 || root >= size_) {
      return Status::invalid("root", fmt::format("rank {} is not in a group of {}", root, size_));
    }
    if (Status s = start(); !s) return s;
    std::lock_guard lock(collective_mu_);
    if (rank_ != root) {
      MPI_Request recv = MPI_REQUEST_NULL;
      if (Status s = irecv(data, bytes, root, kBroadcastTag, &recv); !s) return s;
      return wait(&recv, root, "broadcast");
    }
    std::vector<MPI_Request> sends(static_cast<std::size_t>(size_), MPI_REQUEST_NULL);
    for (int k = 0; k < size_; ++k) {
      if (k == root) continue;
      if (Status s = isend(data, bytes, k, kBroadcastTag, &sends[static_cast<std::size_t>(k)]); !s) return s;
    }
    for (int k = 0; k < size_; ++k) {
      if (k == root) continue;
      if (Status s = wait(&sends[static_cast<std::size_t>(k)], k, "broadcast hand-over"); !s) return s;
    }
    return Status::ok();
  } catch (...) {
    return Status(ErrorCode::out_of_memory, "process group", "out of memory");
  }
}

}  // namespace kallpa::ring
