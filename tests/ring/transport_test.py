#!/usr/bin/env python3
"""The process group's transports (docs/scale-out.md): byte-exact all-gathers and broadcasts under
mpirun over MPI and over NCCL, and choosing a transport from the `kallpa` command line.
Usage: transport_test.py MPIRUN ROUNDTRIP KALLPA TEST.

The NCCL tests skip (exit 77), saying why, where NCCL is not built or this host has fewer CUDA
devices than the job has ranks; the probe that decides it asks the CUDA runtime, not the transport."""
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mpi_job import fail, mpirun_command, rank_env  # noqa: E402

MPIRUN, ROUNDTRIP, KALLPA, TEST = sys.argv[1:5]


def skip(why):
    print(f"SKIP: {why}")
    sys.exit(77)


def probe():
    """(nccl built, CUDA devices visible)."""
    out = subprocess.run([ROUNDTRIP, "--probe"], capture_output=True, text=True, timeout=120).stdout
    m = re.match(r"nccl built, (\d+) CUDA devices", out)
    return (True, int(m.group(1))) if m else (False, 0)


def need_devices(n):
    built, devices = probe()
    if not built:
        skip("this build has no NCCL (KALLPA_WITH_NCCL: the CUDA toolkit, MPI and NCCL at configure time)")
    if devices < n:
        skip(f"{n} rank(s) on this host need {n} CUDA device(s), one each; {devices} visible")


def roundtrip(n, transport):
    r = subprocess.run(mpirun_command(MPIRUN, n) + [ROUNDTRIP, transport], env=rank_env(), capture_output=True,
                       text=True, timeout=300)
    out = r.stdout + r.stderr
    print(out[-3000:])
    if r.returncode != 0:
        fail(f"mpirun -np {n} kallpa_transport_roundtrip {transport} exited {r.returncode}", out)
    want = f"transport {transport}, {n} rank{'' if n == 1 else 's'}: 7 all-gathers and {7 * n} broadcasts byte-exact"
    if want not in r.stdout:
        fail(f"no summary '{want}'", out)


def kallpa(*args, **env):
    r = subprocess.run([KALLPA, *args], env=rank_env(**env), capture_output=True, text=True, timeout=300)
    return r.returncode, r.stdout + r.stderr


def cli_select():
    code, out = kallpa("--ring-transport", "carrier-pigeon", "--no-health-check", "backends")
    print(out)
    if code != 2 or "no transport 'carrier-pigeon' (this build has: mpi, nccl)" not in out:
        fail(f"an unknown transport: exit {code}, expected 2 and the transports there are", out)
    built, devices = probe()
    for args, env in ((["--ring-transport", "nccl"], {}), ([], {"KALLPA_RING_TRANSPORT": "nccl"})):
        code, out = kallpa(*args, "--no-health-check", "backends", **env)
        print(out[-2000:])
        how = " ".join(args) or "KALLPA_RING_TRANSPORT=nccl"
        if not built:
            if code != 1 or "kallpa: --ring-transport: unsupported: nccl: this kallpa was built without NCCL" not in out:
                fail(f"{how} without NCCL built: exit {code}, expected 1 and why", out)
        elif devices == 0:
            if code != 1 or "kallpa: --ring-transport: unsupported: nccl: no CUDA device is visible" not in out:
                fail(f"{how} without a CUDA device: exit {code}, expected 1 and why", out)
        elif code != 0:
            fail(f"{how} with {devices} CUDA device(s): exit {code}", out)


def transport_mismatch():
    # Rank 1 alone chooses NCCL through the environment, which the command line does not show:
    # the ranks compare transports at start (over MPI, which both have) and name rank 1.
    need_devices(1)
    script = (f'if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then export KALLPA_RING_TRANSPORT=nccl; fi; '
              f'exec "{KALLPA}" --no-health-check backends')
    r = subprocess.run(mpirun_command(MPIRUN, 2) + ["sh", "-c", script], env=rank_env(KALLPA_RING_TIMEOUT=20),
                       capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    print(out[-3000:])
    if r.returncode == 0 or "rank 1's transport differs from rank 0's" not in out:
        fail(f"ranks with different transports: exit {r.returncode}, expected an error naming rank 1", out)


if TEST == "mpi_np2":
    roundtrip(2, "mpi")
elif TEST == "nccl_np1":
    need_devices(1)
    roundtrip(1, "nccl")
elif TEST == "nccl_np2":
    need_devices(2)
    roundtrip(2, "nccl")
elif TEST == "cli_select":
    cli_select()
elif TEST == "transport_mismatch":
    transport_mismatch()
else:
    fail(f"unknown test {TEST}")
print("PASS")
