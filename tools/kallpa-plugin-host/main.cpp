// kallpa-plugin-host: runs one untrusted attention plugin on behalf of the process that started it
// (src/core/isolated_backend.cpp), so that whatever the plugin does to this process (a crash, an
// abort, a hang, a stray write, a leak) costs this process only.
//
// Started with the control socket as fd 3 and the shared tensor arena as fd 4 (plugin_wire.h). It
// loads the plugin, says hello with its table, then answers supports() and run() requests until
// the socket closes. Its plugin's workspace always ends at a PROT_NONE page; with --guard-pages,
// o and lse in the arena are fenced the same way for each call. A write that hits one of those
// pages is reported to the parent (which buffer, how far past it) before the host dies of it.
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <string>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "core/plugin_backend.h"
#include "core/plugin_wire.h"
#include "kallpa/attention.h"

// Under ASan (the sanitizer CI build) the host must die of a plugin's SIGSEGV by the signal, and
// report guard-page hits through its own handler, not ASan's; a plugin that leaks on purpose (the
// memory limit's test) must not fail the host at exit; and freed memory held in ASan's quarantine
// must not count much against the host's memory limit. Unused in other builds.
extern "C" __attribute__((visibility("default"), used)) const char* __asan_default_options() {
  return "detect_leaks=0:handle_segv=0:handle_sigbus=0:handle_abort=0:quarantine_size_mb=16";
}

namespace kallpa::plugin_host {
namespace {

namespace wire = detail::wire;

// ---- guard pages: what the SIGSEGV handler reads (lock-free atomics are async-signal-safe) ----

struct Guard {
  std::atomic<std::uintptr_t> begin{0}, end{0};  // the guarded buffer's bytes
  std::atomic<std::uintptr_t> before{0};         // its leading guard page (its trailing one is at end)
};
Guard g_guards[3];  // indexed by wire::Buffer

void report_guard_hit(std::uintptr_t address) {
  const std::uintptr_t page = static_cast<std::uintptr_t>(wire::page_bytes());
  for (int b = 0; b < 3; ++b) {
    const Guard& g = g_guards[b];
    const std::uintptr_t begin = g.begin.load(), end = g.end.load(), before = g.before.load();
    if (end == 0) continue;
    wire::GuardFault fault;
    fault.buffer = static_cast<wire::Buffer>(b);
    if (address >= end && address < end + page) {
      fault.bytes_past = static_cast<std::int64_t>(address - end) + 1;
    } else if (address >= before && address < before + page) {
      fault.bytes_past = -static_cast<std::int64_t>(begin - address) + 1;
    } else {
      continue;
    }
    send(wire::kSocketFd, &fault, sizeof fault, MSG_NOSIGNAL);
    return;
  }
}

void on_segv(int sig, siginfo_t* info, void*) {
  report_guard_hit(reinterpret_cast<std::uintptr_t>(info->si_addr));
  // Die of the signal itself: the faulting write runs again with the default action.
  signal(sig, SIG_DFL);
}

void install_guard_handler() {
  static char alt_stack[64 * 1024];
  stack_t ss{};
  ss.ss_sp = alt_stack;
  ss.ss_size = sizeof alt_stack;
  sigaltstack(&ss, nullptr);
  struct sigaction action {};
  action.sa_sigaction = on_segv;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  sigaction(SIGSEGV, &action, nullptr);
}

// ---- memory ----

// The arena as this process maps it.
struct Arena {
  unsigned char* base = nullptr;
  std::size_t bytes = 0;

  bool map(std::size_t size) {
    if (size == bytes) return true;
    if (base != nullptr) munmap(base, bytes);
    void* m = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, wire::kArenaFd, 0);
    base = m == MAP_FAILED ? nullptr : static_cast<unsigned char*>(m);
    bytes = base != nullptr ? size : 0;
    return base != nullptr;
  }
};

// The plugin's scratch memory: private pages between two guard pages, its end flush with the
// trailing one. Kept at the largest size asked for.
struct GuardedWorkspace {
  unsigned char* base = nullptr;
  std::size_t capacity = 0;  // usable bytes between the guards

