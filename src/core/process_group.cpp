// The process group slot (kallpa/process_group.h). An atomic pointer: a transport installs its group
// while the library loads, and any thread may read it afterwards.
#include "kallpa/process_group.h"

#include <atomic>

namespace kallpa {
namespace {
std::atomic<ProcessGroup*> g_group{nullptr};
}  // namespace

ProcessGroup* process_group() noexcept { return g_group.load(std::memory_order_acquire); }
void set_process_group(ProcessGroup* group) noexcept { g_group.store(group, std::memory_order_release); }

}  // namespace kallpa
