#!/usr/bin/env python3
"""kallpa and llama.cpp side by side on this machine, as ratios, in one run.

llama.cpp is the peer that users run on CPUs, so every speed claim we make about the CPU path is
checked against it here, on the same machine, in the same minutes: the two programs' runs alternate
(`--rounds`), and each ratio is kallpa's throughput over llama.cpp's (above 1: kallpa is faster),
given as the median of the per-round ratios with their range. Three comparisons, each run when its
llama.cpp program is given:

  model      --llama-bench PATH          prompt and generation tokens/s of one GGUF file
                                         (`kallpa bench model` against `llama-bench`), at each depth
  batched    --llama-batched-bench PATH  aggregate generation tokens/s of B sequences decoding
                                         together (`kallpa bench model -B` against
                                         `llama-batched-bench -npl`)
  attention  --test-backend-ops PATH     the CPU flash-attention cases of llama.cpp's own perf suite
                                         (`test-backend-ops perf -o FLASH_ATTN_EXT -b CPU`) that the
                                         kallpa contract expresses, each timed by
                                         `kallpa bench attention` on the same shape

  matmul     --test-backend-ops PATH     quantised matrix products on a model's own shapes and types
             --matmul                    (by default Gemma-3-270M Q4_K_M's: Q5_0, Q4_K, Q6_K, Q8_0),
                                         `test-backend-ops perf -b CPU --test-file` with one MUL_MAT
                                         case per shape against `quant_matmul_bench`'s
                                         BM_GemmaMatmul, one thread each

How the matmul cases map: a kallpa W of rows x cols (outputs x inputs) times a batch of b rows is
ggml's MUL_MAT with src0 of that type, ne [cols, rows] (m = rows, k = cols), and src1 f32, ne
[cols, b] (n = b). test-backend-ops's perf suite has no case on these shapes, so the script writes
them in its --test-file format (one generic op per line: op, result type, result ne, op params,
sources with their ne and nb, a name) and picks them out of the console output by name. Both run
with one thread: test-backend-ops gives its CPU backend half the hardware threads (one on two
cores), and BM_GemmaMatmul's threads:1 cases run the kernels on the calling thread. llama.cpp
quantises the activations of these types (Q8_K for the K-quants, Q8_0 for Q5_0/Q8_0); kallpa's
rows, batch 1 (a decode step) and batch 512 (a prompt), are shown with q16 activations (the
engine's choice for every row) and exact f32 ones.

How the attention cases map: ggml's FLASH_ATTN_EXT(hsk, hsv, nh, nr23=[r2, r3], kv, nb, ...) is
b=r3, sq=nb, skv=kv, hq=nh*r2, hkv=nh, d=hsk, dv=hsv, q f32 (as ggml's), K/V of type_K, softcap
for logit_softcap, ALiBi for max_bias. Cases the contract has no counterpart for (quantised K/V,
attention sinks, a sparse-mask hint n_kv_max, V as a view of K, permuted layouts, K and V of two
types) are listed with the reason and left out. ggml's cases carry a mask (random values, with
about a tenth of the blocks -inf, which its CPU kernel may skip); kallpa's run without one, so the
peer does at most the same work. test-backend-ops gives its CPU backend half the hardware threads,
and kallpa's attention runs with that many (`--fa-threads` to say otherwise).

This script builds nothing: bench/build_llama_cpp.sh builds the pinned llama.cpp (from the
llama-cpp-python 0.3.36 sdist) and prints the folder of its programs.

  bin=$(bash bench/build_llama_cpp.sh)
  python3 bench/peer_llama_cpp.py --llama-bench $bin/llama-bench \
      --llama-batched-bench $bin/llama-batched-bench \
      --test-backend-ops $bin/test-backend-ops --rounds 3 --json peers.json
  python3 bench/peer_llama_cpp.py --test-backend-ops $bin/test-backend-ops --matmul --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ANSI = re.compile(r"\x1b\[[0-9;]*m")
FA_LINE = re.compile(r"^\s*FLASH_ATTN_EXT\((?P<params>.*)\):\s+(?P<runs>\d+) runs\s+-\s+(?P<us>[0-9.]+) us/run")
KV_TYPES = {"f16", "bf16", "f32"}
# test-backend-ops -p regexes over a case's parameters (in the order its FLASH_ATTN_EXT prints them):
# the cases fa_case_to_spec can map, and of those the decode ones (one query row per sequence).
# Its prefill cases take seconds to minutes each on one thread, so decode is the default.
FA_EXPRESSIBLE = (r"sinks=0,.*type_K=(f16|bf16|f32),type_V=(f16|bf16|f32),permute=\[0,1,2,3\],kv_view=[01],"
                  r"v_is_view_of_k=0,n_kv_max=0")
FA_DECODE = r",nb=1,.*"
MM_NAME = re.compile(r"name=([^,)]+)")
MM_LINE = re.compile(r"^\s*MUL_MAT\((?P<params>.*)\):\s+(?P<runs>\d+) runs\s+-\s+(?P<us>[0-9.]+) us/run")
# ggml's enum values (ggml.h) for the --test-file lines: the op, and per type its id, elements per
# block and bytes per block. kallpa's GgmlType ids are the same numbers.
GGML_OP_MUL_MAT = 29
GGML_TYPES = {"f32": (0, 1, 4), "q5_0": (6, 32, 22), "q8_0": (8, 32, 34), "q4_K": (12, 256, 144),
              "q5_K": (13, 256, 176), "q6_K": (14, 256, 210)}
# Gemma-3-270M Q4_K_M's matrices: (type, rows, cols) = (type, m, k), as the file holds them.
GEMMA3_270M_MATMULS = [("q5_0", 1024, 640), ("q5_0", 256, 640), ("q5_0", 2048, 640), ("q4_K", 640, 1024),
                       ("q4_K", 640, 2048), ("q6_K", 640, 2048), ("q8_0", 256, 640), ("q8_0", 262144, 640)]
# Batch sizes: decode (1) and a pp512 prompt (512; not for the output head, which a prompt runs
# on its last row only).
MM_BATCHES = (1, 512)


class PeerError(RuntimeError):
    """A program failed or printed what this script cannot read; the message says which."""


# ---------------------------------------------------------------------------------------------
# Reading the peers' output (pure functions; tests/peers/peer_harness_test.py holds them to
# examples of each format).

def split_params(text: str) -> dict[str, str]:
    """'a=1,b=[2,3],c=x' -> {'a': '1', 'b': '[2,3]', 'c': 'x'}; commas inside [] stay."""
    out: dict[str, str] = {}
    depth = 0
    start = 0
    for i, ch in enumerate(text + ","):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            item = text[start:i]
            start = i + 1
            if not item:
                continue
            key, sep, value = item.partition("=")
            if not sep:
                raise PeerError(f"test-backend-ops parameter without '=': '{item}' in '{text}'")
            out[key.strip()] = value.strip()
    return out


def int_list(value: str) -> list[int]:
    return [int(x) for x in value.strip("[]").split(",") if x.strip()]


def fa_case_to_spec(params: dict[str, str]) -> tuple[str | None, str]:
    """A FLASH_ATTN_EXT case as a kallpa problem spec, or (None, why it has no counterpart)."""
    def num(key: str, default: str = "0") -> float:
        return float(params.get(key, default))

    try:
        hsk, hsv, nh, kv, nb = (int(params[k]) for k in ("hsk", "hsv", "nh", "kv", "nb"))
        r2, r3 = int_list(params.get("nr23", "[1,1]"))
    except (KeyError, ValueError) as e:
        return None, f"unreadable case ({e})"
    type_k, type_v = params.get("type_K", "f16"), params.get("type_V", "f16")
    if type_k not in KV_TYPES or type_v not in KV_TYPES:
        return None, f"K/V types {type_k}/{type_v} (the contract has f32, f16 and bf16 K/V)"
    if type_k != type_v:
        return None, f"K and V of two types ({type_k}/{type_v})"
    if num("sinks") != 0:
        return None, "attention sinks"
    if num("n_kv_max") != 0:
        return None, "sparse-mask hint n_kv_max"
    if num("v_is_view_of_k") != 0:
        return None, "V is a view of K (half the memory traffic)"
    if int_list(params.get("permute", "[0,1,2,3]")) != [0, 1, 2, 3]:
        return None, f"permuted layout {params['permute']}"
    spec = [f"b={r3}", f"sq={nb}", f"skv={kv}", f"hq={nh * r2}", f"hkv={nh}", f"d={hsk}"]
    if hsv != hsk:
        spec.append(f"dv={hsv}")
    spec += ["dtype=f32", f"kv_dtype={type_k}"]
    if num("logit_softcap") > 0:
        spec.append(f"softcap={num('logit_softcap'):g}")
    if num("max_bias") > 0:
        spec.append("alibi")
    return ",".join(spec), ""


def parse_test_backend_ops(text: str) -> list[dict]:
    """The timed FLASH_ATTN_EXT lines of `test-backend-ops perf` console output."""
    cases = []
    for line in ANSI.sub("", text).splitlines():
        m = FA_LINE.match(line)
        if m:
            cases.append({"params": m["params"], "runs": int(m["runs"]), "seconds": float(m["us"]) * 1e-6})
    return cases


def mm_case_name(type_name: str, m: int, k: int, n: int) -> str:
    return f"kallpa_{type_name}_m{m}_k{k}_n{n}"


def mm_test_file_line(type_name: str, m: int, k: int, n: int) -> str:
    """One MUL_MAT case in test-backend-ops's --test-file format: dst f32 [m, n]; src0 type [k, m];
    src1 f32 [k, n]; contiguous nb; named by mm_case_name."""
    tid, blck, size = GGML_TYPES[type_name]
    row = k // blck * size
    src0 = [tid, k, m, 1, 1, size, row, row * m, row * m]
    src1 = [0, k, n, 1, 1, 4, 4 * k, 4 * k * n, 4 * k * n]
    fields = [GGML_OP_MUL_MAT, 0, m, n, 1, 1, 0, 2, *src0, *src1]
    return " ".join(map(str, fields)) + " " + mm_case_name(type_name, m, k, n)


def parse_test_backend_ops_matmul(text: str) -> dict[str, float]:
    """The timed MUL_MAT lines of `test-backend-ops perf --test-file` output -> {case name: seconds}."""
    out = {}
    for line in ANSI.sub("", text).splitlines():
        m = MM_LINE.match(line)
        # The name comes first; the sources after it print as a bare list (q5_0[640,1024,1,1],f32[...]).
        name = MM_NAME.match(m["params"]) if m else None
        if name:
            out[name[1]] = float(m["us"]) * 1e-6
    return out


def parse_quant_bench(text: str) -> dict[tuple[int, int, int, int, int], float]:
    """`quant_matmul_bench --benchmark_format=json` BM_GemmaMatmul runs -> {(type id, rows, cols, b,
    act): seconds per call}."""
    out = {}
    for b in json.loads(text)["benchmarks"]:
        if b.get("run_type", "iteration") != "iteration" or not b["name"].startswith("BM_GemmaMatmul/"):
            continue
        args = dict(part.split(":", 1) for part in b["name"].split("/")[1:] if ":" in part)
        unit = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[b.get("time_unit", "ns")]
        key = (int(args["type"]), int(args["rows"]), int(args["cols"]), int(args["b"]), int(args["act"]))
        out[key] = float(b["real_time"]) * unit
    if not out:
        raise PeerError("quant_matmul_bench ran no BM_GemmaMatmul case")
    return out


def parse_llama_bench(text: str) -> dict[tuple[str, int], float]:
    """`llama-bench -o json` -> {(test, depth): tokens/s}, tests named as kallpa names them."""
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise PeerError(f"llama-bench printed no JSON array ({e})") from e
    out = {}
    for row in rows:
        n_prompt, n_gen = int(row["n_prompt"]), int(row["n_gen"])
        test = f"tg{n_gen}" if n_gen > 0 else f"pp{n_prompt}"
        out[(test, int(row.get("n_depth", 0)))] = float(row["avg_ts"])
    return out


def parse_batched_bench(text: str) -> dict[int, float]:
    """`llama-batched-bench --output-format jsonl` -> {sequences: aggregate generation tokens/s}."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            row = json.loads(line)
            out[int(row["pl"])] = float(row["speed_tg"])
    if not out:
        raise PeerError("llama-batched-bench printed no JSONL result rows")
    return out


