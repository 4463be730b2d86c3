#include "kallpa/ops/memory_region.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

namespace kallpa::ops {

namespace {

struct Mapping {
  std::uintptr_t begin = 0, end = 0;
  bool file = false;          // backed by a file (its pages may be in the page cache, not ours)
  std::size_t rss_bytes = 0;  // this process's resident pages of it
};

std::vector<Mapping> mappings() {
  std::vector<Mapping> out;
  std::ifstream in("/proc/self/smaps");
  std::string line;
  while (std::getline(in, line)) {
    unsigned long long begin = 0, end = 0, inode = 0;
    char perms[8] = {}, dev[16] = {};
    unsigned long long offset = 0;
    if (std::sscanf(line.c_str(), "%llx-%llx %7s %llx %15s %llu", &begin, &end, perms, &offset, dev, &inode) == 6) {
      out.push_back({static_cast<std::uintptr_t>(begin), static_cast<std::uintptr_t>(end), inode != 0, 0});
    } else if (!out.empty() && line.rfind("Rss:", 0) == 0) {
      out.back().rss_bytes = std::stoull(line.substr(4)) * 1024;
    }
  }
  return out;
}

// Resident pages of [begin, end) (page-aligned) by mincore: exact for anonymous memory.
std::size_t mincore_bytes(std::uintptr_t begin, std::uintptr_t end, std::uintptr_t page) {
  std::vector<unsigned char> in_core((end - begin) / page);
  if (in_core.empty() || mincore(reinterpret_cast<void*>(begin), end - begin, in_core.data()) != 0) return 0;
  std::size_t pages = 0;
  for (const unsigned char c : in_core) pages += c & 1u;
  return pages * page;
}

}  // namespace

std::size_t resident_bytes(std::span<const MemoryRegion> regions) noexcept {
  try {
    const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
    std::vector<std::pair<std::uintptr_t, std::uintptr_t>> ranges;  // whole pages
    for (const MemoryRegion& r : regions) {
      if (r.data == nullptr || r.bytes == 0) continue;
      const auto at = reinterpret_cast<std::uintptr_t>(r.data);
      ranges.emplace_back(at / page * page, (at + r.bytes + page - 1) / page * page);
    }
    std::sort(ranges.begin(), ranges.end());
    std::vector<std::pair<std::uintptr_t, std::uintptr_t>> merged;
    for (const auto& r : ranges) {
      if (!merged.empty() && r.first <= merged.back().second) {
        merged.back().second = std::max(merged.back().second, r.second);
      } else {
        merged.push_back(r);
      }
    }
    const std::vector<Mapping> maps = mappings();
    std::size_t total = 0;
    for (const auto& [begin, end] : merged) {
      for (const Mapping& m : maps) {
        const std::uintptr_t lo = std::max(begin, m.begin), hi = std::min(end, m.end);
        if (lo >= hi) continue;
        // mincore tells whether a file's page is in the page cache, not whether this process maps
        // it: a file mapping counts its own Rss, when the range covers it whole.
        if (m.file && lo == m.begin && hi == m.end) {
          total += m.rss_bytes;
        } else {
          total += mincore_bytes(lo, hi, page);
        }
      }
    }
    return total;
  } catch (...) {
    return 0;
  }
}

}  // namespace kallpa::ops
