#!/usr/bin/env python3
"""Cross-checks `kallpa embed` against an independent implementation of the same sentence encoder.

The reference: Hugging Face `tokenizers` loading the folder's own tokenizer.json (BERT normaliser,
pre-tokenizer and WordPiece, as sentence-transformers tokenizes), and a BERT forward pass written
here in numpy, in float64, from the safetensors bytes (read with numpy alone: the 8-byte header
length, the JSON header, the data), followed by the folder's pooling (mean over every token) and
L2 normalisation. kallpa reads the same folder with its own C++ safetensors reader, WordPiece
tokenizer (ICU) and encoder (the op interface and the attention dispatcher, all sequences packed
into one bidirectional problem).

Compared on the tokenizer corpus of tests/tokenizer/crosscheck.py, BERT-specific texts (accents,
CJK, punctuation, control characters, a Greek final sigma, a dotted capital I, words longer than
100 characters) and seeded random mixtures: token ids must be equal, and each vector's cosine with
the reference at least --min-cosine (default 0.9999). Texts the reference tokenizes to more than
the encoder's 256 tokens are checked separately: kallpa must refuse them with an error naming the
input.

Exit status: 0 all equal; 1 any mismatch; 77 skipped (numpy, tokenizers or the model missing).

  crosscheck.py --kallpa build/tools/kallpa/kallpa [--model DIR] [--random N] [--time]

The model: --model, else $KALLPA_EMBEDDING_MODEL, else $KALLPA_MODEL_DIR/all-MiniLM-L6-v2, else
<repo>/models/all-MiniLM-L6-v2 (scripts/fetch_model.sh --model minilm). --time also prints the
time per text of both implementations on the corpus (informational; not a test).
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

# One BLAS thread: the reference's products are small, and BLAS threads spinning beside kallpa's
# (and other tests') on a busy machine make it many times slower.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tokenizer"))
from crosscheck import CORPUS, find_model, random_corpus, skip  # noqa: E402

MODEL_DIR = "all-MiniLM-L6-v2"

BERT_CORPUS = [
    "Héllo Wörld! Ça va? Ñandú, Ærøskøbing, naïve café, résumé",
    "ΟΔΟΣ ΣΟΦΟΣ — final sigma: ΣΊΣΥΦΟΣ",
    "İstanbul'da İyi ıslak IŞIK",
    "中文分词测试：我爱北京天安门。日本語のテキスト、한국어 텍스트",
    "don't stop-believing... (really?) [yes] {no} <maybe> #tag @user $5.00 100% a^b `code` ~tilde",
    "control\u0000chars\u0007and\u200bzero\u200dwidth\ufeffmarks\ufffd",
    "supercalifragilisticexpialidocious" * 4,
    "x" * 101 + " short",
    "unaffable unbelievable antidisestablishmentarianism",
    "a long input: " + "one two three four five six seven eight nine ten " * 30,
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
]


def read_safetensors(path, np):
    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    dtypes = {"F32": np.float32, "F16": np.float16, "BF16": None, "I64": np.int64}
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        b, e = t["data_offsets"]
        if t["dtype"] == "BF16":
            u = np.frombuffer(raw[base + b:base + e], dtype=np.uint16).astype(np.uint32) << 16
            arr = u.view(np.float32)
        else:
            arr = np.frombuffer(raw[base + b:base + e], dtype=dtypes[t["dtype"]])
        out[name] = arr.reshape(t["shape"]).astype(np.float64)
    return out


def erf(x, np):
    """erf by Numerical Recipes' Chebyshev erfc (relative error below 1.2e-7 everywhere), vectorised:
    numpy has no erf, and math.erf element by element takes minutes on the corpus."""
    z = np.abs(x)
    t = 1.0 / (1.0 + 0.5 * z)
    poly = (-z * z - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (
        -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277)))))))))
    erfc = t * np.exp(poly)
    return np.where(x >= 0, 1.0 - erfc, erfc - 1.0)


class Reference:
    def __init__(self, folder, np):
        self.np = np
        cfg = json.load(open(os.path.join(folder, "config.json")))
        self.w = read_safetensors(os.path.join(folder, "model.safetensors"), np)
        self.layers = cfg["num_hidden_layers"]
        self.heads = cfg["num_attention_heads"]
        self.eps = cfg["layer_norm_eps"]

    def ln(self, x, name):
        np = self.np
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + self.eps) * self.w[name + ".weight"] + self.w[name + ".bias"]

    def dense(self, x, name):
        return x @ self.w[name + ".weight"].T + self.w[name + ".bias"]

    def embed(self, ids):
        np, w = self.np, self.w
        n = len(ids)
        x = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:n]
             + w["embeddings.token_type_embeddings.weight"][0])
        x = self.ln(x, "embeddings.LayerNorm")
        d = x.shape[1] // self.heads
        for i in range(self.layers):
            p = f"encoder.layer.{i}."
            q = self.dense(x, p + "attention.self.query").reshape(n, self.heads, d).transpose(1, 0, 2)
            k = self.dense(x, p + "attention.self.key").reshape(n, self.heads, d).transpose(1, 0, 2)
            v = self.dense(x, p + "attention.self.value").reshape(n, self.heads, d).transpose(1, 0, 2)
            s = q @ k.transpose(0, 2, 1) / math.sqrt(d)
            s = np.exp(s - s.max(-1, keepdims=True))
            a = (s / s.sum(-1, keepdims=True)) @ v
            a = a.transpose(1, 0, 2).reshape(n, -1)
            x = self.ln(x + self.dense(a, p + "attention.output.dense"), p + "attention.output.LayerNorm")
            h = self.dense(x, p + "intermediate.dense")
            h = 0.5 * h * (1.0 + erf(h / math.sqrt(2.0), np))
            x = self.ln(x + self.dense(h, p + "output.dense"), p + "output.LayerNorm")
        pooled = x.mean(0)
        return pooled / max(np.linalg.norm(pooled), 1e-12)


def run_kallpa(kallpa, folder, texts, workdir):
    path = os.path.join(workdir, "texts.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(texts, f, ensure_ascii=False)
    proc = subprocess.run([kallpa, "embed", "-m", folder, "--tokens", "--input-json", path],
                          capture_output=True, text=True, check=False)
    return proc


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kallpa", required=True)
    ap.add_argument("--model")
    ap.add_argument("--random", type=int, default=150)
    ap.add_argument("--min-cosine", type=float, default=0.9999)
    ap.add_argument("--time", action="store_true")
    args = ap.parse_args()
    try:
        import numpy as np
        from tokenizers import Tokenizer
    except ImportError as e:
        skip(f"python package missing: {e}")
    folder = find_model(args.model, env="KALLPA_EMBEDDING_MODEL", model_file=MODEL_DIR)
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        skip(f"no encoder at {folder} (bash scripts/fetch_model.sh --model minilm)")
    hf = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    hf.no_truncation()
    hf.no_padding()
    max_tokens = json.load(open(os.path.join(folder, "sentence_bert_config.json")))["max_seq_length"]

    texts = [t for t in CORPUS if isinstance(t, str)] + BERT_CORPUS + random_corpus(args.random, seed=20261207)
    want_ids = [hf.encode(t).ids for t in texts]
    fits = [i for i, ids in enumerate(want_ids) if len(ids) <= max_tokens]
    too_long = [i for i, ids in enumerate(want_ids) if len(ids) > max_tokens]
    failures = 0
    with tempfile.TemporaryDirectory() as workdir:
        started = time.perf_counter()
        proc = run_kallpa(args.kallpa, folder, [texts[i] for i in fits], workdir)
        kallpa_seconds = time.perf_counter() - started
        if proc.returncode != 0:
            print(f"FAIL: kallpa embed exited {proc.returncode}: {proc.stderr.strip()}")
            return 1
        got = json.loads(proc.stdout)["data"]
        for long_index in too_long[:3]:
            bad = run_kallpa(args.kallpa, folder, [texts[fits[0]], texts[long_index]], workdir)
            if bad.returncode == 0 or "input[1]" not in bad.stderr:
                failures += 1
                print(f"MISMATCH [too long] {len(want_ids[long_index])} tokens: exit {bad.returncode}, "
                      f"stderr {bad.stderr.strip()!r}")
    ref = Reference(folder, np)
    started = time.perf_counter()
    worst = 1.0
    for item, i in zip(got, fits):
        text = texts[i]
        if item["tokens"] != want_ids[i]:
            failures += 1
            print(f"MISMATCH [tokens] text={text!r}\n    kallpa: {item['tokens']}\n    hf:     {want_ids[i]}")
            continue
        r = ref.embed(want_ids[i])
        v = np.asarray(item["embedding"], dtype=np.float64)
        cos = float(v @ r / (np.linalg.norm(v) * np.linalg.norm(r)))
        worst = min(worst, cos)
        if not cos >= args.min_cosine:
            failures += 1
            print(f"MISMATCH [cosine {cos:.7f}] text={text!r}")
    ref_seconds = time.perf_counter() - started
    print(f"{len(fits)} texts ({sum(len(want_ids[i]) for i in fits)} tokens): token ids equal for "
          f"{len(fits) - failures}, worst cosine {worst:.9f}; {len(too_long)} over {max_tokens} tokens refused")
    if args.time:
        print(f"time: kallpa embed (process, load included) {kallpa_seconds:.3f} s, "
              f"numpy float64 reference {ref_seconds:.3f} s")
    if failures:
        print(f"FAIL: {failures} mismatches")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
