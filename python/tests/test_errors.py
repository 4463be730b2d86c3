"""Bad input gets a typed kallpa.Error naming the field (and the value where the binding knows it),
never a crash and never silent garbage."""

from __future__ import annotations

import numpy as np
import pytest

import kallpa
from conftest import randn
from fake_dlpack import DL_CUDA, DL_VULKAN, OnDevice


@pytest.fixture
def qkv(rng):
    return randn(rng, 2, 5, 4, 16), randn(rng, 2, 7, 2, 16), randn(rng, 2, 7, 2, 16)


def raises(cls, field, fn, *args, **kwargs):
    with pytest.raises(cls) as info:
        fn(*args, **kwargs)
    e = info.value
    assert isinstance(e, kallpa.Error)
    assert e.field == field, f"field {e.field!r}, message {e.message!r}"
    assert e.code == cls.code and str(e).startswith(f"{e.code.value}: {field}: ")
    return e


@pytest.mark.parametrize("dtype,text", [(np.float64, "float64"), (np.int32, "int32"), (np.bool_, "bool")])
def test_wrong_dtypes(qkv, dtype, text):
    q, k, v = qkv
    e = raises(kallpa.InvalidArgumentError, "q.dtype", kallpa.attention, q.astype(dtype), k, v)
    assert e.value == text and "float32, float16 or bfloat16" in e.message
    raises(kallpa.InvalidArgumentError, "v.dtype", kallpa.attention, q, k, v.astype(dtype))


def test_mixed_dtypes(qkv):
    q, k, v = qkv
    e = pytest.raises(kallpa.InvalidArgumentError, kallpa.attention, q, k.astype(np.float16), v).value
    assert e.field in ("k.dtype", "v.dtype") and "f16" in e.message


def test_wrong_ranks_and_shapes(qkv):
    q, k, v = qkv
    e = raises(kallpa.InvalidArgumentError, "q.rank", kallpa.attention, q[0], k, v)
    assert e.value == "3"
    raises(kallpa.InvalidArgumentError, "k.shape[2]", kallpa.attention, q, np.repeat(k[:, :, :1], 3, axis=2),
           np.repeat(v[:, :, :1], 3, axis=2))
    e = pytest.raises(kallpa.InvalidArgumentError, kallpa.attention, q, k[..., :8], v).value
    assert e.field.startswith("k.")
    e = pytest.raises(kallpa.InvalidArgumentError, kallpa.attention, q, k, v[:1]).value
    assert e.field.startswith("v.")


def test_negative_strides_are_refused(qkv):
    q, k, v = qkv
    e = raises(kallpa.InvalidArgumentError, "q.stride[1]", kallpa.attention, q[:, ::-1], k, v)
    assert "negative" in e.message


def test_parameters(qkv):
    q, k, v = qkv
    raises(kallpa.InvalidArgumentError, "softcap", kallpa.attention, q, k, v, softcap=-1.0)
    raises(kallpa.InvalidArgumentError, "window_left", kallpa.attention, q, k, v, window=(-2, 0))
    raises(kallpa.InvalidArgumentError, "window", kallpa.attention, q, k, v, window=3)
    raises(kallpa.InvalidArgumentError, "alibi_slopes", kallpa.attention, q, k, v, alibi_slopes=np.ones(3, np.float32))
    raises(kallpa.InvalidArgumentError, "alibi_slopes", kallpa.attention, q, k, v, alibi_slopes=np.ones(4, np.int32))


def test_index_arrays(rng):
    q, k, v = randn(rng, 6, 2, 8), randn(rng, 6, 2, 8), randn(rng, 6, 2, 8)
    e = raises(kallpa.InvalidArgumentError, "cu_seqlens_k", kallpa.attention, q, k, v, cu_seqlens_q=[0, 3, 6],
               cu_seqlens_k=[0, 6])
    assert e.value == "2" and "a batch of 2 needs 3" in e.message
    raises(kallpa.InvalidArgumentError, "cu_seqlens_q", kallpa.attention, q, k, v, cu_seqlens_q=[0.0, 6.0],
           cu_seqlens_k=[0, 6])
    raises(kallpa.InvalidArgumentError, "cu_seqlens_q", kallpa.attention, q, k, v, cu_seqlens_q=[0, 2**40],
           cu_seqlens_k=[0, 6])
    e = pytest.raises(kallpa.InvalidArgumentError, kallpa.attention, q, k, v, cu_seqlens_q=[0, 4, 3],
                      cu_seqlens_k=[0, 3, 6]).value
    assert e.field.startswith("cu_seqlens_q")
    e = pytest.raises(kallpa.InvalidArgumentError, kallpa.attention, q, k, v, cu_seqlens_q=[0, 3, 6],
                      cu_seqlens_k=[0, 3, 60]).value
    assert e.field.startswith("cu_seqlens_k")


