// libnccl is loaded at first use (dlopen), as cuDNN and cuBLAS are, so that kallpa loads on machines
// without it (a GPU image may hold only PyTorch's copy, which the loader does not know) and choosing
// the transport there says why it cannot run. nccl.h gives the types and signatures alone.
#include "backends/ring/nccl_comm.h"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "backends/ring/poll_pause.h"

namespace kallpa::ring {
namespace {

using clock = std::chrono::steady_clock;

std::string cuda_text(std::string_view call, cudaError_t err) {
  return fmt::format("{}: {}: {}", call, cudaGetErrorName(err), cudaGetErrorString(err));
}

// The entry points the transport calls, from the library loaded at run time.
struct NcclApi {
  decltype(&::ncclGetVersion) GetVersion = nullptr;
  decltype(&::ncclGetErrorString) GetErrorString = nullptr;
  decltype(&::ncclGetLastError) GetLastError = nullptr;
  decltype(&::ncclGetUniqueId) GetUniqueId = nullptr;
  decltype(&::ncclCommInitRankConfig) CommInitRankConfig = nullptr;
  decltype(&::ncclCommGetAsyncError) CommGetAsyncError = nullptr;
  decltype(&::ncclCommAbort) CommAbort = nullptr;
  decltype(&::ncclCommFinalize) CommFinalize = nullptr;
  decltype(&::ncclCommDestroy) CommDestroy = nullptr;
  decltype(&::ncclAllGather) AllGather = nullptr;
  decltype(&::ncclBroadcast) Broadcast = nullptr;
};

struct LoadedNccl {
  NcclApi api;
  std::string why_not;  // empty when loaded
};

template <typename F>
bool resolve(void* lib, const char* name, F* out, std::string* missing) {
  *out = reinterpret_cast<F>(dlsym(lib, name));
  if (*out == nullptr && missing->empty()) *missing = name;
  return *out != nullptr;
}

// libnccl.so.2 from the loader's path, else from the directory it was found in at configure time;
// loaded once per process, never unloaded.
const LoadedNccl& loaded_nccl() {
  static const LoadedNccl loaded = [] {
    LoadedNccl l;
    void* lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    const std::string first_error = lib == nullptr ? dlerror() : "";
#ifdef KALLPA_NCCL_DIR
    if (lib == nullptr) lib = dlopen(KALLPA_NCCL_DIR "/libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
#endif
    if (lib == nullptr) {
      l.why_not = "libnccl.so.2 is not loadable (" + first_error + ")";
      return l;
    }
    NcclApi& a = l.api;
    std::string missing;
    resolve(lib, "ncclGetVersion", &a.GetVersion, &missing);
    resolve(lib, "ncclGetErrorString", &a.GetErrorString, &missing);
    resolve(lib, "ncclGetLastError", &a.GetLastError, &missing);
    resolve(lib, "ncclGetUniqueId", &a.GetUniqueId, &missing);
    resolve(lib, "ncclCommInitRankConfig", &a.CommInitRankConfig, &missing);
    resolve(lib, "ncclCommGetAsyncError", &a.CommGetAsyncError, &missing);
    resolve(lib, "ncclCommAbort", &a.CommAbort, &missing);
    resolve(lib, "ncclCommFinalize", &a.CommFinalize, &missing);
    resolve(lib, "ncclCommDestroy", &a.CommDestroy, &missing);
    resolve(lib, "ncclAllGather", &a.AllGather, &missing);
    resolve(lib, "ncclBroadcast", &a.Broadcast, &missing);
    if (!missing.empty()) {
      l.why_not = "libnccl.so.2 lacks " + missing + " (the transport needs NCCL 2.14 or later)";
      return l;
    }
    // The non-blocking communicator and its configuration came with 2.14.
    int version = 0;
    if (a.GetVersion(&version) != ncclSuccess || version < NCCL_VERSION(2, 14, 0)) {
      l.why_not = fmt::format("libnccl.so.2 is version code {} (the transport needs NCCL 2.14 or later)", version);
    }
    return l;
  }();
  return loaded;
}

const NcclApi& nccl() { return loaded_nccl().api; }

std::string nccl_text(std::string_view call, ncclResult_t rc, ncclComm_t comm) {
  std::string text = fmt::format("{}: {}", call, nccl().GetErrorString(rc));
  if (const char* last = nccl().GetLastError(comm); last != nullptr && *last != '\0') {
    text += fmt::format(" ({})", last);
  }
  return text;
}

// The ranks a collective waits on, for messages: "rank 1", "ranks 1, 2 and 3".
std::string others(int rank, int size) {
  std::vector<int> peers;
  for (int k = 0; k < size; ++k) {
    if (k != rank) peers.push_back(k);
  }
  if (peers.empty()) return "no other rank";
  if (peers.size() == 1) return fmt::format("rank {}", peers[0]);
  std::string text = "ranks ";
  for (std::size_t i = 0; i < peers.size(); ++i) {
    if (i > 0) text += i + 1 == peers.size() ? " and " : ", ";
    text += std::to_string(peers[i]);
  }
  return text;
}

// What each rank tells the others at start: its host, how many CUDA devices it sees there, and why
// it cannot use NCCL at all, when it cannot; so that every rank reaches the same verdict.
struct HostReport {
  char host[256];
  std::int32_t devices;
  char why_not[220];
};

// Rank 0's NCCL id, or why it has none.
struct IdReport {
  ncclUniqueId id;
  std::int32_t ok;
  char why[220];
};

void copy_text(char* out, std::size_t size, std::string_view text) {
  const std::size_t n = std::min(size - 1, text.size());
  std::memcpy(out, text.data(), n);
  out[n] = '\0';
}

}  // namespace

struct NcclComm::State {
  State(ProcessGroup& b, std::chrono::duration<double> t) : bootstrap(b), timeout(t), rank(b.rank()), size(b.size()) {}

