// Where a part of the engine keeps its bytes, for accounting (`kallpa bench model --memory`): each
// part names its host memory, and resident_bytes() says how much of it the process holds now.
#pragma once

#include <cstddef>
#include <span>
#include <string>

namespace kallpa::ops {

struct MemoryRegion {
  std::string part;  // "weights (repacked)", "KV cache", ...
  const void* data = nullptr;
  std::size_t bytes = 0;
  bool file = false;  // a file's mapping (the rest of a process's file-backed memory is its code)
};

// Bytes of the regions in resident pages of this process (whole pages, each counted once even
// where regions share it): anonymous memory page by page; a file mapping by its own resident count
// where the regions cover it whole (otherwise by the page cache's, which may be more). 0 where the
// kernel cannot tell.
std::size_t resident_bytes(std::span<const MemoryRegion> regions) noexcept;

}  // namespace kallpa::ops
