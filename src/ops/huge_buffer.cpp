#include "ops/huge_buffer.h"

#include <cstdint>
#include <utility>

#include <sys/mman.h>

#include <fmt/format.h>

namespace kallpa::ops {

namespace {
constexpr std::size_t kHugePage = std::size_t{2} << 20;
}

Result<HugeBuffer> HugeBuffer::allocate(std::size_t bytes, const char* what) {
  HugeBuffer b;
  if (bytes == 0) return b;
  const std::size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  b.mapped_ = rounded + kHugePage;  // room to align the start
  void* p = mmap(nullptr, b.mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    b.mapped_ = 0;
    return Status(ErrorCode::out_of_memory, what,
                  fmt::format("cannot map {:.1f} MiB", double(bytes) / double(1 << 20)));
  }
  b.mapping_ = p;
  const auto at = (reinterpret_cast<std::uintptr_t>(p) + kHugePage - 1) / kHugePage * kHugePage;
  b.data_ = reinterpret_cast<std::byte*>(at);
  b.size_ = bytes;
  // Advisory: without transparent huge pages the buffer works the same, with more TLB misses.
  (void)madvise(b.data_, rounded, MADV_HUGEPAGE);
  return b;
}

HugeBuffer::~HugeBuffer() {
  if (mapping_ != nullptr) munmap(mapping_, mapped_);
}

HugeBuffer::HugeBuffer(HugeBuffer&& other) noexcept
    : mapping_(std::exchange(other.mapping_, nullptr)),
      mapped_(std::exchange(other.mapped_, 0)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

HugeBuffer& HugeBuffer::operator=(HugeBuffer&& other) noexcept {
  if (this != &other) {
    if (mapping_ != nullptr) munmap(mapping_, mapped_);
    mapping_ = std::exchange(other.mapping_, nullptr);
    mapped_ = std::exchange(other.mapped_, 0);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

}  // namespace kallpa::ops