  ProcessGroup& bootstrap;
  std::chrono::duration<double> timeout;
  int rank;
  int size;
  std::mutex mu;  // one collective at a time, so that they pair by order; start() too
  bool started = false;
  std::atomic<int> device{-1};
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  std::byte* dev = nullptr;  // device staging, dev_bytes long
  std::size_t dev_bytes = 0;
  std::byte* host = nullptr;  // pinned host staging, host_bytes long
  std::size_t host_bytes = 0;
  // Work enqueued on the stream that has not been seen to finish: after a failure, the transfers
  // of the failed call may still write into the staging buffers.
  bool in_flight = false;
  mutable std::mutex broken_mu;
  std::string broken;  // under broken_mu
  std::atomic<double> wait_seconds{0.0};

  std::string first_failure() const {
    std::lock_guard lock(broken_mu);
    return broken;
  }

  Status fail(Status status) {
    std::lock_guard lock(broken_mu);
    if (broken.empty()) broken = status.message();
    return status;
  }

  // Aborts the communicator (local: it waits for no peer) so that a collective stuck on a dead
  // rank's part ends on the device too, then fails.
  Status abort_and_fail(Status status) {
    if (comm != nullptr) {
      (void)nccl().CommAbort(comm);
      comm = nullptr;
    }
    return fail(std::move(status));
  }

  Status timed_out(std::string_view what) {
    const std::string peers = others(rank, size);
    return abort_and_fail(Status(ErrorCode::backend_lost, "nccl",
                                 fmt::format("rank {}: no {} from {} within {} s: {} died or stalls", rank, what, peers,
                                             timeout.count(), size == 2 ? peers : "one of them")));
  }

  // The communicator's asynchronous state (a query that fails counts as its error).
  ncclResult_t async_state() {
    ncclResult_t state = ncclSuccess;
    if (const ncclResult_t rc = nccl().CommGetAsyncError(comm, &state); rc != ncclSuccess) state = rc;
    return state;
  }

  Status failed_with_peers(std::string_view what, ncclResult_t state) {
    return abort_and_fail(Status(
        ErrorCode::backend_lost, "nccl",
        fmt::format("rank {}: {} with {} failed: {}", rank, what, others(rank, size), nccl_text("NCCL", state, comm))));
  }

  // NCCL's state after a call on a non-blocking communicator: a call may return before its work is
  // enqueued (ncclInProgress), and nothing else may be called on the communicator until it is.
  Status settle(std::string_view what, clock::time_point deadline) {
    PollPause pause(clock::now());
    for (;;) {
      const ncclResult_t state = async_state();
      if (state == ncclSuccess) return Status::ok();
      if (state != ncclInProgress) return failed_with_peers(what, state);
      const auto now = clock::now();
      if (now >= deadline) return timed_out(what);
      pause(now);
    }
  }

