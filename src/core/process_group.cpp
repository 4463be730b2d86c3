// The process group slot (kallpa/process_group.h). An atomic pointer: a transport installs its group
// while the library loads, and any thread may read it afterwards. The transports offered sit in a
// list under a mutex, built on first use, because transports add themselves from other files'
// static initialisers, whose order against this file's is not defined.
#include "kallpa/process_group.h"

#include <atomic>
#include <mutex>
#include <new>
#include <utility>

#include <fmt/format.h>

namespace kallpa {
namespace {

std::atomic<ProcessGroup*> g_group{nullptr};

struct Transports {
  std::mutex mu;
  std::vector<std::pair<std::string, ProcessGroupOpener>> list;  // under mu
};

Transports& transports() {
  static Transports t;
  return t;
}

}  // namespace

ProcessGroup* process_group() noexcept { return g_group.load(std::memory_order_acquire); }
void set_process_group(ProcessGroup* group) noexcept { g_group.store(group, std::memory_order_release); }

void add_process_group_transport(std::string_view name, ProcessGroupOpener open) {
  Transports& t = transports();
  std::lock_guard lock(t.mu);
  for (auto& [known, opener] : t.list) {
    if (known == name) {
      opener = open;
      return;
    }
  }
  t.list.emplace_back(std::string(name), open);
}

std::vector<std::string> process_group_transports() {
  Transports& t = transports();
  std::lock_guard lock(t.mu);
  std::vector<std::string> names;
  for (const auto& entry : t.list) names.push_back(entry.first);
  return names;
}

Status use_process_group_transport(std::string_view name) noexcept {
  try {
    ProcessGroupOpener open = nullptr;
    std::vector<std::string> names;
    {
      Transports& t = transports();
      std::lock_guard lock(t.mu);
      for (const auto& [known, opener] : t.list) {
        if (known == name) open = opener;
        names.push_back(known);
      }
    }
    if (open == nullptr) {
      return Status(ErrorCode::not_found, "transport",
                    names.empty()
                        ? fmt::format("no transport '{}': this build has none (the ring backend, which "
                                      "carries them, needs MPI at build time; docs/scale-out.md)",
                                      name)
                        : fmt::format("no transport '{}' (this build has: {})", name, fmt::join(names, ", ")));
    }
    Result<ProcessGroup*> group = open();
    if (!group) return group.status();
    set_process_group(*group);
    return Status::ok();
  } catch (const std::bad_alloc&) {
    return Status(ErrorCode::out_of_memory, "transport", "out of memory");
  }
}

}  // namespace kallpa
