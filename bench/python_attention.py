#!/usr/bin/env python3
"""kallpa.attention against torch.nn.functional.scaled_dot_product_attention on the CPU, side by side
in one run: the same tensors, torch's flash kernel and its math kernel (torch.nn.attention.sdpa_kernel),
the same thread count. Rounds interleave the three, so load from other processes falls on all alike;
each figure is the median over rounds, and the ratios are what to read.

Every shape is one where the two agree on the answer (causal only with Sq == Skv, or decode, where
kallpa's bottom-right mask hides nothing; see docs/python.md); the largest difference from SDPA's
math kernel is printed beside the times.

    PYTHONPATH=build/python .venv/bin/python bench/python_attention.py [--rounds N] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import subprocess
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import kallpa

# (label, B, Sq, Skv, Hq, Hkv, D, causal)
SHAPES = [
    ("prefill 512, 8 heads, d64, causal", 1, 512, 512, 8, 8, 64, True),
    ("prefill 1024, 16 heads, d128, causal", 1, 1024, 1024, 16, 16, 128, True),
    ("prefill 512, 8 heads, d64", 2, 512, 512, 8, 8, 64, False),
    ("decode, batch 8, 2048 keys, 32 heads, d64", 8, 1, 2048, 32, 32, 64, False),
    ("decode, batch 1, 8192 keys, 32 heads, d128", 1, 1, 8192, 32, 32, 128, False),
    ("decode GQA 32/8, batch 8, 2048 keys, d64", 8, 1, 2048, 32, 8, 64, False),
    # Small enough that the cost of a call itself (Python, binding, dispatch) shows.
    ("tiny: decode, 64 keys, 8 heads, d64", 1, 1, 64, 8, 8, 64, False),
]


def lscpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor()
    keep = ("Model name", "L1d", "L2", "L3", "CPU(s):", "Thread(s) per core")
    return "; ".join(" ".join(line.split()) for line in out.splitlines() if line.strip().startswith(keep))


def time_round(fn, rounds_out: list[float], repeat: int) -> None:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    rounds_out.append((time.perf_counter() - start) / repeat)


def bench_shape(shape, rounds: int, dtype: torch.dtype):
    label, b, sq, skv, hq, hkv, d, causal = shape
    g = torch.Generator().manual_seed(0)
    # PyTorch's layout [B, H, S, D]; kallpa reads the same memory as [B, S, H, D] (strided, no copy).
    q = torch.randn(b, hq, sq, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, skv, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, skv, d, generator=g).to(dtype)
    qk, kk, vk = (x.transpose(1, 2) for x in (q, k, v))
    out = torch.empty(b, sq, hq, d, dtype=dtype)
    gqa = hq != hkv

    def run_kallpa():
        kallpa.attention(qk, kk, vk, causal=causal, out=out)

    def sdpa_with(backend):
        def run():
            with sdpa_kernel(backend):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        return run

    candidates = {"kallpa": run_kallpa, "sdpa flash": sdpa_with(SDPBackend.FLASH_ATTENTION),
                  "sdpa math": sdpa_with(SDPBackend.MATH)}
    usable = {}
    for name, fn in candidates.items():
        try:
            fn()
            fn()
            usable[name] = fn
        except RuntimeError as e:  # a kernel that refuses the shape (e.g. flash with GQA on some builds)
            print(f"  {label}: {name} not run: {str(e).splitlines()[0]}", file=sys.stderr)
    times = {name: [] for name in usable}
    repeat = 200 if sq * skv * hq * b < 1 << 16 else 1  # a round of a tiny shape is many calls
    for _ in range(rounds):
        for name, fn in usable.items():
            time_round(fn, times[name], repeat)
    med = {name: statistics.median(t) for name, t in times.items()}
    run_kallpa()
    with sdpa_kernel(SDPBackend.MATH):
        ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal,
                                                               enable_gqa=gqa)
    err = (out.transpose(1, 2).double() - ref).abs().max().item()
    return label, med, err


def fmt_ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.3f}" if seconds < 1e-3 else f"{seconds * 1e3:.2f}"


def fmt_ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None else f"{a / b:.2f}x"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per shape (default 15)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--out", help="also write the Markdown report to this file")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)

    selected = kallpa.explain(torch.zeros(1, 1, 1, 64, dtype=dtype), torch.zeros(1, 1, 1, 64, dtype=dtype),
                              torch.zeros(1, 1, 1, 64, dtype=dtype)).selected
    lines = [
        f"- command: `PYTHONPATH=build/python .venv/bin/python bench/python_attention.py --rounds {args.rounds}"
        f" --dtype {args.dtype}`",
        f"- machine: {lscpu()}",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- torch {torch.__version__}, {torch.get_num_threads()} threads; kallpa backend chosen: {selected};"
        f" dtype {args.dtype}; median of {args.rounds} interleaved rounds",
        "",
        "| shape | kallpa ms | sdpa flash ms | sdpa math ms | flash / kallpa | math / kallpa | max abs diff |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for shape in SHAPES:
        label, med, err = bench_shape(shape, args.rounds, dtype)
        kp, fl, ma = med.get("kallpa"), med.get("sdpa flash"), med.get("sdpa math")
        lines.append(f"| {label} | {fmt_ms(kp)} | {fmt_ms(fl)} | {fmt_ms(ma)} | {fmt_ratio(fl, kp)} | "
                     f"{fmt_ratio(ma, kp)} | {err:.1e} |")
        print(lines[-1], flush=True)
    report = "\n".join(lines) + "\n"
    print()
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
