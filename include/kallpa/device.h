// Device memory, version 1: how tensors get onto a device other than the host, and back.
//
// A backend whose device is not the CPU exposes its device's memory through
// AttentionBackend::device_memory(). Whoever builds a problem for that backend (the conformance
// suite, the health check, `kallpa bench`, an engine) allocates there, uploads, runs, downloads.
//
// The address rule. DeviceMemory::allocate returns a `void*` that is an *address on the device*,
// not a host pointer: it must never be dereferenced on the host, but pointer arithmetic on it is
// valid within the allocation (plus one past its end), exactly as for host memory. That keeps
// TensorView::data one pointer for every device: a view at (base + offset) with any strides is
// formed the same way on the host and on a device, and a backend resolves it back to its native
// handle. What the address is depends on the device:
//   * OpenCL (opencl-flash): a unique fake base per allocation in a reserved, non-canonical range
//     (a host dereference faults at once), mapped back to (cl_mem, byte offset) through the
//     device's allocation table, as ggml does. Ranges are never reused while the process lives.
//   * CUDA/HIP: the device pointer itself.
// upload/download/free accept any address inside a live allocation of the same DeviceMemory; a
// range that crosses the end of its allocation, or an address it did not hand out, is an
// invalid_argument error (never a crash).
//
// Index arrays stay on the host. cu_seqlens_q/k, block_table, seqlens_k and alibi_slopes are host
// memory for every device (attention.h, "Index arrays ... live in host memory in v1"): a backend
// plans its launch from them on the host and copies what its kernel needs itself.
//
// Ordering: calls on one DeviceMemory are ordered among themselves and with the runs of the
// backend that exposes it; upload and download return when the copy is complete, and a backend's
// run() returns when its outputs are written (so download after run needs no extra synchronize).
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

#include "kallpa/attention.h"
#include "kallpa/status.h"
#include "kallpa/tensor.h"

namespace kallpa {

inline constexpr int kDeviceMemoryVersion = 1;

class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;

  // kDeviceMemoryVersion of the header the implementation was built against.
  virtual int version() const noexcept { return kDeviceMemoryVersion; }
  // The device tensors allocated here live on (TensorView::device of views into them).
  virtual Device device() const noexcept = 0;

  // At least 256-byte aligned; `bytes` may be 0 (a unique address that holds nothing).
  virtual Result<void*> allocate(std::size_t bytes) noexcept = 0;
  // nullptr is ignored. Only the base address allocate() returned is accepted.
  virtual void free(void* device_ptr) noexcept = 0;
  virtual Status upload(void* device_dst, const void* host_src, std::size_t bytes) noexcept = 0;
  virtual Status download(void* host_dst, const void* device_src, std::size_t bytes) noexcept = 0;
  // Waits for everything queued on the device; reports an asynchronous failure, if any.
  virtual Status synchronize() noexcept = 0;
};

// Byte range [low, high) a view's elements cover, relative to its data pointer (low < 0 with
// negative strides); {0, 0} for an empty view. What an allocation must hold around the pointer.
std::pair<std::int64_t, std::int64_t> view_byte_extent(const TensorView& t) noexcept;

// One allocation, freed on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  static Result<DeviceBuffer> allocate(DeviceMemory& memory, std::size_t bytes) noexcept;
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { reset(); }

  void* data() const noexcept { return data_; }
  std::size_t bytes() const noexcept { return bytes_; }
  void reset() noexcept;

 private:
  DeviceMemory* memory_ = nullptr;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// A host problem's tensors (q, k, v, o, lse) mirrored on a device: each view's memory, from its
// lowest to its highest element plus `margin_bytes` on either side, is copied into its own device
// allocation, and problem() is the same problem over the device copies (index arrays and ALiBi
// slopes still point at the host's). The margins let a caller that keeps guard bytes around its
// views (the conformance suite) see a device kernel's stray writes after download_outputs().
class StagedProblem {
 public:
  // Uploads q, k, v and the current contents of o and lse (margins included).
  static Result<StagedProblem> stage(DeviceMemory& memory, const AttentionProblem& host,
                                     std::size_t margin_bytes = 0) noexcept;

  const AttentionProblem& problem() const noexcept { return device_; }
  // Copies o and lse (with margins) back over the host problem's memory.
  Status download_outputs() const noexcept;
  // Copies q, k and v (with margins) back over the host's, to prove a backend left them alone.
  Status download_inputs() const noexcept;

 private:
  struct Mirror {
    DeviceBuffer buffer;
    void* host_begin = nullptr;  // the host bytes the buffer mirrors (view's lowest byte - margin)
  };
  Status download(const Mirror& m) const noexcept;

  DeviceMemory* memory_ = nullptr;
  AttentionProblem device_;
  Mirror q_, k_, v_, o_, lse_;
};

}  // namespace kallpa
