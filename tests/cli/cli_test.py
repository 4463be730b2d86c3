#!/usr/bin/env python3
"""Tests of the real `kallpa` binary: python3 cli_test.py PATH_TO_KALLPA TEST_NAME.

Each test runs the program, checks exit status and output, and exits 1 with a message on the
first mismatch (so ctest reports it), 0 when everything held.
"""
import json
import os
import re
import subprocess
import sys

GOOD_SPEC = "b=1,sq=4096,skv=4096,hq=32,hkv=8,d=128,causal,dtype=bf16"
SMALL_SPEC = "b=1,sq=64,skv=64,hq=4,hkv=2,d=32,causal"
SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed(, (\d+) skipped)?$")


class Failure(Exception):
    pass


def check(cond, message, result=None):
    if not cond:
        if result is not None:
            message += (f"\n--- command: {' '.join(result.args)}\n--- exit: {result.returncode}"
                        f"\n--- stdout (tail):\n{result.stdout[-3000:]}\n--- stderr (tail):\n{result.stderr[-3000:]}")
        raise Failure(message)


def run(*args, env_extra=None, timeout=540):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KALLPA_ATTENTION")}
    env.update(env_extra or {})
    result = subprocess.run([KALLPA, *args], capture_output=True, text=True, env=env, timeout=timeout)
    # A negative code is a signal (a crash); never acceptable, whatever the test expects.
    check(result.returncode >= 0, f"killed by signal {-result.returncode}", result)
    return result


def last_line(text):
    lines = [l for l in text.splitlines() if l.strip()]
    return lines[-1] if lines else ""


def expect_usage_error(args, must_mention, env_extra=None):
    r = run(*args, env_extra=env_extra)
    check(r.returncode == 2, f"expected exit 2 for {args}", r)
    for word in must_mention:
        check(word in r.stderr, f"stderr should mention '{word}' for {args}", r)
    check("internal error" not in r.stderr, "input error reported as an internal error", r)
    return r


# --- tests -------------------------------------------------------------------------------------

def test_version():
    r = run("--version")
    check(r.returncode == 0 and r.stdout.startswith("kallpa "), "--version prints 'kallpa X'", r)


def test_usage_errors():
    expect_usage_error([], [])                        # no subcommand
    expect_usage_error(["frobnicate"], [])            # unknown subcommand
    expect_usage_error(["backends", "--bogus"], ["--bogus"])
    expect_usage_error(["--log-level", "loud", "backends"], ["loud"])
    expect_usage_error(["demo", "--attention", "nosuch"], ["nosuch"])
    expect_usage_error(["demo", "--attention", "reference,,reference"], ["--attention"])
    expect_usage_error(["demo"], ["nosuch"], env_extra={"KALLPA_ATTENTION": "nosuch"})
    expect_usage_error(["demo", "--spec", "b=1,sq=abc"], ["sq"])


def test_backends_text():
    r = run("backends")
    check(r.returncode == 0, "backends exits 0", r)
    check(re.search(r"^reference\s+cpu\s", r.stdout, re.M), "backends lists reference on cpu", r)


def test_backends_json():
    r = run("backends", "--json")
    check(r.returncode == 0, "backends --json exits 0", r)
    try:
        data = json.loads(r.stdout)
    except json.JSONDecodeError as e:
        raise Failure(f"backends --json is not JSON: {e}\n{r.stdout[:2000]}")
    check(isinstance(data, list) and data, "a non-empty JSON array", r)
    for item in data:
        for key in ("name", "device", "version", "health"):
            check(key in item, f"every backend object has '{key}': {item}", r)
    names = [b["name"] for b in data]
    check("reference" in names, f"reference listed: {names}", r)
    check(len(names) == len(set(names)), f"names unique: {names}", r)
    ref = next(b for b in data if b["name"] == "reference")
    check(ref["device"] == "cpu", f"reference is a cpu backend: {ref}", r)
    check(ref["health"] in ("healthy", "unchecked"), f"reference is not quarantined: {ref}", r)


