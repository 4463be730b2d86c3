#!/usr/bin/env python3
"""`kallpa generate --context-parallel` under mpirun on the default model (docs/scale-out.md):
the greedy text of 2 and 4 ranks against one process's, a rank killed mid-generation, and a rank
given another model file. Usage: context_parallel_test.py MPIRUN KALLPA MODEL OTHER_MODEL TEST.
Skipped (77) without the models (scripts/fetch_model.sh)."""
import os
import re
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mpi_job import fail, mpirun_command, rank_env, rank_pids as find_rank_pids  # noqa: E402

MPIRUN, KALLPA, MODEL, OTHER_MODEL, TEST = sys.argv[1:6]
DEADLINE = 5  # KALLPA_RING_TIMEOUT for the failure tests, seconds


def mpirun(n):
    return mpirun_command(MPIRUN, n)


def rank_pids(marker, n):
    return find_rank_pids(KALLPA, marker, n)


# A prompt of a few hundred tokens, so that every rank's slice (two of 2N chunks) is far shorter
# than the prompt, with an ending that makes the model write on.
PROMPT = (
    "The river town kept its records in a long ledger. " * 3
    + "In spring the water rose over the low fields, and the farmers moved their sheep to the hills. "
    "In summer the boats carried wool and grain down to the sea, and the market filled with traders "
    "from the coast who brought salt, iron tools and bright cloth. In autumn the town counted its "
    "harvest, mended the nets and repaired the bridge before the rains. In winter the children "
    "learned their letters by the fire while the old people told stories of the great flood. " * 3
    + "Question: What did the boats carry in summer, and what did the traders bring? Answer:"
)
GENERATED = 24


def skip_without_models():
    for path in (MODEL, OTHER_MODEL):
        if not os.path.exists(path):
            print(f"SKIP: {path} not found (scripts/fetch_model.sh)")
            sys.exit(77)



def env(**extra):
    return rank_env(KALLPA_MODEL=MODEL, **extra)



def generate_args(prompt, tokens):
    return [KALLPA, "generate", "-p", prompt, "--temp", "0", "-n", str(tokens)]


def same_text(n):
    one = subprocess.run(generate_args(PROMPT, GENERATED), env=env(), capture_output=True, text=True, timeout=300)
    if one.returncode != 0:
        fail(f"one process exited {one.returncode}", one.stdout + one.stderr)
    prompt_tokens = int(re.search(r"\[(\d+) prompt tokens", one.stderr).group(1))
    if prompt_tokens < 200:
        fail(f"the prompt has {prompt_tokens} tokens; the test needs a few hundred", one.stderr)
    many = subprocess.run(mpirun(n) + generate_args(PROMPT, GENERATED) + ["--context-parallel"], env=env(),
                          capture_output=True, text=True, timeout=300)
    out = many.stdout + many.stderr
    print(out[-3000:])
    if many.returncode != 0:
        fail(f"mpirun -np {n} kallpa generate --context-parallel exited {many.returncode}", out)
    if f"context parallel over {n} ranks" not in many.stderr:
        fail(f"no summary of a context-parallel run over {n} ranks", out)
    if many.stderr.count("prompt tokens in") != 1:
        fail("the summary should come once, from rank 0", out)
    print(f"one process: {one.stdout!r}")
    print(f"{n} ranks:     {many.stdout!r}")
    if not one.stdout.strip():
        fail("one process generated no text", one.stdout + one.stderr)
    # Rank 0 alone prints: the output is the one-process text, once.
    if many.stdout != one.stdout:
        fail(f"{n} ranks' greedy text differs from one process's", out)



def dead_rank():
    # A prompt the model continues for long; rank 1 dies once rank 0 has printed some of the text.
    marker = f"cp-{os.getpid()}"
    prompt = "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"
    proc = subprocess.Popen(mpirun(2) + generate_args(prompt, 2000) + ["--context-parallel"],
                            env=env(KALLPA_RING_TIMEOUT=DEADLINE, KALLPA_RING_TEST_RUN=marker),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    pids = rank_pids(marker, 2)
    seen = b""
    while len(seen) < 20:  # decoding has begun
        byte = proc.stdout.read(1)
        if not byte:
            fail("the run ended before rank 1 could be killed", seen.decode(errors="replace"))
        seen += byte
    start = time.time()
    os.kill(pids[1], signal.SIGKILL)
    try:
        rest, _ = proc.communicate(timeout=DEADLINE + 60)
    except subprocess.TimeoutExpired:
        proc.kill()
        fail(f"mpirun still runs {DEADLINE + 60} s after rank 1 was killed")
    took = time.time() - start
    out = (seen + rest).decode(errors="replace")
    print(out[-2000:])
    print(f"ended {took:.1f} s after rank 1 was killed")
    if proc.returncode == 0:
        fail("mpirun exited 0", out)
    if not re.search(r"rank 1\b", out):
        fail("no message names rank 1", out)
    if took > DEADLINE + 30:
        fail(f"took {took:.1f} s, beyond the {DEADLINE} s deadline and a margin", out)


def mismatched_model():
    # The same command line on both ranks; rank 1's KALLPA_MODEL names another file.
    script = (f'if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then export KALLPA_MODEL="{OTHER_MODEL}"; fi; '
              f'exec "{KALLPA}" generate --context-parallel -p "Hello" --temp 0 -n 4')
    r = subprocess.run(mpirun(2) + ["sh", "-c", script], env=env(KALLPA_RING_TIMEOUT=DEADLINE), capture_output=True,
                       text=True, timeout=120)
    out = r.stdout + r.stderr
    print(out[-2000:])
    if r.returncode == 0:
        fail("mpirun exited 0 with different model files", out)
    if "rank 1's model file differs from rank 0's" not in out:
        fail("no message names rank 1's model file", out)


skip_without_models()
if TEST == "cp_generate_np2":
    same_text(2)
elif TEST == "cp_generate_np4":
    same_text(4)
elif TEST == "cp_dead_rank":
    dead_rank()
elif TEST == "cp_mismatched_model":
    mismatched_model()
else:
    fail(f"unknown test {TEST}")
print("PASS")