def parse_kallpa_model(text: str) -> dict[tuple[str, int], float]:
    """`kallpa bench model --json` -> {(test, depth): tokens/s}; 'tg128 x4' stays as named."""
    return {(row["test"], int(row["depth"])): float(row["tokens_per_second"]) for row in json.loads(text)}


def parse_kallpa_attention(text: str) -> dict[str, float]:
    """`kallpa bench attention --json` -> {shape: seconds} for the runs that ran."""
    return {row["shape"]: float(row["seconds"]) for row in json.loads(text) if row.get("ran")}


def summarise(ours: list[float], theirs: list[float]) -> dict:
    """Medians and the per-round ratios ours / theirs (throughputs: above 1, kallpa is faster)."""
    ratios = [a / b for a, b in zip(ours, theirs) if b > 0]
    return {
        "kallpa": statistics.median(ours),
        "peer": statistics.median(theirs),
        "ratio": statistics.median(ratios) if ratios else float("nan"),
        "ratio_min": min(ratios) if ratios else float("nan"),
        "ratio_max": max(ratios) if ratios else float("nan"),
    }


# ---------------------------------------------------------------------------------------------
# Running them.

def run(cmd: list[str], what: str, timeout: float, parse):
    """parse(stdout) of cmd; a failed run, or output parse cannot read, is a PeerError naming `what`."""
    print("  $ " + " ".join(cmd), file=sys.stderr, flush=True)
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        raise PeerError(f"{what}: cannot run {cmd[0]} ({e.strerror})") from e
    except subprocess.TimeoutExpired as e:
        raise PeerError(f"{what}: no result within {timeout:.0f} s") from e
    if res.returncode != 0:
        tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
        raise PeerError(f"{what}: exit {res.returncode}: " + " | ".join(tail))
    try:
        return parse(res.stdout)
    except (ValueError, KeyError, TypeError) as e:  # JSON errors are ValueErrors
        raise PeerError(f"{what}: unreadable output ({type(e).__name__}: {e})") from e


