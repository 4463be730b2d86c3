#!/usr/bin/env python3
"""POST /v1/embeddings of `kallpa serve --embedding-model`, served alone and beside a chat model,
driven by the official `openai` client (and raw HTTP for what it would refuse to send).

    python3 embeddings_server_test.py --kallpa BIN --fixture-tool BIN --work DIR --model-dir DIR [TEST...]

The encoder is the real all-MiniLM-L6-v2 folder that scripts/fetch_model.sh --model minilm puts in
models/ (skipped without it). The vectors the server answers are held to `kallpa embed` on the
same texts, which tests/embeddings/crosscheck.py holds to an independent implementation.
"""
from __future__ import annotations

import base64
import json
import math
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import server_test  # noqa: E402  (exits 77 itself without openai)
from server_test import Skip, check, metric, parse_metrics  # noqa: E402

import openai  # noqa: E402

ENCODER = "all-MiniLM-L6-v2"
TEXTS = ["The cat sits on the mat.", "Llamas live in the Andes.", "kallpa: fuerza, en quechua ⚡",
         "def f(x):\n    return x * 2"]


def encoder():
    folder = Path(server_test.ARGS.model_dir) / ENCODER
    if not (folder / "model.safetensors").exists():
        raise Skip(f"{folder} not found (bash scripts/fetch_model.sh --model minilm)")
    return folder


class EmbeddingServer:
    """`kallpa serve --embedding-model FOLDER [-m CHAT]` on a free port."""

    def __init__(self, name, folder, chat_model=None, extra=()):
        work = Path(server_test.ARGS.work) / name
        work.mkdir(parents=True, exist_ok=True)
        cmd = [server_test.ARGS.kallpa, "serve", "--embedding-model", str(folder), "--port", "0", *extra]
        if chat_model is not None:
            cmd += ["-m", str(chat_model), "--context", "4096"]
        self.log = open(work / "server.log", "w")
        env = {k: v for k, v in os.environ.items() if not k.startswith("KALLPA_") or k == "KALLPA_QUARANTINE_JOURNAL"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        box = []
        reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(120)
        check(box and "listening on http://127.0.0.1:" in box[0],
              f"unexpected first line {box!r}\n{(work / 'server.log').read_text()[-2000:]}")
        self.port = int(box[0].split("127.0.0.1:")[1].split()[0])
        self.base = f"http://127.0.0.1:{self.port}"
        self.raw = server_test.Server.request.__get__(self)  # raw HTTP, as server_test's servers do

    def client(self):
        return openai.OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=120)

    def stop(self):
        self.proc.terminate()
        code = self.proc.wait(timeout=60)
        self.log.close()
        return code

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.stop()


def cli_vectors(folder, texts):
    r = subprocess.run([server_test.ARGS.kallpa, "--no-health-check", "embed", "-m", str(folder), *texts],
                       capture_output=True, text=True, timeout=300)
    check(r.returncode == 0, f"kallpa embed: exit {r.returncode}: {r.stderr}")
    return [item["embedding"] for item in json.loads(r.stdout)["data"]]


def close(a, b, tol=1e-5):
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) <= tol


def expect_error(s, body, status, param, code=None):
    got, _, reply = s.raw("POST", "/v1/embeddings", body)
    check(got == status, f"{body!r}: status {got}, expected {status}: {reply!r}")
    err = reply.get("error", {}) if isinstance(reply, dict) else {}
    check(err.get("param") == param, f"{body!r}: param {err.get('param')!r}, expected {param!r}: {reply!r}")
    if code is not None:
        check(err.get("code") == code, f"{body!r}: code {err.get('code')!r}, expected {code!r}")
    check(err.get("message"), f"{body!r}: an error message")
    return err["message"]


def test_alone():
    folder = encoder()
    expected = cli_vectors(folder, TEXTS)
    with EmbeddingServer("embeddings_alone", folder) as s:
        c = s.client()
        models = [m.id for m in c.models.list().data]
        check(models[0] == ENCODER, f"/v1/models lists the encoder first: {models}")
        r = c.embeddings.create(model=ENCODER, input=TEXTS)
        check(len(r.data) == len(TEXTS) and [d.index for d in r.data] == list(range(len(TEXTS))),
              f"one vector per input, in order: {[d.index for d in r.data]}")
        for i, d in enumerate(r.data):
            check(len(d.embedding) == 384, f"input {i}: width {len(d.embedding)}")
            check(abs(math.sqrt(sum(x * x for x in d.embedding)) - 1) < 1e-4, f"input {i}: not normalised")
            check(close(d.embedding, expected[i]), f"input {i}: differs from kallpa embed")
        check(r.usage.prompt_tokens > len(TEXTS) and r.usage.total_tokens == r.usage.prompt_tokens,
              f"usage: {r.usage}")
        # One input alone gives the vector it gets in a batch (padding does not leak into pooling).
        alone = c.embeddings.create(model=ENCODER, input=TEXTS[2]).data[0].embedding
        check(close(alone, expected[2]), "a single input differs from the same input in a batch")
        # base64: little-endian float32, as the openai client decodes it; raw here to see the bytes.
        status, _, body = s.raw("POST", "/v1/embeddings",
                                {"model": ENCODER, "input": TEXTS[:2], "encoding_format": "base64"})
        check(status == 200, f"base64: {status} {body!r}")
        for i, item in enumerate(body["data"]):
            raw = base64.b64decode(item["embedding"])
            floats = struct.unpack(f"<{len(raw) // 4}f", raw)
            check(close(floats, expected[i]), f"base64 input {i} differs from the float answer")
        # No chat model: the chat routes say so.
        status, _, body = s.raw("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        check(status == 404 and body["error"]["code"] == "model_not_found" and ENCODER in body["error"]["message"],
              f"chat without a chat model: {status} {body!r}")
        status, _, body = s.raw("POST", "/tokenize", {"content": "hi"})
        check(status == 404, f"/tokenize without a chat model: {status} {body!r}")
        status, _, body = s.raw("GET", "/metrics")
        inputs = metric(parse_metrics(body), "kallpa_embedding_inputs_total")
        check(inputs == len(TEXTS) + 1 + 2, f"kallpa_embedding_inputs_total {inputs}")
        check(s.stop() == 0, "the server exits 0 on SIGTERM")


