#!/usr/bin/env python3
"""Structured output against the real default model (models/SmolLM2-135M-Instruct.Q4_1.gguf):
`response_format` json_schema and json_object through `kallpa serve` and the official `openai`
client, and `kallpa generate --json-schema`. Every answer must parse and validate against its
schema with the `jsonschema` package, over a corpus of schemas (nested objects, arrays, enums,
numbers with ranges, anyOf, required and optional properties), greedy and sampled, streamed and
not. A schema the engine cannot compile is a 400 naming response_format's part.

    python3 structured_output_test.py --kallpa BIN --fixture-tool BIN --work DIR --model-dir DIR

Reuses server_test.py's Server. Exit 0 passed, 1 failed, 77 skipped (no model, no jsonschema).
"""
from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import server_test  # noqa: E402  (exits 77 itself without openai)
from server_test import Failure, Server, Skip, check  # noqa: E402
from structured_schemas import CORPUS  # noqa: E402

try:
    import jsonschema
except ImportError as e:  # pragma: no cover
    print(f"skipped: {e} (pip install -r scripts/requirements.txt)")
    sys.exit(77)



def schema_format(name, schema, strict=True):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": strict}}


def ask(client, prompt, response_format, **kw):
    r = client.chat.completions.create(model=server_test.REAL_MODEL.removesuffix(".gguf"), messages=[{"role": "user", "content": prompt}],
                                       response_format=response_format, max_tokens=kw.pop("max_tokens", 256), **kw)
    return r.choices[0].message.content, r.choices[0].finish_reason


def ask_streamed(client, prompt, response_format, **kw):
    text, finish = "", None
    for chunk in client.chat.completions.create(model=server_test.REAL_MODEL.removesuffix(".gguf"), messages=[{"role": "user", "content": prompt}],
                                                response_format=response_format, max_tokens=256, stream=True, **kw):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def validate(where, text, finish, schema):
    check(finish == "stop", f"{where}: finish_reason {finish!r} (the grammar should end it): {text!r}")
    try:
        value = json.loads(text)
    except ValueError as e:
        raise Failure(f"{where}: not JSON ({e}): {text!r}")
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as e:
        raise Failure(f"{where}: does not validate ({e.message}): {text!r}")
    return value


def real_model():
    model = Path(server_test.ARGS.model_dir) / server_test.REAL_MODEL
    if not model.exists():
        raise Skip(f"{model} not found (scripts/fetch_model.sh)")
    return model


def test_schema_corpus():
    """Every schema, greedy and sampled (two seeds), all at once (the scheduler batches them); then
    greedy again streamed, which must give the same text."""
    with Server("structured_corpus", "--model-alias", "kallpa", model=real_model()) as s:
        client = s.client()
        jobs = []
        for name, prompt, schema in CORPUS:
            fmt = schema_format(name, schema)
            jobs.append((f"{name} greedy", prompt, schema, fmt, {"temperature": 0, "seed": 0}))
            for seed in (1, 2):
                jobs.append((f"{name} seed {seed}", prompt, schema, fmt, {"temperature": 0.9, "seed": seed}))
        with ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(lambda j: ask(client, j[1], j[3], **j[4]), jobs))
        greedy = {}
        for (where, _, schema, _, kw), (text, finish) in zip(jobs, answers):
            validate(where, text, finish, schema)
            if kw["temperature"] == 0:
                greedy[where.split()[0]] = text
        with ThreadPoolExecutor(len(CORPUS)) as pool:
            streamed = list(pool.map(lambda c: ask_streamed(client, c[1], schema_format(c[0], c[2]), temperature=0,
                                                            seed=0), CORPUS))
        for (name, _, schema), (text, finish) in zip(CORPUS, streamed):
            validate(f"{name} streamed", text, finish, schema)
            check(text == greedy[name], f"{name}: streamed {text!r} != {greedy[name]!r}")


