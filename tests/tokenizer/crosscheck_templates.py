#!/usr/bin/env python3
"""Cross-checks kallpa's chat-template rendering (llama.cpp's Jinja engine) against Python's jinja2.

Renders real chat templates (llama.cpp's collection, models/templates/*.jinja, fetched with the
engine into third_party/llama-jinja/templates by scripts/fetch_jinja.sh) with several
conversations, with and without add_generation_prompt, in both engines, and compares the text.
jinja2 is set up as Hugging Face transformers renders chat templates: a sandboxed environment with
trim_blocks and lstrip_blocks, the loopcontrols extension, raise_exception() and strftime_now(),
and a tojson that keeps non-ASCII text.

The templates in REQUIRED (Llama 3.x, Qwen 2.5/3, Gemma 2, Mistral Nemo, Phi 3.5, SmolLM3, DeepSeek
R1 distills, Granite) must give the same text for every conversation both engines accept, and
both engines must refuse the same conversations (e.g. Gemma 2 raises on a system message). The
other templates are rendered and counted, for information (some need tools or content lists).

Exit status: 0 equal; 1 a mismatch; 77 skipped (jinja2 missing, the templates not fetched, or the
engine not built).

  crosscheck_templates.py --tool build/tests/support/kallpa_chat_template_tool [--templates DIR]
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

SKIP = 77
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

REQUIRED = [
    "meta-llama-Llama-3.1-8B-Instruct",
    "meta-llama-Llama-3.2-3B-Instruct",
    "meta-llama-Llama-3.3-70B-Instruct",
    "Qwen-Qwen2.5-7B-Instruct",
    "Qwen-Qwen3-0.6B",
    "google-gemma-2-2b-it",
    "mistralai-Mistral-Nemo-Instruct-2407",
    "microsoft-Phi-3.5-mini-instruct",
    "HuggingFaceTB-SmolLM3-3B",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
    "ibm-granite-granite-3.3-2B-Instruct",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Write a haiku about 12345 cats 🐱."},
     {"role": "assistant", "content": "Cats nap in the sun,\nnumbers purr: one, two, three, four…"},
     {"role": "user", "content": "  Again,\tplease!\n"}],
    [{"role": "user", "content": "Quote: \"<end_of_turn>\" and '<|im_end|>' and {{ not jinja }} and 中文"}],
]

BOS, EOS = "<s>", "</s>"


def skip(reason):
    print(f"SKIP: {reason}")
    sys.exit(SKIP)


def hf_environment(jinja2):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tool", required=True, help="path to kallpa_chat_template_tool")
    ap.add_argument("--templates", default=os.path.join(REPO, "third_party", "llama-jinja", "templates"))
    args = ap.parse_args()
    try:
        import jinja2
    except ImportError:
        skip("python package jinja2 missing: pip install -r scripts/requirements.txt")
    if not os.path.isdir(args.templates):
        skip(f"{args.templates} not found (run scripts/fetch_jinja.sh)")

    names = sorted(f[:-len(".jinja")] for f in os.listdir(args.templates) if f.endswith(".jinja"))
    missing = [n for n in REQUIRED if n not in names]
    if missing:
        print(f"FAIL: required templates missing from {args.templates}: {missing}")
        return 1
    env = hf_environment(jinja2)
    cases, meta = [], []
    for name in names:
        with open(os.path.join(args.templates, name + ".jinja"), encoding="utf-8") as fh:
            source = fh.read()
        for ci, msgs in enumerate(CONVERSATIONS):
            for gen in (True, False):
                try:
                    want = env.from_string(source).render(messages=msgs, bos_token=BOS, eos_token=EOS,
                                                          add_generation_prompt=gen)
                    err = None
                except Exception as e:  # noqa: BLE001 - a refusal is a result too
                    want, err = None, f"{type(e).__name__}: {e}"
                cases.append({"template": source, "messages": msgs, "bos_token": BOS, "eos_token": EOS,
                              "add_generation_prompt": gen})
                meta.append((name, ci, gen, want, err))

    with tempfile.TemporaryDirectory(prefix="kallpa-tmpl-") as work:
        path = os.path.join(work, "input.json")
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({"cases": cases}, fh, ensure_ascii=False)
        proc = subprocess.run([args.tool, "--input", path], capture_output=True)
    if proc.returncode != 0:
        print(f"FAIL: the tool exited with {proc.returncode}: {proc.stderr.decode('utf-8', 'replace')}")
        return 1
    out = json.loads(proc.stdout.decode("utf-8"))
    if not out["jinja"]:
        skip("kallpa was built without the Jinja engine (run scripts/fetch_jinja.sh and reconfigure)")

    failures, compared, refused_both = 0, 0, 0
    other = {"equal": 0, "different": 0, "refused": 0}
    other_diffs = set()
    for (name, ci, gen, want, err), res in zip(meta, out["results"]):
        got, got_err = res.get("text"), res.get("error")
        required = name in REQUIRED
        if want is not None and got == want:
            if required:
                compared += 1
            else:
                other["equal"] += 1
            continue
        if want is None and got is None:
            if required:
                refused_both += 1
            else:
                other["refused"] += 1
            continue
        if not required:
            other["different"] += 1
            other_diffs.add(name)
            continue
        failures += 1
        print(f"MISMATCH [{name}] conversation {ci}, add_generation_prompt={gen}")
        print(f"    jinja2: {want!r}" if err is None else f"    jinja2 refused: {err}")
        print(f"    kallpa: {got!r}" if got_err is None else f"    kallpa refused: {got_err}")

    print(f"required templates: {len(REQUIRED)}; {compared} renderings equal, {refused_both} refused by both")
    print(f"other templates ({len(names) - len(REQUIRED)}, for information): {other['equal']} equal, "
          f"{other['refused']} refused by both, {other['different']} different or refused by one "
          f"({', '.join(sorted(other_diffs)) or 'none'})")
    if failures:
        print(f"FAIL: {failures} mismatch(es)")
        return 1
    print("OK: kallpa renders every required template as jinja2 does")
    return 0


if __name__ == "__main__":
    sys.exit(main())
