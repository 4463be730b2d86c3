// The device's copies of paged K/V pools (docs/pjrt.md, "The KV cache on the device"). A problem
// whose cache states page versions (AttentionProblem::page_versions, kv_pool_id) finds its pool
// mirrored on the device; before the attention program runs, only the blocks it reads whose
// version moved since they were last uploaded cross from the host, written into the mirror by the
// page update program. In decode that is one page per sequence and layer, not the whole context.
#pragma once

#include <atomic>
#include <compare>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backends/pjrt/attention_program.h"
#include "backends/pjrt/pjrt_runtime.h"
#include "kallpa/attention.h"
#include "kallpa/status.h"

namespace kallpa::pjrt {

// Pages per update program: a step that changed more runs the program several times, so that the
// programs compiled stay few (one per power of two up to this).
inline constexpr std::int64_t kMaxPagesPerUpdate = 64;

struct MirrorStats {
  std::uint64_t pages_uploaded = 0;  // pages written into mirrors (padding repeats not counted)
  std::uint64_t updates = 0;         // page update programs run
  std::uint64_t created = 0;         // mirrors started (zeros made on the device)
  std::uint64_t evictions = 0;       // mirrors dropped to stay under the capacity
  std::uint64_t mirrors = 0;         // held now
  std::uint64_t bytes = 0;           // device bytes the mirrors held now hold
};

class KvMirrors {
 public:
  // The backend's executable cache: the executable under `key`, compiling `program()` on a miss.
  using ProgramCache = std::function<Result<std::shared_ptr<const Executable>>(
      const std::string& key, const std::function<std::string()>& program)>;
  // What runs with the mirror held: the device buffers of the pool's K and V.
  using Use = std::function<Status(PJRT_Buffer* k, PJRT_Buffer* v)>;

  // `capacity_bytes`: the most device memory the mirrors hold together; the least recently used
  // goes first.
  explicit KvMirrors(std::uint64_t capacity_bytes) noexcept : capacity_(capacity_bytes) {}
  // Before the first run (the backend reads its environment on first use).
  void set_capacity(std::uint64_t bytes) noexcept { capacity_.store(bytes, std::memory_order_relaxed); }

  // Whether the problem can run over a mirror: paged, with page versions, and a pool that fits in
  // the capacity by itself.
  bool applies(const ValidatedProblem& vp) const noexcept;

  // Brings the mirror of the problem's pool up to date for every block the problem reads, then
  // calls `use` with it, holding it so that no other run updates it meanwhile. `bytes_up` grows by
  // the bytes copied from the host. On an error the mirror is dropped (the next run starts anew).
  Status run_with(const Client& client, const ValidatedProblem& vp, const ProgramCache& programs,
                  std::uint64_t& bytes_up, const Use& use);

  MirrorStats stats() const;

 private:
  // A pool is its id and the K and V storage the views point at: the contract's promise holds for
  // that triple only.
  struct Key {
    std::uint64_t pool = 0;
    const void* k = nullptr;
    const void* v = nullptr;
    auto operator<=>(const Key&) const = default;
  };
  struct Mirror {
    std::mutex mu;  // held by an update and the run that reads it
    Buffer k, v;
    std::vector<std::uint64_t> versions;  // per block: the version on the device (0: none)
    bool ready = false;                   // k and v hold the pool's shape (zeros where never written)
    std::uint64_t bytes = 0;
    std::uint64_t last_used = 0;  // under KvMirrors::mu_
  };

  std::shared_ptr<Mirror> acquire(const Key& key, std::uint64_t bytes);
  void drop(const Key& key, const std::shared_ptr<Mirror>& mirror);
  Status start(const Client& client, const PageUpdateSpec& spec, const ProgramCache& programs, Mirror& m);
  Status write_pages(const Client& client, const ValidatedProblem& vp, const PageUpdateSpec& spec,
                     const std::vector<std::int32_t>& blocks, const ProgramCache& programs, std::uint64_t& bytes_up,
                     Mirror& m);

  std::atomic<std::uint64_t> capacity_;
  mutable std::mutex mu_;
  std::map<Key, std::shared_ptr<Mirror>> mirrors_;  // under mu_
  std::uint64_t resident_ = 0;                      // under mu_
  std::uint64_t clock_ = 0;                         // under mu_
  MirrorStats stats_;                               // under mu_ (mirrors and bytes derived)
};

}  // namespace kallpa::pjrt
