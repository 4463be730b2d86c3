// Arrays from Python (anything that speaks DLPack or the buffer protocol, through nanobind) as the
// contract's TensorViews, without copying: the view points at the array's own memory, with its own
// strides, on its own device.
#pragma once

#include <nanobind/ndarray.h>

#include <cstdint>
#include <string>

#include "kallpa/tensor.h"

namespace kallpa::python {

// Any dtype, shape and device; read-only arrays are accepted (the contract never writes q, k, v).
using AnyArray = nanobind::ndarray<nanobind::ro>;
// Outputs: writable arrays only.
using OutArray = nanobind::ndarray<>;

// The DLPack dtype as a person reads it ("float32", "int64", "bfloat16").
std::string dtype_text(nanobind::dlpack::dtype dtype);
// The DLPack device as kallpa names devices ("cpu", "cuda:1"), or its DLPack type number.
std::string device_text(int device_type, int device_id);

// `name` is the contract's field ("q", "k", "v", "out", "lse"): errors name "q.dtype",
// "k.device", ... Throws StatusError for a dtype kallpa does not take, a rank above kMaxRank, or a
// device kind it cannot address. Shapes and strides are judged later, by validate().
TensorView to_view(const AnyArray& array, const char* name);
TensorView to_view(const OutArray& array, const char* name);

}  // namespace kallpa::python
