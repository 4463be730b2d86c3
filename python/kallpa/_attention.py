"""kallpa.attention and its companions on arrays from NumPy, PyTorch or anything with DLPack or
the buffer protocol. The tensors are handed to the native module as views (no copies); outputs are
allocated here, in the caller's framework, unless ``out=`` is given."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from . import _kallpa
from ._errors import InvalidArgumentError


def _torch_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _as_array(x: Any, name: str) -> Any:
    """What the native module reads: a torch tensor (detached), a NumPy array, any other DLPack
    object as it is (on whatever device it claims), or a NumPy view of a buffer-protocol object."""
    if _torch_tensor(x):
        if x.device.type not in ("cpu", "cuda"):
            raise InvalidArgumentError(f"{name}.device", "is a PyTorch device kallpa cannot address (cpu and cuda are)",
                                       str(x.device))
        return x.detach()
    if isinstance(x, np.ndarray) or (hasattr(x, "__dlpack__") and hasattr(x, "shape")):
        return x
    try:
        a = np.from_dlpack(x) if hasattr(x, "__dlpack__") else np.asarray(x)
    except Exception as e:  # noqa: BLE001 - any failure means: not an array kallpa can read
        raise InvalidArgumentError(name, f"is not an array (DLPack or buffer protocol): {e}",
                                   type(x).__name__) from None
    if a.dtype == object:
        raise InvalidArgumentError(name, "is not an array (DLPack or buffer protocol)", type(x).__name__)
    return a


def _index(x: Any, name: str, ndim: int) -> np.ndarray | None:
    """An index array as contiguous host int32 (small: a copy is cheap), range-checked."""
    if x is None:
        return None
    if _torch_tensor(x):
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise InvalidArgumentError(name, f"must hold integers, holds {a.dtype}", str(a.dtype))
    if a.ndim != ndim:
        raise InvalidArgumentError(name, f"must have {ndim} dimension(s), has {a.ndim}", str(a.ndim))
    if a.size and (a.min() < -(2**31) or a.max() >= 2**31):
        raise InvalidArgumentError(name, "holds values outside int32", f"{a.min()}..{a.max()}")
    return np.ascontiguousarray(a, dtype=np.int32)


def _slopes(x: Any) -> np.ndarray | None:
    if x is None:
        return None
    if _torch_tensor(x):
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.dtype.kind != "f":
        raise InvalidArgumentError("alibi_slopes", f"must hold floats, holds {a.dtype}", str(a.dtype))
    if a.ndim != 1:
        raise InvalidArgumentError("alibi_slopes", f"must be one-dimensional [Hq], has {a.ndim} dimensions",
                                   str(a.ndim))
    return np.ascontiguousarray(a, dtype=np.float32)


def _window(window: Any) -> tuple[int, int]:
    try:
        left, right = window
        return int(left), int(right)
    except (TypeError, ValueError):
        raise InvalidArgumentError("window", "must be a pair (left, right); -1 is unbounded", repr(window)) from None


def _backend_list(backend: str | Sequence[str] | None) -> list[str] | None:
    if backend is None:
        return None
    names = backend.split(",") if isinstance(backend, str) else list(backend)
    if not names or any(not isinstance(n, str) or not n.strip() for n in names):
        raise InvalidArgumentError("backend", "must name one or more backends", repr(backend))
    return [n.strip() for n in names]


def _empty(like: Any, shape: tuple[int, ...], float32: bool = False) -> Any:
    """A new array in `like`'s framework, on its device, of `like`'s dtype or float32 (a host NumPy
    array for frameworks other than NumPy and PyTorch: pass out= for those)."""
    if _torch_tensor(like):
        import torch

        return torch.empty(shape, dtype=torch.float32 if float32 else like.dtype, device=like.device)
    return np.empty(shape, dtype=np.float32 if float32 else like.dtype)


def _o_shape(q_shape: tuple[int, ...], v_shape: tuple[int, ...]) -> tuple[int, ...]:
    """o: q's shape with v's head dimension."""
    return (*q_shape[:-1], v_shape[-1])


def _lse_shape(q_shape: tuple[int, ...], packed: bool) -> tuple[int, ...]:
    """lse: [Hq, Tq] for packed q, [B, Hq, Sq] otherwise."""
    return (q_shape[1], q_shape[0]) if packed else (q_shape[0], q_shape[2], q_shape[1])


def _check_writable(a: Any, name: str) -> None:
    if isinstance(a, np.ndarray) and not a.flags.writeable:
        raise InvalidArgumentError(name, "is read-only", "read-only array")


def _call(q, k, v, *, causal, window, softcap, alibi_slopes, scale, cu_seqlens_q, cu_seqlens_k, block_table,
          seqlens_k, return_lse, out):
    q, k, v = _as_array(q, "q"), _as_array(k, "k"), _as_array(v, "v")
    packed_q = cu_seqlens_q is not None
    q_rank = 3 if packed_q else 4
    if q.ndim != q_rank:
        layout = "[Tq, Hq, D] (packed, with cu_seqlens_q)" if packed_q else "[B, Sq, Hq, D]"
        raise InvalidArgumentError("q.rank", f"is {q.ndim}; q must be {layout}", str(q.ndim))
    if v.ndim < 1:
        raise InvalidArgumentError("v.rank", "is 0; v must be [B, Skv, Hkv, Dv], [Tkv, Hkv, Dv] or paged", "0")
    if out is None:
        out = _empty(q, _o_shape(q.shape, v.shape))
    elif _torch_tensor(out):
        if out.requires_grad:
            raise InvalidArgumentError("out", "requires grad; kallpa writes it in place", "requires_grad=True")
        _as_array(out, "out")  # the device check
    else:
        out = _as_array(out, "out")
        _check_writable(out, "out")
    lse = None
    if return_lse:
        lse = _empty(q, _lse_shape(q.shape, packed_q), float32=True)
    left, right = _window(window)
    indices = (_index(cu_seqlens_q, "cu_seqlens_q", 1), _index(cu_seqlens_k, "cu_seqlens_k", 1),
               _index(block_table, "block_table", 2), _index(seqlens_k, "seqlens_k", 1))
    try:
        call = _kallpa._Call(q, k, v, out, lse, bool(causal), left, right, float(softcap),
                             None if scale is None else float(scale), _slopes(alibi_slopes), *indices)
    except TypeError as e:  # nanobind could not import one of them through DLPack or the buffer protocol
        raise InvalidArgumentError("q, k, v, out", f"one of them cannot be read as an array: {e}",
                                   ", ".join(type(x).__name__ for x in (q, k, v, out))) from None
    if _torch_tensor(q) and q.is_cuda:
        # kallpa's device backends run on their own stream: wait for what PyTorch queued on q, k, v.
        import torch

        torch.cuda.current_stream(q.device).synchronize()
    return call, out, lse


def attention(q, k, v, *, causal: bool = False, window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
              alibi_slopes=None, scale: float | None = None, cu_seqlens_q=None, cu_seqlens_k=None,
              block_table=None, seqlens_k=None, return_lse: bool = False, backend: str | Sequence[str] | None = None,
              strict: bool = False, out=None):
    """softmax(mask(alibi + softcap(scale * q k^T))) v, as FlashAttention lays it out.

    q is [B, Sq, Hq, D], or packed [Tq, Hq, D] with ``cu_seqlens_q`` [B+1]; k and v are
    [B, Skv, Hkv, D|Dv], packed [Tkv, Hkv, D|Dv] with ``cu_seqlens_k``, or a paged cache
    [blocks, page, Hkv, D|Dv] with ``block_table`` [B, max_blocks] and ``seqlens_k`` [B].
    Masks align bottom-right (query i sits at key position Skv - Sq + i). ``window`` is
    (left, right), -1 unbounded. Returns o (like q, with Dv) in the caller's framework, or (o, lse)
    with ``return_lse`` (lse float32, [B, Hq, Sq] or packed [Hq, Tq]). ``backend`` names one backend
    or a list to try in order; ``strict`` makes a backend that cannot run the problem an error
    instead of a fallback. Errors raise kallpa.Error subclasses naming the field.
    """
    call, out, lse = _call(q, k, v, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                           scale=scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                           block_table=block_table, seqlens_k=seqlens_k, return_lse=return_lse, out=out)
    _kallpa._attention(call, _backend_list(backend), bool(strict))
    return (out, lse) if return_lse else out


@dataclass(frozen=True)
class Verdict:
    """One backend's verdict on a problem (kallpa::Verdict)."""

    backend: str
    health: str
    supported: bool
    selected: bool  # the backend a call would try first
    rank: int  # position among the candidates, -1 when not one
    reason: str


