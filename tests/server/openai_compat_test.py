#!/usr/bin/env python3
"""OpenAI compatibility of `kallpa serve`, as an application sees it: the official `openai` client
against the real default model (models/SmolLM2-135M-Instruct.Q4_1.gguf), over every parameter of
/v1/chat/completions and /v1/completions that the server supports, and the exact error of those it
refuses (the table in docs/server.md says the same). Also /tokenize and /detokenize.

    python3 openai_compat_test.py --kallpa BIN --model-dir DIR --work DIR

One server for the whole suite, a few tokens per request (CI has two cores). Exit 0 passed,
1 failed, 77 skipped (the model or the `openai` package is missing).
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
try:
    import jsonschema
    import openai
    import server_test as st
except ImportError as e:  # pragma: no cover
    print(f"skipped: {e} (pip install -r scripts/requirements.txt)")
    sys.exit(77)

from server_test import Failure, Server, check  # noqa: E402

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL = Path(MODEL_FILE).stem
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"


def expect_400(fn, param, code, status=400):
    """Calls fn; it must raise the client's typed error with this status, param and code."""
    try:
        fn()
    except openai.APIStatusError as e:
        body = e.body if isinstance(e.body, dict) else {}
        check(e.status_code == status, f"{param}: status {e.status_code}, expected {status}: {body}")
        check(body.get("param") == param and body.get("code") == code,
              f"{param}: error {body}, expected param {param!r} code {code!r}")
        return body
    raise Failure(f"{param}: accepted, expected {status} {code}")


# The log-probability checks use prompts no other request sends: a prompt found in the prefix
# cache is computed in other attention shapes than the CLI's, which moves logits by float
# reordering (up to ~2e-3 in a log-probability here), while a fresh one gives the CLI's values.
LOGPROB_CHAT = [{"role": "user", "content": "Name the capital city of Italy."}]
LOGPROB_PROMPT = "The largest planet of the solar system is"


def cli_logits_top(chat, n, k):
    """`kallpa generate --logits-top K` on the same prompt: one JSON object per step."""
    cmd = [ARGS.kallpa, "generate", "-m", str(Path(ARGS.model_dir) / MODEL_FILE), "-n", str(n), "--temp", "0",
           "--logits-top", str(k), "-q"]
    cmd += ["--chat", "-p", LOGPROB_CHAT[0]["content"]] if chat else ["-p", LOGPROB_PROMPT]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def close(a, b, tol=1e-4):
    return abs(a - b) <= tol


def test_models(s, client):
    ids = [m.id for m in client.models.list().data]
    check(ids[0] == MODEL, f"/v1/models lists {ids}")
    check("smol" in ids and MODEL_FILE in ids, f"aliases listed: {ids}")
    # Every id the server answers to: its id, the file name, general.name, and --model-alias.
    general_name = next(i for i in ids if i not in (MODEL, MODEL_FILE, "smol"))
    for model in (MODEL, MODEL_FILE, general_name, "smol"):
        r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=1, temperature=0)
        check(r.model == MODEL and r.choices[0].message.content is not None, f"model {model!r}: {r}")
        check(client.models.retrieve(model).id == model, f"retrieve {model!r}")
    expect_400(lambda: client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=1), "model",
               "model_not_found", 404)
    expect_400(lambda: client.completions.create(model="gpt-4o", prompt="x", max_tokens=1), "model",
               "model_not_found", 404)
    try:
        client.models.retrieve("gpt-4o")
        raise Failure("unknown model retrieved")
    except openai.NotFoundError:
        pass