  Status nccl_call(std::string_view what, ncclResult_t rc, clock::time_point deadline) {
    if (rc == ncclInProgress) return settle(what, deadline);
    if (rc != ncclSuccess) {
      return abort_and_fail(Status(ErrorCode::backend_failure, "nccl",
                                   fmt::format("rank {}: {}: {}", rank, what, nccl_text("NCCL", rc, comm))));
    }
    return Status::ok();
  }

  Status cuda_call(std::string_view call, cudaError_t err) {
    if (err == cudaSuccess) return Status::ok();
    return abort_and_fail(
        Status(ErrorCode::backend_failure, "nccl", fmt::format("rank {}: {}", rank, cuda_text(call, err))));
  }

  // Waits until everything enqueued on the stream has run, watching NCCL's error state meanwhile
  // (a peer that exits makes NCCL report a remote error) and the deadline.
  Status wait_stream(std::string_view what, clock::time_point start, clock::time_point deadline) {
    PollPause pause(start);
    for (;;) {
      const cudaError_t q = cudaStreamQuery(stream);
      if (q == cudaSuccess) break;
      if (q != cudaErrorNotReady) return cuda_call("cudaStreamQuery", q);
      if (const ncclResult_t state = async_state(); state != ncclSuccess && state != ncclInProgress) {
        return failed_with_peers(what, state);
      }
      const auto now = clock::now();
      if (now >= deadline) return timed_out(what);
      pause(now);
    }
    in_flight = false;
    wait_seconds.store(
        wait_seconds.load(std::memory_order_relaxed) + std::chrono::duration<double>(clock::now() - start).count(),
        std::memory_order_relaxed);
    return Status::ok();
  }

  // Staging of at least `bytes` on the device and in pinned host memory. Every collective has
  // finished with them when it returns, so the old ones can go.
  Status reserve(std::size_t bytes) {
    if (bytes > dev_bytes) {
      if (dev != nullptr) (void)cudaFree(dev);
      dev = nullptr;
      dev_bytes = 0;
      void* p = nullptr;
      if (const cudaError_t e = cudaMalloc(&p, bytes); e != cudaSuccess) {
        return Status(ErrorCode::out_of_memory, "nccl",
                      fmt::format("rank {}: {} bytes of device staging: {}", rank, bytes, cuda_text("cudaMalloc", e)));
      }
      dev = static_cast<std::byte*>(p);
      dev_bytes = bytes;
    }
    if (bytes > host_bytes) {
      if (host != nullptr) (void)cudaFreeHost(host);
      host = nullptr;
      host_bytes = 0;
      void* p = nullptr;
      if (const cudaError_t e = cudaMallocHost(&p, bytes); e != cudaSuccess) {
        return Status(
            ErrorCode::out_of_memory, "nccl",
            fmt::format("rank {}: {} bytes of pinned host staging: {}", rank, bytes, cuda_text("cudaMallocHost", e)));
      }
      host = static_cast<std::byte*>(p);
      host_bytes = bytes;
    }
    return Status::ok();
  }