def test_explain():
    r = run("backends", "--explain", GOOD_SPEC)
    check(r.returncode == 0, "explain of a valid spec exits 0", r)
    check(re.search(r"^reference\s", r.stdout, re.M), "explain lists reference's verdict", r)
    check(re.search(r"^selected: \S+", r.stdout, re.M), "explain names the selected backend", r)

    r = run("backends", "--explain", GOOD_SPEC, "--json")
    check(r.returncode == 0, "explain --json exits 0", r)
    data = json.loads(r.stdout)
    listed = json.loads(run("backends", "--json").stdout)
    check(len(data) == len(listed), "one verdict per registered backend", r)
    for v in data:
        for key in ("backend", "supported", "selected", "reason", "health"):
            check(key in v, f"verdict has '{key}': {v}", r)
        if not v["supported"]:
            check(v["reason"], f"an unsupported verdict gives a reason: {v}", r)
    check(sum(1 for v in data if v["selected"]) == 1, "exactly one backend selected", r)
    ref = next(v for v in data if v["backend"] == "reference")
    check(ref["supported"], f"reference supports every valid cpu problem: {ref}", r)

    # An explicit choice is honoured by explain.
    r = run("--attention", "reference", "backends", "--explain", GOOD_SPEC, "--json")
    check(r.returncode == 0, "explain with --attention reference exits 0", r)
    sel = [v["backend"] for v in json.loads(r.stdout) if v["selected"]]
    check(sel == ["reference"], f"--attention reference selects reference, got {sel}", r)


def test_explain_malformed():
    expect_usage_error(["backends", "--explain", "b=1,sq=abc"], ["sq"])
    expect_usage_error(["backends", "--explain", "b=1,sq=4,bogus=3"], ["bogus"])
    expect_usage_error(["backends", "--explain", "hq=32,hkv=5"], ["hkv"])
    expect_usage_error(["backends", "--explain", "b=1,sq=4,sq=5"], ["sq"])
    expect_usage_error(["backends", "--explain", "b=1,sq=abc", "--json"], ["sq"])


def test_conformance_quick():
    r = run("conformance", "--backend", "reference", "--quick")
    check(r.returncode == 0, "conformance --backend reference --quick exits 0", r)
    m = SUMMARY.match(last_line(r.stdout))
    check(m is not None, "output ends with 'N passed, M failed'", r)
    check(int(m.group(2)) == 0, "no failures for reference", r)
    check(int(m.group(1)) > 0, "some cases ran", r)


def test_conformance_json():
    r = run("conformance", "--backend", "reference", "--quick", "--json")
    check(r.returncode == 0, "conformance --json exits 0", r)
    try:
        data = json.loads(r.stdout)
    except json.JSONDecodeError as e:
        raise Failure(f"conformance --json stdout is not JSON: {e}\n{r.stdout[:2000]}")
    check(isinstance(data, list) and data, "a non-empty JSON array", r)
    for item in data:
        for key in ("backend", "case", "max_error", "allowed", "passed", "skipped", "reason"):
            check(key in item, f"result has '{key}': {item}", r)
    m = SUMMARY.match(last_line(r.stderr))
    check(m is not None, "in --json mode the summary line ends stderr", r)
    passed = sum(1 for i in data if i["passed"])
    failed = sum(1 for i in data if not i["passed"] and not i["skipped"])
    check((int(m.group(1)), int(m.group(2))) == (passed, failed), "summary agrees with the JSON", r)


def test_conformance_tiers():
    counts = {}
    names = {}
    for tier, flags in (("quick", ["--quick"]), ("normal", []), ("full", ["--full"])):
        r = run("conformance", "--backend", "reference", "--list", *flags)
        check(r.returncode == 0, f"conformance --list {' '.join(flags)} exits 0", r)
        names[tier] = set(r.stdout.split())
        m = re.search(r"^(\d+) case\(s\)$", r.stderr, re.M)
        check(m is not None and int(m.group(1)) == len(names[tier]), "--list counts the names it prints", r)
        counts[tier] = len(names[tier])
    check(counts["quick"] < counts["normal"] < counts["full"], f"each tier adds cases: {counts}")
    check(names["quick"] <= names["normal"] <= names["full"], "each tier contains the one below")
    check(any("skv4097" in n for n in names["normal"]) and not any("skv4097" in n for n in names["quick"]),
          "the default tier crosses the 4096-key bucket, the quick one does not")
    check(any("131072" in n and "sampled" in n for n in names["full"]), "the full tier has sampled 128k-key cases")
    expect_usage_error(["conformance", "--quick", "--full"], ["--full"])