def test_chat_basics(s, client):
    r = client.chat.completions.create(
        model=MODEL, max_completion_tokens=12, temperature=0, seed=7, user="someone", top_p=1.0,
        messages=[{"role": "developer", "content": "You answer in one word."},
                  {"role": "user", "content": [{"type": "text", "text": "What is the capital "},
                                               {"type": "text", "text": "of France?"}]}],
        response_format={"type": "text"}, stream_options=None,
        extra_body={"top_k": 40, "min_p": 0.0, "repetition_penalty": 1.0})
    check("Paris" in r.choices[0].message.content, f"no Paris: {r.choices[0].message.content!r}")
    check(r.usage.completion_tokens <= 12 and r.choices[0].finish_reason in ("stop", "length"), f"{r.usage}")
    # stop, seed, stream with usage.
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    text = full.choices[0].message.content
    stop = text[4:7]
    cut = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0, stop=[stop])
    check(cut.choices[0].message.content == text[:text.find(stop)] and cut.choices[0].finish_reason == "stop",
          f"stop {stop!r}: {cut.choices[0].message.content!r} from {text!r}")
    a = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=1.5, seed=3)
    b = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=1.5, seed=3)
    check(a.choices[0].message.content == b.choices[0].message.content, "same seed, same text")
    streamed, usage = "", None
    for chunk in client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            streamed += c.delta.content or ""
    check(streamed == text and usage.completion_tokens == full.usage.completion_tokens, f"stream {streamed!r}")


def test_chat_logprobs(s, client):
    steps = cli_logits_top(chat=True, n=5, k=3)
    r = client.chat.completions.create(model=MODEL, messages=LOGPROB_CHAT, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    check(len(content) == r.usage.completion_tokens, f"{len(content)} entries for {r.usage.completion_tokens} tokens")
    check("".join(e.token for e in content) == r.choices[0].message.content, "the tokens spell the text")
    for i, (e, step) in enumerate(zip(content, steps)):
        check(e.token == step["piece"] and close(e.logprob, step["logprob"]),
              f"step {i}: {e.token!r} {e.logprob} vs the CLI's {step['piece']!r} {step['logprob']}")
        check(bytes(e.bytes) == e.token.encode(), f"step {i}: bytes {e.bytes}")
        check([t.token for t in e.top_logprobs] == [t["piece"] for t in step["top"]], f"step {i}: top tokens")
        check(all(close(t.logprob, c["logprob"]) for t, c in zip(e.top_logprobs, step["top"])),
              f"step {i}: top {[(t.token, t.logprob) for t in e.top_logprobs]} vs {[(c['piece'], c['logprob']) for c in step['top']]}")
    # Streaming: the same entries, spread over the chunks.
    entries = []
    for chunk in client.chat.completions.create(model=MODEL, messages=LOGPROB_CHAT, max_tokens=5, temperature=0,
                                                logprobs=True, top_logprobs=2, stream=True):
        for c in chunk.choices:
            if c.logprobs and c.logprobs.content:
                entries += c.logprobs.content
    check([e.token for e in entries] == [e.token for e in content], "streamed logprob tokens")
    # (Its prompt is in the prefix cache now: equal up to attention's float reordering.)
    check(all(close(a.logprob, b.logprob, 5e-3) and len(a.top_logprobs) == 2 for a, b in zip(entries, content)),
          "streamed logprob values")
    # logprobs without top_logprobs: no alternatives; neither: null.
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0, logprobs=True)
    check(all(e.top_logprobs == [] for e in r.choices[0].logprobs.content), "no alternatives asked for")
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0)
    check(r.choices[0].logprobs is None, "logprobs null when not asked for")