def compare_model(a) -> list[dict]:
    depths = [str(d) for d in a.depth]
    ours, theirs = [], []
    for _ in range(a.rounds):
        k = [a.kallpa, "bench", "model", "-m", a.model, "--threads", str(a.threads), "-p", str(a.prompt), "-n",
             str(a.gen), "-r", "1", "--json"]
        for d in depths:
            k += ["-d", d]
        ours.append(run(k, "kallpa bench model", a.timeout, parse_kallpa_model))
        lb = [a.llama_bench, "-m", a.model, "-t", str(a.threads), "-p", str(a.prompt), "-n", str(a.gen), "-d",
              ",".join(depths), "-r", "1", "-o", "json"]
        theirs.append(run(lb, "llama-bench", a.timeout, parse_llama_bench))
    rows = []
    for key in sorted(set(ours[0]) & set(theirs[0]), key=lambda t: (t[1], t[0])):
        s = summarise([o[key] for o in ours], [t[key] for t in theirs])
        rows.append({"test": key[0], "depth": key[1], **s})
    if not rows:
        raise PeerError(f"kallpa's tests {sorted(ours[0])} and llama-bench's {sorted(theirs[0])} share none")
    return rows


def compare_batched(a) -> list[dict]:
    sizes = sorted(set(a.batch))
    ctx = (a.batch_prompt + a.batch_gen) * max(sizes) + 64
    ours, theirs = [], []
    for _ in range(a.rounds):
        k = [a.kallpa, "bench", "model", "-m", a.model, "--threads", str(a.threads), "-p", str(a.batch_prompt),
             "-n", str(a.batch_gen), "-d", "0", "-B", ",".join(map(str, sizes)), "-r", "1", "--json"]
        name = f"tg{a.batch_gen}"
        ours.append(run(k, "kallpa bench model -B", a.timeout,
                        lambda out: {b: parse_kallpa_model(out)[(name if b == 1 else f"{name} x{b}", 0)]
                                     for b in sizes}))
        bb = [a.llama_batched_bench, "-m", a.model, "-t", str(a.threads), "-c", str(ctx), "-b", "2048", "-ub",
              "512", "-npp", str(a.batch_prompt), "-ntg", str(a.batch_gen), "-npl", ",".join(map(str, sizes)),
              "--output-format", "jsonl"]
        theirs.append(run(bb, "llama-batched-bench", a.timeout, parse_batched_bench))
    rows = []
    for b in sizes:
        s = summarise([o[b] for o in ours], [t[b] for t in theirs])
        rows.append({"sequences": b, **s})
    one = next(r for r in rows if r["sequences"] == min(sizes))
    for r in rows:  # how each program scales from its own fewest sequences
        r["kallpa_scaling"] = r["kallpa"] / one["kallpa"]
        r["peer_scaling"] = r["peer"] / one["peer"]
    return rows