def test_json_object_and_text():
    with Server("structured_json_object", "--model-alias", "kallpa", model=real_model()) as s:
        client = s.client()
        for seed in (0, 1, 2):
            text, finish = ask(client, "Return a JSON object describing a cat: its name and age.", {"type": "json_object"},
                               temperature=0.0 if seed == 0 else 0.9, seed=seed)
            value = validate(f"json_object seed {seed}", text, finish, {"type": "object"})
            check(isinstance(value, dict), f"json_object gives an object: {text!r}")
        # json_schema without a schema is any object; non-strict lets a schema's objects take more keys.
        text, finish = ask(client, "Return a JSON object describing a dog: its name and age.",
                           {"type": "json_schema", "json_schema": {"name": "free"}}, temperature=0)
        validate("json_schema without schema", text, finish, {"type": "object"})
        loose = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30}}, "required": ["name"]}
        text, finish = ask(client, "Return a JSON object describing a cat: its name and age.", schema_format("loose", loose, strict=False),
                           temperature=0)
        validate("non-strict", text, finish, loose)
        # The default, text, is unconstrained.
        text, finish = ask(client, "What is the capital of France?", {"type": "text"}, temperature=0, max_tokens=24)
        check("Paris" in text, f"response_format text answers as without it: {text!r}")


def test_bad_formats():
    """Refused with a 400 that names the part; no model needed beyond the fixture."""
    with Server("structured_bad", "--model-alias", "kallpa") as s:
        chat = "/v1/chat/completions"
        base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        cases = [
            ({"type": "xml"}, "response_format.type", "invalid_value"),
            ("json", "response_format", "invalid_type"),
            ({}, "response_format.type", "missing_required_parameter"),
            ({"type": "json_schema"}, "response_format.json_schema", "missing_required_parameter"),
            ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name",
             "missing_required_parameter"),
            ({"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}, "response_format.json_schema.schema",
             "invalid_type"),
            ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}},
             "response_format.json_schema.strict", "invalid_type"),
            # The engine cannot compile these: the message says which part.
            ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]}}},
             "response_format.json_schema.schema", "invalid_value"),
            ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}},
                "required": ["n"]}}},
             "response_format.json_schema.schema", "invalid_value"),
        ]
        for fmt, param, code in cases:
            status, _, body = s.request("POST", chat, {**base, "response_format": fmt})
            check(status == 400, f"{fmt!r}: status {status}, expected 400: {body!r}")
            err = body.get("error", {}) if isinstance(body, dict) else {}
            check(err.get("param") == param, f"{fmt!r}: param {err.get('param')!r}, expected {param!r}")
            check(err.get("code") == code, f"{fmt!r}: code {err.get('code')!r}, expected {code!r}")
            check(err.get("message"), f"{fmt!r}: a message")
        _, _, body = s.request("POST", chat, {**base, "response_format": cases[7][0]})
        check("missing" in body["error"]["message"], f"the message names the dangling $ref: {body!r}")


def test_cli_json_schema():
    model = real_model()
    _, prompt, schema = CORPUS[0]
    work = Path(server_test.ARGS.work) / "structured_cli"
    work.mkdir(parents=True, exist_ok=True)
    schema_file = work / "person.schema.json"
    schema_file.write_text(json.dumps(schema))
    for extra in (["--temp", "0"], ["--temp", "0.9", "--seed", "3"]):
        r = subprocess.run([server_test.ARGS.kallpa, "generate", "-m", str(model), "--chat", "-p", prompt, "-n", "256",
                            "-q", "--json-schema", str(schema_file), *extra], capture_output=True, text=True, timeout=300)
        check(r.returncode == 0, f"kallpa generate --json-schema {extra}: exit {r.returncode}: {r.stderr}")
        text = r.stdout.strip()
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError) as e:
            raise Failure(f"kallpa generate --json-schema {extra}: {e}: {text!r}")
    r = subprocess.run([server_test.ARGS.kallpa, "generate", "-m", str(model), "-p", "x", "-q", "--json-schema",
                        str(work / "absent.json")], capture_output=True, text=True, timeout=300)
    check(r.returncode != 0 and "absent.json" in r.stderr, f"a missing schema file is an error naming it: {r.stderr!r}")


if __name__ == "__main__":
    sys.exit(server_test.suite_main(globals()))
