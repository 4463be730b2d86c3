#!/usr/bin/env python3
"""Synthetic GGUF files for every decoder architecture kallpa runs, and an independent NumPy
float64 forward pass of each, to check kallpa's logits position by position.

The files are written by the `gguf` package with random weights; the reference reads them back
with the same package (dequantising with gguf.quants) and shares no code with kallpa. Each
architecture's differences from Llama are spelled out below in Python, from the models' published
definitions (Hugging Face transformers) and llama.cpp's reading of their GGUF files.

    arch_models.py check TOOL [--keep DIR]    every variant: kallpa_logits_tool vs NumPy
    arch_models.py real TOOL MODEL.gguf       a real file: finite logits, same top-1 per position
    arch_models.py write VARIANT OUT.gguf     one synthetic file
    arch_models.py reference MODEL.gguf ID... the reference's logits of every position (JSON)

TOOL is tests/engine's kallpa_logits_tool (its --all-positions mode). Exit codes: 0 pass,
1 mismatch, 77 skipped (numpy or gguf missing).
"""
import json
import math
import os
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import gguf
    from gguf import GGUFReader, GGUFWriter, GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize
except ImportError as e:  # pragma: no cover - the ctest reports it as skipped
    print(f"SKIP: {e} (pip install numpy gguf)")
    sys.exit(77)

# ---------------------------------------------------------------------------------------------
# What each architecture does differently (the reference's own table).
#   rope: "adjacent" pairs (2i, 2i+1) as GGUF stores Llama; "halves" pairs (i, i + d/2) (NeoX)
#   window: None, "all" layers, or ("period", n): layer il is local when il % n < n - 1
FACTS = {
    "llama": dict(rope="adjacent", window="all"),
    "mistral": dict(rope="adjacent", window="all"),
    "qwen2": dict(rope="halves", bias=True),
    "qwen3": dict(rope="halves", qk_norm=True),
    "phi3": dict(rope="halves", fused=True),
    "gemma2": dict(rope="halves", post_norms=True, gelu=True, embd_scale=True, window=("period", 2)),
    "gemma3": dict(rope="halves", qk_norm=True, post_norms=True, gelu=True, embd_scale=True,
                   window=("period", 6), local_base=10000.0),
}

# Synthetic variants: (architecture, file options).
VARIANTS = {
    "llama": ("llama", dict(matrix=T.Q8_0)),
    "llama-rope-freqs": ("llama", dict(matrix=T.F16, rope_freqs=True, tied=True)),
    "llama-window": ("llama", dict(matrix=T.F16, window=8)),
    "mistral": ("mistral", dict(matrix=T.F32, window=8)),
    "qwen2": ("qwen2", dict(matrix=T.F16, tied=True)),
    "qwen3": ("qwen3", dict(matrix=T.Q8_0, head_dim=32)),
    "phi3": ("phi3", dict(matrix=T.F16)),
    "phi3-split": ("phi3", dict(matrix=T.F32, split_qkv=True)),
    "gemma2": ("gemma2", dict(matrix=T.F16, window=8, attn_cap=1.5, final_cap=15.0, tied=True, layers=4)),
    "gemma3": ("gemma3", dict(matrix=T.Q8_0, window=8, tied=True, layers=7, base=1e6, head_dim=32)),
    "gemma3-pattern": ("gemma3", dict(matrix=T.F16, window=5, tied=True, layers=3, base=1e6,
                                      pattern=[True, False, True], linear_scale=2.0)),
}

N_EMBD, N_HEAD, N_HEAD_KV, N_FF, VOCAB = 64, 4, 2, 96, 200