def compare_attention(a) -> tuple[list[dict], list[dict]]:
    tbo = [a.test_backend_ops, "perf", "-o", "FLASH_ATTN_EXT", "-b", "CPU", "-p",
           a.fa_filter or (FA_DECODE if a.fa_cases == "decode" else "") + FA_EXPRESSIBLE]
    peer_runs = []
    ours = []
    mapped: dict[str, str] = {}
    skipped = []
    for r in range(a.rounds):
        cases = run(tbo, "test-backend-ops perf", a.timeout, parse_test_backend_ops)
        if not cases:
            raise PeerError(f"test-backend-ops timed no FLASH_ATTN_EXT case for the filter {tbo[-1]!r} (is its CPU "
                            "backend built? does its case list, or the order of its parameters, differ?)")
        peer_runs.append({c["params"]: c["seconds"] for c in cases})
        if r == 0:
            for c in cases:
                spec, why = fa_case_to_spec(split_params(c["params"]))
                if spec is None:
                    skipped.append({"case": c["params"], "why": why})
                else:
                    mapped[c["params"]] = spec
            if not mapped:
                return [], skipped
        k = [a.kallpa, "bench", "attention", "-b", a.backend, "--threads", str(a.fa_threads), "--json"]
        for spec in dict.fromkeys(mapped.values()):
            k += ["--spec", spec]
        ours.append(run(k, "kallpa bench attention", a.timeout, parse_kallpa_attention))
    rows = []
    for case, spec in mapped.items():
        got = [o.get(spec) for o in ours]
        if any(g is None for g in got):
            skipped.append({"case": case, "why": f"kallpa did not run {spec}"})
            continue
        # Throughputs as runs per second, so that the ratio reads as everywhere else in this file.
        s = summarise([1 / g for g in got], [1 / p[case] for p in peer_runs])
        rows.append({"case": case, "spec": spec, "kallpa_ms": 1e3 / s["kallpa"], "peer_ms": 1e3 / s["peer"],
                     "ratio": s["ratio"], "ratio_min": s["ratio_min"], "ratio_max": s["ratio_max"]})
    return rows, skipped


