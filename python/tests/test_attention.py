"""kallpa.attention on NumPy arrays against the float64 contract (reference.py): every feature of
the contract, every layout, on every CPU backend that supports the problem."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import kallpa
import reference
from conftest import close, close_lse, randn

CPU_BACKENDS = [b.name for b in kallpa.backends() if b.device == "cpu" and b.health == "healthy"]


def dense(rng, b=2, sq=5, skv=7, hq=4, hkv=2, d=16, dv=None, dtype=np.float32):
    return (randn(rng, b, sq, hq, d, dtype=dtype), randn(rng, b, skv, hkv, d, dtype=dtype),
            randn(rng, b, skv, hkv, dv or d, dtype=dtype))


def check(q, k, v, dtype="float32", **kw):
    o, lse = kallpa.attention(q, k, v, return_lse=True, **kw)
    contract = {key: value for key, value in kw.items() if key not in ("backend", "strict")}
    ref_o, ref_lse = reference.attention(q, k, v, **contract)
    assert o.dtype == q.dtype and o.shape == ref_o.shape
    assert lse.dtype == np.float32 and lse.shape == ref_lse.shape
    close(o, ref_o, dtype)
    close_lse(lse, ref_lse, dtype)
    return o


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("features", [
    {},
    {"causal": True},
    {"window": (3, 0)},
    {"window": (2, 1), "causal": False},
    {"causal": True, "window": (4, -1)},
    {"softcap": 5.0},
    {"scale": 0.3},
    {"alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625], dtype=np.float32)},
    {"causal": True, "softcap": 3.0, "alibi_slopes": np.array([0.1, 0.2, 0.3, 0.4], dtype=np.float32)},
], ids=lambda f: ",".join(f) or "plain")
def test_dense_features_on_every_backend(rng, backend, features):
    q, k, v = dense(rng)
    explanation = kallpa.explain(q, k, v, backend=backend, **features)
    if not next(x for x in explanation.verdicts if x.backend == backend).supported:
        pytest.skip(f"{backend} does not support {explanation.signature}")
    check(q, k, v, backend=backend, strict=True, **features)


@pytest.mark.parametrize("sq,skv", [(5, 5), (1, 9), (3, 8), (8, 3), (6, 0)])
def test_causal_is_bottom_right_and_rows_without_keys_are_zero(rng, sq, skv):
    q, k, v = dense(rng, sq=sq, skv=skv)
    o = check(q, k, v, causal=True)
    if sq > skv:  # the first sq - skv rows see no key: o = 0 (lse = -inf, checked above)
        assert not o[:, : sq - skv].any()


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (6, 1)])
def test_gqa_and_mqa(rng, hq, hkv):
    check(*dense(rng, hq=hq, hkv=hkv), causal=True)


def test_value_head_dim_differs(rng):
    check(*dense(rng, d=16, dv=8))


@pytest.mark.parametrize("dtype", ["float16"])
def test_half_precision(rng, dtype):
    check(*dense(rng, dtype=np.dtype(dtype)), dtype=dtype, causal=True)


def test_varlen_packed_q_and_kv_with_empty_sequences(rng):
    cu_q = np.array([0, 3, 3, 7, 8], dtype=np.int32)
    cu_k = np.array([0, 5, 9, 9, 15], dtype=np.int32)
    q, k, v = randn(rng, 8, 4, 16), randn(rng, 15, 2, 16), randn(rng, 15, 2, 16)
    for features in ({}, {"causal": True}, {"window": (2, 2)}):
        check(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **features)


def test_index_arrays_take_any_integer_type_and_lists(rng):
    q, k, v = randn(rng, 5, 2, 8), randn(rng, 6, 2, 8), randn(rng, 6, 2, 8)
    a = kallpa.attention(q, k, v, cu_seqlens_q=[0, 2, 5], cu_seqlens_k=np.array([0, 4, 6], dtype=np.int64))
    b = kallpa.attention(q, k, v, cu_seqlens_q=np.array([0, 2, 5], np.int32), cu_seqlens_k=[0, 4, 6])
    np.testing.assert_array_equal(a, b)


def paged_cache(rng, lengths, page=4, hkv=2, d=16, spare_blocks=3):
    """k/v pools [blocks, page, hkv, d] with each sequence's blocks scattered (and shuffled)."""
    need = [-(-n // page) for n in lengths]
    blocks = sum(need) + spare_blocks
    order = rng.permutation(blocks)
    table = np.zeros((len(lengths), max(need + [1])), dtype=np.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = order[at:at + n]
        at += n
    k = randn(rng, blocks, page, hkv, d)
    v = randn(rng, blocks, page, hkv, d)
    return k, v, table, np.array(lengths, dtype=np.int32)


def test_paged_decode(rng):
    k, v, table, lens = paged_cache(rng, [9, 1, 13])
    q = randn(rng, 3, 1, 4, 16)
    for features in ({}, {"causal": True}, {"window": (5, 0)}, {"softcap": 2.0}):
        check(q, k, v, block_table=table, seqlens_k=lens, **features)


def test_paged_chunked_prefill_with_packed_q(rng):
    k, v, table, lens = paged_cache(rng, [10, 7])
    q = randn(rng, 7, 4, 16)
    check(q, k, v, cu_seqlens_q=np.array([0, 4, 7], np.int32), block_table=table, seqlens_k=lens, causal=True)


def test_empty_batch_writes_nothing(rng):
    q, k, v = dense(rng, b=0)
    o, lse = kallpa.attention(q, k, v, return_lse=True)
    assert o.shape == (0, 5, 4, 16) and lse.shape == (0, 4, 5)


def test_out_is_written_in_place_and_returned(rng):
    q, k, v = dense(rng)
    out = np.full(q.shape, np.nan, dtype=np.float32)
    got = kallpa.attention(q, k, v, out=out)
    assert got is out
    close(out, reference.attention(q, k, v)[0])


def test_strided_views_are_read_without_copies(rng):
    # PyTorch's usual [B, H, S, D] memory seen as [B, S, H, D]: strided, unit stride along D.
    q4 = randn(rng, 2, 4, 256, 64)
    k4 = randn(rng, 2, 2, 256, 64)
    v4 = randn(rng, 2, 2, 256, 64)
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q4, k4, v4))
    assert not q.flags.c_contiguous
    out = np.empty(q.shape, dtype=np.float32)
    kallpa.attention(q, k, v, out=out, causal=True)  # warm: dispatcher caches, health checks
    tracemalloc.start()
    kallpa.attention(q, k, v, out=out, causal=True)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < q.nbytes // 8, f"{peak} bytes allocated from Python for a {q.nbytes}-byte q: a copy was made"
    close(out, reference.attention(q, k, v, causal=True)[0])


def test_read_only_inputs_are_accepted(rng):
    q, k, v = dense(rng)
    for x in (q, k, v):
        x.flags.writeable = False
    check(q, k, v)


def test_explain_names_the_selected_backend(rng):
    q, k, v = dense(rng)
    e = kallpa.explain(q, k, v, causal=True)
    assert e.selected in CPU_BACKENDS
    assert "causal" in e.signature and "hq=4" in e.signature
    assert {x.backend for x in e.verdicts} == {b.name for b in kallpa.backends()}
    assert str(e).startswith("problem: ")
    forced = kallpa.explain(q, k, v, backend="reference")
    assert forced.selected == "reference"


def test_backends_lists_the_registry():
    names = [b.name for b in kallpa.backends()]
    assert "reference" in names and "cpu-flash" in names
    ref = next(b for b in kallpa.backends() if b.name == "reference")
    assert ref.health == "healthy" and ref.device == "cpu" and ref.version