  void* get(std::size_t bytes) {
    const std::size_t page = static_cast<std::size_t>(wire::page_bytes());
    const std::size_t want = (bytes + 63) / 64 * 64;
    if (want > capacity || base == nullptr) {
      if (base != nullptr) munmap(base, capacity + 2 * page);
      const std::size_t usable = std::max<std::size_t>((want + page - 1) / page * page, page);
      void* m = mmap(nullptr, usable + 2 * page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (m == MAP_FAILED) {
        base = nullptr;
        capacity = 0;
        return nullptr;
      }
      base = static_cast<unsigned char*>(m);
      capacity = usable;
      mprotect(base + page, usable, PROT_READ | PROT_WRITE);
    }
    unsigned char* end = base + page + capacity;
    Guard& g = g_guards[static_cast<int>(wire::Buffer::workspace)];
    g.before.store(reinterpret_cast<std::uintptr_t>(base));
    g.begin.store(reinterpret_cast<std::uintptr_t>(end - want));
    g.end.store(reinterpret_cast<std::uintptr_t>(end));
    return end - want;
  }
};

// Anonymous resident memory (statm's resident minus shared): the host's own heap and stacks, not
// the arena the parent owns.
std::uint64_t anon_rss_bytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  unsigned long long size = 0, resident = 0, shared = 0;
  const int got = std::fscanf(f, "%llu %llu %llu", &size, &resident, &shared);
  std::fclose(f);
  if (got != 3 || shared > resident) return 0;
  return (resident - shared) * static_cast<std::uint64_t>(wire::page_bytes());
}

template <std::size_t N>
void copy_text(char (&to)[N], std::string_view text) {
  const std::size_t n = std::min(text.size(), N - 1);
  std::memcpy(to, text.data(), n);
  to[n] = '\0';
}

// ---- serving ----

class Host {
 public:
  Host(AttentionBackend& backend, bool guard_pages) : backend_(backend), guard_pages_(guard_pages) {}