def test_completions_logprobs(s, client):
    steps = cli_logits_top(chat=False, n=4, k=2)
    r = client.completions.create(model=MODEL, prompt=LOGPROB_PROMPT, max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    check("".join(lp.tokens) == r.choices[0].text, f"tokens {lp.tokens} spell {r.choices[0].text!r}")
    for i, step in enumerate(steps[:len(lp.tokens)]):
        check(lp.tokens[i] == step["piece"] and close(lp.token_logprobs[i], step["logprob"]),
              f"step {i}: {lp.tokens[i]!r} {lp.token_logprobs[i]} vs the CLI's {step['piece']!r} {step['logprob']}")
        check(set(lp.top_logprobs[i]) == {t["piece"] for t in step["top"]}, f"step {i}: top {lp.top_logprobs[i]}")
    offsets = [sum(len(t.encode()) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    check(lp.text_offset == offsets, f"text_offset {lp.text_offset}")
    streamed = []
    for chunk in client.completions.create(model=MODEL, prompt=LOGPROB_PROMPT, max_tokens=4, temperature=0,
                                           logprobs=0, stream=True):
        for c in chunk.choices:
            if c.logprobs:
                streamed += c.logprobs.tokens
    check(streamed == lp.tokens, f"streamed tokens {streamed}")


def test_n(s, client):
    before = st.metric(s.metrics(), "kallpa_prompt_tokens_total")
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=1.0, seed=11, n=3)
    check([c.index for c in r.choices] == [0, 1, 2], f"indices {[c.index for c in r.choices]}")
    check(3 <= r.usage.completion_tokens <= 18, f"usage counts every choice: {r.usage}")
    # Choice i draws with seed + i: choice 1 of seed 11 is choice 0 of seed 12.
    one = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=1.0, seed=12)
    check(one.choices[0].message.content == r.choices[1].message.content,
          f"choice 1 {r.choices[1].message.content!r} != seed 12 {one.choices[0].message.content!r}")
    # The prompt is counted (and computed) once for the three.
    after = st.metric(s.metrics(), "kallpa_prompt_tokens_total")
    check(r.usage.prompt_tokens == one.usage.prompt_tokens, f"prompt tokens {r.usage.prompt_tokens}")
    check(after - before == 2 * r.usage.prompt_tokens, f"prompt tokens counted {after - before}")
    texts = {}
    for chunk in client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=1.0, seed=11,
                                                n=3, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    check([texts[i] for i in range(3)] == [c.message.content for c in r.choices], f"streamed n=3: {texts}")
    expect_400(lambda: client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, n=9), "n",
               "invalid_value")
    expect_400(lambda: client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, n=0), "n",
               "invalid_value")


def test_penalties_and_bias(s, client):
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    text = plain.choices[0].message.content
    # The first token of the greedy answer, banned: the answer changes; forced: it is all there is.
    first = s.request("POST", "/tokenize", {"content": text})[2]["tokens"][0]
    banned = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0,
                                            logit_bias={str(first): -100})
    check(not banned.choices[0].message.content.startswith(text[:3]), f"banned: {banned.choices[0].message.content!r}")
    forced = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0,
                                            logit_bias={str(first): 100}, extra_body={"ignore_eos": True})
    piece = s.request("POST", "/detokenize", {"tokens": [first]})[2]["content"]
    check(forced.choices[0].message.content == piece * 3, f"forced {forced.choices[0].message.content!r}, {piece!r}")
    # Penalties apply to the generated tokens: a strong frequency penalty changes a long greedy text.
    long = client.completions.create(model=MODEL, prompt="one one one one", max_tokens=12, temperature=0)
    pen = client.completions.create(model=MODEL, prompt="one one one one", max_tokens=12, temperature=0,
                                    frequency_penalty=2.0, presence_penalty=2.0)
    check(pen.choices[0].text != long.choices[0].text, f"penalties changed nothing: {pen.choices[0].text!r}")
    client.completions.create(model=MODEL, prompt="x", max_tokens=1, presence_penalty=-2.0, frequency_penalty=-2.0)
    expect_400(lambda: client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1,
                                                      presence_penalty=2.5), "presence_penalty", "invalid_value")
    expect_400(lambda: client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1,
                                                      logit_bias={"5": 150}), "logit_bias", "invalid_value")
    expect_400(lambda: client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1,
                                                      logit_bias={"99999999": 1}), "logit_bias", "invalid_value")


