#!/usr/bin/env python3
"""The attention program compiles ahead of time for a TPU generation through libtpu, on a machine
without a TPU, and its temporary memory does not grow with the keys: at 32k keys it stays within a
few times (here 4x) that at 2k, where a program that materialised the score matrix would grow 16x.

Usage: tpu_aot_test.py KALLPA LIBTPU TOPOLOGY      (exit 77, skipped, when LIBTPU is absent)

libtpu without a TPU would ask a cloud metadata server: TPU_SKIP_MDS_QUERY=1 tells it not to, and
where the runner allows it the network is taken away too (unshare -n), so it never waits on one.
"""

import json
import os
import subprocess
import sys

SPEC = "b=1,sq=2048,hq=32,hkv=8,d=128,dtype=bf16,causal"


def main() -> int:
    kallpa, libtpu, topology = sys.argv[1:4]
    if not os.path.isfile(libtpu):
        print(f"skipped: {libtpu} is absent (run scripts/fetch_pjrt.sh --tpu)")
        return 77
    env = dict(os.environ, TPU_SKIP_MDS_QUERY="1", KALLPA_PJRT_PLUGIN="")
    command = [kallpa, "--pjrt-plugin", libtpu, "pjrt", "compile", "--target", topology, "--spec", SPEC,
               "--keys", "2048,8192,32768", "--json"]
    if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0:
        command = ["unshare", "-n"] + command
    else:
        print("note: unshare -n is not allowed here; running with the network")
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        print(run.stdout, run.stderr[-4000:], sep="\n")
        print(f"FAIL: kallpa exited {run.returncode}")
        return 1
    rows = json.loads(run.stdout)
    temps = [r["temp_bytes"] for r in rows]
    for r in rows:
        print(f"{topology} {r['problem']}: temp {r['temp_bytes']} bytes, compile {r['compile_ms']:.0f} ms")
    if len(temps) != 3 or min(temps) <= 0:
        print(f"FAIL: expected three memory reports, got {temps}")
        return 1
    if temps[2] > 4 * temps[0]:
        print(f"FAIL: temp grows from {temps[0]} (2k keys) to {temps[2]} (32k keys): more than 4x")
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
