#!/usr/bin/env python3
"""How much the KV cache's storage type changes a model's answers: greedy generations with
`--kv-type f16` and `bf16` set against `--kv-type f32` (exact), prompt by prompt.

For each prompt every type generates --tokens greedy tokens (`kallpa generate --temp 0
--logits-top 1`, one JSON line per step). Reported per type: how many generations equal f32's
token for token, the mean and worst number of tokens before the first difference, and the
largest difference of the chosen token's log-softmax from f32's over the steps before it (the
steps where both read the same context, so the difference is the cache's rounding alone).

  kv_type_drift.py --kallpa build/tools/kallpa/kallpa [--model FILE] [--tokens 64] [--threads 2]
"""

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain how a hash table works.",
    "def fibonacci(n):",
    "The three laws of thermodynamics are",
    "Once upon a time, in a small village by the mountains,",
    "List five prime numbers greater than 100:",
    "Translate to Spanish: The weather is nice today.",
    "Q: What is the boiling point of water at sea level?\nA:",
    "The most important idea in computer science is",
    "import numpy as np\n\n# compute the mean of each column\n",
    "Summarize the plot of Romeo and Juliet in two sentences.",
]
TYPES = ["f16", "bf16"]


def generate(args, prompt, kv_type):
    cmd = [args.kallpa, "generate", "-m", args.model, "-p", prompt, "-n", str(args.tokens), "--temp", "0",
           "--logits-top", "1", "--kv-type", kv_type, "--threads", str(args.threads)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr[-2000:]}")
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kallpa", default=os.path.join(REPO, "build/tools/kallpa/kallpa"))
    p.add_argument("--model", default=os.path.join(REPO, "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    exact = {prompt: generate(args, prompt, "f32") for prompt in PROMPTS}
    print(f"model {os.path.basename(args.model)}, {len(PROMPTS)} prompts, {args.tokens} greedy tokens each, "
          "against --kv-type f32")
    print("| kv type | generations equal to f32 | tokens before the first difference (mean / worst) "
          "| largest logprob difference before it |")
    print("| --- | --- | --- | --- |")
    for kv_type in TYPES:
        same, before, worst_logprob = 0, [], 0.0
        for prompt in PROMPTS:
            ref, got = exact[prompt], generate(args, prompt, kv_type)
            n = 0
            while n < min(len(ref), len(got)) and ref[n]["id"] == got[n]["id"]:
                worst_logprob = max(worst_logprob, abs(ref[n]["logprob"] - got[n]["logprob"]))
                n += 1
            same += n == len(ref) == len(got)
            before.append(n)
        print(f"| {kv_type} | {same} / {len(PROMPTS)} | {sum(before) / len(before):.1f} / {min(before)} "
              f"| {worst_logprob:.2e} |")


if __name__ == "__main__":
    main()