def test_completions_prompts_and_echo(s, client):
    r = client.completions.create(model=MODEL, prompt=[PROMPT, "1, 2, 3,"], max_tokens=3, temperature=0, n=2)
    check([c.index for c in r.choices] == [0, 1, 2, 3], f"indices {[c.index for c in r.choices]}")
    solo = [client.completions.create(model=MODEL, prompt=p, max_tokens=3, temperature=0).choices[0].text
            for p in (PROMPT, "1, 2, 3,")]
    check([c.text for c in r.choices] == [solo[0], solo[0], solo[1], solo[1]], f"{[c.text for c in r.choices]}")
    ids = s.request("POST", "/tokenize", {"content": PROMPT, "add_special": True})[2]["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=3, temperature=0)
    check([c.text for c in by_ids.choices] == [solo[0]] * 2, "prompts as token ids")
    echo = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    check(echo.choices[0].text == PROMPT + solo[0], f"echo: {echo.choices[0].text!r}")
    parts = "".join(c.text for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                                                  temperature=0, echo=True, stream=True)
                    for c in chunk.choices)
    check(parts == echo.choices[0].text, f"streamed echo {parts!r}")
    client.completions.create(model=MODEL, prompt="x", max_tokens=1, best_of=1, suffix="")
    expect_400(lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=1, best_of=2), "best_of",
               "unsupported_value")
    expect_400(lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=1, suffix="y"), "suffix",
               "unsupported_value")
    expect_400(lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=1, echo=True, logprobs=1),
               "echo", "unsupported_value")


def test_refused(s, client):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    cases = [
        ("functions", dict(functions=[tool["function"]]), "unsupported_value"),
        ("function_call", dict(function_call="auto"), "unsupported_value"),
        ("response_format.type", dict(response_format={"type": "xml"}), "invalid_value"),
        ("top_logprobs", dict(top_logprobs=2), "invalid_value"),
        ("top_logprobs", dict(logprobs=True, top_logprobs=21), "invalid_value"),
        ("modalities", dict(modalities=["text", "audio"]), "unsupported_value"),
        ("audio", dict(audio={"voice": "alloy", "format": "wav"}), "unsupported_value"),
        ("prediction", dict(prediction={"type": "content", "content": "x"}), "unsupported_value"),
        ("web_search_options", dict(web_search_options={}), "unsupported_value"),
        ("temperature", dict(temperature=2.5), "invalid_value"),
        ("max_tokens", dict(max_tokens=0), "invalid_value"),
        ("messages[0].role", dict(messages=[{"role": "function", "content": "x", "name": "f"}]), "invalid_value"),
    ]
    for param, kw, code in cases:
        args = {"model": MODEL, "messages": CHAT, "max_tokens": 1, **kw}
        expect_400(lambda: client.chat.completions.create(**args), param, code)
    # Accepted and without effect on a one-model server: store, metadata, service_tier, user, ...
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, store=False, metadata={"a": "b"},
                                       service_tier="auto", user="u", parallel_tool_calls=False,
                                       modalities=["text"])
    check(r.choices[0].message.tool_calls is None, "parallel_tool_calls without tools offers none")
    check(r.choices[0].finish_reason in ("length", "stop"), "ignored fields")
    # verbosity: accepted and ignored (max_tokens is the length control).
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, verbosity="low")
    check(r.choices[0].finish_reason in ("length", "stop"), "verbosity")
    # stream_options.include_obfuscation: accepted and ignored; no chunk carries an obfuscation field.
    for chunks in (list(client.chat.completions.create(
                       model=MODEL, messages=CHAT, max_tokens=3, stream=True,
                       stream_options={"include_usage": True, "include_obfuscation": True})),
                   list(client.completions.create(
                       model=MODEL, prompt="Hello", max_tokens=3, stream=True,
                       stream_options={"include_usage": True, "include_obfuscation": False}))):
        check(chunks and chunks[-1].usage is not None, "include_obfuscation: the usage chunk")
        check(all("obfuscation" not in (c.model_extra or {}) for c in chunks), "an obfuscation field")


