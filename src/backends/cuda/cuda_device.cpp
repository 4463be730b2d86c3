#include "backends/cuda/cuda_device.h"

#include <cstdlib>
#include <new>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

namespace kallpa::cuda {

Status cuda_failure(std::string_view call, cudaError_t err, std::string_view context) {
  std::string message = fmt::format("{}: {}", cudaGetErrorName(err), cudaGetErrorString(err));
  if (!context.empty()) message += fmt::format(" ({})", context);
  return Status(err == cudaErrorMemoryAllocation ? ErrorCode::out_of_memory : ErrorCode::backend_failure,
                std::string(call), std::move(message));
}

namespace {

std::string& reason_storage() {
  static std::string reason;
  return reason;
}

}  // namespace

CudaDevice* CudaDevice::create(std::string* why) noexcept {
  try {
    int count = 0;
    if (const cudaError_t err = cudaGetDeviceCount(&count); err != cudaSuccess) {
      *why = fmt::format("CUDA runtime: cudaGetDeviceCount failed with {} ({})", cudaGetErrorName(err),
                         cudaGetErrorString(err));
      return nullptr;
    }
    if (count == 0) {
      *why = "CUDA runtime: no CUDA device (cudaGetDeviceCount returned 0)";
      return nullptr;
    }
    int index = 0;
    if (const char* env = std::getenv("KALLPA_CUDA_DEVICE"); env != nullptr && *env != '\0') {
      char* end = nullptr;
      const long v = std::strtol(env, &end, 10);
      if (*end != '\0' || v < 0 || v >= count) {
        *why = fmt::format("KALLPA_CUDA_DEVICE='{}' is not a CUDA device index in [0, {})", env, count);
        return nullptr;
      }
      index = static_cast<int>(v);
    }
    cudaDeviceProp prop{};
    if (const cudaError_t err = cudaGetDeviceProperties(&prop, index); err != cudaSuccess) {
      *why = fmt::format("CUDA runtime: cudaGetDeviceProperties({}) failed with {} ({})", index, cudaGetErrorName(err),
                         cudaGetErrorString(err));
      return nullptr;
    }
    if (prop.major < 8) {
      *why = fmt::format("CUDA device {} ('{}') has compute capability {}.{}; the kernels are built for 8.0 and up",
                         index, prop.name, prop.major, prop.minor);
      return nullptr;
    }
    auto* d = new CudaDevice();
    d->facts_.index = index;
    d->facts_.name = prop.name;
    d->facts_.sm_count = prop.multiProcessorCount;
    d->facts_.cc_major = prop.major;
    d->facts_.cc_minor = prop.minor;
    d->facts_.smem_per_block_optin = prop.sharedMemPerBlockOptin;
    d->memory_ = new CudaMemory(*d);
    spdlog::debug("cuda: device {} '{}' (sm_{}{}, {} SMs, {} KiB shared memory per block)", index, prop.name,
                  prop.major, prop.minor, prop.multiProcessorCount, prop.sharedMemPerBlockOptin / 1024);
    return d;
  } catch (const std::exception& e) {
    *why = fmt::format("CUDA device setup failed: {}", e.what());
    return nullptr;
  }
}

CudaDevice* CudaDevice::get() noexcept {
  // Never destroyed: CUDA objects must not be released from static destructors, after the
  // runtime may have torn itself down.
  static CudaDevice* const device = create(&reason_storage());
  return device;
}

const std::string& CudaDevice::unavailable_reason() noexcept {
  (void)get();
  return reason_storage();
}

Status CudaDevice::make_current() const noexcept {
  const cudaError_t err = cudaSetDevice(facts_.index);
  return err == cudaSuccess ? Status{} : cuda_failure("cudaSetDevice", err, fmt::format("device {}", facts_.index));
}

// ---- run leases --------------------------------------------------------------------------------

struct CudaDevice::Lease::Slot {
  cudaStream_t stream = nullptr;
  void* scratch = nullptr;
  std::size_t scratch_bytes = 0;
};

Result<CudaDevice::Lease> CudaDevice::lease() noexcept {
  if (Status s = make_current(); !s) return s;
  {
    std::lock_guard lock(pool_mu_);
    if (!free_slots_.empty()) {
      Lease::Slot* slot = free_slots_.back();
      free_slots_.pop_back();
      return Lease(this, slot);
    }
  }
  auto* slot = new (std::nothrow) Lease::Slot();
  if (slot == nullptr) return Status(ErrorCode::out_of_memory, "cuda", "out of host memory for a stream slot");
  // Non-blocking: runs on different threads do not serialise on the legacy default stream.
  if (const cudaError_t err = cudaStreamCreateWithFlags(&slot->stream, cudaStreamNonBlocking); err != cudaSuccess) {
    delete slot;
    return cuda_failure("cudaStreamCreateWithFlags", err);
  }
  return Lease(this, slot);
}

CudaDevice::Lease::~Lease() {
  if (slot_ == nullptr) return;
  std::lock_guard lock(device_->pool_mu_);
  device_->free_slots_.push_back(slot_);
}

cudaStream_t CudaDevice::Lease::stream() const noexcept { return slot_->stream; }

Result<void*> CudaDevice::Lease::scratch(std::size_t bytes) noexcept {
  if (bytes <= slot_->scratch_bytes) return slot_->scratch;
  if (slot_->scratch != nullptr) {
    // Work queued on this stream may still read the old scratch.
    if (const cudaError_t err = cudaStreamSynchronize(slot_->stream); err != cudaSuccess) {
      return cuda_failure("cudaStreamSynchronize", err, "before growing scratch");
    }
    cudaFree(slot_->scratch);
    slot_->scratch = nullptr;
    slot_->scratch_bytes = 0;
  }
  const std::size_t want = std::max<std::size_t>(bytes, 1 << 20);
  if (const cudaError_t err = cudaMalloc(&slot_->scratch, want); err != cudaSuccess) {
    slot_->scratch = nullptr;
    return cuda_failure("cudaMalloc", err, fmt::format("{} bytes of scratch", want));
  }
  slot_->scratch_bytes = want;
  return slot_->scratch;
}

// ---- memory ------------------------------------------------------------------------------------

Result<void*> CudaMemory::allocate(std::size_t bytes) noexcept {
  if (Status s = device_.make_current(); !s) return s;
  void* ptr = nullptr;
  // cudaMalloc(0) may return nullptr; a zero-byte allocation still needs a distinct address.
  if (const cudaError_t err = cudaMalloc(&ptr, bytes == 0 ? 256 : bytes); err != cudaSuccess) {
    return cuda_failure("cudaMalloc", err, fmt::format("{} bytes", bytes));
  }
  try {
    std::lock_guard lock(mu_);
    live_.emplace(reinterpret_cast<std::uintptr_t>(ptr), bytes);
  } catch (const std::bad_alloc&) {
    cudaFree(ptr);
    return Status(ErrorCode::out_of_memory, "cuda allocate", "out of host memory for the allocation table");
  }
  return ptr;
}

void CudaMemory::free(void* device_ptr) noexcept {
  if (device_ptr == nullptr) return;
  std::lock_guard lock(mu_);
  auto it = live_.find(reinterpret_cast<std::uintptr_t>(device_ptr));
  if (it == live_.end()) return;
  if (device_.make_current()) cudaFree(device_ptr);
  live_.erase(it);
}

Status CudaMemory::check(const void* address, std::int64_t low, std::int64_t high, const char* what) const {
  const auto a = reinterpret_cast<std::uintptr_t>(address);
  std::lock_guard lock(mu_);
  auto it = live_.upper_bound(a);
  if (it == live_.begin()) {
    return Status::invalid(what, fmt::format("{:#x} is not an address of CUDA device {} memory "
                                             "(allocate tensors with its DeviceMemory)",
                                             a, device_.index()));
  }
  --it;
  const auto offset = static_cast<std::int64_t>(a - it->first);
  const auto size = static_cast<std::int64_t>(it->second);
  if (offset + low < 0 || offset + high > size) {
    return Status::invalid(
        what, fmt::format("bytes [{}, {}) from {:#x} fall outside its {}-byte CUDA allocation", low, high, a, size));
  }
  return {};
}

Status CudaMemory::upload(void* device_dst, const void* host_src, std::size_t bytes) noexcept {
  if (Status s = check(device_dst, 0, static_cast<std::int64_t>(bytes), "upload destination"); !s) return s;
  if (bytes == 0) return {};
  if (Status s = device_.make_current(); !s) return s;
  if (const cudaError_t err = cudaMemcpy(device_dst, host_src, bytes, cudaMemcpyHostToDevice); err != cudaSuccess) {
    return cuda_failure("cudaMemcpy", err, fmt::format("{} bytes host to device", bytes));
  }
  // From pageable memory cudaMemcpy may return before the DMA lands; a run on another stream
  // must see the data.
  const cudaError_t err = cudaStreamSynchronize(cudaStreamLegacy);
  return err == cudaSuccess ? Status{} : cuda_failure("cudaStreamSynchronize", err, "after upload");
}

Status CudaMemory::download(void* host_dst, const void* device_src, std::size_t bytes) noexcept {
  if (Status s = check(device_src, 0, static_cast<std::int64_t>(bytes), "download source"); !s) return s;
  if (bytes == 0) return {};
  if (Status s = device_.make_current(); !s) return s;
  const cudaError_t err = cudaMemcpy(host_dst, device_src, bytes, cudaMemcpyDeviceToHost);
  return err == cudaSuccess ? Status{} : cuda_failure("cudaMemcpy", err, fmt::format("{} bytes device to host", bytes));
}

Status CudaMemory::synchronize() noexcept {
  if (Status s = device_.make_current(); !s) return s;
  const cudaError_t err = cudaDeviceSynchronize();
  return err == cudaSuccess ? Status{} : cuda_failure("cudaDeviceSynchronize", err);
}

}  // namespace kallpa::cuda