def test_conformance_unknown():
    r = expect_usage_error(["conformance", "--backend", "nosuch"], ["nosuch"])
    check("not_found" in r.stderr, "typed error (not_found)", r)


def test_demo():
    r = run("demo")
    check(r.returncode == 0, "demo exits 0", r)
    check(re.search(r"^reference\s+cpu\s+ok\s", r.stdout, re.M), "demo ran reference", r)
    check("dispatcher (automatic): chose " in r.stdout, "demo says what the dispatcher chose", r)
    check("StatsObserver" in r.stdout, "demo prints the telemetry summary", r)
    check("FAILED" not in r.stdout, "no backend failed", r)


def test_demo_strict():
    r = run("--attention", "reference", "demo", "--strict", "--spec", SMALL_SPEC)
    check(r.returncode == 0, "strict explicit reference demo exits 0", r)
    check("chose reference" in r.stdout, "the explicit choice ran", r)


def test_bench_json():
    r = run("bench", "attention", "--spec", SMALL_SPEC, "--backend", "reference", "--min-time", "0.01", "--json")
    check(r.returncode == 0, "bench attention --json exits 0", r)
    data = json.loads(r.stdout)
    check(isinstance(data, list) and len(data) == 1, "one row: one backend x one shape", r)
    row = data[0]
    check(row["backend"] == "reference" and row["ran"], f"reference ran: {row}", r)
    check(row["gflops"] > 0 and row["seconds"] > 0, f"positive timings: {row}", r)
    expect_usage_error(["bench", "attention", "--backend", "nosuch"], ["nosuch"])
    expect_usage_error(["bench", "attention", "--spec", "d=0x"], ["d"])


class Skip(Exception):
    pass


