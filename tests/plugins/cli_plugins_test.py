#!/usr/bin/env python3
"""The `kallpa` binary with plugins: python3 cli_plugins_test.py KALLPA PLUGIN_DIR TEST_NAME.

Plugins come from --plugin and KALLPA_PLUGIN_PATH; libraries that cannot load are reported on
stderr with path and reason while the command carries on; `kallpa backends` (text and --json)
shows each backend's health with the reason for a quarantine; the health check can be skipped.
"""
import json
import os
import subprocess
import sys

SPEC = "b=1,sq=1,skv=64,hq=4,hkv=2,d=16,kv=paged,page=16,causal"


class Failure(Exception):
    pass


def check(cond, message, result=None):
    if not cond:
        if result is not None:
            message += (f"\n--- command: {' '.join(result.args)}\n--- exit: {result.returncode}"
                        f"\n--- stdout:\n{result.stdout[-3000:]}\n--- stderr:\n{result.stderr[-3000:]}")
        raise Failure(message)


def run(*args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KALLPA_") or k == "KALLPA_QUARANTINE_JOURNAL"}
    env.update(env_extra or {})
    r = subprocess.run([KALLPA, *args], capture_output=True, text=True, env=env, timeout=300)
    check(r.returncode >= 0, f"killed by signal {-r.returncode}", r)
    return r


def plugin(name):
    return os.path.join(PLUGINS, f"fault-{name}.so")


def by_name(result):
    return {b["name"]: b for b in json.loads(result.stdout)}


def test_load_failures_are_reported_and_kallpa_carries_on():
    r = run("--plugin", plugin("good"), "--plugin", "/nonexistent/x.so", "--plugin", plugin("wrong-major"),
            "--plugin", plugin("no-entry"), "--plugin", plugin("init-error"), "backends")
    check(r.returncode == 0, "backends still lists what loaded", r)
    check("fault-good" in r.stdout, "the good plugin is listed", r)
    for path, words in (("/nonexistent/x.so", "no such file"),
                        (plugin("wrong-major"), "major version must match"),
                        (plugin("no-entry"), "kallpa_attention_plugin_init"),
                        (plugin("init-error"), "no accelerator found")):
        line = next((l for l in r.stderr.splitlines() if path in l), "")
        check(words in line, f"stderr names {path} and says '{words}'", r)


def test_backends_show_health_and_quarantine_reasons():
    r = run("--plugin", plugin("offby"), "--plugin", plugin("old-minor"), "backends")
    check(r.returncode == 0, "backends exits 0", r)
    lines = {}
    for l in r.stdout.splitlines():  # a backend's first line; its counters line may follow
        if l.strip():
            lines.setdefault(l.split()[0], l)
    check("quarantined (canary '" in lines.get("fault-offby", ""), "offby is quarantined with its canary", r)
    check(" healthy " in lines.get("fault-old-minor", ""), "the ABI 1.0 plugin loads and is healthy", r)
    for name in ("cpu-flash", "reference"):
        check(" healthy " in lines.get(name, ""), f"built-in {name} is healthy", r)
    check("quarantined" in r.stdout.splitlines()[-1], "the summary line counts quarantines", r)

    r = run("--plugin", plugin("offby"), "backends", "--json")
    b = by_name(r)
    check(b["fault-offby"]["health"] == "quarantined", "json: offby quarantined", r)
    check(b["fault-offby"]["health_reason"].startswith("canary '"), "json: the reason names the canary", r)
    check(b["reference"]["health"] == "healthy", "json: reference healthy", r)


def test_plugin_path_environment():
    # Every plugin of the directory, the rogues' gallery included, each in its own host process:
    # the ones that crash, abort, hang (a 2 s watchdog here) or write past o (caught by the guard
    # pages of paranoid mode) are quarantined by their canaries; `kallpa backends` carries on.
    env = {"KALLPA_PLUGIN_PATH": f"/nonexistent:{PLUGINS}", "KALLPA_PLUGIN_TIMEOUT_MS": "2000", "KALLPA_PARANOID": "1"}
    r = run("backends", "--json", env_extra=env)
    check(r.returncode == 0, "backends exits 0", r)
    b = by_name(r)
    for name, health in (("fault-good", "healthy"), ("fault-old-minor", "healthy"), ("fault-offby", "quarantined"),
                         ("fault-decode", "quarantined"), ("fault-error", "quarantined"),
                         ("fault-nan", "quarantined"), ("fault-throw", "quarantined"), ("fault-segv", "quarantined"),
                         ("fault-abort", "quarantined"), ("fault-hang", "quarantined"), ("fault-oob", "quarantined"),
                         ("fault-liar", "quarantined"), ("fault-large", "healthy")):
        # fault-large is wrong only past 4,096 keys, where no canary goes: the run-time checks
        # (first use of a size bucket) are what catch it (tests/plugin_isolation_test.cpp).
        check(b.get(name, {}).get("health") == health, f"{name} is {health}", r)
    for name, words in (("fault-segv", "SIGSEGV"), ("fault-abort", "SIGABRT"), ("fault-hang", "watchdog"),
                        ("fault-oob", "past the end of o")):
        check(words in b[name]["health_reason"], f"{name}'s reason says {words}", r)
    check("/nonexistent" in r.stderr, "the missing directory is reported", r)


def test_explain_and_strict_choice_of_a_quarantined_plugin():
    r = run("--plugin", plugin("offby"), "--plugin", plugin("good"), "backends", "--explain", SPEC)
    check(r.returncode == 0, "explain exits 0", r)
    check("selected: fault-good" in r.stdout, "the healthy plugin is selected", r)
    check("quarantined: canary" in r.stdout, "explain gives the quarantine reason", r)
    r = run("--plugin", plugin("offby"), "--attention", "fault-offby", "--strict", "backends", "--explain", SPEC)
    check(r.returncode == 1, "a strict choice of a quarantined backend cannot run", r)


def test_health_check_can_be_skipped():
    for args, env, why in ((["--no-health-check"], {}, "--no-health-check"),
                           ([], {"KALLPA_SKIP_HEALTH_CHECK": "1"}, "KALLPA_SKIP_HEALTH_CHECK=1")):
        r = run(*args, "--plugin", plugin("offby"), "backends", "--json", env_extra=env)
        b = by_name(r)
        check(b["fault-offby"]["health"] == "unchecked", f"{why}: offby is unchecked", r)
        check(why in b["fault-offby"]["health_reason"], f"{why}: the reason says why", r)


def test_conformance_of_a_plugin():
    r = run("--plugin", plugin("good"), "conformance", "--backend", "fault-good", "--quick", "--filter", "paged16")
    check(r.returncode == 0 and r.stdout.strip().splitlines()[-1].endswith("0 failed"), "good passes", r)
    r = run("--plugin", plugin("decode"), "conformance", "--backend", "fault-decode", "--quick", "--filter", "paged16")
    check(r.returncode == 1, "the decode fault fails conformance", r)


if __name__ == "__main__":
    KALLPA, PLUGINS, name = sys.argv[1], sys.argv[2], sys.argv[3]
    try:
        globals()[f"test_{name}"]()
    except Failure as e:
        print(f"FAIL {name}: {e}")
        sys.exit(1)
    print(f"ok {name}")
