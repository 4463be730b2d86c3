"""PyTorch operators ``torch.ops.kallpa.attention`` and ``torch.ops.kallpa.attention_lse`` for CPU
tensors (torch.library custom ops with fake implementations, so torch.compile traces through them
without running kallpa). Importing this module registers them; ``import kallpa`` does so when torch
is already imported."""

from __future__ import annotations

from typing import Optional

import torch

from ._attention import _lse_shape, _o_shape
from ._attention import attention as _attention


def _run(q, k, v, causal, window_left, window_right, softcap, scale, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
         block_table, seqlens_k, return_lse):
    return _attention(q, k, v, causal=causal, window=(window_left, window_right), softcap=softcap, scale=scale,
                      alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      block_table=block_table, seqlens_k=seqlens_k, return_lse=return_lse)


@torch.library.custom_op("kallpa::attention", mutates_args=(), device_types="cpu")
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, window_left: int = -1,
              window_right: int = -1, softcap: float = 0.0, scale: Optional[float] = None,
              alibi_slopes: Optional[torch.Tensor] = None, cu_seqlens_q: Optional[torch.Tensor] = None,
              cu_seqlens_k: Optional[torch.Tensor] = None, block_table: Optional[torch.Tensor] = None,
              seqlens_k: Optional[torch.Tensor] = None) -> torch.Tensor:
    """kallpa.attention as a PyTorch operator; the arguments mean what they mean there."""
    return _run(q, k, v, causal, window_left, window_right, softcap, scale, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                block_table, seqlens_k, False)


@torch.library.custom_op("kallpa::attention_lse", mutates_args=(), device_types="cpu")
def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, window_left: int = -1,
                  window_right: int = -1, softcap: float = 0.0, scale: Optional[float] = None,
                  alibi_slopes: Optional[torch.Tensor] = None, cu_seqlens_q: Optional[torch.Tensor] = None,
                  cu_seqlens_k: Optional[torch.Tensor] = None, block_table: Optional[torch.Tensor] = None,
                  seqlens_k: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """kallpa.attention with return_lse=True: (o, lse), lse float32 [B, Hq, Sq] or packed [Hq, Tq]."""
    return _run(q, k, v, causal, window_left, window_right, softcap, scale, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                block_table, seqlens_k, True)


def _o_like(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return q.new_empty(_o_shape(q.shape, v.shape))


def _lse_like(q: torch.Tensor, packed: bool) -> torch.Tensor:
    return q.new_empty(_lse_shape(q.shape, packed), dtype=torch.float32)


@attention.register_fake
def _attention_fake(q, k, v, causal=False, window_left=-1, window_right=-1, softcap=0.0, scale=None,
                    alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None, block_table=None, seqlens_k=None):
    return _o_like(q, v)


@attention_lse.register_fake
def _attention_lse_fake(q, k, v, causal=False, window_left=-1, window_right=-1, softcap=0.0, scale=None,
                        alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None, block_table=None, seqlens_k=None):
    return _o_like(q, v), _lse_like(q, cu_seqlens_q is not None)
