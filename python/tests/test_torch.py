"""kallpa.attention on PyTorch CPU tensors against torch.nn.functional.scaled_dot_product_attention
where their semantics agree, and the torch.ops.kallpa operators in eager mode and in torch.compile.

SDPA's is_causal aligns the mask top-left (query i sees keys j <= i); kallpa's, like FlashAttention
2.1+, bottom-right (j <= i + Skv - Sq). They agree when Sq == Skv; otherwise SDPA is given kallpa's
mask explicitly."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="PyTorch is not installed in .venv (scripts/requirements-torch.txt): torch tests skipped")

import kallpa  # noqa: E402
import kallpa.torch_ops  # noqa: E402,F401  (registers torch.ops.kallpa.*)
import reference  # noqa: E402
from conftest import close, close_lse  # noqa: E402

F = torch.nn.functional
TORCH_TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2.5e-2}


def bhsd(b, h, s, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, s, d, generator=g).to(dtype)


def kallpa_layout(x):
    """[B, H, S, D] seen as [B, S, H, D]: a strided view, no copy."""
    return x.transpose(1, 2)


def sdpa(q, k, v, **kw):
    return F.scaled_dot_product_attention(q, k, v, **kw)


def assert_close(actual, expected, dtype):
    tol = TORCH_TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_sdpa_where_semantics_agree(dtype, hq, hkv, causal):
    q, k, v = bhsd(2, hq, 33, 64, dtype, 1), bhsd(2, hkv, 33, 64, dtype, 2), bhsd(2, hkv, 33, 64, dtype, 3)
    # The half-precision reference is SDPA in float32 on the same (rounded) inputs.
    expected = sdpa(q.float(), k.float(), v.float(), is_causal=causal, enable_gqa=hq != hkv)
    o = kallpa.attention(kallpa_layout(q), kallpa_layout(k), kallpa_layout(v), causal=causal)
    assert o.dtype == dtype and o.shape == (2, 33, hq, 64)
    assert_close(kallpa_layout(o), expected, dtype)


def test_scale_matches_sdpa():
    q, k, v = bhsd(1, 2, 9, 32, seed=4), bhsd(1, 2, 9, 32, seed=5), bhsd(1, 2, 9, 32, seed=6)
    o = kallpa.attention(kallpa_layout(q), kallpa_layout(k), kallpa_layout(v), scale=0.05)
    assert_close(kallpa_layout(o), sdpa(q, k, v, scale=0.05), torch.float32)


def test_causal_with_fewer_queries_than_keys_is_bottom_right():
    sq, skv = 4, 11
    q, k, v = bhsd(1, 2, sq, 32, seed=7), bhsd(1, 2, skv, 32, seed=8), bhsd(1, 2, skv, 32, seed=9)
    o = kallpa_layout(kallpa.attention(kallpa_layout(q), kallpa_layout(k), kallpa_layout(v), causal=True))
    bottom_right = torch.ones(sq, skv, dtype=torch.bool).tril(diagonal=skv - sq)
    assert_close(o, sdpa(q, k, v, attn_mask=bottom_right), torch.float32)
    # SDPA's own is_causal is top-left: a different answer for these shapes.
    assert not torch.allclose(o, sdpa(q, k, v, is_causal=True), atol=1e-3)


def test_sliding_window_matches_sdpa_with_that_mask():
    s, left = 16, 3
    q, k, v = bhsd(1, 2, s, 32, seed=10), bhsd(1, 2, s, 32, seed=11), bhsd(1, 2, s, 32, seed=12)
    i = torch.arange(s)[:, None]
    j = torch.arange(s)[None, :]
    mask = (j <= i) & (j >= i - left)
    o = kallpa.attention(kallpa_layout(q), kallpa_layout(k), kallpa_layout(v), causal=True, window=(left, 0))
    assert_close(kallpa_layout(o), sdpa(q, k, v, attn_mask=mask), torch.float32)


def test_bfloat16_against_float64():
    q, k, v = (bhsd(2, 4, 17, 32, torch.bfloat16, s) for s in (13, 14, 15))
    q, k, v = (kallpa_layout(x) for x in (q, k, v))
    o, lse = kallpa.attention(q, k, v, causal=True, return_lse=True)
    ref_o, ref_lse = reference.attention(*(x.float().numpy() for x in (q, k, v)), causal=True)
    close(o.float().numpy(), ref_o, "bfloat16")
    close_lse(lse.numpy(), ref_lse, "bfloat16")


def test_out_tensor_is_written_in_place_and_grad_inputs_are_read():
    q, k, v = (kallpa_layout(bhsd(1, 2, 8, 16, seed=s)) for s in (16, 17, 18))
    q.requires_grad_(True)
    out = torch.full((1, 8, 2, 16), float("nan"))
    got = kallpa.attention(q, k, v, out=out)
    assert got is out and not out.requires_grad
    close(out.numpy(), reference.attention(q.detach().numpy(), k.numpy(), v.numpy())[0])


def test_torch_index_tensors_for_varlen_and_paged():
    g = torch.Generator().manual_seed(19)
    q, k, v = torch.randn(7, 4, 16, generator=g), torch.randn(9, 2, 16, generator=g), torch.randn(9, 2, 16, generator=g)
    cu_q, cu_k = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int64)
    o = kallpa.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    close(o.numpy(), reference.attention(q.numpy(), k.numpy(), v.numpy(), causal=True, cu_seqlens_q=cu_q.numpy(),
                                         cu_seqlens_k=cu_k.numpy())[0])
    kp, vp = torch.randn(5, 4, 2, 16, generator=g), torch.randn(5, 4, 2, 16, generator=g)
    table, lens = torch.tensor([[3, 0], [4, 1]], dtype=torch.int32), torch.tensor([6, 5], dtype=torch.int32)
    qd = torch.randn(2, 1, 4, 16, generator=g)
    o = kallpa.attention(qd, kp, vp, block_table=table, seqlens_k=lens)
    close(o.numpy(), reference.attention(qd.numpy(), kp.numpy(), vp.numpy(), block_table=table.numpy(),
                                         seqlens_k=lens.numpy())[0])


def test_meta_tensors_are_refused_with_a_typed_error():
    q = torch.empty(1, 4, 2, 16, device="meta")
    with pytest.raises((kallpa.InvalidArgumentError, kallpa.UnsupportedError)):
        kallpa.attention(q, q, q)


def test_custom_op_matches_the_function():
    q, k, v = (kallpa_layout(bhsd(2, 4, 12, 32, seed=s)) for s in (20, 21, 22))
    expected = kallpa.attention(q, k, v, causal=True, softcap=4.0)
    torch.testing.assert_close(torch.ops.kallpa.attention(q, k, v, causal=True, softcap=4.0), expected)
    o, lse = torch.ops.kallpa.attention_lse(q, k, v, causal=True, window_left=3, window_right=0)
    eo, else_ = kallpa.attention(q, k, v, causal=True, window=(3, 0), return_lse=True)
    torch.testing.assert_close(o, eo)
    torch.testing.assert_close(lse, else_)


def test_custom_op_passes_opcheck():
    q, k, v = (bhsd(1, 5, 2, 16, seed=s) for s in (23, 24, 25))
    torch.library.opcheck(torch.ops.kallpa.attention.default, (q, k, v), {"causal": True})
    torch.library.opcheck(torch.ops.kallpa.attention_lse.default, (q, k, v), {"causal": True})
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    torch.library.opcheck(torch.ops.kallpa.attention_lse.default, (q[0], k[0], v[0]),
                          {"cu_seqlens_q": cu, "cu_seqlens_k": cu})


def test_custom_op_inside_torch_compile():
    proj = torch.nn.Linear(32, 32)

    def block(x, k, v):
        q = proj(x).view(x.shape[0], x.shape[1], 4, 8)
        o = torch.ops.kallpa.attention(q, k, v, causal=True)
        return torch.relu(o.reshape(x.shape)) + x

    x = torch.randn(2, 6, 32)
    k, v = torch.randn(2, 6, 2, 8), torch.randn(2, 6, 2, 8)
    compiled = torch.compile(block, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, k, v), block(x, k, v))
        x2 = torch.randn(2, 6, 32)  # a second call reuses the compiled graph
        torch.testing.assert_close(compiled(x2, k, v), block(x2, k, v))