def compare_matmul(a) -> list[dict]:
    cases = [(t, m, k, n) for t, m, k in GEMMA3_270M_MATMULS for n in MM_BATCHES if n == 1 or m < 100000]
    test_file = Path(a.work_dir) / "kallpa_matmul_cases.txt"
    test_file.write_text("".join(mm_test_file_line(*c) + "\n" for c in cases))
    tbo = [a.test_backend_ops, "perf", "-b", "CPU", "--test-file", str(test_file)]
    qb = [a.quant_bench, "--benchmark_filter=BM_GemmaMatmul/.*/threads:1/", "--benchmark_format=json",
          f"--benchmark_min_time={a.mm_min_time}"]
    ours, theirs = [], []
    for _ in range(a.rounds):
        theirs.append(run(tbo, "test-backend-ops perf --test-file", a.timeout, parse_test_backend_ops_matmul))
        ours.append(run(qb, "quant_matmul_bench", a.timeout, parse_quant_bench))
    rows = []
    for t, m, k, n in cases:
        name = mm_case_name(t, m, k, n)
        peer_s = [r.get(name) for r in theirs]
        if any(p is None for p in peer_s):
            raise PeerError(f"test-backend-ops did not time {name} (does its CPU backend take {t}?)")
        for act in (2, 0):
            key = (GGML_TYPES[t][0], m, k, n, act)
            got = [o.get(key) for o in ours]
            if any(g is None for g in got):
                raise PeerError(f"quant_matmul_bench did not run {key} (type, rows, cols, b, act)")
            s = summarise([1 / g for g in got], [1 / p for p in peer_s])
            # On a shared machine other processes only ever add time, so each program's best round
            # is the nearest to its unloaded speed; its ratio is given beside the median's.
            rows.append({"type": t, "m": m, "k": k, "n": n, "activations": "q16" if act == 2 else "f32",
                         "kallpa_us": 1e6 / s["kallpa"], "peer_us": 1e6 / s["peer"], "ratio": s["ratio"],
                         "ratio_min": s["ratio_min"], "ratio_max": s["ratio_max"],
                         "kallpa_best_us": 1e6 * min(got), "peer_best_us": 1e6 * min(peer_s),
                         "ratio_best": min(peer_s) / min(got)})
    return rows


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    print(f"\n{title}")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


