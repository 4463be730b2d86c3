#!/usr/bin/env python3
"""The ring backend under mpirun: conformance on 2 and 4 ranks, a rank killed or stalled mid-run,
ranks started with different command lines. Usage: ring_test.py MPIRUN KALLPA TEST."""
import os
import re
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mpi_job import fail, mpirun_command, rank_env, rank_pids as find_rank_pids  # noqa: E402

MPIRUN, KALLPA, TEST = sys.argv[1], sys.argv[2], sys.argv[3]
DEADLINE = 5  # KALLPA_RING_TIMEOUT for the failure tests, seconds


def mpirun(n):
    return mpirun_command(MPIRUN, n)


def rank_pids(marker, n):
    return find_rank_pids(KALLPA, marker, n)



def env(**extra):
    return rank_env(**extra)



def conformance(n):
    r = subprocess.run(mpirun(n) + [KALLPA, "conformance", "--backend", "ring", "--quick"], env=env(),
                       capture_output=True, text=True, timeout=580)
    out = r.stdout + r.stderr
    print(out[-3000:])
    if r.returncode != 0:
        fail(f"mpirun -np {n} kallpa conformance --backend ring exited {r.returncode}", out)
    summaries = re.findall(r"^(\d+) passed, (\d+) failed", out, re.M)
    if len(summaries) != n:
        fail(f"expected one summary per rank ({n}), found {len(summaries)}", out)
    for passed, failed in summaries:
        if int(failed) != 0 or int(passed) < 100:
            fail(f"a rank reports {passed} passed, {failed} failed", out)



def fault(kind):
    # The default tier runs long enough to be interrupted in the middle.
    marker = str(os.getpid())
    proc = subprocess.Popen(mpirun(2) + [KALLPA, "conformance", "--backend", "ring", "-v"],
                            env=env(KALLPA_RING_TIMEOUT=DEADLINE, KALLPA_RING_TEST_RUN=marker),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pids = rank_pids(int(marker), 2)
    lines = []
    for line in proc.stdout:  # wait until the ring has answered some cases
        lines.append(line)
        if sum(l.startswith("pass") for l in lines) >= 4:
            break
    start = time.time()
    os.kill(pids[1], signal.SIGKILL if kind == "dead" else signal.SIGSTOP)
    try:
        rest, _ = proc.communicate(timeout=DEADLINE + 60)
    except subprocess.TimeoutExpired:
        os.kill(pids[1], signal.SIGKILL)
        proc.kill()
        rest, _ = proc.communicate()
        fail(f"mpirun still runs {DEADLINE + 60} s after rank 1 was {'killed' if kind == 'dead' else 'stopped'}",
             "".join(lines) + rest)
    took = time.time() - start
    out = "".join(lines) + rest
    print(out[-2000:])
    print(f"ended {took:.1f} s after rank 1 was {'killed' if kind == 'dead' else 'stopped'}")
    if proc.returncode == 0:
        fail("mpirun exited 0", out)
    if kind == "dead":
        if not re.search(r"rank 1\b", out):
            fail("no message names rank 1", out)
    else:
        # Rank 0's own deadline: the message names the stalled rank.
        if not re.search(r"rank 0: no .* with rank 1 within 5 s: rank 1 died or stalls", out):
            fail("rank 0 did not report rank 1 by its deadline", out)
        # The lost ring is given no later case: the run ends instead of failing each one in turn.
        # (A killed rank takes mpirun's job down with it before rank 0 gets that far.)
        if not re.search(r"ring: lost on '.*'; its \d+ later case\(s\) were not run", out):
            fail("the run went on after the ring was lost", out)
    if took > DEADLINE + 30:
        fail(f"took {took:.1f} s, beyond the {DEADLINE} s deadline and a margin", out)


def mismatched():
    # Rank 1 is started with another filter than rank 0.
    script = f'exec "{KALLPA}" conformance --backend ring --quick --filter "d$OMPI_COMM_WORLD_RANK"'
    r = subprocess.run(mpirun(2) + ["sh", "-c", script], env=env(KALLPA_RING_TIMEOUT=DEADLINE), capture_output=True,
                       text=True, timeout=120)
    out = r.stdout + r.stderr
    print(out[-2000:])
    if r.returncode == 0:
        fail("mpirun exited 0 with different command lines", out)
    if "rank 1's command line differs from rank 0's" not in out:
        fail("no message names rank 1's command line", out)


if TEST == "conformance_np2":
    conformance(2)
elif TEST == "conformance_np4":
    conformance(4)
elif TEST == "dead_rank":
    fault("dead")
elif TEST == "stalled_rank":
    fault("stall")
elif TEST == "mismatched_command":
    mismatched()
else:
    fail(f"unknown test {TEST}")
print("PASS")
