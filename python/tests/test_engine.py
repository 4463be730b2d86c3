"""kallpa.Model on the project's default model (scripts/fetch_model.sh): tokenizer, greedy and
streamed generation, stop strings, closing a stream early, concurrent callers, typed errors."""

from __future__ import annotations

import threading

import pytest

import kallpa
from conftest import MODEL

pytestmark = pytest.mark.skipif(not MODEL.exists(), reason=f"{MODEL} is missing (bash scripts/fetch_model.sh)")


@pytest.fixture(scope="module")
def model():
    return kallpa.Model(MODEL)


def test_config_and_tokenizer_round_trip(model):
    assert model.config["architecture"] == "llama" and model.config["n_layer"] > 0
    text = "Hello, world! Ünïcödé and numbers 12345."
    ids = model.tokenize(text, add_special=False)
    assert all(isinstance(i, int) for i in ids) and len(ids) > 5
    assert model.detokenize(ids) == text
    assert model.eos_id is not None
    assert model.detokenize([model.eos_id], skip_special=True) == ""


def test_greedy_stream_equals_the_whole_text(model):
    whole = model.generate("The capital of France is", max_tokens=12, temperature=0)
    pieces = list(model.generate("The capital of France is", max_tokens=12, temperature=0, stream=True))
    assert len(pieces) > 1 and "".join(pieces) == whole
    assert 0 < len(model.tokenize(whole, add_special=False)) <= 14


def test_chat_answers_the_setup_question(model):
    answer = model.generate("What is the capital of France?", chat=True, max_tokens=32, temperature=0)
    assert "Paris" in answer


def test_token_id_prompts_and_seeded_sampling(model):
    ids = model.tokenize("Once upon a time")
    assert model.generate(ids, max_tokens=8, temperature=0) == model.generate("Once upon a time", max_tokens=8,
                                                                               temperature=0)
    a = model.generate(ids, max_tokens=10, temperature=1.0, seed=7)
    b = model.generate(ids, max_tokens=10, temperature=1.0, seed=7)
    assert a == b


def test_stop_strings_end_the_text_before_them(model):
    whole = model.generate("Count: one, two, three, four,", max_tokens=16, temperature=0)
    assert "," in whole
    cut = model.generate("Count: one, two, three, four,", max_tokens=16, temperature=0, stop=[","])
    assert cut == whole[: whole.index(",")]


def test_closing_a_stream_early_stops_it_and_the_model_goes_on(model):
    expected = model.generate("Once upon a time, there was", max_tokens=10, temperature=0)
    stream = model.generate("Once upon a time, there was", max_tokens=200, temperature=0, stream=True)
    first = next(stream)
    stream.close()
    assert expected.startswith(first)
    assert model.generate("Once upon a time, there was", max_tokens=10, temperature=0) == expected


def test_concurrent_generations_on_one_model(model):
    expected = model.generate("Water boils at", max_tokens=8, temperature=0)
    results = []

    def run():
        results.append(model.generate("Water boils at", max_tokens=8, temperature=0))

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [expected] * 3


def test_errors(model, tmp_path):
    with pytest.raises(kallpa.InvalidArgumentError) as info:
        model.generate("x", temperature=-1.0)
    assert info.value.field == "temperature"
    with pytest.raises(kallpa.InvalidArgumentError) as info:
        model.generate([1, 2], chat=True)
    assert info.value.field == "chat"
    with pytest.raises(kallpa.InvalidArgumentError) as info:
        model.generate("x", stop=[""])
    assert info.value.field == "stop"
    with pytest.raises(kallpa.Error) as info:
        kallpa.Model(tmp_path / "missing.gguf")
    assert "missing.gguf" in str(info.value)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 60)
    with pytest.raises(kallpa.Error):
        kallpa.Model(bad)


def test_exiting_with_a_stream_still_open_is_clean():
    # The interpreter exits while a generation runs in a stream nobody closed: it must be stopped
    # before the interpreter finalizes, not killed inside the engine.
    import subprocess
    import sys

    script = ("import kallpa\n"
              f"m = kallpa.Model({str(MODEL)!r})\n"
              "g = m.generate('Once upon a time', max_tokens=500, temperature=0, stream=True)\n"
              "print(next(g), flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "terminate" not in done.stderr
