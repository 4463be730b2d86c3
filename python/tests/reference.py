"""The attention contract (include/kallpa/attention.h) in NumPy float64: plain loops over sequences
and heads, written from the contract's text, for the tests to judge kallpa.attention against."""

from __future__ import annotations

import numpy as np


def _sequences(q, k, v, cu_q, cu_k, block_table, seqlens_k):
    """Per sequence: (q rows [Sq, Hq, D], k rows [Skv, Hkv, D], v rows [Skv, Hkv, Dv], q row offset)."""
    if cu_q is not None:
        batch = len(cu_q) - 1
        qs = [(q[cu_q[b]:cu_q[b + 1]], cu_q[b]) for b in range(batch)]
    else:
        batch = q.shape[0]
        qs = [(q[b], None) for b in range(batch)]
    out = []
    for b in range(batch):
        if block_table is not None:
            page = k.shape[1]
            n = int(seqlens_k[b])
            idx = [(block_table[b][j // page], j % page) for j in range(n)]
            kb = np.stack([k[blk, r] for blk, r in idx]) if n else k[:0, 0]
            vb = np.stack([v[blk, r] for blk, r in idx]) if n else v[:0, 0]
        elif cu_k is not None:
            kb, vb = k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
        else:
            kb, vb = k[b], v[b]
        out.append((qs[b][0], kb, vb))
    return out


def attention(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, alibi_slopes=None, scale=None,
              cu_seqlens_q=None, cu_seqlens_k=None, block_table=None, seqlens_k=None):
    """(o, lse) in float64, shaped as kallpa returns them."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    hq, d = q.shape[-2], q.shape[-1]
    hkv, dv = k.shape[-2], v.shape[-1]
    group = hq // hkv
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    left, right = window
    o = np.zeros((*q.shape[:-1], dv))
    packed = cu_seqlens_q is not None
    lse = np.full((hq, q.shape[0]) if packed else (q.shape[0], hq, q.shape[1]), -np.inf)
    for b, (qb, kb, vb) in enumerate(_sequences(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqlens_k)):
        sq, skv = qb.shape[0], kb.shape[0]
        for h in range(hq):
            kh = h // group
            for i in range(sq):
                p = i + skv - sq
                js = np.arange(skv)
                visible = np.ones(skv, dtype=bool)
                if causal:
                    visible &= js <= p
                if left >= 0:
                    visible &= js >= p - left
                if right >= 0:
                    visible &= js <= p + right
                s = scale * (kb[:, kh, :] @ qb[i, h, :])
                if softcap > 0:
                    s = softcap * np.tanh(s / softcap)
                if alibi_slopes is not None:
                    s = s - alibi_slopes[h] * np.abs(p - js)
                s = np.where(visible, s, -np.inf)
                row = (cu_seqlens_q[b] + i) if packed else i
                if not visible.any() or np.all(np.isneginf(s)):
                    continue  # o stays 0, lse -inf
                m = s.max()
                w = np.exp(s - m)
                total = w.sum()
                value = (w / total) @ vb[:, kh, :]
                if packed:
                    o[row, h] = value
                    lse[h, row] = m + np.log(total)
                else:
                    o[b, row, h] = value
                    lse[b, h, row] = m + np.log(total)
    return o, lse