def ratio_text(r: dict) -> str:
    return f"{r['ratio']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="See the file's header for how cases map and what is compared.")
    ap.add_argument("--kallpa", default=str(ROOT / "build/tools/kallpa/kallpa"), help="the kallpa binary")
    ap.add_argument("--model", default=str(ROOT / "models/SmolLM2-135M-Instruct.Q4_1.gguf"),
                    help="GGUF file both programs load (model and batched)")
    ap.add_argument("--llama-bench", help="llama.cpp's llama-bench: compare the model")
    ap.add_argument("--llama-batched-bench", help="llama.cpp's llama-batched-bench: compare batched generation")
    ap.add_argument("--test-backend-ops", help="llama.cpp's test-backend-ops: compare CPU flash attention (or, "
                    "with --matmul, quantised matrix products)")
    ap.add_argument("--matmul", action="store_true",
                    help="with --test-backend-ops: compare Gemma-3-270M Q4_K_M's matrix products instead of attention")
    ap.add_argument("--quant-bench", default=str(ROOT / "build/bench/quant_matmul_bench"),
                    help="kallpa's quant_matmul_bench (configure with -DKALLPA_BUILD_BENCH=ON)")
    ap.add_argument("--mm-min-time", type=float, default=0.3,
                    help="quant_matmul_bench's --benchmark_min_time per case, seconds (default 0.3)")
    ap.add_argument("--work-dir", default=None, help="folder for the generated test file (default: a temporary one)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="model and batched runs (both programs)")
    ap.add_argument("--fa-threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                    help="kallpa's attention threads: test-backend-ops's CPU backend uses half the hardware threads")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the two programs (default 3)")
    ap.add_argument("-p", "--prompt", type=int, default=512, help="prompt tokens of the model test (default 512)")
    ap.add_argument("-n", "--gen", type=int, default=128, help="generated tokens of the model test (default 128)")
    ap.add_argument("-d", "--depth", type=int, action="append", help="context depth(s) (default 0)")
    ap.add_argument("-B", "--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16],
                    help="sequences decoding together, comma-separated (default 1,4,16)")
    ap.add_argument("--batch-prompt", type=int, default=16, help="prompt tokens per sequence (default 16)")
    ap.add_argument("--batch-gen", type=int, default=128, help="generated tokens per sequence (default 128)")
    ap.add_argument("--backend", default="cpu-flash", help="kallpa attention backend for the attention cases")
    ap.add_argument("--fa-cases", choices=["decode", "all"], default="decode",
                    help="which of test-backend-ops's expressible cases to run (default decode; all adds its "
                         "prefill cases, minutes each)")
    ap.add_argument("--fa-filter", help="test-backend-ops -p regex over the cases' parameters (replaces --fa-cases)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds for one program run")
    ap.add_argument("--json", help="write every result to this file")
    a = ap.parse_args(argv)
    a.depth = a.depth or [0]
    if a.rounds < 1 or a.threads < 1 or a.fa_threads < 1:
        ap.error("--rounds, --threads and --fa-threads must be at least 1")
    if not (a.llama_bench or a.llama_batched_bench or a.test_backend_ops):
        ap.error("give at least one of --llama-bench, --llama-batched-bench, --test-backend-ops")
    needs_model = a.llama_bench or a.llama_batched_bench
    if needs_model and not Path(a.model).is_file():
        ap.error(f"--model {a.model}: no such file (scripts/setup.sh fetches the default model)")

    report: dict = {"threads": a.threads, "fa_threads": a.fa_threads, "rounds": a.rounds, "model_file": a.model}
    print(f"kallpa vs llama.cpp: ratios are kallpa / llama.cpp throughput (above 1: kallpa faster); median of "
          f"{a.rounds} alternating rounds (range)")
    try:
        if a.llama_bench:
            rows = report["model"] = compare_model(a)
            print_table(f"model: {Path(a.model).name}, {a.threads} threads", ["test", "depth", "kallpa tok/s",
                        "llama.cpp tok/s", "ratio"],
                        [[r["test"], str(r["depth"]), f"{r['kallpa']:.1f}", f"{r['peer']:.1f}", ratio_text(r)]
                         for r in rows])
        if a.llama_batched_bench:
            rows = report["batched"] = compare_batched(a)
            print_table(f"batched generation: prompt {a.batch_prompt}, {a.batch_gen} tokens each, {a.threads} threads",
                        ["sequences", "kallpa tok/s", "llama.cpp tok/s", "ratio", "kallpa scaling", "llama.cpp scaling"],
                        [[str(r["sequences"]), f"{r['kallpa']:.1f}", f"{r['peer']:.1f}", ratio_text(r),
                          f"{r['kallpa_scaling']:.2f}x", f"{r['peer_scaling']:.2f}x"] for r in rows])
        if a.test_backend_ops and a.matmul:
            with tempfile.TemporaryDirectory() as tmp:
                a.work_dir = a.work_dir or tmp
                rows = report["matmul"] = compare_matmul(a)
            print_table("matmul: test-backend-ops MUL_MAT (CPU, 1 thread) vs kallpa quant_matmul_bench (1 thread); "
                        "m x k = outputs x inputs, n = batch; best: each program's fastest round",
                        ["type", "m", "k", "n", "kallpa act", "kallpa us", "llama.cpp us", "ratio", "kallpa best us",
                         "llama.cpp best us", "best ratio"],
                        [[r["type"], str(r["m"]), str(r["k"]), str(r["n"]), r["activations"],
                          f"{r['kallpa_us']:.1f}", f"{r['peer_us']:.1f}", ratio_text(r), f"{r['kallpa_best_us']:.1f}",
                          f"{r['peer_best_us']:.1f}", f"{r['ratio_best']:.2f}x"] for r in rows])
        elif a.test_backend_ops:
            rows, skipped = compare_attention(a)
            report["attention"] = {"rows": rows, "skipped": skipped}
            if rows:
                print_table(f"attention: test-backend-ops FLASH_ATTN_EXT (CPU) vs kallpa {a.backend}, "
                            f"{a.fa_threads} threads", ["kallpa spec", "kallpa ms", "llama.cpp ms", "ratio"],
                            [[r["spec"], f"{r['kallpa_ms']:.3f}", f"{r['peer_ms']:.3f}", ratio_text(r)] for r in rows])
            else:
                print("\nattention: no case that test-backend-ops timed has a counterpart in the contract")
            for s in skipped:
                print(f"  left out: {s['case']}: {s['why']}")
    except PeerError as e:
        print(f"peer_llama_cpp: {e}", file=sys.stderr)
        return 1
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
