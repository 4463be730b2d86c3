#!/usr/bin/env python3
"""kallpa's answers against llama.cpp's on the same GGUF file and the same token ids.

Two comparisons, both on token ids (no tokenizer on either side, so a file whose tokenizer kallpa
does not read yet still compares):

  greedy     each program continues the prompt greedily for --tokens steps; the script prints both
             continuations as text (pieces from llama.cpp's vocabulary) and where they part.
  positions  both programs score the same sequence (the prompt and llama.cpp's greedy
             continuation) with logits at every position; the script reports how many positions
             have the same top-1 token, and lists each disagreement with both programs' logit gaps
             between the two tokens (a near-tie is a disagreement whose gaps are small: quantised
             activations in llama.cpp's matrix products move logits by about that much).

llama.cpp runs in this process through llama-cpp-python's ctypes bindings (llama_cpp/llama_cpp.py of
the pinned sdist that bench/build_llama_cpp.sh unpacks) over the libllama.so that script builds;
kallpa runs as tests/engine's kallpa_logits_tool (`--all-positions`), built with the tests.

  python3 bench/compare_llama_cpp.py models/gemma-3-270m-q4_k_m.gguf --ids 2 818 5279 529 7001 563
  python3 bench/compare_llama_cpp.py MODEL.gguf --text '<start_of_turn>user\nHi<end_of_turn>\n' --tokens 32
  python3 bench/compare_llama_cpp.py MODEL.gguf --ids ... --tokens 32 --threads 2 --json out.json

With --text the prompt is tokenized by llama.cpp (the ids are printed), and both programs get
those ids.

Options: --llama-cpp DIR (the build's bin folder with libllama.so; default
~/.cache/kallpa/llama.cpp/build-0.3.36/bin), --bindings DIR (the sdist's llama_cpp package folder;
default found under ~/.cache/kallpa/llama.cpp/src-0.3.36), --tool PATH (default
build/tests/engine/kallpa_logits_tool).
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import importlib
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
# Where bench/build_llama_cpp.sh builds the pinned llama.cpp (the same version and cache folder).
LLAMA_CPP_VERSION = "0.3.36"
CACHE = Path(os.environ.get("KALLPA_LLAMA_CPP_CACHE",
                            Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kallpa" / "llama.cpp"))


def load_bindings(bindings: Path, lib_dir: Path):
    """llama_cpp.llama_cpp alone: the package's __init__ imports the high-level API and its
    dependencies, which the low-level calls here do not need."""
    os.environ["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
    package = types.ModuleType("llama_cpp")
    package.__path__ = [str(bindings)]
    sys.modules["llama_cpp"] = package
    return importlib.import_module("llama_cpp.llama_cpp")


class LlamaCpp:
    def __init__(self, L, model_path: str, n_ctx: int, threads: int, verbose: bool):
        self.L = L
        L.llama_backend_init()
        if not verbose:
            silent = L.llama_log_callback(lambda level, text, user: None)
            L.llama_log_set(silent, ctypes.c_void_p())
            self._keep = silent
        mp = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(model_path.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp cannot load {model_path} (--verbose shows its log)")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_ctx
        cp.n_ubatch = n_ctx
        cp.n_threads = threads
        cp.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp cannot make a context")

    def clear(self):
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def decode(self, ids, start, all_logits):
        """Decodes ids at positions start..; returns the logits of every position or the last."""
        L = self.L
        batch = L.llama_batch_init(len(ids), 0, 1)
        try:
            batch.n_tokens = len(ids)
            for i, t in enumerate(ids):
                batch.token[i] = t
                batch.pos[i] = start + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1 if all_logits or i == len(ids) - 1 else 0
            if L.llama_decode(self.ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            rows = range(len(ids)) if all_logits else [len(ids) - 1]
            return np.array([np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
                             for i in rows], dtype=np.float64)
        finally:
            L.llama_batch_free(batch)

    def greedy(self, prompt, n):
        """n greedy tokens, and the logits each was chosen from."""
        self.clear()
        logits = self.decode(prompt, 0, False)[-1]
        out, rows = [], []
        for g in range(n):
            out.append(int(logits.argmax()))
            rows.append(logits)
            if g + 1 < n:
                logits = self.decode([out[-1]], len(prompt) + g, False)[-1]
        return out, rows

    def score(self, ids):
        self.clear()
        return self.decode(ids, 0, True)

    def tokenize(self, text):
        """Token ids of text by llama.cpp's tokenizer (special tokens parsed, BOS as the file says)."""
        raw = text.encode()
        ids = (self.L.llama_token * (len(raw) + 8))()
        n = self.L.llama_tokenize(self.vocab, raw, len(raw), ids, len(ids), True, True)
        if n < 0:
            raise RuntimeError("llama_tokenize failed")
        return list(ids[:n])

    def piece(self, token):
        buf = ctypes.create_string_buffer(256)
        n = self.L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
        return buf.raw[:max(n, 0)].decode("utf-8", errors="replace")


