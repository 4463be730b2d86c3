"""A DLPack producer that claims any device for a host NumPy array: what lets the tests hand kallpa
a "CUDA" or "Vulkan" tensor on a machine without one, to see how it is refused. The memory is never
dereferenced by a correct kallpa: such a tensor must be turned away before any backend reads it."""

from __future__ import annotations

import ctypes

import numpy as np


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32), ("dtype", _DType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _Managed(ctypes.Structure):
    pass


_Managed._fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p),
                     ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(_Managed)))]

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

DL_CUDA = 2
DL_VULKAN = 7


class OnDevice:
    """`array`'s memory presented as living on DLPack device (device_type, device_id)."""

    def __init__(self, array: np.ndarray, device_type: int, device_id: int = 0):
        self._array = np.ascontiguousarray(array, dtype=np.float32)
        self._device = (device_type, device_id)
        self._shape = (ctypes.c_int64 * self._array.ndim)(*self._array.shape)
        self._strides = (ctypes.c_int64 * self._array.ndim)(*(s // 4 for s in self._array.strides))
        self._managed = _Managed()
        t = self._managed.dl_tensor
        t.data = self._array.ctypes.data
        t.device = _Device(device_type, device_id)
        t.ndim = self._array.ndim
        t.dtype = _DType(2, 32, 1)  # float32
        t.shape = self._shape
        t.strides = self._strides
        self.shape = self._array.shape
        self.ndim = self._array.ndim
        self.dtype = self._array.dtype

    def __dlpack_device__(self):
        return self._device

    def __dlpack__(self, *args, **kwargs):
        return _capsule_new(ctypes.addressof(self._managed), b"dltensor", None)
