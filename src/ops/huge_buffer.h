// Zero-filled anonymous memory, 2 MiB-aligned and advised for transparent huge pages: for big
// buffers that kernels stream through (repacked weights, the KV cache), where 4 KiB pages cost a
// TLB miss every few cache lines. Pages are committed on first touch, so a large buffer that is
// only partly used (a KV cache sized for the worst case) costs only what is used.
#pragma once

#include <cstddef>

#include "kallpa/status.h"

namespace kallpa::ops {

class HugeBuffer {
 public:
  HugeBuffer() = default;
  ~HugeBuffer();
  HugeBuffer(HugeBuffer&& other) noexcept;
  HugeBuffer& operator=(HugeBuffer&& other) noexcept;
  HugeBuffer(const HugeBuffer&) = delete;
  HugeBuffer& operator=(const HugeBuffer&) = delete;

  // out_of_memory (field `what`) when the mapping fails. bytes == 0 gives an empty buffer.
  static Result<HugeBuffer> allocate(std::size_t bytes, const char* what);

  std::byte* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }

 private:
  void* mapping_ = nullptr;
  std::size_t mapped_ = 0;
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace kallpa::ops