def kallpa(tool, model, ids, generate=0, top=8):
    cmd = [str(tool), "--all-positions", "--top", str(top), "--generate", str(generate), model] + [str(i) for i in ids]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"kallpa_logits_tool failed ({out.returncode}): {out.stderr.strip()}")
    return json.loads(out.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    prompt = ap.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--ids", type=int, nargs="+", help="prompt token ids")
    prompt.add_argument("--text", help="a prompt to tokenize with llama.cpp's tokenizer (\\n for newlines)")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens to generate")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--llama-cpp", type=Path, default=CACHE / f"build-{LLAMA_CPP_VERSION}" / "bin")
    ap.add_argument("--bindings", type=Path, default=None)
    ap.add_argument("--tool", type=Path, default=ROOT / "build" / "tests" / "engine" / "kallpa_logits_tool")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--verbose", action="store_true", help="show llama.cpp's log")
    a = ap.parse_args()
    bindings = a.bindings or next(iter(glob.glob(str(CACHE / f"src-{LLAMA_CPP_VERSION}" / "*" / "llama_cpp"))), None)
    if bindings is None or not (a.llama_cpp / "libllama.so").exists():
        sys.exit(f"llama.cpp not found (libllama.so in {a.llama_cpp}, bindings {bindings}): bench/build_llama_cpp.sh")
    L = load_bindings(Path(bindings), a.llama_cpp)
    peer = LlamaCpp(L, a.model, 4096, a.threads, a.verbose)
    if a.text is not None:
        a.ids = peer.tokenize(a.text.replace("\\n", "\n"))

    theirs_gen, theirs_rows = peer.greedy(a.ids, a.tokens)
    ours = kallpa(a.tool, a.model, a.ids, generate=a.tokens)
    ours_gen = ours["generated"]
    split = next((i for i, (x, y) in enumerate(zip(ours_gen, theirs_gen)) if x != y), None)
    text = lambda toks: "".join(peer.piece(t) for t in toks)  # noqa: E731
    print(f"model: {a.model}\nprompt ids: {a.ids}\n")
    print(f"greedy, kallpa   : {text(ours_gen)!r}")
    print(f"greedy, llama.cpp: {text(theirs_gen)!r}")
    split_gaps = None
    if split is None:
        print("greedy tokens: identical\n")
    else:
        l_tok, k_tok = theirs_gen[split], ours_gen[split]
        k_row = dict((int(i), v) for i, v in ours["logits"][len(a.ids) - 1 + split])
        split_gaps = dict(llama_cpp=float(theirs_rows[split][l_tok] - theirs_rows[split][k_tok]),
                          kallpa=(k_row[k_tok] - k_row[l_tok]) if l_tok in k_row else None)
        kg = "n/a" if split_gaps["kallpa"] is None else f"{split_gaps['kallpa']:.4f}"
        print(f"greedy tokens: part at generated token {split}: llama.cpp {l_tok} {peer.piece(l_tok)!r} by "
              f"{split_gaps['llama_cpp']:.4f} logits, kallpa {k_tok} {peer.piece(k_tok)!r} by {kg}\n")

    # Per-position top-1 on one sequence: the prompt and llama.cpp's continuation.
    seq = a.ids + theirs_gen[:-1]
    ref = peer.score(seq)
    mine = kallpa(a.tool, a.model, seq, generate=0)["logits"]
    agree, ties = 0, []
    for t in range(len(seq)):
        l_top = int(ref[t].argmax())
        k_top = int(mine[t][0][0])
        if l_top == k_top:
            agree += 1
            continue
        l_gap = float(ref[t, l_top] - ref[t, k_top])
        k_logits = dict((int(i), v) for i, v in mine[t])
        k_gap = k_logits[k_top] - k_logits[l_top] if l_top in k_logits else None
        ties.append(dict(position=t, llama_cpp=l_top, kallpa=k_top, llama_cpp_gap=l_gap, kallpa_gap=k_gap,
                         llama_cpp_piece=peer.piece(l_top), kallpa_piece=peer.piece(k_top)))
    print(f"per-position top-1: {agree}/{len(seq)} equal")
    for d in ties:
        kg = "n/a (not in its top 8)" if d["kallpa_gap"] is None else f"{d['kallpa_gap']:.4f}"
        print(f"  position {d['position']}: llama.cpp {d['llama_cpp']} {d['llama_cpp_piece']!r} by "
              f"{d['llama_cpp_gap']:.4f} logits, kallpa {d['kallpa']} {d['kallpa_piece']!r} by {kg}")
    if a.json:
        a.json.write_text(json.dumps(dict(model=a.model, prompt=a.ids, kallpa_greedy=ours_gen,
                                          llama_cpp_greedy=theirs_gen, greedy_split=split,
                                          greedy_split_gaps=split_gaps, positions=len(seq),
                                          top1_equal=agree, disagreements=ties), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
