#!/usr/bin/env python3
"""An independent Llama forward pass in NumPy, reading a GGUF file with the `gguf` package.

It shares no code with kallpa: tensors are dequantised by gguf.quants, RoPE follows GGUF's llama
convention (adjacent pairs), attention is a plain causal softmax. Used by tests to check kallpa's
logits.

    python3 tools/reference/llama_numpy.py MODEL.gguf 1 2 3 4      # prints the last token's logits as JSON
"""
import json
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def load(path):
    r = GGUFReader(path)
    t = {}
    for tensor in r.tensors:
        w = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        # gguf's shape lists ne0 first; NumPy holds the data row-major with ne0 last.
        t[tensor.name] = w.reshape([int(d) for d in reversed(tensor.shape)])
    arch = field(r, "general.architecture")
    cfg = {
        "n_layer": int(field(r, f"{arch}.block_count")),
        "n_head": int(field(r, f"{arch}.attention.head_count")),
        "n_head_kv": int(field(r, f"{arch}.attention.head_count_kv")),
        "eps": float(field(r, f"{arch}.attention.layer_norm_rms_epsilon")),
        "base": float(field(r, f"{arch}.rope.freq_base", 10000.0)),
    }
    return cfg, t


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + eps).astype(np.float32) * w


def rope(x, pos, base):
    # x: [T, H, D]; pairs (2i, 2i+1) rotate by pos * base^(-2i/D)
    d = x.shape[-1]
    inv = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = pos[:, None].astype(np.float64) * inv[None, :]
    c = np.cos(ang)[:, None, :].astype(np.float32)
    s = np.sin(ang)[:, None, :].astype(np.float32)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def forward(cfg, t, ids):
    n = len(ids)
    x = t["token_embd.weight"][ids]
    hq, hkv = cfg["n_head"], cfg["n_head_kv"]
    pos = np.arange(n)
    for l in range(cfg["n_layer"]):
        p = f"blk.{l}."
        h = rms(x, t[p + "attn_norm.weight"], cfg["eps"])
        q = (h @ t[p + "attn_q.weight"].T).reshape(n, hq, -1)
        k = (h @ t[p + "attn_k.weight"].T).reshape(n, hkv, -1)
        v = (h @ t[p + "attn_v.weight"].T).reshape(n, hkv, -1)
        q, k = rope(q, pos, cfg["base"]), rope(k, pos, cfg["base"])
        d = q.shape[-1]
        out = np.zeros_like(q)
        for head in range(hq):
            kh = head // (hq // hkv)
            s = (q[:, head, :] @ k[:, kh, :].T) / np.sqrt(d)
            s = s + np.triu(np.full((n, n), -np.inf, dtype=np.float32), 1)
            s = s - s.max(axis=-1, keepdims=True)
            pr = np.exp(s)
            pr /= pr.sum(axis=-1, keepdims=True)
            out[:, head, :] = pr @ v[:, kh, :]
        x = x + out.reshape(n, -1) @ t[p + "attn_output.weight"].T
        h = rms(x, t[p + "ffn_norm.weight"], cfg["eps"])
        g = h @ t[p + "ffn_gate.weight"].T
        u = h @ t[p + "ffn_up.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * u) @ t[p + "ffn_down.weight"].T
    h = rms(x[-1:], t["output_norm.weight"], cfg["eps"])
    out_w = t.get("output.weight", t["token_embd.weight"])
    return (h @ out_w.T)[0]


def main():
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    cfg, t = load(sys.argv[1])
    ids = [int(a) for a in sys.argv[2:]]
    logits = forward(cfg, t, ids)
    json.dump([float(v) for v in logits], sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