def write_variant(variant, path, seed=0):
    arch, o = VARIANTS[variant]
    f = FACTS[arch]
    rng = np.random.default_rng(seed)
    layers = o.get("layers", 2)
    hd = o.get("head_dim", 16)
    q_dim, kv_dim = N_HEAD * hd, N_HEAD_KV * hd
    w = GGUFWriter(path, arch)
    w.add_name(f"synthetic {variant}")
    w.add_context_length(256)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(layers)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(o.get("base", 10000.0))
    if "window" in o:
        w.add_sliding_window(o["window"])
    if "pattern" in o:
        w.add_sliding_window_pattern(o["pattern"])
    if "attn_cap" in o:
        w.add_attn_logit_softcapping(o["attn_cap"])
    if "final_cap" in o:
        w.add_final_logit_softcapping(o["final_cap"])
    if "linear_scale" in o:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(o["linear_scale"])
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>" for i in range(VOCAB)])

    def matrix(name, rows, cols, scale=None):
        a = rng.standard_normal((rows, cols)).astype(np.float32) * np.float32(scale or 1.0 / math.sqrt(cols))
        t = o["matrix"]
        if t == T.F32:
            w.add_tensor(name, a)
        elif t == T.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, quantize(a, t), raw_dtype=t)

    def vector(name, n, center=1.0, spread=0.2):
        w.add_tensor(name, (center + spread * rng.standard_normal(n)).astype(np.float32))

    matrix("token_embd.weight", VOCAB, N_EMBD, scale=1.0)
    vector("output_norm.weight", N_EMBD)
    if not o.get("tied"):
        matrix("output.weight", VOCAB, N_EMBD)
    if o.get("rope_freqs"):
        w.add_tensor("rope_freqs.weight", (1.0 + 7.0 * rng.random(hd // 2)).astype(np.float32))
    for il in range(layers):
        b = f"blk.{il}."
        vector(b + "attn_norm.weight", N_EMBD)
        if f.get("fused") and not o.get("split_qkv"):
            matrix(b + "attn_qkv.weight", q_dim + 2 * kv_dim, N_EMBD)
        else:
            matrix(b + "attn_q.weight", q_dim, N_EMBD)
            matrix(b + "attn_k.weight", kv_dim, N_EMBD)
            matrix(b + "attn_v.weight", kv_dim, N_EMBD)
        if f.get("bias"):
            vector(b + "attn_q.bias", q_dim, 0.0, 0.5)
            vector(b + "attn_k.bias", kv_dim, 0.0, 0.5)
            vector(b + "attn_v.bias", kv_dim, 0.0, 0.5)
        if f.get("qk_norm"):
            vector(b + "attn_q_norm.weight", hd)
            vector(b + "attn_k_norm.weight", hd)
        matrix(b + "attn_output.weight", N_EMBD, q_dim)
        if f.get("post_norms"):
            vector(b + "post_attention_norm.weight", N_EMBD)
            vector(b + "post_ffw_norm.weight", N_EMBD)
        vector(b + "ffn_norm.weight", N_EMBD)
        if f.get("fused"):
            matrix(b + "ffn_up.weight", 2 * N_FF, N_EMBD)
        else:
            matrix(b + "ffn_gate.weight", N_FF, N_EMBD)
            matrix(b + "ffn_up.weight", N_FF, N_EMBD)
        matrix(b + "ffn_down.weight", N_EMBD, N_FF)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---------------------------------------------------------------------------------------------
# The reference forward pass, float64.

class Model:
    def __init__(self, path, keep_f32=("token_embd.weight", "output.weight")):
        r = GGUFReader(path)
        self.fields = {k: v for k, v in r.fields.items()}
        self.arch = self.get("general.architecture")
        if self.arch not in FACTS:
            raise ValueError(f"no reference for architecture {self.arch}")
        self.facts = FACTS[self.arch]
        self.t = {}
        for tensor in r.tensors:
            a = dequantize(tensor.data, tensor.tensor_type)
            a = a.reshape([int(d) for d in reversed(tensor.shape)])
            # The big tables stay f32 (a 262k vocabulary in f64 is 1.3 GB); rows are widened on use.
            self.t[tensor.name] = a.astype(np.float32 if tensor.name in keep_f32 else np.float64)
        p = self.arch + "."
        g = lambda k, d=None: self.get(p + k, d)  # noqa: E731
        self.n_layer = int(g("block_count"))
        self.n_embd = int(g("embedding_length"))
        self.n_head = int(g("attention.head_count"))
        self.n_head_kv = int(g("attention.head_count_kv", self.n_head))
        self.head_dim = int(g("attention.key_length", self.n_embd // self.n_head))
        self.n_rot = int(g("rope.dimension_count", self.head_dim))
        self.eps = float(g("attention.layer_norm_rms_epsilon"))
        self.base = float(g("rope.freq_base", 10000.0))
        self.local_base = float(g("rope.freq_base_swa", self.facts.get("local_base", self.base)))
        self.freq_scale = 1.0
        if g("rope.scaling.type", "none") == "linear":
            self.freq_scale = 1.0 / float(g("rope.scaling.factor"))
        self.attn_cap = float(g("attn_logit_softcapping", 0.0))
        self.final_cap = float(g("final_logit_softcapping", 0.0))
        window = int(g("attention.sliding_window", 0))
        rule = self.facts.get("window")
        pattern = g("attention.sliding_window_pattern")
        self.window = [0] * self.n_layer
        for il in range(self.n_layer):
            if rule is None or window == 0:
                local = False
            elif rule == "all":
                local = True
            elif isinstance(pattern, list):
                local = bool(pattern[il])
            else:
                n = int(pattern) if pattern is not None else rule[1]
                local = il % n < n - 1
            self.window[il] = window if local else 0
        # Gemma's 1/sqrt(query_pre_attn_scalar): n_embd / n_head for the 27B models, else head_dim.
        big = {"gemma2": 46, "gemma3": 62}.get(self.arch)
        self.scale = 1.0 / math.sqrt(self.n_embd // self.n_head if self.n_layer == big else self.head_dim)

    def get(self, key, default=None):
        f = self.fields.get(key)
        return default if f is None else f.contents()

    def weight(self, name):
        return self.t[name]

    def rms(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def rope(self, x, pos, base, freq_scale):
        # x [T, H, D]: pair i of the first n_rot dims rotates by pos * freq_scale * base^(-2i/n_rot) / factor_i
        n = self.n_rot
        inv = freq_scale * base ** (-np.arange(0, n, 2, dtype=np.float64) / n)
        if "rope_freqs.weight" in self.t:
            inv = inv / self.t["rope_freqs.weight"]
        ang = pos[:, None].astype(np.float64) * inv[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        out = x.copy()
        if self.facts["rope"] == "adjacent":
            x0, x1 = x[..., 0:n:2], x[..., 1:n:2]
            out[..., 0:n:2] = x0 * c - x1 * s
            out[..., 1:n:2] = x0 * s + x1 * c
        else:
            h = n // 2
            x0, x1 = x[..., :h], x[..., h:n]
            out[..., :h] = x0 * c - x1 * s
            out[..., h:n] = x0 * s + x1 * c
        return out

    def forward(self, ids):
        """Logits of every position, [len(ids), vocab]."""
        f = self.facts
        n = len(ids)
        hq, hkv, d = self.n_head, self.n_head_kv, self.head_dim
        x = self.t["token_embd.weight"][ids].astype(np.float64)
        if f.get("embd_scale"):
            x = x * np.float64(np.float32(math.sqrt(self.n_embd)))
        pos = np.arange(n)
        for il in range(self.n_layer):
            p = f"blk.{il}."
            h = self.rms(x, self.weight(p + "attn_norm.weight"))
            if p + "attn_qkv.weight" in self.t:
                qkv = h @ self.weight(p + "attn_qkv.weight").T
                q, k, v = np.split(qkv, [hq * d, hq * d + hkv * d], axis=1)
            else:
                q = h @ self.weight(p + "attn_q.weight").T
                k = h @ self.weight(p + "attn_k.weight").T
                v = h @ self.weight(p + "attn_v.weight").T
            if f.get("bias"):
                q = q + self.weight(p + "attn_q.bias")
                k = k + self.weight(p + "attn_k.bias")
                v = v + self.weight(p + "attn_v.bias")
            q, k, v = q.reshape(n, hq, d), k.reshape(n, hkv, d), v.reshape(n, hkv, d)
            if f.get("qk_norm"):
                q = self.rms(q, self.weight(p + "attn_q_norm.weight"))
                k = self.rms(k, self.weight(p + "attn_k_norm.weight"))
            local = self.window[il] > 0
            base = self.local_base if local else self.base
            fs = 1.0 if local else self.freq_scale
            q, k = self.rope(q, pos, base, fs), self.rope(k, pos, base, fs)
            # Query i sees key j when j <= i and, in a local layer, i - j < window.
            visible = pos[None, :] <= pos[:, None]
            if local:
                visible &= pos[:, None] - pos[None, :] < self.window[il]
            out = np.zeros((n, hq, d))
            for head in range(hq):
                kh = head // (hq // hkv)
                s = (q[:, head, :] @ k[:, kh, :].T) * self.scale
                if self.attn_cap > 0:
                    s = self.attn_cap * np.tanh(s / self.attn_cap)
                s = np.where(visible, s, -np.inf)
                s = s - s.max(axis=-1, keepdims=True)
                pr = np.exp(s)
                pr /= pr.sum(axis=-1, keepdims=True)
                out[:, head, :] = pr @ v[:, kh, :]
            o = out.reshape(n, -1) @ self.weight(p + "attn_output.weight").T
            if f.get("post_norms"):
                o = self.rms(o, self.weight(p + "post_attention_norm.weight"))
            x = x + o
            h = self.rms(x, self.weight(p + "ffn_norm.weight"))
            if f.get("fused"):
                gu = h @ self.weight(p + "ffn_up.weight").T
                g, u = np.split(gu, 2, axis=1)
            else:
                g = h @ self.weight(p + "ffn_gate.weight").T
                u = h @ self.weight(p + "ffn_up.weight").T
            if f.get("gelu"):
                act = 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3)))
            else:
                act = g / (1.0 + np.exp(-g))
            o = (act * u) @ self.weight(p + "ffn_down.weight").T
            if f.get("post_norms"):
                o = self.rms(o, self.weight(p + "post_ffw_norm.weight"))
            x = x + o
        h = self.rms(x, self.weight("output_norm.weight"))
        out_w = self.t.get("output.weight", self.t["token_embd.weight"])
        logits = np.empty((n, out_w.shape[0]))
        for lo in range(0, out_w.shape[0], 32768):
            logits[:, lo:lo + 32768] = h @ out_w[lo:lo + 32768].astype(np.float64).T
        if self.final_cap > 0:
            logits = self.final_cap * np.tanh(logits / self.final_cap)
        return logits


# ---------------------------------------------------------------------------------------------
# Comparison.

def kallpa_logits(tool, model, ids, chunk=0):
    cmd = [tool, "--all-positions"] + (["--chunk", str(chunk)] if chunk else []) + [model] + [str(i) for i in ids]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:5])} ... failed ({out.returncode}): {out.stderr.strip()}")
    return np.array(json.loads(out.stdout)["logits"], dtype=np.float64)


def compare(label, ours, ref, tol):
    """Per-position logits within tol x max(|ref|, 1); top-1 equal unless the reference's own gap
    between the two tokens is within the tolerance (a near-tie). Returns (ok, near_ties)."""
    allowed = tol * max(float(np.abs(ref).max()), 1.0)
    err = float(np.abs(ours - ref).max())
    ok = bool(np.isfinite(ours).all()) and err <= allowed
    near = []
    for t in range(ref.shape[0]):
        a, b = int(ours[t].argmax()), int(ref[t].argmax())
        if a != b:
            gap = float(ref[t, b] - ref[t, a])
            if gap <= 2 * allowed:
                near.append((t, a, b, gap))
            else:
                ok = False
                print(f"  position {t}: top-1 {a} vs reference {b} (gap {gap:.4g})")
    print(f"{'ok  ' if ok else 'FAIL'} {label}: max |diff| {err:.3g} (allowed {allowed:.3g}), "
          f"{ref.shape[0] - len(near)}/{ref.shape[0]} top-1 equal"
          + "".join(f"; near-tie at {t}: {a} vs {b}, gap {g:.3g}" for t, a, b, g in near))
    return ok


def check(tool, keep=None):
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        work = keep or tmp
        os.makedirs(work, exist_ok=True)
        ids = [(5 + 37 * i) % (VOCAB - 3) + 3 for i in range(24)]
        for variant in VARIANTS:
            path = os.path.join(work, f"synthetic-{variant}.gguf")
            write_variant(variant, path)
            ref = Model(path).forward(ids)
            # One prefill, then chunks that put window edges inside chunks, then decode steps.
            for chunk in (0, 5, 1):
                ours = kallpa_logits(tool, path, ids, chunk)
                ok &= compare(f"{variant} (chunk {chunk or 'all'})", ours, ref, 1e-3)
    return ok


def vocab_ids(path, words):
    tokens = GGUFReader(path).fields["tokenizer.ggml.tokens"].contents()
    index = {t: i for i, t in enumerate(tokens)}
    return [index[w] for w in words]


def real(tool, path):
    """A real file: kallpa's logits finite and its top-1 the reference's at every position."""
    if not os.path.exists(path):
        print(f"SKIP: {path} not found (scripts/fetch_model.sh)")
        return 77
    # Token ids straight from the file's vocabulary (no tokenizer involved): "<bos>The capital of
    # France is" in SentencePiece pieces.
    ids = [2] + vocab_ids(path, ["The", "▁capital", "▁of", "▁France", "▁is"])
    ref = Model(path).forward(ids)
    ours = kallpa_logits(tool, path, ids)
    ok = compare(f"{os.path.basename(path)} ids {ids}", ours, ref, 3e-3)
    print(f"  top-1 after the prompt: kallpa {int(ours[-1].argmax())}, reference {int(ref[-1].argmax())}")
    return 0 if ok else 1


def main(argv):
    if len(argv) >= 3 and argv[1] == "check":
        keep = argv[4] if len(argv) >= 5 and argv[3] == "--keep" else None
        return 0 if check(argv[2], keep) else 1
    if len(argv) == 4 and argv[1] == "real":
        return real(argv[2], argv[3])
    if len(argv) == 4 and argv[1] == "write":
        write_variant(argv[2], argv[3])
        return 0
    if len(argv) >= 4 and argv[1] == "reference":
        json.dump(Model(argv[2]).forward([int(a) for a in argv[3:]]).tolist(), sys.stdout)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