def test_tokenize(s, client):
    status, _, body = s.request("POST", "/tokenize", {"content": "Hello world"})
    check(status == 200 and all(isinstance(t, int) for t in body["tokens"]), f"/tokenize: {status} {body}")
    plain = body["tokens"]
    status, _, body = s.request("POST", "/detokenize", {"tokens": plain})
    check(status == 200 and body["content"] == "Hello world", f"/detokenize: {body}")
    _, _, pieces = s.request("POST", "/tokenize", {"content": "Hello world", "with_pieces": True})
    check([p["id"] for p in pieces["tokens"]] == plain and "".join(p["piece"] for p in pieces["tokens"]) ==
          "Hello world", f"with_pieces: {pieces}")
    # Special tokens: read as such by default, as text with parse_special false; add_special adds
    # what the model asks for (SmolLM2: nothing), and detokenize shows or skips them.
    _, _, special = s.request("POST", "/tokenize", {"content": "<|im_start|>user"})
    _, _, literal = s.request("POST", "/tokenize", {"content": "<|im_start|>user", "parse_special": False})
    check(len(special["tokens"]) < len(literal["tokens"]), f"special {special} literal {literal}")
    _, _, added = s.request("POST", "/tokenize", {"content": "Hello world", "add_special": True})
    check(added["tokens"][-len(plain):] == plain, f"add_special {added}")
    _, _, shown = s.request("POST", "/detokenize", {"tokens": special["tokens"]})
    _, _, skipped = s.request("POST", "/detokenize", {"tokens": special["tokens"], "skip_special": True})
    check(shown["content"] == "<|im_start|>user" and skipped["content"] == "user", f"{shown} {skipped}")
    # A multi-byte character split over tokens: its pieces are given as bytes.
    _, _, emoji = s.request("POST", "/tokenize", {"content": "🦙", "with_pieces": True})
    raw = b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode()
                   for p in emoji["tokens"])
    check(raw.decode() == "🦙", f"pieces of an emoji: {emoji}")
    for path, body, param, code in [("/tokenize", {}, "content", "missing_required_parameter"),
                                    ("/tokenize", {"content": 5}, "content", "invalid_type"),
                                    ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces", "invalid_type"),
                                    ("/detokenize", {"tokens": "x"}, "tokens", "invalid_type"),
                                    ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens[1]", "invalid_value"),
                                    ("/detokenize", {"tokens": [1, "a"]}, "tokens[1]", "invalid_type")]:
        st.expect_error(s, "POST", path, body, 400, code, param)
    st.expect_error(s, "POST", "/tokenize", "{", 400, "invalid_json")


# Tools: two functions whose arguments the small model can fill in a few tokens (enums and short
# strings), so that every reply completes well within max_tokens.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "description": "The city, e.g. Paris"},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
                   "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
WEATHER_CHAT = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def check_calls(message, finish_reason, names=None):
    """The message is a tool call reply whose calls name known tools and whose arguments validate."""
    check(finish_reason == "tool_calls", f"finish_reason {finish_reason!r}: {message}")
    check(message.content is None and message.tool_calls, f"no tool calls: {message}")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in message.tool_calls:
        check(call.type == "function" and call.id.startswith("call_") and len(call.id) > 10, f"call {call}")
        check(call.function.name in (names or schemas), f"function {call.function.name!r}, expected {names}")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    return message.tool_calls


