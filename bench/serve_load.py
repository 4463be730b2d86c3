#!/usr/bin/env python3
"""Load generator for `kallpa serve`, and llama.cpp's `llama-server` beside it: aggregate generated
tokens/s and time to first token (p50/p99) at several concurrency levels, with streaming chat
requests, for each variant of request:

  plain  every request gets exactly --max-tokens tokens (distinct prompts, seeded sampling at
         temperature 0.8 and `ignore_eos`, which both servers accept, so no request ends early)
  json   the same with response_format json_schema (a record of a few fields): grammar-constrained
         decoding; requests end when the JSON closes, so tokens/s counts what was generated
  n4     the plain request with n = 4 choices (the prompt's KV shared by the four)

    python3 bench/serve_load.py --kallpa build/tools/kallpa/kallpa [-m MODEL] [--concurrency 1,4,16,32]
        [--variants plain,json,n4] [--llama-server PATH] [--rounds 2] [--passes 2]
    python3 bench/serve_load.py --url http://127.0.0.1:8080 ...     # a server already running

Each level sends concurrency * --rounds requests, `concurrency` at a time. With --llama-server
(bench/build_llama_cpp.sh builds it), both servers run on the same model with the same threads,
and every level alternates between them, --passes times; a variant a server refuses is reported as
such. Standard library only; one JSON line per level.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse


RECORD_SCHEMA = {"type": "object",
                 "properties": {"name": {"type": "string", "maxLength": 40},
                                "serial": {"type": "integer", "minimum": 0, "maximum": 99999},
                                "tasks": {"type": "array", "items": {"type": "string", "maxLength": 30},
                                          "maxItems": 3}},
                 "required": ["name", "serial", "tasks"], "additionalProperties": False}


def request_body(i, max_tokens, variant):
    if variant == "json":
        return {"messages": [{"role": "user", "content": f"Describe robot number {i} as JSON: name, serial, tasks."}],
                "max_tokens": max_tokens, "temperature": 0.8, "seed": i, "stream": True,
                "stream_options": {"include_usage": True},
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "robot", "schema": RECORD_SCHEMA, "strict": True}}}
    body = {"messages": [{"role": "user", "content": f"Write a long story about a robot number {i}."}],
            "max_tokens": max_tokens, "temperature": 0.8, "seed": i, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    if variant == "n4":
        body["n"] = 4
    return body


def stream_one(host, port, i, max_tokens, variant="plain"):
    body = request_body(i, max_tokens, variant)
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


def run_level(host, port, concurrency, rounds, max_tokens, variant="plain"):
    ttfts, total_tokens, lock, errors = [], [0], threading.Lock(), []
    counter = iter(range(10**9))

    def worker():
        for _ in range(rounds):
            with lock:
                i = next(counter)
            try:
                ttft, tokens = stream_one(host, port, i, max_tokens, variant)
            except RuntimeError as e:
                with lock:
                    errors.append(str(e))
                return
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
    if errors:
        return {"variant": variant, "concurrency": concurrency, "error": errors[0]}
    return {"variant": variant, "concurrency": concurrency, "requests": len(ttfts), "tokens": total_tokens[0], "seconds": round(wall, 2),
            "tokens_per_s": round(total_tokens[0] / wall, 1), "ttft_p50_ms": round(1e3 * statistics.median(ttfts), 1),
            "ttft_p99_ms": round(1e3 * pct(ttfts, 0.99), 1)}


def start_kallpa(a):
    cmd = [a.kallpa, "serve", "--port", "0", "--no-access-log", *a.server_args.split()]
    if a.model:
        cmd += ["-m", a.model]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    return proc, "127.0.0.1", int(line.split("127.0.0.1:")[1].split()[0])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_llama_server(a, slots):
    port = free_port()
    # One slot per concurrent sequence (n4: four per request); the context is split among slots.
    cmd = [a.llama_server, "-m", a.model, "--host", "127.0.0.1", "--port", str(port), "-t", str(a.threads),
           "--parallel", str(slots), "-c", str(slots * a.slot_context), "--no-webui", *a.llama_args.split()]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc, "127.0.0.1", port
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"llama-server did not come up on port {port}: {' '.join(cmd)}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (else --kallpa starts one)")
    p.add_argument("--kallpa", help="the kallpa binary, to start a server")
    p.add_argument("-m", "--model", help="model for the started servers (default: kallpa's default)")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--variants", default="plain", help="plain,json,n4")
    p.add_argument("--rounds", type=int, default=2, help="requests per concurrent client")
    p.add_argument("--passes", type=int, default=1, help="alternations between the servers")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--server-args", default="", help="extra arguments for kallpa serve")
    p.add_argument("--llama-server", help="llama.cpp's llama-server binary, run side by side (needs -m)")
    p.add_argument("--llama-args", default="", help="extra arguments for llama-server")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server's -t (kallpa: KALLPA_THREADS)")
    p.add_argument("--slot-context", type=int, default=512, help="llama-server's context per slot")
    a = p.parse_args()
    os.environ["NO_PROXY"] = "127.0.0.1,localhost"
    levels = [int(x) for x in a.concurrency.split(",")]
    variants = a.variants.split(",")
    servers, procs = [], []
    try:
        if a.url:
            u = urlparse(a.url)
            servers.append(("given", u.hostname, u.port))
        else:
            if not a.kallpa:
                p.error("give --url or --kallpa")
            proc, host, port = start_kallpa(a)
            procs.append(proc)
            servers.append(("kallpa", host, port))
        if a.llama_server:
            if not a.model:
                p.error("--llama-server needs -m (the same file for both servers)")
            slots = max(levels) * (4 if "n4" in variants else 1)
            proc, host, port = start_llama_server(a, slots)
            procs.append(proc)
            servers.append(("llama-server", host, port))
        for _, host, port in servers:
            stream_one(host, port, 0, 4)  # warm-up
        for pass_index in range(a.passes):
            for variant in variants:
                for c in levels:
                    for name, host, port in servers:
                        row = run_level(host, port, c, a.rounds, a.max_tokens, variant)
                        print(json.dumps({"server": name, "pass": pass_index, **row}), flush=True)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    sys.exit(main())
