#!/usr/bin/env python3
"""Peak resident memory of token generation: `kallpa bench model` against `llama-bench` on the same
GGUF file, the same generation (tg128 after `depth` tokens) and thread count, side by side.

Each run is a process of its own; its peak is the kernel's high-water mark of its resident set
(wait4's ru_maxrss), which counts mapped file pages as they are read, so the two are measured the
same way. Both size their KV cache to the run (kallpa bench model does unless --context is given;
llama-bench always does). Rounds alternate the two; the table gives each one's largest peak.

  peak_rss.py --kallpa build/tools/kallpa/kallpa --llama-bench PATH [--model FILE] [--depth 0 2048]
"""

import argparse
import os
import subprocess
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def peak_mib(cmd):
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    err = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{' '.join(cmd)} failed: {err[-2000:]}")
    return usage.ru_maxrss / 1024.0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kallpa", default=os.path.join(REPO, "build/tools/kallpa/kallpa"))
    p.add_argument("--llama-bench", default=os.path.expanduser("~/.cache/kallpa/llama.cpp/build-0.3.36/bin/llama-bench"))
    p.add_argument("--model", default=os.path.join(REPO, "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    p.add_argument("--depth", type=int, nargs="+", default=[0, 2048])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    print(f"model {os.path.basename(args.model)}, tg{args.tokens}, {args.threads} threads, {args.rounds} rounds")
    print("| depth | kallpa peak MiB | llama.cpp peak MiB | kallpa / llama.cpp |")
    print("| --- | --- | --- | --- |")
    for depth in args.depth:
        kallpa = [args.kallpa, "bench", "model", "-m", args.model, "-p", "1", "-n", str(args.tokens), "-d", str(depth),
                  "-r", "1", "--threads", str(args.threads)]
        llama = [args.llama_bench, "-m", args.model, "-p", "0", "-n", str(args.tokens), "-r", "1", "-t",
                 str(args.threads)] + (["-d", str(depth)] if depth > 0 else [])
        ours, theirs = [], []
        for _ in range(args.rounds):
            ours.append(peak_mib(kallpa))
            theirs.append(peak_mib(llama))
        print(f"| {depth} | {max(ours):.1f} | {max(theirs):.1f} | {max(ours) / max(theirs):.2f}x |")


if __name__ == "__main__":
    main()
