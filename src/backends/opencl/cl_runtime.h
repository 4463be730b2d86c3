// The OpenCL device opencl-flash runs on: found once per process (lazily, on first use), with its
// context, one in-order queue, its limits, and the attention program built at first need and kept.
#pragma once

#ifndef CL_TARGET_OPENCL_VERSION
#define CL_TARGET_OPENCL_VERSION 120
#endif
#include <CL/cl.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>

#include "kallpa/status.h"

namespace kallpa::opencl {

// "CL_OUT_OF_RESOURCES" for -5; "CL error" for codes this table does not know.
std::string_view cl_error_name(cl_int code) noexcept;
// The Status for a failed OpenCL call: backend_failure, field = the call, message names the code.
Status cl_failure(std::string_view call, cl_int code, std::string_view context = {});

// Compiles an OpenCL C program for one device. A failure is backend_failure naming `what`, with
// the compiler's build log (its first 2000 characters).
Result<cl_program> build_program(cl_context context, cl_device_id device, const char* source, const char* options,
                                 std::string_view what) noexcept;

// Sets a kernel's arguments in order (a.mem(b).i64(n).f32(x)...); keeps the first failure, naming
// the kernel and the argument's index, for status().
class KernelArgs {
 public:
  explicit KernelArgs(cl_kernel kernel, std::string_view name = "kernel") : kernel_(kernel), name_(name) {}
  KernelArgs& mem(cl_mem m) { return set(sizeof m, &m); }
  KernelArgs& i32(std::int64_t v) {
    const cl_int x = static_cast<cl_int>(v);
    return set(sizeof x, &x);
  }
  KernelArgs& i64(std::int64_t v) {
    const cl_long x = v;
    return set(sizeof x, &x);
  }
  KernelArgs& u64(std::uint64_t v) {
    const cl_ulong x = v;
    return set(sizeof x, &x);
  }
  KernelArgs& f32(float v) { return set(sizeof v, &v); }
  // A __local buffer of `bytes` (at least 4: a zero-sized local argument is an error).
  KernelArgs& local(std::size_t bytes) { return set(bytes < 4 ? 4 : bytes, nullptr); }
  const Status& status() const noexcept { return status_; }

 private:
  KernelArgs& set(std::size_t size, const void* value);
  cl_kernel kernel_;
  std::string_view name_;
  cl_uint index_ = 0;
  Status status_;
};

struct DeviceLimits {
  std::string name;      // "pthread-haswell-AMD EPYC"
  std::string platform;  // "Portable Computing Language"
  std::string version;   // "OpenCL 3.0 PoCL ..."
  std::size_t local_mem_bytes = 0;
  std::size_t max_work_group = 1;
  cl_ulong max_alloc_bytes = 0;
};

class Runtime {
 public:
  // The device chosen by KALLPA_OPENCL_DEVICE (an index over every platform's devices, default
  // 0), or nullptr when there is none; unavailable_reason() then says why.
  static Runtime* get() noexcept;
  static const std::string& unavailable_reason() noexcept;

  int index() const noexcept { return index_; }
  cl_context context() const noexcept { return context_; }
  cl_command_queue queue() const noexcept { return queue_; }
  cl_device_id device() const noexcept { return device_; }
  const DeviceLimits& limits() const noexcept { return limits_; }

  // The attention program, built on first call (seconds on PoCL, whose own kernel cache then
  // makes later processes fast) and kept for the life of the process. A build failure is kept
  // too: it is returned on every later call, with the compiler's log.
  Result<cl_program> program() noexcept;
  double program_build_seconds() const noexcept { return build_seconds_; }

 private:
  Runtime() = default;
  static Runtime* create(std::string* why) noexcept;

  int index_ = 0;
  cl_device_id device_ = nullptr;
  cl_context context_ = nullptr;
  cl_command_queue queue_ = nullptr;
  DeviceLimits limits_;

  std::once_flag build_once_;
  cl_program program_ = nullptr;
  Status build_status_;
  double build_seconds_ = 0.0;
};

}  // namespace kallpa::opencl
