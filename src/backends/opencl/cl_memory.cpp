#include "backends/opencl/cl_memory.h"

#include <fmt/format.h>

namespace kallpa::opencl {

OpenClMemory* shared_memory() noexcept {
  static OpenClMemory* const m = Runtime::get() != nullptr ? new OpenClMemory(*Runtime::get()) : nullptr;
  return m;
}

OpenClMemory::~OpenClMemory() {
  for (auto& [base, a] : live_) clReleaseMemObject(a.buffer);
}

Result<void*> OpenClMemory::allocate(std::size_t bytes) noexcept {
  if (runtime_.limits().max_alloc_bytes > 0 && bytes > runtime_.limits().max_alloc_bytes) {
    return Status(
        ErrorCode::out_of_memory, "opencl allocate",
        fmt::format("{} bytes is over the device's {}-byte limit per allocation (CL_DEVICE_MAX_MEM_ALLOC_SIZE)", bytes,
                    runtime_.limits().max_alloc_bytes));
  }
  cl_int err = CL_SUCCESS;
  // OpenCL refuses empty buffers; a zero-byte allocation still gets a distinct address.
  cl_mem buffer = clCreateBuffer(runtime_.context(), CL_MEM_READ_WRITE, bytes == 0 ? 64 : bytes, nullptr, &err);
  if (err != CL_SUCCESS) {
    return err == CL_MEM_OBJECT_ALLOCATION_FAILURE || err == CL_OUT_OF_HOST_MEMORY || err == CL_OUT_OF_RESOURCES
               ? Status(ErrorCode::out_of_memory, "clCreateBuffer",
                        fmt::format("{} ({}) for {} bytes", cl_error_name(err), err, bytes))
               : cl_failure("clCreateBuffer", err, fmt::format("{} bytes", bytes));
  }
  std::lock_guard lock(mu_);
  const std::uintptr_t base = next_;
  // A spare page between allocations: one-past-the-end of one is never the start of the next.
  constexpr std::uintptr_t kPage = 4096;
  next_ += (bytes + kPage - 1) / kPage * kPage + kPage;
  live_.emplace(base, Allocation{buffer, bytes});
  return reinterpret_cast<void*>(base);
}

void OpenClMemory::free(void* device_ptr) noexcept {
  if (device_ptr == nullptr) return;
  std::lock_guard lock(mu_);
  auto it = live_.find(reinterpret_cast<std::uintptr_t>(device_ptr));
  if (it == live_.end()) return;
  clReleaseMemObject(it->second.buffer);
  live_.erase(it);
}

Result<OpenClMemory::Resolved> OpenClMemory::resolve(const void* address, std::int64_t low, std::int64_t high,
                                                     const char* what) const {
  const auto a = reinterpret_cast<std::uintptr_t>(address);
  std::lock_guard lock(mu_);
  auto it = live_.upper_bound(a);
  if (it == live_.begin()) {
    return Status::invalid(what, fmt::format("{:#x} is not an address of OpenCL device {} memory "
                                             "(allocate tensors with its DeviceMemory)",
                                             a, runtime_.index()));
  }
  --it;
  const auto offset = static_cast<std::int64_t>(a - it->first);
  const auto size = static_cast<std::int64_t>(it->second.bytes);
  if (offset + low < 0 || offset + high > size) {
    return Status::invalid(
        what, fmt::format("bytes [{}, {}) from {:#x} fall outside its {}-byte OpenCL allocation", low, high, a, size));
  }
  return Resolved{it->second.buffer, static_cast<std::size_t>(offset)};
}

Status OpenClMemory::upload(void* device_dst, const void* host_src, std::size_t bytes) noexcept {
  Result<Resolved> r = resolve(device_dst, 0, static_cast<std::int64_t>(bytes), "upload destination");
  if (!r) return r.status();
  if (bytes == 0) return {};
  const cl_int err =
      clEnqueueWriteBuffer(runtime_.queue(), r->buffer, CL_TRUE, r->offset, bytes, host_src, 0, nullptr, nullptr);
  return err == CL_SUCCESS ? Status{} : cl_failure("clEnqueueWriteBuffer", err, fmt::format("{} bytes", bytes));
}

Status OpenClMemory::download(void* host_dst, const void* device_src, std::size_t bytes) noexcept {
  Result<Resolved> r = resolve(device_src, 0, static_cast<std::int64_t>(bytes), "download source");
  if (!r) return r.status();
  if (bytes == 0) return {};
  const cl_int err =
      clEnqueueReadBuffer(runtime_.queue(), r->buffer, CL_TRUE, r->offset, bytes, host_dst, 0, nullptr, nullptr);
  return err == CL_SUCCESS ? Status{} : cl_failure("clEnqueueReadBuffer", err, fmt::format("{} bytes", bytes));
}

Status OpenClMemory::synchronize() noexcept {
  const cl_int err = clFinish(runtime_.queue());
  return err == CL_SUCCESS ? Status{} : cl_failure("clFinish", err);
}

}  // namespace kallpa::opencl