def model_or_skip():
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.environ.get("KALLPA_MODEL") or os.path.join(here, "..", "..", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.exists(path):
        raise Skip(f"model not found at {path} (bash scripts/fetch_model.sh)")
    return os.path.abspath(path)


def test_generate_chat():
    model = model_or_skip()
    r = run("generate", "-m", model, "--chat", "-p", "What is the capital of France?", "--temp", "0", "-n", "32")
    check(r.returncode == 0, "generate exits 0", r)
    check("Paris" in r.stdout, "the answer mentions Paris", r)
    check("attention:" in r.stderr and "tok/s" in r.stderr, "a summary line on stderr", r)
    again = run("generate", "-m", model, "-p", "Once upon a time", "--seed", "7", "-n", "16", "-q")
    same = run("generate", "-m", model, "-p", "Once upon a time", "--seed", "7", "-n", "16", "-q")
    check(again.returncode == 0 and again.stdout == same.stdout, "same seed, same text", same)


def test_generate_errors():
    expect_usage_error(["generate", "-m", "/nonexistent/model.gguf", "-p", "hi"], ["/nonexistent/model.gguf"])
    expect_usage_error(["generate", "-p", "hi", "--temp", "-1"], ["temperature"])
    expect_usage_error(["generate"], ["prompt"])


def test_bench_model_batch():
    model = model_or_skip()
    r = run("bench", "model", "-m", model, "-p", "8", "-n", "4", "-d", "0", "-B", "1,3", "-r", "1", "--threads", "1", "--json")
    check(r.returncode == 0, "bench model --batch exits 0", r)
    rows = {row["test"]: row for row in json.loads(r.stdout)}
    check(set(rows) == {"pp8", "tg4", "tg4 x3"}, f"one row per test: {sorted(rows)}", r)
    check(rows["tg4"]["tokens"] == 4 and rows["tg4 x3"]["tokens"] == 12, "a batch counts every sequence's tokens", r)
    check(all(row["tokens_per_second"] > 0 and len(row["seconds"]) == 1 for row in rows.values()),
          "every row has a rate and one timed run", r)
    # matmul_gops is the rate times 2 ops per weight of every projection and the head: one
    # constant per model (SmolLM2-135M: 30 layers of 3,538,944 weights + a 576 x 49152 head).
    per_token = {t: row["matmul_gops"] * 1e9 / row["tokens_per_second"] for t, row in rows.items()}
    check(max(per_token.values()) - min(per_token.values()) < 1e-6 * max(per_token.values()),
          f"one matmul op count per token for every test: {per_token}", r)
    if "SmolLM2-135M" in model:
        check(abs(per_token["tg4"] - 2 * (30 * 3538944 + 576 * 49152)) < 1.0,
              f"SmolLM2-135M's matmuls are 269.0 M ops per token: {per_token['tg4']}", r)
    expect_usage_error(["bench", "model", "-m", model, "-B", "0"], ["--batch"])


def test_tokenize_json():
    model = model_or_skip()
    r = run("tokenize", "-m", model, "--json", "Hello world 123")
    check(r.returncode == 0, "tokenize exits 0", r)
    data = json.loads(r.stdout)
    check([t["piece"] for t in data] == ["Hello", " world", " ", "1", "2", "3"], f"pieces: {data}", r)


def test_quarantine_journal():
    import json
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "state", "quarantine.jsonl")
        os.makedirs(os.path.dirname(path))
        # An earlier build of cpu-gemm was quarantined: its history shows, the current build is not held.
        with open(path, "w") as f:
            f.write(json.dumps({"event": "quarantined", "backend": "cpu-gemm", "identity": "cpu-gemm@0-old",
                                "scope": "backend", "source": "shadow_check", "reason": "wrong at 8k keys",
                                "time": "2025-01-01T00:00:00Z"}) + "\n")
            f.write("garbage line\n")
        r = run("backends", "--quarantine-journal", path)
        check(r.returncode == 0, "backends with a journal exits 0", r)
        check("journal of cpu-gemm: 2025-01-01T00:00:00Z quarantined cpu-gemm@0-old" in r.stdout,
              "backends lists the journal history", r)
        check("line 2" in r.stderr, "a corrupt journal line is skipped with a warning naming it", r)
        r = run("backends", "--json", env_extra={"KALLPA_QUARANTINE_JOURNAL": path})
        check(r.returncode == 0, "backends --json exits 0", r)
        gemm = [b for b in json.loads(r.stdout) if b["name"] == "cpu-gemm"][0]
        check(gemm["health"] != "quarantined", "another build's quarantine does not hold this one", r)
        check(gemm["journal"][0]["identity"] == "cpu-gemm@0-old" and "verification" in gemm, "journal in --json", r)
        check(gemm["identity"].startswith("cpu-gemm@"), "identity in --json", r)
    r = run("demo", "--verify-rate", "1/1", "--spec", "b=1,sq=1,skv=64,hq=2,hkv=1,d=16",
            env_extra={"KALLPA_QUARANTINE_JOURNAL": "off"})
    check(r.returncode == 0, "demo with every call verified exits 0", r)
    expect_usage_error(["demo", "--verify-rate", "often"], ["--verify-rate"])
    expect_usage_error(["demo"], ["KALLPA_VERIFY_RATE"], env_extra={"KALLPA_VERIFY_RATE": "2"})


TESTS = {name[5:]: fn for name, fn in globals().items() if name.startswith("test_")}

if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[2] not in TESTS:
        print(f"usage: {sys.argv[0]} KALLPA_BINARY TEST\ntests: {' '.join(TESTS)}", file=sys.stderr)
        sys.exit(2)
    KALLPA = sys.argv[1]
    try:
        TESTS[sys.argv[2]]()
    except Failure as e:
        print(f"FAIL {sys.argv[2]}: {e}", file=sys.stderr)
        sys.exit(1)
    except Skip as e:
        print(f"SKIP {sys.argv[2]}: {e}")
        sys.exit(77)
    except subprocess.TimeoutExpired as e:
        print(f"FAIL {sys.argv[2]}: timed out: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"ok {sys.argv[2]}")
