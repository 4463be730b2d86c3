#include "backends/opencl/cl_runtime.h"

#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "flash_attention_cl.h"  // generated from flash_attention.cl: kFlashAttentionSource

namespace kallpa::opencl {

std::string_view cl_error_name(cl_int code) noexcept {
  switch (code) {
    case CL_SUCCESS: return "CL_SUCCESS";
    case CL_DEVICE_NOT_FOUND: return "CL_DEVICE_NOT_FOUND";
    case CL_DEVICE_NOT_AVAILABLE: return "CL_DEVICE_NOT_AVAILABLE";
    case CL_COMPILER_NOT_AVAILABLE: return "CL_COMPILER_NOT_AVAILABLE";
    case CL_MEM_OBJECT_ALLOCATION_FAILURE: return "CL_MEM_OBJECT_ALLOCATION_FAILURE";
    case CL_OUT_OF_RESOURCES: return "CL_OUT_OF_RESOURCES";
    case CL_OUT_OF_HOST_MEMORY: return "CL_OUT_OF_HOST_MEMORY";
    case CL_BUILD_PROGRAM_FAILURE: return "CL_BUILD_PROGRAM_FAILURE";
    case CL_MISALIGNED_SUB_BUFFER_OFFSET: return "CL_MISALIGNED_SUB_BUFFER_OFFSET";
    case CL_EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST: return "CL_EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST";
    case CL_INVALID_VALUE: return "CL_INVALID_VALUE";
    case CL_INVALID_DEVICE_TYPE: return "CL_INVALID_DEVICE_TYPE";
    case CL_INVALID_PLATFORM: return "CL_INVALID_PLATFORM";
    case CL_INVALID_DEVICE: return "CL_INVALID_DEVICE";
    case CL_INVALID_CONTEXT: return "CL_INVALID_CONTEXT";
    case CL_INVALID_COMMAND_QUEUE: return "CL_INVALID_COMMAND_QUEUE";
    case CL_INVALID_HOST_PTR: return "CL_INVALID_HOST_PTR";
    case CL_INVALID_MEM_OBJECT: return "CL_INVALID_MEM_OBJECT";
    case CL_INVALID_BINARY: return "CL_INVALID_BINARY";
    case CL_INVALID_BUILD_OPTIONS: return "CL_INVALID_BUILD_OPTIONS";
    case CL_INVALID_PROGRAM: return "CL_INVALID_PROGRAM";
    case CL_INVALID_PROGRAM_EXECUTABLE: return "CL_INVALID_PROGRAM_EXECUTABLE";
    case CL_INVALID_KERNEL_NAME: return "CL_INVALID_KERNEL_NAME";
    case CL_INVALID_KERNEL: return "CL_INVALID_KERNEL";
    case CL_INVALID_ARG_INDEX: return "CL_INVALID_ARG_INDEX";
    case CL_INVALID_ARG_VALUE: return "CL_INVALID_ARG_VALUE";
    case CL_INVALID_ARG_SIZE: return "CL_INVALID_ARG_SIZE";
    case CL_INVALID_KERNEL_ARGS: return "CL_INVALID_KERNEL_ARGS";
    case CL_INVALID_WORK_DIMENSION: return "CL_INVALID_WORK_DIMENSION";
    case CL_INVALID_WORK_GROUP_SIZE: return "CL_INVALID_WORK_GROUP_SIZE";
    case CL_INVALID_WORK_ITEM_SIZE: return "CL_INVALID_WORK_ITEM_SIZE";
    case CL_INVALID_GLOBAL_OFFSET: return "CL_INVALID_GLOBAL_OFFSET";
    case CL_INVALID_EVENT_WAIT_LIST: return "CL_INVALID_EVENT_WAIT_LIST";
    case CL_INVALID_EVENT: return "CL_INVALID_EVENT";
    case CL_INVALID_OPERATION: return "CL_INVALID_OPERATION";
    case CL_INVALID_BUFFER_SIZE: return "CL_INVALID_BUFFER_SIZE";
    case CL_INVALID_GLOBAL_WORK_SIZE: return "CL_INVALID_GLOBAL_WORK_SIZE";
    case -1001: return "CL_PLATFORM_NOT_FOUND_KHR";  // from the ICD loader: no platform installed
    default: return "CL error";
  }
}

Status cl_failure(std::string_view call, cl_int code, std::string_view context) {
  std::string message = fmt::format("{} ({})", cl_error_name(code), code);
  if (!context.empty()) message += fmt::format(": {}", context);
  return Status(ErrorCode::backend_failure, std::string(call), std::move(message));
}

namespace {

std::string device_string(cl_device_id device, cl_device_info what) {
  std::size_t size = 0;
  if (clGetDeviceInfo(device, what, 0, nullptr, &size) != CL_SUCCESS || size == 0) return {};
  std::string s(size, '\0');
  if (clGetDeviceInfo(device, what, size, s.data(), nullptr) != CL_SUCCESS) return {};
  while (!s.empty() && s.back() == '\0') s.pop_back();
  return s;
}

std::string platform_string(cl_platform_id platform, cl_platform_info what) {
  std::size_t size = 0;
  if (clGetPlatformInfo(platform, what, 0, nullptr, &size) != CL_SUCCESS || size == 0) return {};
  std::string s(size, '\0');
  if (clGetPlatformInfo(platform, what, size, s.data(), nullptr) != CL_SUCCESS) return {};
  while (!s.empty() && s.back() == '\0') s.pop_back();
  return s;
}

template <typename T>
T device_value(cl_device_id device, cl_device_info what) {
  T value{};
  if (clGetDeviceInfo(device, what, sizeof(T), &value, nullptr) != CL_SUCCESS) return T{};
  return value;
}

struct Found {
  Runtime* runtime = nullptr;
  std::string why;
};

Found& found() {
  // Never destroyed: OpenCL objects must not be released from static destructors, which may run
  // after the ICD loader or the driver has already torn itself down.
  static Found* f = new Found();
  return *f;
}

}  // namespace

Runtime* Runtime::create(std::string* why) noexcept {
  try {
    int wanted = 0;
    if (const char* text = std::getenv("KALLPA_OPENCL_DEVICE"); text != nullptr && *text != '\0') {
      char* end = nullptr;
      const long n = std::strtol(text, &end, 10);
      if (*end != '\0' || n < 0 || n > 1000) {
        *why = fmt::format("KALLPA_OPENCL_DEVICE='{}' is not a device index (an integer >= 0)", text);
        return nullptr;
      }
      wanted = static_cast<int>(n);
    }
    cl_uint nplatforms = 0;
    cl_int err = clGetPlatformIDs(0, nullptr, &nplatforms);
    if (err != CL_SUCCESS || nplatforms == 0) {
      *why = err != CL_SUCCESS
                 ? fmt::format("no OpenCL platform: clGetPlatformIDs returned {} ({})", cl_error_name(err), err)
                 : "no OpenCL platform installed (an ICD such as pocl-opencl-icd)";
      return nullptr;
    }
    std::vector<cl_platform_id> platforms(nplatforms);
    clGetPlatformIDs(nplatforms, platforms.data(), nullptr);
    std::vector<std::pair<cl_platform_id, cl_device_id>> devices;
    for (cl_platform_id p : platforms) {
      cl_uint n = 0;
      if (clGetDeviceIDs(p, CL_DEVICE_TYPE_ALL, 0, nullptr, &n) != CL_SUCCESS || n == 0) continue;
      std::vector<cl_device_id> ids(n);
      if (clGetDeviceIDs(p, CL_DEVICE_TYPE_ALL, n, ids.data(), nullptr) != CL_SUCCESS) continue;
      for (cl_device_id d : ids) devices.emplace_back(p, d);
    }
    if (devices.empty()) {
      *why = fmt::format("no OpenCL device on {} platform(s)", nplatforms);
      return nullptr;
    }
    if (static_cast<std::size_t>(wanted) >= devices.size()) {
      *why = fmt::format("KALLPA_OPENCL_DEVICE={} but only {} OpenCL device(s) exist", wanted, devices.size());
      return nullptr;
    }
    auto [platform, device] = devices[static_cast<std::size_t>(wanted)];
    auto* rt = new Runtime();
    rt->index_ = wanted;
    rt->device_ = device;
    rt->limits_.name = device_string(device, CL_DEVICE_NAME);
    rt->limits_.version = device_string(device, CL_DEVICE_VERSION);
    rt->limits_.platform = platform_string(platform, CL_PLATFORM_NAME);
    rt->limits_.local_mem_bytes = static_cast<std::size_t>(device_value<cl_ulong>(device, CL_DEVICE_LOCAL_MEM_SIZE));
    rt->limits_.max_work_group = device_value<std::size_t>(device, CL_DEVICE_MAX_WORK_GROUP_SIZE);
    rt->limits_.max_alloc_bytes = device_value<cl_ulong>(device, CL_DEVICE_MAX_MEM_ALLOC_SIZE);
    const cl_context_properties props[] = {CL_CONTEXT_PLATFORM, reinterpret_cast<cl_context_properties>(platform), 0};
    rt->context_ = clCreateContext(props, 1, &device, nullptr, nullptr, &err);
    if (err != CL_SUCCESS) {
      *why = fmt::format("clCreateContext on '{}' failed: {} ({})", rt->limits_.name, cl_error_name(err), err);
      delete rt;
      return nullptr;
    }
    rt->queue_ = clCreateCommandQueue(rt->context_, device, 0, &err);
    if (err != CL_SUCCESS) {
      *why = fmt::format("clCreateCommandQueue on '{}' failed: {} ({})", rt->limits_.name, cl_error_name(err), err);
      clReleaseContext(rt->context_);
      delete rt;
      return nullptr;
    }
    spdlog::debug("kallpa: opencl-flash uses OpenCL device {} '{}' ({}), {} KiB local memory", wanted, rt->limits_.name,
                  rt->limits_.platform, rt->limits_.local_mem_bytes / 1024);
    return rt;
  } catch (const std::exception& e) {
    *why = fmt::format("OpenCL discovery failed: {}", e.what());
    return nullptr;
  }
}

Runtime* Runtime::get() noexcept {
  static std::once_flag once;
  std::call_once(once, [] { found().runtime = create(&found().why); });
  return found().runtime;
}

const std::string& Runtime::unavailable_reason() noexcept {
  get();
  return found().why;
}

Result<cl_program> build_program(cl_context context, cl_device_id device, const char* source, const char* options,
                                 std::string_view what) noexcept {
  try {
    cl_int err = CL_SUCCESS;
    cl_program program = clCreateProgramWithSource(context, 1, &source, nullptr, &err);
    if (err != CL_SUCCESS) return cl_failure("clCreateProgramWithSource", err, what);
    err = clBuildProgram(program, 1, &device, options, nullptr, nullptr);
    if (err == CL_SUCCESS) return program;
    std::string log;
    std::size_t size = 0;
    if (clGetProgramBuildInfo(program, device, CL_PROGRAM_BUILD_LOG, 0, nullptr, &size) == CL_SUCCESS && size > 0) {
      log.resize(size);
      clGetProgramBuildInfo(program, device, CL_PROGRAM_BUILD_LOG, size, log.data(), nullptr);
      while (!log.empty() && (log.back() == '\0' || log.back() == '\n')) log.pop_back();
      if (log.size() > 2000) log = log.substr(0, 2000) + " ...";
    }
    clReleaseProgram(program);
    return cl_failure("clBuildProgram", err,
                      fmt::format("{} program: {}", what, log.empty() ? "no build log" : "build log: " + log));
  } catch (const std::exception& e) {
    return Status(ErrorCode::internal, "clBuildProgram", e.what());
  }
}

Result<cl_program> Runtime::program() noexcept {
  std::call_once(build_once_, [this] {
    const auto start = std::chrono::steady_clock::now();
    // No fast-math options: the conformance suite holds f32 results to 1e-5.
    Result<cl_program> built = build_program(context_, device_, kFlashAttentionSource, "-cl-std=CL1.2", "attention");
    build_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!built) {
      build_status_ = built.status();
      return;
    }
    program_ = *built;
    spdlog::debug("kallpa: opencl-flash program built for '{}' in {:.2f} s", limits_.name, build_seconds_);
  });
  if (!build_status_) return build_status_;
  return program_;
}

KernelArgs& KernelArgs::set(std::size_t size, const void* value) {
  if (status_) {
    const cl_int err = clSetKernelArg(kernel_, index_, size, value);
    if (err != CL_SUCCESS) status_ = cl_failure("clSetKernelArg", err, fmt::format("{} argument {}", name_, index_));
  }
  ++index_;
  return *this;
}

}  // namespace kallpa::opencl
