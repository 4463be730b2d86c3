#include "tensor_view.h"

#include <fmt/format.h>

#include "status_error.h"

namespace kallpa::python {
namespace {

namespace nb = nanobind;
using nb::dlpack::dtype_code;

// DLPack device types (dlpack.h, DLDeviceType).
constexpr int kDLCPU = 1;
constexpr int kDLCUDA = 2;
constexpr int kDLCUDAHost = 3;
constexpr int kDLOpenCL = 4;
constexpr int kDLCUDAManaged = 13;

TensorView view_of(const nb::dlpack::dtype dtype, std::size_t ndim, const std::int64_t* shape,
                   const std::int64_t* strides, void* data, int device_type, int device_id, const char* name) {
  TensorView t;
  if (dtype.lanes != 1) {
    throw_invalid(fmt::format("{}.dtype", name), "vector dtypes (lanes > 1) are not tensors kallpa takes",
                  dtype_text(dtype));
  }
  if (dtype.code == static_cast<std::uint8_t>(dtype_code::Float) && dtype.bits == 32) {
    t.dtype = DType::f32;
  } else if (dtype.code == static_cast<std::uint8_t>(dtype_code::Float) && dtype.bits == 16) {
    t.dtype = DType::f16;
  } else if (dtype.code == static_cast<std::uint8_t>(dtype_code::Bfloat) && dtype.bits == 16) {
    t.dtype = DType::bf16;
  } else {
    throw_invalid(
        fmt::format("{}.dtype", name),
        fmt::format("{} is not a dtype kallpa attention takes (float32, float16 or bfloat16)", dtype_text(dtype)),
        dtype_text(dtype));
  }
  if (ndim > static_cast<std::size_t>(kMaxRank)) {
    throw_invalid(name, fmt::format("rank {} is above the contract's largest, {}", ndim, kMaxRank),
                  fmt::format("rank {}", ndim));
  }
  switch (device_type) {
    case kDLCPU:
    case kDLCUDAHost:  // pinned host memory: host addresses
      t.device = Device::cpu();
      break;
    case kDLCUDA:
    case kDLCUDAManaged: t.device = Device{DeviceKind::cuda, device_id}; break;
    case kDLOpenCL: t.device = Device{DeviceKind::opencl, device_id}; break;
    default:
      throw_invalid(fmt::format("{}.device", name), "a device kallpa cannot address (cpu, cuda and opencl are)",
                    device_text(device_type, device_id));
  }
  t.rank = static_cast<int>(ndim);
  for (std::size_t i = 0; i < ndim; ++i) {
    t.shape[i] = shape[i];
    // DLPack allows null strides for a compact row-major array.
    t.stride[i] = 1;
    if (strides != nullptr) {
      t.stride[i] = strides[i];
    } else {
      for (std::size_t j = i + 1; j < ndim; ++j) t.stride[i] *= shape[j];
    }
  }
  // A zero-element array may carry a null pointer (PyTorch's empty tensors do); the contract
  // accepts that for a view with no elements.
  t.data = data;
  return t;
}

}  // namespace

std::string dtype_text(nb::dlpack::dtype dtype) {
  const char* kind = "code";
  switch (static_cast<dtype_code>(dtype.code)) {
    case dtype_code::Int: kind = "int"; break;
    case dtype_code::UInt: kind = "uint"; break;
    case dtype_code::Float: kind = "float"; break;
    case dtype_code::Bfloat: kind = "bfloat"; break;
    case dtype_code::Complex: kind = "complex"; break;
    case dtype_code::Bool: return "bool";
    default: return fmt::format("dlpack code {} ({} bits)", dtype.code, dtype.bits);
  }
  std::string text = fmt::format("{}{}", kind, dtype.bits);
  if (dtype.lanes > 1) text += fmt::format("x{}", dtype.lanes);
  return text;
}

std::string device_text(int device_type, int device_id) {
  switch (device_type) {
    case kDLCPU: return "cpu";
    case kDLCUDA: return fmt::format("cuda:{}", device_id);
    case kDLCUDAHost: return "cuda_host";
    case kDLOpenCL: return fmt::format("opencl:{}", device_id);
    case kDLCUDAManaged: return fmt::format("cuda_managed:{}", device_id);
    default: return fmt::format("dlpack device type {}:{}", device_type, device_id);
  }
}

TensorView to_view(const AnyArray& array, const char* name) {
  return view_of(array.dtype(), array.ndim(), array.shape_ptr(), array.stride_ptr(), const_cast<void*>(array.data()),
                 array.device_type(), array.device_id(), name);
}

TensorView to_view(const OutArray& array, const char* name) {
  return view_of(array.dtype(), array.ndim(), array.shape_ptr(), array.stride_ptr(), array.data(), array.device_type(),
                 array.device_id(), name);
}

}  // namespace kallpa::python