def test_tools_required_and_named(s, client):
    r = client.chat.completions.create(model=MODEL, messages=WEATHER_CHAT, tools=TOOLS, tool_choice="required",
                                       max_tokens=96, temperature=0)
    calls = check_calls(r.choices[0].message, r.choices[0].finish_reason)
    check(r.usage.completion_tokens > 0, f"usage {r.usage}")
    r = client.chat.completions.create(model=MODEL, messages=WEATHER_CHAT, tools=TOOLS, max_tokens=96,
                                       temperature=0, tool_choice={"type": "function", "function": {"name": "get_time"}})
    check(len(check_calls(r.choices[0].message, r.choices[0].finish_reason, names=["get_time"])) == 1, "one call")
    # parallel_tool_calls false: exactly one call; n = 3: every choice a valid call, every id unique.
    r = client.chat.completions.create(model=MODEL, messages=WEATHER_CHAT, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=96, temperature=1.0, seed=5, n=3)
    ids = set()
    for c in r.choices:
        one = check_calls(c.message, c.finish_reason)
        check(len(one) == 1, f"parallel_tool_calls false gave {len(one)} calls")
        ids |= {call.id for call in one}
    check(len(ids) == 3, f"ids {ids}")
    check(r.usage.completion_tokens >= 3 and r.usage.prompt_tokens > 0, f"usage {r.usage}")
    # none: no tools offered, a plain answer.
    r = client.chat.completions.create(model=MODEL, messages=WEATHER_CHAT, tools=TOOLS, tool_choice="none",
                                       max_tokens=8, temperature=0)
    check(r.choices[0].message.tool_calls is None and r.choices[0].message.content, f"none: {r.choices[0]}")
    return calls


