#!/usr/bin/env python3
"""Prefill of a long prompt by `kallpa generate --context-parallel` on 1, 2 and 4 MPI ranks, with the
share of rank 0's prefill spent waiting on the group's transfers (docs/scale-out.md). One process is
the baseline, with all the threads the ranks share and with one thread. Side by side in one run.

  python3 bench/context_parallel_prefill.py --kallpa build/tools/kallpa/kallpa --tokens 4000
"""
import argparse
import os
import re
import subprocess
import sys

PARAGRAPHS = [
    "The river town kept its records in a long ledger, one line for every boat that passed the bridge.",
    "In spring the water rose over the low fields, and the farmers moved their sheep to the hills.",
    "Traders from the coast brought salt, iron tools and bright cloth, and left with wool and grain.",
    "The miller's daughter learned to read the ledger and found that the numbers did not add up.",
    "Every autumn the council met in the long hall to count the harvest and to settle old quarrels.",
    "A storm in the ninth year broke the bridge, and for a season the town was cut in two halves.",
    "The old ferryman remembered the great flood and told the children where the water had reached.",
    "When the railway came, the boats grew fewer, and the ledger filled more slowly every year.",
]


def prompt_text(kallpa, model, tokens):
    """Paragraphs, numbered so that no two sentences repeat exactly, until the prompt has `tokens`."""
    text, i = "", 0
    while True:
        text += f"{i}. {PARAGRAPHS[i % len(PARAGRAPHS)]} "
        i += 1
        if i % 8 == 0:
            r = subprocess.run([kallpa, "tokenize", "--json", "-m", model, text], capture_output=True, text=True,
                               check=True)
            if r.stdout.count('"id"') >= tokens:
                return text


def run(cmd, env):
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{cmd[0]} ... exited {r.returncode}:\n{r.stderr[-2000:]}")
    m = re.search(r"\[(\d+) prompt tokens in ([\d.]+) s", r.stderr)
    wait = re.search(r"prefill waited ([\d.]+) s on transfers", r.stderr)
    return int(m.group(1)), float(m.group(2)), float(wait.group(1)) if wait else 0.0


def decode_rate(cmd, env):
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{cmd[0]} ... exited {r.returncode}:\n{r.stderr[-2000:]}")
    m = re.search(r"(\d+) generated in ([\d.]+) s", r.stderr)
    return int(m.group(1)), float(m.group(2))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kallpa", default="build/tools/kallpa/kallpa")
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--cores", type=int, default=os.cpu_count())
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--decode-tokens", type=int, default=64)
    args = ap.parse_args()
    prompt = prompt_text(args.kallpa, args.model, args.tokens)
    gen = [args.kallpa, "generate", "-m", args.model, "-p", prompt, "--temp", "0", "-n", "1",
           "--context", "8192"]
    mpirun = ["mpirun", "--oversubscribe", "--mca", "btl_vader_single_copy_mechanism", "none"]
    if os.geteuid() == 0:
        mpirun.append("--allow-run-as-root")
    print(f"load average before: {os.getloadavg()}")
    rows = []
    for threads in sorted({args.cores, 1}, reverse=True):
        env = dict(os.environ, KALLPA_THREADS=str(threads))
        n, secs, _ = run(gen, env)
        rows.append((f"1 process, {threads} thread(s)", n, secs, 0.0))
    for ranks in [int(x) for x in args.ranks.split(",") if int(x) > 1]:
        env = dict(os.environ, KALLPA_THREADS="1")
        n, secs, wait = run(mpirun + ["-np", str(ranks)] + gen + ["--context-parallel"], env)
        rows.append((f"{ranks} ranks x 1 thread", n, secs, wait))
    base = rows[0][2]
    print("| run | prompt tokens | prefill s | tok/s | vs first row | rank 0 waiting on transfers |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, n, secs, wait in rows:
        share = f"{wait:.2f} s ({100 * wait / secs:.1f}%)" if wait else "-"
        print(f"| {name} | {n} | {secs:.2f} | {n / secs:.0f} | {base / secs:.2f}x | {share} |")
    # Decode steps after a short prompt: every rank runs the token's row, plus an all-gather of the
    # partial attention per layer.
    short = [args.kallpa, "generate", "-m", args.model, "-p", "Count: 1, 2, 3, 4, 5, 6,", "--temp", "0", "-n",
             str(args.decode_tokens)]
    print()
    print("| run | generated | decode s | tok/s |")
    print("| --- | ---: | ---: | ---: |")
    for threads in sorted({args.cores, 1}, reverse=True):
        n, secs = decode_rate(short, dict(os.environ, KALLPA_THREADS=str(threads)))
        print(f"| 1 process, {threads} thread(s) | {n} | {secs:.2f} | {n / secs:.1f} |")
    for ranks in [int(x) for x in args.ranks.split(",") if int(x) > 1]:
        n, secs = decode_rate(mpirun + ["-np", str(ranks)] + short + ["--context-parallel"],
                              dict(os.environ, KALLPA_THREADS="1"))
        print(f"| {ranks} ranks x 1 thread | {n} | {secs:.2f} | {n / secs:.1f} |")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
