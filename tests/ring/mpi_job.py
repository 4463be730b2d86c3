"""What the ring's tests share: the mpirun command line for this machine, the ranks' environment,
finding the ranks' processes, and failing with the output shown."""
import os
import sys
import time


def mpirun_command(mpirun, n):
    cmd = [mpirun, "-np", str(n), "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    # Containers often forbid the cross-process memory reads of shared-memory single copy.
    cmd += ["--mca", "btl_vader_single_copy_mechanism", "none"]
    return cmd


def rank_env(**extra):
    e = dict(os.environ)
    # Each rank takes a share of the cores, as on a machine the ranks share.
    e.setdefault("KALLPA_THREADS", "1")
    e.update({k: str(v) for k, v in extra.items()})
    return e


def fail(msg, out=""):
    print(out)
    print(f"FAIL: {msg}")
    sys.exit(1)


def rank_pids(kallpa, marker, n, timeout=60):
    """The pids of the n ranks of the job whose environment holds KALLPA_RING_TEST_RUN=marker,
    by rank."""
    end = time.time() + timeout
    while time.time() < end:
        found = {}
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    environ = f.read().split(b"\0")
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if not cmdline.startswith(kallpa.encode()):
                continue
            values = dict(v.split(b"=", 1) for v in environ if b"=" in v)
            if values.get(b"KALLPA_RING_TEST_RUN") != str(marker).encode():
                continue
            if b"OMPI_COMM_WORLD_RANK" in values:
                found[int(values[b"OMPI_COMM_WORLD_RANK"])] = int(pid)
        if len(found) == n:
            return found
        time.sleep(0.1)
    fail(f"could not find the {n} ranks' processes")