  Status start() {
    if (std::string b = first_failure(); !b.empty()) {
      return Status(ErrorCode::backend_lost, "nccl", "the NCCL group broke earlier: " + b);
    }
    if (started) return Status::ok();
    const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(timeout);

    // Placement: each rank takes the device of its rank among the ranks on its host, so a host
    // needs a device per rank there (NCCL refuses two ranks on one device). Every rank hears every
    // rank's report, so all reach the same verdict rather than some waiting on the others.
    HostReport mine{};
    if (gethostname(mine.host, sizeof mine.host) != 0) copy_text(mine.host, sizeof mine.host, "(unknown host)");
    mine.host[sizeof mine.host - 1] = '\0';
    const Status here = NcclComm::usable();
    if (!here) copy_text(mine.why_not, sizeof mine.why_not, here.message());
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
    mine.devices = count;
    std::vector<HostReport> all(static_cast<std::size_t>(size));
    if (size > 1) {
      if (Status s = bootstrap.all_gather(&mine, sizeof mine, all.data()); !s) return fail(s);
    } else {
      all[0] = mine;
    }
    const auto same_host = [&](int a, int b) {
      return std::strcmp(all[static_cast<std::size_t>(a)].host, all[static_cast<std::size_t>(b)].host) == 0;
    };
    for (int k = 0; k < size; ++k) {
      const HostReport& at = all[static_cast<std::size_t>(k)];
      if (at.why_not[0] != '\0') {
        return fail(Status(ErrorCode::unsupported, "nccl",
                           fmt::format("rank {} on host {} cannot use NCCL: {}", k, at.host, at.why_not)));
      }
      int on_host = 0;
      for (int j = 0; j < size; ++j) on_host += same_host(j, k) ? 1 : 0;
      if (on_host > at.devices) {
        return fail(Status(
            ErrorCode::unsupported, "nccl",
            fmt::format("{} ranks on host {} share {} CUDA device{}; NCCL needs a device of its own for each rank",
                        on_host, at.host, at.devices, at.devices == 1 ? "" : "s")));
      }
    }
    int local_rank = 0;
    for (int j = 0; j < rank; ++j) local_rank += same_host(j, rank) ? 1 : 0;
    device.store(local_rank);
    if (Status s = cuda_call("cudaSetDevice", cudaSetDevice(local_rank)); !s) return s;

    IdReport id{};
    if (rank == 0) {
      const ncclResult_t rc = nccl().GetUniqueId(&id.id);
      id.ok = rc == ncclSuccess ? 1 : 0;
      if (rc != ncclSuccess) copy_text(id.why, sizeof id.why, nccl_text("ncclGetUniqueId", rc, nullptr));
    }
    if (size > 1) {
      if (Status s = bootstrap.broadcast(&id, sizeof id, 0); !s) return fail(s);
    }
    if (id.ok == 0) {
      return fail(Status(ErrorCode::backend_failure, "nccl", fmt::format("rank 0 has no NCCL id: {}", id.why)));
    }
    if (Status s = cuda_call("cudaStreamCreateWithFlags", cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        !s)
      return s;
    // Non-blocking, so that the start and each later call can be given up at the deadline.
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t rc = nccl().CommInitRankConfig(&comm, size, id.id, rank, &config);
    if (Status s = nccl_call("start of NCCL", rc, deadline); !s) return s;
    started = true;
    return Status::ok();
  }
};

Status NcclComm::usable() noexcept {
  try {
    if (const std::string& why = loaded_nccl().why_not; !why.empty())
      return Status(ErrorCode::unsupported, "nccl", why);
    int count = 0;
    if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
      return Status(ErrorCode::unsupported, "nccl",
                    "no CUDA device is visible (" + cuda_text("cudaGetDeviceCount", e) + ")");
    }
    if (count == 0) return Status(ErrorCode::unsupported, "nccl", "no CUDA device is visible (cudaGetDeviceCount: 0)");
    return Status::ok();
  } catch (const std::bad_alloc&) {
    return Status(ErrorCode::out_of_memory, "nccl", "out of memory");
  }
}

NcclComm::NcclComm(ProcessGroup& bootstrap, std::chrono::duration<double> timeout)
    : state_(std::make_unique<State>(bootstrap, timeout)) {}

NcclComm::~NcclComm() {
  State& s = *state_;
  if (s.in_flight) {
    // The failed call's transfers may still write into the staging buffers and hold the stream:
    // they stay.
    (void)state_.release();
    return;
  }
  if (s.comm != nullptr) {
    (void)cudaSetDevice(s.device.load());
    const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(s.timeout);
    // Past the deadline the communicator is aborted instead (and s.comm cleared).
    if (s.nccl_call("shutdown of NCCL", nccl().CommFinalize(s.comm), deadline)) (void)nccl().CommDestroy(s.comm);
  }
  if (s.stream != nullptr) (void)cudaStreamDestroy(s.stream);
  if (s.dev != nullptr) (void)cudaFree(s.dev);
  if (s.host != nullptr) (void)cudaFreeHost(s.host);
}

int NcclComm::rank() const noexcept { return state_->rank; }
int NcclComm::size() const noexcept { return state_->size; }
int NcclComm::device() const noexcept { return state_->device.load(); }
double NcclComm::wait_seconds() const noexcept { return state_->wait_seconds.load(std::memory_order_relaxed); }

std::string NcclComm::broken() const { return state_->first_failure(); }

Status NcclComm::start() noexcept {
  try {
    std::lock_guard lock(state_->mu);
    return state_->start();
  } catch (const std::bad_alloc&) {
    return Status(ErrorCode::out_of_memory, "nccl", "out of memory");
  }
}

Status NcclComm::agree(std::string_view what, std::string_view text) noexcept {
  return state_->bootstrap.agree(what, text);
}

Status NcclComm::all_gather(const void* mine, std::size_t bytes, void* all) noexcept {
  try {
    State& s = *state_;
    std::lock_guard lock(s.mu);
    if (Status st = s.start(); !st) return st;
    if (bytes == 0) return Status::ok();
    if (bytes > std::numeric_limits<std::size_t>::max() / static_cast<std::size_t>(s.size)) {
      return Status::invalid("bytes", fmt::format("{} ranks of {} bytes overflow", s.size, bytes));
    }
    const std::size_t total = bytes * static_cast<std::size_t>(s.size);
    const std::size_t at = bytes * static_cast<std::size_t>(s.rank);
    const auto start = clock::now();
    const auto deadline = start + std::chrono::duration_cast<clock::duration>(s.timeout);
    if (Status st = s.cuda_call("cudaSetDevice", cudaSetDevice(s.device.load())); !st) return st;
    if (Status st = s.reserve(total); !st) return st;
    std::memcpy(s.host + at, mine, bytes);
    s.in_flight = true;
    if (Status st = s.cuda_call("cudaMemcpyAsync",
                                cudaMemcpyAsync(s.dev + at, s.host + at, bytes, cudaMemcpyHostToDevice, s.stream));
        !st)
      return st;
    // In place: this rank's block already sits at its offset of the gathered buffer.
    if (Status st = s.nccl_call("all-gather", nccl().AllGather(s.dev + at, s.dev, bytes, ncclUint8, s.comm, s.stream),
                                deadline);
        !st)
      return st;
    if (Status st =
            s.cuda_call("cudaMemcpyAsync", cudaMemcpyAsync(s.host, s.dev, total, cudaMemcpyDeviceToHost, s.stream));
        !st)
      return st;
    if (Status st = s.wait_stream("all-gather block", start, deadline); !st) return st;
    std::memcpy(all, s.host, total);
    return Status::ok();
  } catch (const std::bad_alloc&) {
    return Status(ErrorCode::out_of_memory, "process group", "out of memory");
  }
}

Status NcclComm::broadcast(void* data, std::size_t bytes, int root) noexcept {
  try {
    State& s = *state_;
    if (root < 0 || root >= s.size) {
      return Status::invalid("root", fmt::format("rank {} is not in a group of {}", root, s.size));
    }
    std::lock_guard lock(s.mu);
    if (Status st = s.start(); !st) return st;
    if (bytes == 0) return Status::ok();
    const auto start = clock::now();
    const auto deadline = start + std::chrono::duration_cast<clock::duration>(s.timeout);
    if (Status st = s.cuda_call("cudaSetDevice", cudaSetDevice(s.device.load())); !st) return st;
    if (Status st = s.reserve(bytes); !st) return st;
    const bool mine = s.rank == root;
    s.in_flight = true;
    if (mine) {
      std::memcpy(s.host, data, bytes);
      if (Status st =
              s.cuda_call("cudaMemcpyAsync", cudaMemcpyAsync(s.dev, s.host, bytes, cudaMemcpyHostToDevice, s.stream));
          !st)
        return st;
    }
    if (Status st = s.nccl_call("broadcast", nccl().Broadcast(s.dev, s.dev, bytes, ncclUint8, root, s.comm, s.stream),
                                deadline);
        !st)
      return st;
    if (!mine) {
      if (Status st =
              s.cuda_call("cudaMemcpyAsync", cudaMemcpyAsync(s.host, s.dev, bytes, cudaMemcpyDeviceToHost, s.stream));
          !st)
        return st;
    }
    if (Status st = s.wait_stream(mine ? "broadcast hand-over" : "broadcast", start, deadline); !st) return st;
    if (!mine) std::memcpy(data, s.host, bytes);
    return Status::ok();
  } catch (const std::bad_alloc&) {
    return Status(ErrorCode::out_of_memory, "process group", "out of memory");
  }
}

}  // namespace kallpa::ring
