// The parent side of an isolated plugin. One host process per plugin, started at load and again
// after it is lost; calls to it are serialised (one arena, one socket). supports() asks the host
// once per signature and caches the verdict (the verdict is the plugin's own code, so it cannot be
// shipped to this side). run() stages the spans of q, k, v and the index arrays into the arena as
// they are (strides, packed and paged layouts keep their offsets), the host rebuilds and validates
// the problem over the arena and runs the plugin, and the elements of o and lse are copied back.
#include "core/isolated_backend.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <mutex>
#include <span>
#include <thread>
#include <unordered_map>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "core/plugin_backend.h"
#include "core/plugin_wire.h"
#include "kallpa/device.h"

extern char** environ;  // NOLINT: POSIX, for posix_spawn

namespace kallpa::detail {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::chrono::milliseconds kFirstBackoff{1000}, kMaxBackoff{60000};

std::int64_t round_up(std::int64_t x, std::int64_t a) { return (x + a - 1) / a * a; }

std::string errno_text(int err) { return std::error_code(err, std::generic_category()).message(); }

std::string describe_exit(int status) {
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    const char* abbrev = sigabbrev_np(sig);
    return fmt::format("was killed by signal {} (SIG{})", sig, abbrev != nullptr ? abbrev : "?");
  }
  if (WIFEXITED(status)) return fmt::format("exited with status {}", WEXITSTATUS(status));
  return "ended";
}

std::string read_message(const char* text) { return std::string(text, strnlen(text, wire::kMessageBytes)); }

std::string_view buffer_name(wire::Buffer b) {
  switch (b) {
    case wire::Buffer::o: return "o";
    case wire::Buffer::lse: return "lse";
    case wire::Buffer::workspace: return "its workspace";
  }
  return "a buffer";
}

struct SignatureHash {
  std::size_t operator()(const ProblemSignature& s) const noexcept { return s.hash(); }
};

class IsolatedPluginBackend final : public AttentionBackend {
 public:
  IsolatedPluginBackend(std::string path, std::string host, PluginOptions options)
      : path_(std::move(path)), host_(std::move(host)), options_(std::move(options)) {}
  ~IsolatedPluginBackend() override {
    std::lock_guard lock(mu_);
    stop_locked(/*kill_now=*/false);
  }
  IsolatedPluginBackend(const IsolatedPluginBackend&) = delete;
  IsolatedPluginBackend& operator=(const IsolatedPluginBackend&) = delete;

  // Starts the first host and takes the plugin's identity from its hello.
  Status start() {
    std::lock_guard lock(mu_);
    wire::Hello hello;
    if (Status s = spawn_locked(&hello); !s) return Status(s.code(), path_, s.message());
    name_ = std::string(hello.name, strnlen(hello.name, sizeof hello.name));
    version_ = std::string(hello.version, strnlen(hello.version, sizeof hello.version));
    description_ = std::string(hello.description, strnlen(hello.description, sizeof hello.description));
    if (description_.empty()) description_ = fmt::format("plugin {}", path_);
    description_ += " (isolated)";
    priority_ = hello.priority;
    identity_ = plugin_identity(name_, version_, path_);
    return {};
  }

  std::string_view name() const noexcept override { return name_; }
  std::string_view version() const noexcept override { return version_; }
  // The same identity as the plugin loaded in process: a quarantine journaled for one holds the other.
  std::string identity() const override { return identity_; }
  DeviceKind device_kind() const noexcept override { return DeviceKind::cpu; }
  int priority() const noexcept override { return priority_; }
  std::string_view description() const noexcept override { return description_; }

  Support supports(const ProblemSignature& signature) const noexcept override {
    try {
      {
        std::lock_guard lock(verdicts_mu_);
        if (auto it = verdicts_.find(signature); it != verdicts_.end()) return it->second;
      }
      std::lock_guard lock(mu_);
      if (Status s = ensure_host_locked(); !s)
        return Support::no(fmt::format("plugin host unavailable: {}", s.message()));
      wire::SupportsRequest request;
      request.signature = signature;
      wire::Reply reply;
      if (Status s = exchange_locked(&request, sizeof request, &reply, "supports()"); !s) {
        return Support::no(s.message());
      }
      Support verdict = reply.code == 0 ? Support::yes() : Support::no(read_message(reply.message));
      std::lock_guard cache(verdicts_mu_);
      verdicts_.emplace(signature, verdict);
      return verdict;
    } catch (...) {  // std::bad_alloc
      return Support::no("out of memory asking the plugin host");
    }
  }