def test_paged_arguments(rng):
    q = randn(rng, 2, 1, 4, 16)
    k, v = randn(rng, 6, 4, 2, 16), randn(rng, 6, 4, 2, 16)
    table = np.array([[0, 1], [2, 3]], np.int32)
    raises(kallpa.InvalidArgumentError, "seqlens_k", kallpa.attention, q, k, v, block_table=table)
    raises(kallpa.InvalidArgumentError, "seqlens_k", kallpa.attention, q, k, v, block_table=table, seqlens_k=[3])
    raises(kallpa.InvalidArgumentError, "block_table", kallpa.attention, q, k, v, block_table=table[:1],
           seqlens_k=[3, 3])
    e = pytest.raises(kallpa.InvalidArgumentError, kallpa.attention, q, k, v,
                      block_table=np.array([[0, 1], [2, 9]], np.int32), seqlens_k=[3, 8]).value
    assert e.field.startswith("block_table")
    e = pytest.raises(kallpa.InvalidArgumentError, kallpa.attention, q, k, v, block_table=table,
                      seqlens_k=[3, 9]).value
    assert e.field.startswith("seqlens_k")


def test_outputs(qkv):
    q, k, v = qkv
    e = pytest.raises(kallpa.InvalidArgumentError, kallpa.attention, q, k, v, out=np.empty((2, 5, 4, 8), np.float32))
    assert e.value.field.startswith("o")
    ro = np.empty(q.shape, np.float32)
    ro.flags.writeable = False
    raises(kallpa.InvalidArgumentError, "out", kallpa.attention, q, k, v, out=ro)
    e = pytest.raises(kallpa.InvalidArgumentError, kallpa.attention, q, k, v, out=q).value
    assert e.field.startswith("o") and "overlaps" in e.message


def test_unknown_backend_and_strict_choice(qkv):
    q, k, v = qkv
    e = raises(kallpa.NotFoundError, "backend", kallpa.attention, q, k, v, backend="no-such-backend")
    assert e.value == "no-such-backend" and "reference" in e.message
    raises(kallpa.InvalidArgumentError, "backend", kallpa.attention, q, k, v, backend=[])
    # opencl-flash (where registered) runs on its device, not on these host arrays: strict refuses.
    if "opencl-flash" in [b.name for b in kallpa.backends()]:
        with pytest.raises(kallpa.UnsupportedError):
            kallpa.attention(q, k, v, backend="opencl-flash", strict=True)


def test_devices(qkv):
    q, k, v = qkv
    e = raises(kallpa.InvalidArgumentError, "k.device", kallpa.attention, q, OnDevice(k, DL_VULKAN), v)
    assert e.value.startswith("dlpack device type 7")
    # Tensors on different devices are refused by the contract before any backend runs.
    e = pytest.raises(kallpa.InvalidArgumentError, kallpa.attention, q, OnDevice(k, DL_CUDA), v).value
    assert "device" in e.field or "device" in e.message
    if not any(b.device == "cuda" for b in kallpa.backends()):
        # Every tensor "on CUDA", and no CUDA backend built: no backend for the device.
        with pytest.raises(kallpa.UnsupportedError) as info:
            kallpa.attention(OnDevice(q, DL_CUDA), OnDevice(k, DL_CUDA), OnDevice(v, DL_CUDA),
                             out=OnDevice(np.empty(q.shape, np.float32), DL_CUDA))
        assert "cuda" in str(info.value)


def test_not_an_array():
    e = raises(kallpa.InvalidArgumentError, "q", kallpa.attention, object(), np.zeros(1), np.zeros(1))
    assert e.value == "object"


def test_error_classes_are_builtin_exceptions_too():
    assert issubclass(kallpa.InvalidArgumentError, ValueError)
    assert issubclass(kallpa.NotFoundError, LookupError)
    assert issubclass(kallpa.UnsupportedError, NotImplementedError)
    # Every ErrorCode of include/kallpa/status.h but ok: a new C++ code must get its Python name.
    assert {c.value for c in kallpa.ErrorCode} == {"invalid_argument", "unsupported", "backend_failure", "not_found",
                                                   "parse_error", "out_of_memory", "internal", "backend_lost"}