  // Answers requests until the socket closes.
  void serve() {
    alignas(wire::RunRequest) unsigned char buffer[std::max(sizeof(wire::RunRequest), sizeof(wire::SupportsRequest))];
    for (;;) {
      const ssize_t n = recv(wire::kSocketFd, buffer, sizeof buffer, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return;
      wire::Op op;
      std::memcpy(&op, buffer, sizeof op);
      wire::Reply reply;
      if (op == wire::Op::supports && n == static_cast<ssize_t>(sizeof(wire::SupportsRequest))) {
        wire::SupportsRequest request;
        std::memcpy(&request, buffer, sizeof request);
        const Support verdict = backend_.supports(request.signature);
        reply.code = static_cast<std::int32_t>(verdict.ok ? ErrorCode::ok : ErrorCode::unsupported);
        copy_text(reply.message, verdict.why_not);
      } else if (op == wire::Op::run && n == static_cast<ssize_t>(sizeof(wire::RunRequest))) {
        wire::RunRequest request;
        std::memcpy(&request, buffer, sizeof request);
        const Status status = run(request);
        reply.code = static_cast<std::int32_t>(status.code());
        copy_text(reply.message, status.message());
      } else {
        reply.code = static_cast<std::int32_t>(ErrorCode::internal);
        copy_text(reply.message, "malformed request to the plugin host");
      }
      reply.anon_rss_bytes = anon_rss_bytes();
      if (send(wire::kSocketFd, &reply, sizeof reply, MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof reply)) return;
    }
  }

 private:
  TensorView view(const wire::Tensor& t) const { return wire::view_in_arena(t, arena_.base); }

  template <typename T>
  const T* array(std::int64_t offset) const {
    return offset < 0 ? nullptr : reinterpret_cast<const T*>(arena_.base + offset);
  }

  // Fences (or releases) the guard pages of o and lse in this process's view of the arena.
  void fence(const wire::RunRequest& r, bool on) {
    const int prot = on ? PROT_NONE : PROT_READ | PROT_WRITE;
    const auto page = static_cast<std::size_t>(wire::page_bytes());
    const wire::Region* regions[2] = {&r.o_region, r.lse.offset >= 0 ? &r.lse_region : nullptr};
    for (int b = 0; b < 2; ++b) {
      Guard& g = g_guards[b];
      if (regions[b] == nullptr || !on) {
        g.end.store(0);
      } else {
        g.before.store(reinterpret_cast<std::uintptr_t>(arena_.base + regions[b]->guard_before));
        g.begin.store(reinterpret_cast<std::uintptr_t>(arena_.base + regions[b]->begin));
        g.end.store(reinterpret_cast<std::uintptr_t>(arena_.base + regions[b]->end));
      }
      if (regions[b] == nullptr) continue;
      mprotect(arena_.base + regions[b]->guard_before, page, prot);
      mprotect(arena_.base + regions[b]->end, page, prot);
    }
  }

  Status run(const wire::RunRequest& r) {
    if (!arena_.map(r.arena_bytes)) {
      return Status(ErrorCode::out_of_memory, "plugin host", "cannot map the shared arena");
    }
    AttentionProblem p;
    p.q_layout = static_cast<QLayout>(r.q_layout);
    p.kv_layout = static_cast<KvLayout>(r.kv_layout);
    p.q = view(r.q);
    p.k = view(r.k);
    p.v = view(r.v);
    p.o = view(r.o);
    p.lse = view(r.lse);
    p.batch = r.batch;
    p.cu_seqlens_q = array<std::int32_t>(r.cu_seqlens_q);
    p.cu_seqlens_k = array<std::int32_t>(r.cu_seqlens_k);
    p.block_table = array<std::int32_t>(r.block_table);
    p.block_table_stride = r.block_table_stride;
    p.max_blocks_per_seq = r.max_blocks_per_seq;
    p.seqlens_k = array<std::int32_t>(r.seqlens_k);
    p.alibi_slopes = array<float>(r.alibi_slopes);
    p.scale = r.scale;
    p.softcap = r.softcap;
    p.causal = r.causal != 0;
    p.window_left = r.window_left;
    p.window_right = r.window_right;
    // The parent validated the caller's problem; this one is its copy in the arena, validated
    // again because the plugin must only ever see validated problems.
    Result<ValidatedProblem> vp = validate(p);
    if (!vp) return Status(ErrorCode::internal, vp.status().field(), "the staged problem: " + vp.status().message());
    const std::size_t bytes = backend_.workspace_size(*vp);
    void* workspace = workspace_.get(bytes);
    if (workspace == nullptr) {
      return Status(ErrorCode::out_of_memory, "workspace", fmt::format("cannot map {} bytes", bytes));
    }
    if (guard_pages_) fence(r, true);
    Status status = backend_.run(*vp, Workspace{workspace, bytes});
    if (guard_pages_) fence(r, false);
    return status;
  }

  AttentionBackend& backend_;
  bool guard_pages_;
  Arena arena_;
  GuardedWorkspace workspace_;
};

int host_main(int argc, char** argv) {
  CLI::App app{"Runs one kallpa attention plugin for the process that started it (fd 3: socket, fd 4: arena)."};
  std::string plugin;
  bool guard_pages = false;
  app.add_option("--plugin", plugin, "The plugin library")->required();
  app.add_flag("--guard-pages", guard_pages, "Fence o and lse with PROT_NONE pages during each run");
  CLI11_PARSE(app, argc, argv);

  // Nothing but the socket and the arena from the parent; and no life after it.
  close_range(wire::kArenaFd + 1, ~0U, 0);
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  install_guard_handler();

  wire::Hello hello;
  auto opened = detail::open_plugin(plugin);
  if (opened && (*opened)->device_kind() != DeviceKind::cpu) {
    opened = Status(ErrorCode::unsupported, plugin,
                    fmt::format("works on {} memory; an isolated plugin gets host memory only (trust it to run "
                                "it in process: --trusted-plugin)",
                                device_kind_name((*opened)->device_kind())));
  }
  if (!opened) {
    hello.code = static_cast<std::int32_t>(opened.status().code());
    copy_text(hello.message, opened.status().message());
    send(wire::kSocketFd, &hello, sizeof hello, MSG_NOSIGNAL);
    return 0;
  }
  AttentionBackend& backend = **opened;
  copy_text(hello.name, backend.name());
  copy_text(hello.version, backend.version());
  copy_text(hello.description, backend.description());
  hello.priority = backend.priority();
  if (send(wire::kSocketFd, &hello, sizeof hello, MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof hello)) return 1;
  Host(backend, guard_pages).serve();
  return 0;
}

}  // namespace
}  // namespace kallpa::plugin_host

int main(int argc, char** argv) { return kallpa::plugin_host::host_main(argc, argv); }
