// OpenCL device memory behind kallpa's DeviceMemory (device.h). Every allocation is a cl_mem with
// a unique fake base address (the scheme ggml uses): addresses start at kBase, in the non-canonical
// part of the x86-64/AArch64 address space, so a host dereference faults at once instead of
// reading something; pointer arithmetic on them works as on host memory. resolve() maps an address
// (base + offset) back to the buffer and byte offset for a kernel argument.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>

#include "backends/opencl/cl_runtime.h"
#include "kallpa/device.h"

namespace kallpa::opencl {

class OpenClMemory final : public DeviceMemory {
 public:
  static constexpr std::uintptr_t kBase = std::uintptr_t{0x4000} << 48;

  explicit OpenClMemory(Runtime& runtime) : runtime_(runtime) {}
  ~OpenClMemory() override;

  Device device() const noexcept override { return Device{DeviceKind::opencl, runtime_.index()}; }
  Result<void*> allocate(std::size_t bytes) noexcept override;
  void free(void* device_ptr) noexcept override;
  Status upload(void* device_dst, const void* host_src, std::size_t bytes) noexcept override;
  Status download(void* host_dst, const void* device_src, std::size_t bytes) noexcept override;
  Status synchronize() noexcept override;

  struct Resolved {
    cl_mem buffer = nullptr;
    std::size_t offset = 0;  // bytes from the buffer's start
  };
  // The buffer holding [address + low, address + high) (byte offsets, low <= 0 <= high allowed
  // either way), or invalid_argument naming `what` when that range is not inside one allocation.
  Result<Resolved> resolve(const void* address, std::int64_t low, std::int64_t high, const char* what) const;

 private:
  struct Allocation {
    cl_mem buffer = nullptr;
    std::size_t bytes = 0;
  };
  Runtime& runtime_;
  mutable std::mutex mu_;
  std::map<std::uintptr_t, Allocation> live_;  // by fake base address
  std::uintptr_t next_ = kBase;
};

// The one OpenClMemory of this process (on Runtime::get()'s device), shared by opencl-flash and
// the engine's OpenCL ops so that addresses either hands out are valid for the other; nullptr when
// there is no OpenCL device. Never destroyed: buffers must not be released from static
// destructors, after the OpenCL driver may have torn itself down.
OpenClMemory* shared_memory() noexcept;

}  // namespace kallpa::opencl