@dataclass(frozen=True)
class Explanation:
    """Why a problem goes where it goes: its signature and every backend's verdict."""

    signature: str
    verdicts: list[Verdict]

    @property
    def selected(self) -> str | None:
        return next((v.backend for v in self.verdicts if v.selected), None)

    def __str__(self) -> str:
        lines = [f"problem: {self.signature}"]
        for v in self.verdicts:
            mark = "*" if v.selected else " "
            verdict = "yes" if v.supported else "no"
            lines.append(f"{mark} {v.backend:<16} {v.health:<11} {verdict:<3} {v.reason}".rstrip())
        return "\n".join(lines)


def explain(q, k, v, *, causal: bool = False, window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
            alibi_slopes=None, scale: float | None = None, cu_seqlens_q=None, cu_seqlens_k=None, block_table=None,
            seqlens_k=None, return_lse: bool = False, backend: str | Sequence[str] | None = None,
            strict: bool = False) -> Explanation:
    """What attention() would do with these arguments, without running it: every backend's verdict."""
    call, _, _ = _call(q, k, v, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                       scale=scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, block_table=block_table,
                       seqlens_k=seqlens_k, return_lse=return_lse, out=None)
    signature, verdicts = _kallpa._explain(call, _backend_list(backend), bool(strict))
    return Explanation(signature, [Verdict(*v) for v in verdicts])


@dataclass(frozen=True)
class BackendInfo:
    """A registered attention backend (kallpa::BackendInfo)."""

    name: str
    version: str
    device: str
    priority: int
    description: str
    health: str
    health_reason: str
    run_failures: int
    quarantined_buckets: list[str]


def backends() -> list[BackendInfo]:
    """Every registered backend in automatic-selection order, after the health check has run."""
    return [BackendInfo(*b) for b in _kallpa._backends()]
