#!/usr/bin/env python3
"""Sentence-embedding throughput: `kallpa embed` against the same encoder in PyTorch, side by side.

The peer is all-MiniLM-L6-v2 written in PyTorch eager (float32, torch.nn.functional's layer_norm,
exact gelu and scaled_dot_product_attention with a padding mask, sentence-transformers' mean
pooling and normalisation), on the same folder, tokenized by Hugging Face `tokenizers` from the
folder's tokenizer.json, in batches of --batch texts padded to their longest, with
torch.set_num_threads(--threads). kallpa runs `kallpa embed --input-json` as a process; its time
is the run on the corpus minus the run on one text (the load), each the best of --rounds, the two
implementations alternated round by round. Also prints the worst cosine between the two.

  embeddings_peer.py --kallpa build/tools/kallpa/kallpa [--model DIR] [--texts 1000] [--threads 2]
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
WORDS = ("the a of and to in is was for on with as by at from that this it be are an or not "
         "model token vector kernel memory cache server client request answer question engine "
         "attention backend device matrix batch sequence embedding sentence language").split()


def corpus(n, seed=7):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40))).capitalize() + "." for _ in range(n)]


def kallpa_seconds(kallpa, folder, texts, workdir, threads):
    path = os.path.join(workdir, f"texts{len(texts)}.json")
    with open(path, "w") as f:
        json.dump(texts, f)
    env = dict(os.environ, KALLPA_THREADS=str(threads))
    start = time.perf_counter()
    out = subprocess.run([kallpa, "embed", "-m", folder, "--input-json", path], env=env, capture_output=True,
                         text=True, check=True).stdout
    return time.perf_counter() - start, json.loads(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kallpa", required=True)
    ap.add_argument("--model", default=os.path.join(REPO, "models", "all-MiniLM-L6-v2"))
    ap.add_argument("--texts", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import numpy as np
    import torch
    import torch.nn.functional as F
    from tokenizers import Tokenizer

    import importlib.util
    spec = importlib.util.spec_from_file_location("embeddings_crosscheck",
                                                  os.path.join(REPO, "tests", "embeddings", "crosscheck.py"))
    crosscheck = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(crosscheck)  # for its numpy safetensors reader

    torch.set_num_threads(args.threads)
    cfg = json.load(open(os.path.join(args.model, "config.json")))
    w = {k: torch.from_numpy(v.astype(np.float32)) for k, v in
         crosscheck.read_safetensors(os.path.join(args.model, "model.safetensors"), np).items() if v.ndim >= 1}
    heads, eps = cfg["num_attention_heads"], cfg["layer_norm_eps"]
    tok = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    tok.no_truncation()
    tok.enable_padding()

    def dense(x, name):
        return F.linear(x, w[name + ".weight"], w[name + ".bias"])

    def ln(x, name):
        return F.layer_norm(x, x.shape[-1:], w[name + ".weight"], w[name + ".bias"], eps)

    @torch.inference_mode()
    def torch_embed(texts):
        out = []
        for i in range(0, len(texts), args.batch):
            enc = tok.encode_batch(texts[i:i + args.batch])
            ids = torch.tensor([e.ids for e in enc])
            mask = torch.tensor([e.attention_mask for e in enc], dtype=torch.bool)
            b, n = ids.shape
            x = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:n]
                 + w["embeddings.token_type_embeddings.weight"][0])
            x = ln(x, "embeddings.LayerNorm")
            d = x.shape[-1] // heads
            for layer in range(cfg["num_hidden_layers"]):
                p = f"encoder.layer.{layer}."
                q, k, v = (dense(x, p + f"attention.self.{m}").view(b, n, heads, d).transpose(1, 2)
                           for m in ("query", "key", "value"))
                a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
                x = ln(x + dense(a.transpose(1, 2).reshape(b, n, -1), p + "attention.output.dense"),
                       p + "attention.output.LayerNorm")
                h = F.gelu(dense(x, p + "intermediate.dense"))
                x = ln(x + dense(h, p + "output.dense"), p + "output.LayerNorm")
            m = mask[..., None].float()
            pooled = (x * m).sum(1) / m.sum(1)
            out.append(F.normalize(pooled, dim=-1))
        return torch.cat(out).numpy()

    texts = corpus(args.texts)
    tokens = sum(len(e.ids) - e.ids.count(0) for e in tok.encode_batch(texts))
    best_k, best_t = float("inf"), float("inf")
    with tempfile.TemporaryDirectory() as workdir:
        for _ in range(args.rounds):
            load, _ = kallpa_seconds(args.kallpa, args.model, texts[:1], workdir, args.threads)
            full, got = kallpa_seconds(args.kallpa, args.model, texts, workdir, args.threads)
            best_k = min(best_k, max(full - load, 1e-9))
            start = time.perf_counter()
            ref = torch_embed(texts)
            best_t = min(best_t, time.perf_counter() - start)
    vec = np.array([d["embedding"] for d in got["data"]])
    cos = (vec * ref).sum(1) / (np.linalg.norm(vec, axis=1) * np.linalg.norm(ref, axis=1))
    print(f"{len(texts)} texts, {tokens} tokens, {args.threads} threads, best of {args.rounds}")
    print(f"kallpa embed: {best_k:.3f} s ({len(texts) / best_k:.0f} texts/s, {tokens / best_k:.0f} tokens/s)")
    print(f"PyTorch {torch.__version__} eager, batch {args.batch}: {best_t:.3f} s "
          f"({len(texts) / best_t:.0f} texts/s, {tokens / best_t:.0f} tokens/s)")
    print(f"ratio kallpa/PyTorch (throughput): {best_t / best_k:.2f}x; worst cosine {cos.min():.7f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