def test_tools_multi_turn(s, client):
    first = client.chat.completions.create(model=MODEL, messages=WEATHER_CHAT, tools=TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           max_tokens=96, temperature=0)
    call = check_calls(first.choices[0].message, first.choices[0].finish_reason, names=["get_weather"])[0]
    # The assistant's message goes back as the client has it (content null, tool_calls), then the result.
    history = WEATHER_CHAT + [first.choices[0].message.model_dump(exclude_none=True),
                              {"role": "tool", "tool_call_id": call.id, "content": "18 degrees celsius, sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=96, temperature=0)
    c = r.choices[0]
    if c.finish_reason == "tool_calls":
        check_calls(c.message, c.finish_reason)
    else:
        check(c.finish_reason == "stop" and c.message.content and c.message.tool_calls is None, f"auto: {c}")
    # Without tools offered the same history is a plain chat; a follow-up user turn works too.
    r = client.chat.completions.create(model=MODEL, messages=history + [{"role": "user", "content": "Thanks!"}],
                                       max_tokens=8, temperature=0)
    check(r.choices[0].message.content and r.choices[0].message.tool_calls is None, f"plain: {r.choices[0]}")
    expect_400(lambda: client.chat.completions.create(
        model=MODEL, max_tokens=1, messages=WEATHER_CHAT + [{"role": "tool", "tool_call_id": "call_x", "content": "x"}]),
        "messages[1].tool_call_id", "invalid_value")


def test_tools_streaming(s, client):
    plain = client.chat.completions.create(model=MODEL, messages=WEATHER_CHAT, tools=TOOLS, tool_choice="required",
                                           max_tokens=96, temperature=0)
    want = [(c.function.name, c.function.arguments) for c in plain.choices[0].message.tool_calls]
    # By hand: deltas accumulate by index (id, name once; argument fragments appended).
    calls, finish = {}, None
    for chunk in client.chat.completions.create(model=MODEL, messages=WEATHER_CHAT, tools=TOOLS,
                                                tool_choice="required", max_tokens=96, temperature=0, stream=True):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = d.id or call["id"]
                if d.function:
                    call["name"] += d.function.name or ""
                    call["arguments"] += d.function.arguments or ""
    got = [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
    check(finish == "tool_calls" and got == want, f"streamed {got} {finish}, expected {want}")
    check(all(c["id"].startswith("call_") for c in calls.values()), f"ids {calls}")
    # The openai client's own accumulation (the stream helper).
    with client.chat.completions.stream(model=MODEL, messages=WEATHER_CHAT, tools=TOOLS, tool_choice="required",
                                        max_tokens=96, temperature=0) as stream:
        final = stream.get_final_completion()
    check_calls(final.choices[0].message, final.choices[0].finish_reason)
    check([(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls] == want,
          f"stream helper: {final.choices[0].message.tool_calls}")
    # auto, answered without a call: the answer streams as content (decoded from the reply's JSON as
    # it is written) and equals the non-streamed one.
    hello = [{"role": "user", "content": "Hello! How are you today?"}]
    plain = client.chat.completions.create(model=MODEL, messages=hello, tools=TOOLS, max_tokens=64, temperature=0)
    check(plain.choices[0].finish_reason == "stop" and plain.choices[0].message.tool_calls is None,
          f"auto answered: {plain.choices[0]}")
    parts = [c.delta.content for chunk in client.chat.completions.create(
        model=MODEL, messages=hello, tools=TOOLS, max_tokens=64, temperature=0, stream=True)
        for c in chunk.choices if c.delta.content]
    check("".join(parts) == plain.choices[0].message.content, f"streamed answer {parts}")
    # n = 2 with usage: each choice's calls under its own index. (Sampled at temperature 1 the small
    # model may append calls until max_tokens when it may make several: one call each here.)
    per_choice, usage = {}, None
    for chunk in client.chat.completions.create(model=MODEL, messages=WEATHER_CHAT, tools=TOOLS, n=2, seed=3,
                                                tool_choice="required", parallel_tool_calls=False, max_tokens=96,
                                                temperature=1.0, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                if d.function and d.function.arguments:
                    per_choice.setdefault(c.index, []).append(d.function.arguments)
    check(sorted(per_choice) == [0, 1] and usage and usage.completion_tokens > 0, f"n=2: {per_choice} {usage}")
    for args in per_choice.values():
        for a in args:
            json.loads(a)


def test_tools_refused(s, client):
    bad_schema = {"type": "function", "function": {"name": "broken", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]}}}
    cases = [
        ("tools[1].function.name", dict(tools=[WEATHER, WEATHER]), "invalid_value"),
        ("tools[0].function.name", dict(tools=[{"type": "function", "function": {"name": "a b"}}]), "invalid_value"),
        ("tools[0].function", dict(tools=[{"type": "function"}]), "missing_required_parameter"),
        ("tools", dict(tools=[]), "invalid_value"),
        ("tool_choice.function.name",
         dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_news"}}), "invalid_value"),
        ("tool_choice", dict(tools=TOOLS, tool_choice="sometimes"), "invalid_value"),
        ("tool_choice", dict(tool_choice="required"), "invalid_value"),
        ("tools[1].function.parameters", dict(tools=[WEATHER, bad_schema]), "invalid_value"),
    ]
    for param, kw, code in cases:
        args = {"model": MODEL, "messages": WEATHER_CHAT, "max_tokens": 1, **kw}
        expect_400(lambda: client.chat.completions.create(**args), param, code)


TESTS = [test_models, test_chat_basics, test_chat_logprobs, test_completions_logprobs, test_n,
         test_penalties_and_bias, test_completions_prompts_and_echo, test_refused, test_tokenize,
         test_tools_required_and_named, test_tools_multi_turn, test_tools_streaming, test_tools_refused]


def main():
    global ARGS
    p = argparse.ArgumentParser()
    p.add_argument("--kallpa", required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("tests", nargs="*", help="test names (default: all)")
    ARGS = p.parse_args()
    model = Path(ARGS.model_dir) / MODEL_FILE
    if not model.exists():
        print(f"skipped: {model} not found (scripts/fetch_model.sh)")
        return 77
    st.ARGS = argparse.Namespace(kallpa=ARGS.kallpa, work=ARGS.work, fixture_tool=None)
    chosen = [t for t in TESTS if not ARGS.tests or t.__name__[5:] in ARGS.tests]
    failed = 0
    with Server("openai_compat", "--model-alias", "smol", "--max-choices", "8", model=model) as s:
        client = s.client()
        for t in chosen:
            start = time.time()
            try:
                t(s, client)
                print(f"ok {t.__name__[5:]} ({time.time() - start:.1f} s)")
            except (Failure, openai.APIError) as e:
                print(f"FAIL {t.__name__[5:]}: {e!r}")
                failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