  Status run(const ValidatedProblem& problem, Workspace /*workspace*/) noexcept override {
    try {
      std::lock_guard lock(mu_);
      return run_locked(problem);
    } catch (const std::exception& e) {  // std::bad_alloc, std::system_error from the mutex
      return Status(ErrorCode::internal, name_, fmt::format("isolated call failed: {}", e.what()));
    }
  }

  std::vector<BackendCounter> counters() const override {
    return {
        {"host_starts", "Plugin host processes started for this isolated plugin.", BackendCounter::Kind::counter,
         static_cast<double>(host_starts_.load(std::memory_order_relaxed))},
        {"hosts_lost", "Plugin hosts that died, hung past the watchdog, hit a guard page or outgrew the memory limit.",
         BackendCounter::Kind::counter, static_cast<double>(hosts_lost_.load(std::memory_order_relaxed))},
        {"host_pid", "Process id of the running plugin host; 0 when none runs.", BackendCounter::Kind::gauge,
         static_cast<double>(host_pid_.load(std::memory_order_relaxed))},
    };
  }

 private:
  // ---- the host process (all under mu_) ----

  Status spawn_locked(wire::Hello* hello_out) const {
    int pair[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair) != 0) {
      return lost_early(fmt::format("socketpair: {}", errno_text(errno)));
    }
    const int arena = memfd_create("kallpa-plugin-arena", MFD_CLOEXEC);
    if (arena < 0) {
      const int err = errno;
      close(pair[0]);
      close(pair[1]);
      return lost_early(fmt::format("memfd_create: {}", errno_text(err)));
    }
    // Above every fd the host is given, so that the dup2 below cannot clobber one with the other.
    const int child_socket = fcntl(pair[1], F_DUPFD_CLOEXEC, 100);
    const int child_arena = fcntl(arena, F_DUPFD_CLOEXEC, 100);
    close(pair[1]);
    std::vector<std::string> args{host_, "--plugin", path_};
    if (options_.guard_pages) args.emplace_back("--guard-pages");
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);

    posix_spawn_file_actions_t actions;
    posix_spawnattr_t attributes;
    posix_spawn_file_actions_init(&actions);
    posix_spawnattr_init(&attributes);
    int rc = child_socket < 0 || child_arena < 0 ? EMFILE : 0;
    if (rc == 0) rc = posix_spawn_file_actions_adddup2(&actions, child_socket, wire::kSocketFd);
    if (rc == 0) rc = posix_spawn_file_actions_adddup2(&actions, child_arena, wire::kArenaFd);
    // The host starts with no signal blocked and every handler at its default, whatever the
    // threads of this process have set.
    sigset_t none, all;
    sigemptyset(&none);
    sigfillset(&all);
    if (rc == 0) rc = posix_spawnattr_setsigmask(&attributes, &none);
    if (rc == 0) rc = posix_spawnattr_setsigdefault(&attributes, &all);
    if (rc == 0) rc = posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
    pid_t pid = -1;
    if (rc == 0) rc = posix_spawn(&pid, host_.c_str(), &actions, &attributes, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    posix_spawnattr_destroy(&attributes);
    if (child_socket >= 0) close(child_socket);
    if (child_arena >= 0) close(child_arena);
    if (rc != 0) {
      close(pair[0]);
      close(arena);
      return lost_early(fmt::format("cannot start the plugin host {}: {}", host_, errno_text(rc)));
    }
    pid_ = pid;
    socket_ = pair[0];
    arena_fd_ = arena;
    host_starts_.fetch_add(1, std::memory_order_relaxed);
    host_pid_.store(pid, std::memory_order_relaxed);

    wire::Hello hello;
    const Clock::time_point deadline = Clock::now() + options_.timeout;
    const ssize_t n = receive_locked(&hello, sizeof hello, deadline);
    if (n != static_cast<ssize_t>(sizeof hello)) {
      std::string how = n < 0 ? fmt::format("did not start within {} ms", options_.timeout.count())
                              : std::string("ended before it reported the plugin");
      return Status(ErrorCode::backend_lost, path_, fmt::format("plugin host {} {}", how, stop_locked(n < 0)));
    }
    if (hello.protocol != wire::kProtocol) {
      return Status(ErrorCode::internal, path_,
                    fmt::format("plugin host {} speaks protocol {}, this library {} (a host from another build?) {}",
                                host_, hello.protocol, wire::kProtocol, stop_locked(true)));
    }
    if (hello.code != 0) {
      const auto code = static_cast<ErrorCode>(hello.code);
      const std::string why = read_message(hello.message);
      stop_locked(false);
      return Status(code, path_, why);
    }
    if (hello_out != nullptr) *hello_out = hello;
    return {};
  }

  Status lost_early(std::string message) const { return Status(ErrorCode::backend_lost, path_, std::move(message)); }

  // Closes the socket (a live host then leaves its loop and exits), waits for the host (killing it
  // at once, or after a grace period) and frees the arena. Returns how the host ended, for messages.
  std::string stop_locked(bool kill_now) const {
    if (pid_ < 0) return {};
    if (kill_now) kill(pid_, SIGKILL);
    close(socket_);
    socket_ = -1;
    int status = 0;
    pid_t done = 0;
    // A host that crashed, or that closes after its socket did, ends by itself within moments.
    const Clock::time_point grace = Clock::now() + std::chrono::seconds(2);
    while ((done = waitpid(pid_, &status, WNOHANG)) == 0 && Clock::now() < grace) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (done == 0) {
      kill(pid_, SIGKILL);
      while ((done = waitpid(pid_, &status, 0)) < 0 && errno == EINTR) {
      }
    }
    std::string how = done == pid_ ? describe_exit(status) : std::string("could not be waited for");
    if (arena_ != nullptr) munmap(arena_, arena_bytes_);
    arena_ = nullptr;
    arena_bytes_ = 0;
    close(arena_fd_);
    arena_fd_ = -1;
    pid_ = -1;
    host_pid_.store(0, std::memory_order_relaxed);
    return how;
  }

  // The call failed for a reason that makes the host untrustworthy: it goes, and the call reports
  // backend_lost (which quarantines the plugin, registry.h).
  Status lose_locked(const std::string& what, bool kill_now) const {
    const pid_t pid = pid_;
    const std::string how = stop_locked(kill_now);
    hosts_lost_.fetch_add(1, std::memory_order_relaxed);
    std::string message = pid < 0 ? what : fmt::format("{}; its plugin host (pid {}) {}", what, pid, how);
    spdlog::error("kallpa: backend '{}' {}", name_, message);
    backoff_ = std::min<std::chrono::milliseconds>(backoff_.count() == 0 ? kFirstBackoff : 2 * backoff_, kMaxBackoff);
    retry_after_ = Clock::now() + backoff_;
    last_loss_ = message;
    return Status(ErrorCode::backend_lost, name_, std::move(message));
  }

  // Starts a host for a call when none runs: not before the backoff since the last loss has passed
  // (so that a plugin that dies at once does not cost a start per call, and a hanging one a watchdog
  // period per call); until then the call fails at once with the last loss's reason.
  Status ensure_host_locked() const {
    if (pid_ >= 0) return {};
    if (backoff_.count() > 0 && Clock::now() < retry_after_) {
      return Status(ErrorCode::backend_lost, name_,
                    fmt::format("the plugin host is down until its restart (backoff {} ms); last lost: {}",
                                backoff_.count(), last_loss_));
    }
    if (Status s = spawn_locked(nullptr); !s) {
      return lose_locked(fmt::format("could not restart the plugin host: {}", s.message()), true);
    }
    return {};
  }

  // Bytes received (one message), 0 at end of stream, -1 when the deadline passed, -2 on an error.
  ssize_t receive_locked(void* buffer, std::size_t capacity, Clock::time_point deadline) const {
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return -1;
      pollfd p{socket_, POLLIN, 0};
      const int ready = poll(&p, 1, static_cast<int>(std::min<long long>(left, 1 << 30)));
      if (ready < 0 && errno == EINTR) continue;
      if (ready < 0) return -2;
      if (ready == 0) return -1;
      const ssize_t n = recv(socket_, buffer, capacity, 0);
      if (n < 0 && errno == EINTR) continue;
      return n < 0 ? -2 : n;
    }
  }

  // One request, one reply, under the watchdog; a lost host is reported as backend_lost.
  Status exchange_locked(const void* request, std::size_t bytes, wire::Reply* reply, std::string_view what) const {
    if (send(socket_, request, bytes, MSG_NOSIGNAL) != static_cast<ssize_t>(bytes)) {
      return lose_locked(fmt::format("could not send {} to the plugin host: {}", what, errno_text(errno)), true);
    }
    union {
      wire::Reply reply;
      wire::GuardFault fault;
    } in{};
    const ssize_t n = receive_locked(&in, sizeof in, Clock::now() + options_.timeout);
    if (n == -1) {
      return lose_locked(fmt::format("did not return from {} within {} ms (watchdog)", what, options_.timeout.count()),
                         true);
    }
    if (n == static_cast<ssize_t>(sizeof(wire::GuardFault)) && in.fault.kind == wire::ReplyKind::guard_fault) {
      const wire::GuardFault f = in.fault;
      const std::string where =
          f.bytes_past > 0
              ? fmt::format("wrote {} byte(s) past the end of {}", f.bytes_past, buffer_name(f.buffer))
              : fmt::format("wrote {} byte(s) before the start of {}", 1 - f.bytes_past, buffer_name(f.buffer));
      return lose_locked(fmt::format("{} in {} (caught by a guard page)", where, what), false);
    }
    if (n != static_cast<ssize_t>(sizeof(wire::Reply)) || in.reply.kind != wire::ReplyKind::result) {
      return lose_locked(fmt::format("died during {}", what), false);
    }
    *reply = in.reply;
    return {};
  }

  // ---- run ----

  // Grows the arena to at least `bytes` (both sides map the whole memfd; the host remaps when the
  // size in a request changes).
  Status reserve_locked(std::int64_t bytes) const {
    bytes = std::max(bytes, wire::page_bytes());
    if (static_cast<std::size_t>(bytes) <= arena_bytes_) return {};
    const auto grown =
        static_cast<std::size_t>(round_up(std::max<std::int64_t>(bytes, 2 * arena_bytes_), wire::page_bytes()));
    if (ftruncate(arena_fd_, static_cast<off_t>(grown)) != 0) {
      return Status(ErrorCode::out_of_memory, name_,
                    fmt::format("cannot size the shared arena to {} bytes: {}", grown, errno_text(errno)));
    }
    void* map = mmap(nullptr, grown, PROT_READ | PROT_WRITE, MAP_SHARED, arena_fd_, 0);
    if (map == MAP_FAILED) {
      return Status(ErrorCode::out_of_memory, name_,
                    fmt::format("cannot map the shared arena of {} bytes: {}", grown, errno_text(errno)));
    }
    if (arena_ != nullptr) munmap(arena_, arena_bytes_);
    arena_ = static_cast<unsigned char*>(map);
    arena_bytes_ = grown;
    return {};
  }

  Status run_locked(const ValidatedProblem& vp) const {
    if (Status s = ensure_host_locked(); !s) return s;
    const AttentionProblem& p = vp.problem();
    wire::RunRequest request;
    request.guard_pages = options_.guard_pages ? 1 : 0;
    request.q_layout = static_cast<std::int32_t>(p.q_layout);
    request.kv_layout = static_cast<std::int32_t>(p.kv_layout);

    // Layout: inputs packed at 64-byte alignment, then o and lse each between guard pages.
    std::int64_t at = 0;
    struct Staged {
      const void* from;
      std::int64_t offset, bytes;
    };
    // q, k, v and at most five index arrays: a fixed list, so a run allocates nothing here.
    std::array<Staged, 8> inputs{};
    std::size_t staged = 0;
    const auto place = [&](const void* from, std::int64_t bytes) {
      const std::int64_t offset = round_up(at, 64);
      at = offset + bytes;
      inputs[staged++] = {from, offset, bytes};
      return offset;
    };
    const auto stage_view = [&](const TensorView& t) {
      return wire::describe(t, place(t.data, view_byte_extent(t).second));
    };
    const auto stage_array = [&](const void* data, std::int64_t count, std::size_t size) -> std::int64_t {
      if (data == nullptr) return -1;
      return place(data, count * static_cast<std::int64_t>(size));
    };
    request.q = stage_view(p.q);
    request.k = stage_view(p.k);
    request.v = stage_view(p.v);
    const std::int64_t batch = vp.batch();
    request.batch = vp.batch();
    request.cu_seqlens_q = stage_array(p.cu_seqlens_q, batch + 1, sizeof(std::int32_t));
    request.cu_seqlens_k = stage_array(p.cu_seqlens_k, batch + 1, sizeof(std::int32_t));
    const std::int64_t table_stride = p.block_table_stride != 0 ? p.block_table_stride : p.max_blocks_per_seq;
    const std::int64_t table_entries = batch > 0 ? (batch - 1) * table_stride + p.max_blocks_per_seq : 0;
    request.block_table = stage_array(p.block_table, table_entries, sizeof(std::int32_t));
    request.block_table_stride = table_stride;
    request.max_blocks_per_seq = p.max_blocks_per_seq;
    request.seqlens_k = stage_array(p.seqlens_k, batch, sizeof(std::int32_t));
    request.alibi_slopes = stage_array(p.alibi_slopes, vp.hq(), sizeof(float));

    const std::int64_t page = wire::page_bytes();
    const auto guarded = [&](const TensorView& t) {
      const std::int64_t bytes = view_byte_extent(t).second;
      wire::Region r;
      r.guard_before = round_up(at, page);
      r.end = round_up(r.guard_before + page + bytes, page);
      r.begin = r.end - bytes;
      at = r.end;  // the page after is the guard; the next region's guard_before starts there
      return r;
    };
    request.o_region = guarded(p.o);
    request.o = wire::describe(p.o, request.o_region.begin);
    if (p.lse.present()) {
      request.lse_region = guarded(p.lse);
      request.lse = wire::describe(p.lse, request.lse_region.begin);
    }
    at += page;  // the last guard
    if (Status s = reserve_locked(at); !s) return s;
    request.arena_bytes = arena_bytes_;
    for (const Staged& s : std::span(inputs.data(), staged)) {
      if (s.bytes > 0) std::memcpy(arena_ + s.offset, s.from, static_cast<std::size_t>(s.bytes));
    }
    // o and lse start as the caller's, so an element the plugin never writes comes back unchanged
    // (what the conformance suite's check for unwritten outputs looks for), never as a stale value
    // of an earlier call.
    TensorView o_arena = p.o, lse_arena = p.lse;
    o_arena.data = arena_ + request.o_region.begin;
    wire::copy_elements(p.o, o_arena);
    if (p.lse.present()) {
      lse_arena.data = arena_ + request.lse_region.begin;
      wire::copy_elements(p.lse, lse_arena);
    }

    request.scale = vp.scale();
    request.softcap = p.softcap;
    request.causal = p.causal ? 1 : 0;
    request.window_left = p.window_left;
    request.window_right = p.window_right;

    wire::Reply reply;
    if (Status s = exchange_locked(&request, sizeof request, &reply, "run()"); !s) return s;
    const std::uint64_t limit = std::uint64_t{options_.memory_limit_mib} << 20;
    if (limit > 0 && reply.anon_rss_bytes > limit) {
      return lose_locked(fmt::format("holds {} MiB of its own memory after run(), past the limit of {} MiB",
                                     reply.anon_rss_bytes >> 20, options_.memory_limit_mib),
                         true);
    }
    backoff_ = std::chrono::milliseconds(0);  // a call came back: the host works again
    if (reply.code != 0) {
      return Status(static_cast<ErrorCode>(reply.code), name_, read_message(reply.message));
    }
    // Packed rows after the last sequence belong to the caller, not to the problem: never written.
    const bool packed = p.q_layout == QLayout::packed;
    TensorView o_to = p.o;
    if (packed) o_arena.shape[0] = o_to.shape[0] = vp.total_q();
    wire::copy_elements(o_arena, o_to);
    if (p.lse.present()) {
      TensorView lse_to = p.lse;
      if (packed) lse_arena.shape[1] = lse_to.shape[1] = vp.total_q();
      wire::copy_elements(lse_arena, lse_to);
    }
    return {};
  }

  std::string path_, host_;
  PluginOptions options_;
  std::string name_, version_, description_, identity_;
  int priority_ = 0;

  mutable std::mutex mu_;  // the host, its socket and the arena
  mutable pid_t pid_ = -1;
  mutable int socket_ = -1;
  mutable int arena_fd_ = -1;
  mutable unsigned char* arena_ = nullptr;
  mutable std::size_t arena_bytes_ = 0;
  mutable std::chrono::milliseconds backoff_{0};  // 0: no loss since the last call that came back
  mutable Clock::time_point retry_after_;
  mutable std::string last_loss_;

  mutable std::mutex verdicts_mu_;
  mutable std::unordered_map<ProblemSignature, Support, SignatureHash> verdicts_;

  mutable std::atomic<std::uint64_t> host_starts_{0}, hosts_lost_{0};
  mutable std::atomic<std::int64_t> host_pid_{0};
};

}  // namespace

Result<std::unique_ptr<AttentionBackend>> start_isolated_plugin(const std::string& path, const PluginOptions& options) {
  std::string host = options.host_path;
  if (host.empty()) {
    Result<std::string> found = find_plugin_host();
    if (!found) return Status(found.status().code(), path, found.status().message());
    host = std::move(*found);
  } else if (access(host.c_str(), X_OK) != 0) {
    return Status(ErrorCode::not_found, path, fmt::format("the plugin host {} is not an executable file", host));
  }
  if (options.timeout.count() <= 0) {
    return Status(ErrorCode::invalid_argument, path, "the plugin timeout must be positive");
  }
  auto backend = std::make_unique<IsolatedPluginBackend>(path, std::move(host), options);
  if (Status s = backend->start(); !s) return s;
  return std::unique_ptr<AttentionBackend>(std::move(backend));
}

}  // namespace kallpa::detail
