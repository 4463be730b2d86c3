#!/usr/bin/env python3
"""Load generator for `kallpa serve`: aggregate generated tokens/s and time to first token
(p50/p99) at several concurrency levels, with streaming chat requests.

    python3 bench/serve_load.py --kallpa build/tools/kallpa/kallpa [-m MODEL] [--concurrency 1,4,16]
    python3 bench/serve_load.py --url http://127.0.0.1:8080 ...     # a server already running

Every request gets exactly --max-tokens tokens (distinct prompts, seeded sampling at temperature
0.8, and `ignore_eos`, the vLLM extension kallpa accepts, so that no request ends early).
Each level sends concurrency * --rounds requests, `concurrency` at a time.
Standard library only.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse


def stream_one(host, port, i, max_tokens):
    body = {"messages": [{"role": "user", "content": f"Write a long story about a robot number {i}."}],
            "max_tokens": max_tokens, "temperature": 0.8, "seed": i, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=600)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"status {resp.status}: {resp.read()[:200]!r}")
    ttft, tokens, buf = None, 0, b""
    while True:
        data = resp.read1(65536)
        if not data:
            break
        buf += data
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            if not event.startswith(b"data: ") or event == b"data: [DONE]":
                continue
            chunk = json.loads(event[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if ttft is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                ttft = time.perf_counter() - start
    conn.close()
    return ttft if ttft is not None else time.perf_counter() - start, tokens


def pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def run_level(host, port, concurrency, rounds, max_tokens):
    ttfts, total_tokens, lock = [], [0], threading.Lock()
    counter = iter(range(10**9))

    def worker():
        for _ in range(rounds):
            with lock:
                i = next(counter)
            ttft, tokens = stream_one(host, port, i, max_tokens)
            with lock:
                ttfts.append(ttft)
                total_tokens[0] += tokens

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return {"concurrency": concurrency, "requests": len(ttfts), "tokens": total_tokens[0], "seconds": round(wall, 2),
            "tokens_per_s": round(total_tokens[0] / wall, 1), "ttft_p50_ms": round(1e3 * statistics.median(ttfts), 1),
            "ttft_p99_ms": round(1e3 * pct(ttfts, 0.99), 1)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (else --kallpa starts one)")
    p.add_argument("--kallpa", help="the kallpa binary, to start a server")
    p.add_argument("-m", "--model", help="model for the started server (default: kallpa's default)")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--rounds", type=int, default=2, help="requests per concurrent client")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--server-args", default="", help="extra arguments for kallpa serve")
    a = p.parse_args()
    os.environ["NO_PROXY"] = "127.0.0.1,localhost"
    proc = None
    if a.url:
        u = urlparse(a.url)
        host, port = u.hostname, u.port
    else:
        if not a.kallpa:
            p.error("give --url or --kallpa")
        cmd = [a.kallpa, "serve", "--port", "0", "--no-access-log", *a.server_args.split()]
        if a.model:
            cmd += ["-m", a.model]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        line = proc.stdout.readline()
        host, port = "127.0.0.1", int(line.split("127.0.0.1:")[1].split()[0])
    try:
        stream_one(host, port, 0, 4)  # warm-up
        for c in (int(x) for x in a.concurrency.split(",")):
            print(json.dumps(run_level(host, port, c, a.rounds, a.max_tokens)), flush=True)
    finally:
        if proc:
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    sys.exit(main())
