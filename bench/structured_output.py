#!/usr/bin/env python3
"""What structured output costs per generated token, end to end through `kallpa serve`.

For each schema of the test corpus (tests/server/structured_output_test.py), a streamed greedy
request with `response_format` json_schema gives N tokens; the same prompt without it, with
max_tokens N and ignore_eos (so exactly N tokens), is the unconstrained twin. The two alternate,
ROUNDS times, and the decode time per token (first token to last, over N - 1) is compared; the
time to first token, which holds the schema's compilation on the first request (cached after),
is reported apart. Then all schemas at once (concurrency = corpus size), constrained and not, for
aggregate tokens/s.

    .venv/bin/python3 bench/structured_output.py [--kallpa build/tools/kallpa/kallpa]
        [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import http.client  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "server"))
from structured_schemas import CORPUS  # noqa: E402  (the test corpus)

os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"


def stream(port, body):
    """(completion tokens, seconds to first token, seconds from first to last token)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=json.dumps({**body, "stream": True,
                                                                  "stream_options": {"include_usage": True}}),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    first = last = None
    tokens = 0
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        for choice in chunk.get("choices", []):
            if choice.get("delta", {}).get("content"):
                now = time.perf_counter()
                first = first or now
                last = now
    conn.close()
    return tokens, (first or t0) - t0, (last or t0) - (first or t0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kallpa", default=str(ROOT / "build/tools/kallpa/kallpa"))
    p.add_argument("--model", default=str(ROOT / "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    corpus = CORPUS
    proc = subprocess.Popen([args.kallpa, "serve", "-m", args.model, "--port", "0", "--max-tokens", "512"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        port = int(line.split("127.0.0.1:")[1].split()[0])

        def bodies(name, prompt, schema):
            base = {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "seed": 0}
            constrained = {**base, "max_tokens": 256,
                           "response_format": {"type": "json_schema",
                                               "json_schema": {"name": name, "schema": schema, "strict": True}}}
            return base, constrained

        print(f"{'schema':18} {'tokens':>6} {'free ms/tok':>11} {'json ms/tok':>11} {'ratio':>6} "
              f"{'TTFT 1st':>9} {'TTFT later':>10} {'TTFT free':>9}")
        ratios = []
        for name, prompt, schema in corpus:
            base, constrained = bodies(name, prompt, schema)
            free_tok, json_tok, ttft_json, ttft_free = [], [], [], []
            n = None
            for _ in range(args.rounds):
                tokens, ttft, decode = stream(port, constrained)
                n = tokens
                json_tok.append(decode / max(1, tokens - 1))
                ttft_json.append(ttft)
                tokens_free, ttft, decode = stream(port, {**base, "max_tokens": n, "ignore_eos": True})
                free_tok.append(decode / max(1, tokens_free - 1))
                ttft_free.append(ttft)
            f, j = statistics.median(free_tok) * 1e3, statistics.median(json_tok) * 1e3
            ratios.append(j / f)
            print(f"{name:18} {n:6d} {f:11.2f} {j:11.2f} {j / f:6.2f} {ttft_json[0] * 1e3:8.1f}ms "
                  f"{statistics.median(ttft_json[1:]) * 1e3:8.1f}ms {statistics.median(ttft_free) * 1e3:7.1f}ms")
        print(f"median ratio (json / free, decode time per token): {statistics.median(ratios):.3f}")

        # Everything at once: aggregate tokens/s, constrained beside unconstrained (same token counts).
        counts = {}
        for label in ("json", "free", "json", "free"):
            jobs = []
            for name, prompt, schema in corpus:
                base, constrained = bodies(name, prompt, schema)
                jobs.append(constrained if label == "json" else {**base, "max_tokens": counts.get(name, 64),
                                                                 "ignore_eos": True})
            t0 = time.perf_counter()
            with ThreadPoolExecutor(len(jobs)) as pool:
                results = list(pool.map(lambda b: stream(port, b), jobs))
            wall = time.perf_counter() - t0
            if label == "json":
                counts = {c[0]: r[0] for c, r in zip(corpus, results)}
            total = sum(r[0] for r in results)
            print(f"concurrency {len(jobs)}, {label}: {total} tokens in {wall:.2f} s = {total / wall:.1f} tok/s")
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
