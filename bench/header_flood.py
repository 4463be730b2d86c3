#!/usr/bin/env python3
"""A `kallpa serve` process's resident memory before and after connections that send an
oversized header set, for one or more binaries side by side (same model, same machine).

    python3 bench/header_flood.py --kallpa build/tools/kallpa/kallpa [--kallpa OTHER] -m MODEL \
        [--connections 4] [--fields 500000]

Each connection sends a request line and then --fields header fields ("X-Flood-N: N"), then reads
the status line. RSS is read from /proc after the connections have closed. Standard library only.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import threading
import time
from pathlib import Path


def rss_mib(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def flood(port, fields, out, i):
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        for start in range(0, fields, 1000):
            block = b"".join(b"X-Flood-%d: %d\r\n" % (j, j) for j in range(start, min(fields, start + 1000)))
            try:
                sock.sendall(block)
            except OSError:
                break  # the server refused and stopped reading
        else:
            try:
                sock.sendall(b"\r\n")
            except OSError:
                pass
        try:
            out[i] = sock.recv(64).split(b"\r\n")[0].decode(errors="replace")
        except OSError as e:
            out[i] = f"error: {e}"
    finally:
        sock.close()


def run(binary, model, connections, fields):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KALLPA_")}
    proc = subprocess.Popen([binary, "serve", "-m", model, "--port", "0", "--no-access-log"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    port = int(proc.stdout.readline().split("127.0.0.1:")[1].split()[0])
    try:
        time.sleep(0.5)
        before = rss_mib(proc.pid)
        out = [None] * connections
        threads = [threading.Thread(target=flood, args=(port, fields, out, i)) for i in range(connections)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(2.0)
        return before, rss_mib(proc.pid), out
    finally:
        proc.kill()
        proc.wait()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kallpa", action="append", required=True)
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--connections", type=int, default=4)
    p.add_argument("--fields", type=int, default=500000)
    a = p.parse_args()
    print("| binary | RSS before (MiB) | RSS after (MiB) | answers |")
    print("| --- | --- | --- | --- |")
    for b in a.kallpa:
        before, after, answers = run(b, a.model, a.connections, a.fields)
        print(f"| {b} | {before:.0f} | {after:.0f} | {', '.join(sorted(set(map(str, answers))))} |", flush=True)


if __name__ == "__main__":
    main()
