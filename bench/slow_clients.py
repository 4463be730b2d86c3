#!/usr/bin/env python3
"""How long `/health` and a small chat request take while N sockets trickle a partial request,
for one or more `kallpa serve` binaries side by side (alternated, same model, same machine).

    python3 bench/slow_clients.py --kallpa build/tools/kallpa/kallpa [--kallpa OTHER] -m MODEL \
        [--sockets 0,50,200] [--rounds 3] [--deadline 20]

Each trickling socket sends "POST /v1/chat/comp" and then one byte every 0.5 s. A request that
gets no answer within --deadline seconds is reported as "timeout". Standard library only.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import threading
import time

CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}


def start(binary, model, sockets):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KALLPA_")}
    cmd = [binary, "serve", "-m", model, "--port", "0", "--no-access-log"]
    # The event-loop server bounds connections per address (default 128); all of these come from
    # 127.0.0.1. Older builds do not know the flag.
    help_text = subprocess.run([binary, "serve", "--help"], capture_output=True, text=True).stdout
    if "--max-connections-per-client" in help_text:
        cmd += ["--max-connections-per-client", str(sockets + 16)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    line = proc.stdout.readline()
    return proc, int(line.split("127.0.0.1:")[1].split()[0])


def timed(port, method, path, body, deadline):
    t = time.perf_counter()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=deadline)
        conn.request(method, path, json.dumps(body) if body else None, {"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        conn.close()
        return time.perf_counter() - t if r.status == 200 else None
    except OSError:
        return None


def run(binary, model, sockets, deadline):
    proc, port = start(binary, model, sockets)
    try:
        timed(port, "POST", "/v1/chat/completions", CHAT, 60)  # warm-up
        socks = []
        for _ in range(sockets):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(b"POST /v1/chat/comp")
            socks.append(s)
        stop = threading.Event()

        def trickle():
            while not stop.is_set():
                for s in socks:
                    try:
                        s.send(b"l")
                    except OSError:
                        pass
                stop.wait(0.5)

        t = threading.Thread(target=trickle, daemon=True)
        t.start()
        time.sleep(1.0)
        health = timed(port, "GET", "/health", None, deadline)
        chat = timed(port, "POST", "/v1/chat/completions", CHAT, deadline)
        stop.set()
        t.join()
        for s in socks:
            s.close()
        return health, chat
    finally:
        proc.kill()
        proc.wait()


def fmt(values):
    done = [v for v in values if v is not None]
    if len(done) < len(values):
        return f"timeout ({len(values) - len(done)}/{len(values)})" + (f", else {statistics.median(done):.3f}" if done else "")
    return f"{statistics.median(done):.3f}"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kallpa", action="append", required=True)
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--sockets", default="0,50,200")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--deadline", type=float, default=20.0)
    a = p.parse_args()
    print("| binary | trickling sockets | /health s (median) | chat s (median) |")
    print("| --- | --- | --- | --- |")
    for n in map(int, a.sockets.split(",")):
        results = {b: ([], []) for b in a.kallpa}
        for _ in range(a.rounds):
            for b in a.kallpa:  # alternated
                h, c = run(b, a.model, n, a.deadline)
                results[b][0].append(h)
                results[b][1].append(c)
        for b in a.kallpa:
            print(f"| {b} | {n} | {fmt(results[b][0])} | {fmt(results[b][1])} |", flush=True)


if __name__ == "__main__":
    main()
