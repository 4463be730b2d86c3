// The CUDA device cuda-flash and cudnn run on: found once per process (lazily), its facts, its
// memory behind kallpa's DeviceMemory (device.h: the addresses are device pointers), and a pool of
// streams with scratch memory for runs.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "backends/cuda/flash_plan.h"
#include "kallpa/device.h"

namespace kallpa::cuda {

// backend_failure naming the call and the CUDA error ("cudaErrorInvalidValue: invalid argument").
Status cuda_failure(std::string_view call, cudaError_t err, std::string_view context = {});

class CudaMemory;

class CudaDevice {
 public:
  // The device chosen by KALLPA_CUDA_DEVICE (default 0), or nullptr when there is none (no driver,
  // no device, compute capability below 8.0); unavailable_reason() then says why.
  static CudaDevice* get() noexcept;
  static const std::string& unavailable_reason() noexcept;

  const DeviceFacts& facts() const noexcept { return facts_; }
  int index() const noexcept { return facts_.index; }
  Device device() const noexcept { return Device{DeviceKind::cuda, facts_.index}; }
  // Makes this device current on the calling thread (CUDA's current device is per thread).
  Status make_current() const noexcept;
  CudaMemory& memory() noexcept { return *memory_; }

  // A stream and device scratch memory for one run, returned to the pool by the destructor.
  class Lease {
   public:
    Lease(Lease&& other) noexcept : device_(other.device_), slot_(other.slot_) { other.slot_ = nullptr; }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    Lease& operator=(Lease&&) = delete;
    ~Lease();
    cudaStream_t stream() const noexcept;
    // Device scratch of at least `bytes` (contents undefined), valid until the lease ends.
    Result<void*> scratch(std::size_t bytes) noexcept;

   private:
    friend class CudaDevice;
    struct Slot;
    Lease(CudaDevice* device, Slot* slot) : device_(device), slot_(slot) {}
    CudaDevice* device_;
    Slot* slot_;
  };
  Result<Lease> lease() noexcept;

 private:
  CudaDevice() = default;
  static CudaDevice* create(std::string* why) noexcept;

  DeviceFacts facts_;
  CudaMemory* memory_ = nullptr;
  std::mutex pool_mu_;
  std::vector<Lease::Slot*> free_slots_;  // never destroyed: no CUDA calls from static destructors
};

class CudaMemory final : public DeviceMemory {
 public:
  explicit CudaMemory(const CudaDevice& device) : device_(device) {}

  Device device() const noexcept override { return device_.device(); }
  Result<void*> allocate(std::size_t bytes) noexcept override;
  void free(void* device_ptr) noexcept override;
  Status upload(void* device_dst, const void* host_src, std::size_t bytes) noexcept override;
  Status download(void* host_dst, const void* device_src, std::size_t bytes) noexcept override;
  Status synchronize() noexcept override;

  // invalid_argument naming `what` unless [address + low, address + high) (bytes) lies inside one
  // live allocation of this memory.
  Status check(const void* address, std::int64_t low, std::int64_t high, const char* what) const;

 private:
  const CudaDevice& device_;
  mutable std::mutex mu_;
  std::map<std::uintptr_t, std::size_t> live_;  // base address -> bytes requested
};

}  // namespace kallpa::cuda