def test_bad_inputs():
    folder = encoder()
    with EmbeddingServer("embeddings_bad", folder) as s:
        msg = expect_error(s, {"model": "nope", "input": "x"}, 404, "model", "model_not_found")
        check(ENCODER in msg, f"the 404 names the model served: {msg!r}")
        expect_error(s, {"input": []}, 400, "input")
        expect_error(s, {"input": ["ok", ""]}, 400, "input[1]")
        expect_error(s, {"input": ["ok", 3]}, 400, "input[1]")
        expect_error(s, {}, 400, "input")
        expect_error(s, {"input": "x", "dimensions": 100}, 400, "dimensions")
        expect_error(s, {"input": "x", "encoding_format": "int8"}, 400, "encoding_format")
        long_text = " ".join(["word"] * 600)  # past the encoder's 256-token limit
        msg = expect_error(s, {"input": ["short", long_text]}, 400, "input[1]")
        check("256" in msg, f"the error says the limit: {msg!r}")
        status, _, body = s.raw("POST", "/v1/embeddings", b"{not json")
        check(status == 400 and body["error"]["code"] == "invalid_json", f"malformed JSON: {status} {body!r}")
        # After all that, it still answers.
        r = s.client().embeddings.create(model=ENCODER, input="still here")
        check(len(r.data[0].embedding) == 384, "a good request after bad ones")


def test_beside_chat_model():
    folder = encoder()
    work = Path(server_test.ARGS.work) / "embeddings_beside"
    work.mkdir(parents=True, exist_ok=True)
    tiny = work / "tiny.gguf"
    subprocess.run([server_test.ARGS.fixture_tool, str(tiny), "4096"], check=True)
    with EmbeddingServer("embeddings_beside", folder, chat_model=tiny) as s:
        c = s.client()
        models = [m.id for m in c.models.list().data]
        check(models[0] == "tiny" and ENCODER in models, f"/v1/models lists both: {models}")
        chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        check(chat.choices[0].finish_reason in ("length", "stop"), f"chat answers: {chat}")
        r = c.embeddings.create(model=ENCODER, input=TEXTS[:1])
        check(close(r.data[0].embedding, cli_vectors(folder, TEXTS[:1])[0]), "embeddings beside chat")
        # Each route serves its own model; the 404 says where the other one is.
        msg = expect_error(s, {"model": "tiny", "input": "x"}, 404, "model", "model_not_found")
        check("chat model" in msg, f"embeddings naming the chat model: {msg!r}")
        status, _, body = s.raw("POST", "/v1/chat/completions",
                                {"model": ENCODER, "messages": [{"role": "user", "content": "hi"}]})
        check(status == 404 and "/v1/embeddings" in body["error"]["message"],
              f"chat naming the embedding model: {status} {body!r}")
        status, _, body = s.raw("GET", f"/v1/models/{ENCODER}")
        check(status == 200 and body["id"] == ENCODER, f"GET /v1/models/{ENCODER}: {status} {body!r}")


def test_concurrent_with_chat():
    """Embeddings and generation at once: both answer, and the vectors are those of a quiet server."""
    folder = encoder()
    work = Path(server_test.ARGS.work) / "embeddings_concurrent"
    work.mkdir(parents=True, exist_ok=True)
    tiny = work / "tiny.gguf"
    subprocess.run([server_test.ARGS.fixture_tool, str(tiny), "4096"], check=True)
    expected = cli_vectors(folder, TEXTS)
    with EmbeddingServer("embeddings_concurrent", folder, chat_model=tiny) as s:
        c = s.client()
        errors = []

        def chat():
            try:
                for _ in range(3):
                    c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "go"}], max_tokens=64)
            except Exception as e:  # noqa: BLE001 (reported below)
                errors.append(f"chat: {e}")

        def embed():
            try:
                for _ in range(5):
                    r = c.embeddings.create(model=ENCODER, input=TEXTS)
                    if not all(close(d.embedding, expected[d.index]) for d in r.data):
                        errors.append("embeddings under load differ from kallpa embed")
            except Exception as e:  # noqa: BLE001
                errors.append(f"embed: {e}")

        threads = [threading.Thread(target=f) for f in (chat, chat, embed, embed)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        check(not errors, "; ".join(errors))


if __name__ == "__main__":
    sys.exit(server_test.suite_main(globals()))
