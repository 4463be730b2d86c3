"""kallpa.Model: a GGUF model file made runnable by kallpa's engine (include/kallpa/runtime/engine.h)."""

from __future__ import annotations

import atexit
import queue
import threading
from typing import Iterator, Sequence

from . import _kallpa
from ._errors import InvalidArgumentError


class _Cancelled(Exception):
    """Raised from the text callback to end a stream its reader closed."""


# Streams whose generation is running: (cancel event, worker thread). At exit they are cancelled and
# joined while the interpreter can still run their callbacks; a worker left running into the
# interpreter's finalization would be killed inside the engine.
_running: set = set()
_running_lock = threading.Lock()


@atexit.register
def _stop_running_streams() -> None:
    with _running_lock:
        running = list(_running)
    for cancel, _ in running:
        cancel.set()
    for _, worker in running:
        worker.join()


class Model:
    """A loaded model: tokenizer, weights, KV cache and attention dispatcher.

    ``device`` is "cpu", "opencl[:N]" or "cuda[:N]"; ``attention`` names attention backends to try
    in order (default: automatic). One generation runs at a time per model; others wait.
    """

    def __init__(self, path: str, *, device: str = "cpu", attention: str | Sequence[str] | None = None,
                 strict_device: bool = False):
        names = attention.split(",") if isinstance(attention, str) else (list(attention) if attention else None)
        self._native = _kallpa._Model(str(path), device, names, strict_device)
        self.path = str(path)

    @property
    def config(self) -> dict:
        """The model's hyperparameters (architecture, context_length, n_layer, n_head, ...)."""
        return self._native.config()

    @property
    def eos_id(self) -> int | None:
        return self._native.eos_id()

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text` (BOS/EOS added when the model asks for them and add_special is set)."""
        return self._native.tokenize(text, add_special, parse_special)

    def detokenize(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        """The text of `ids` (invalid UTF-8 from partial tokens replaced by U+FFFD)."""
        return self._native.detokenize(list(ids), skip_special)

    def chat_tokens(self, messages: Sequence[dict | tuple[str, str]], *, add_generation_prompt: bool = True) -> list[int]:
        """The prompt of a conversation in the model's chat template; messages are {"role", "content"}
        dicts or (role, content) pairs."""
        pairs = [(m["role"], m["content"]) if isinstance(m, dict) else (m[0], m[1]) for m in messages]
        return self._native.chat_tokens(pairs, add_generation_prompt)

    def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 128, temperature: float = 0.8,
                 top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, repetition_penalty: float = 1.0,
                 seed: int = 0, stop: Sequence[str] = (), stop_at_eos: bool = True, chat: bool = False,
                 system: str | None = None, stream: bool = False) -> str | Iterator[str]:
        """Text after `prompt` (a string, or token ids). ``chat=True`` wraps a string prompt as one user
        turn in the chat template (with ``system`` as the system prompt, else the model's default).
        temperature 0 is greedy. With ``stream=True`` returns an iterator of text pieces as they become
        final; closing it early stops the generation."""
        ids = self._prompt(prompt, chat, system)
        args = _kallpa._GenerateArgs()
        args.max_tokens = int(max_tokens)
        args.temperature = float(temperature)
        args.top_k = int(top_k)
        args.top_p = float(top_p)
        args.min_p = float(min_p)
        args.repetition_penalty = float(repetition_penalty)
        args.seed = int(seed)
        args.stop = [stop] if isinstance(stop, str) else list(stop)
        args.stop_at_eos = bool(stop_at_eos)
        if stream:
            return self._stream(ids, args)
        return self._native.generate(ids, args, None)["text"]

    def _prompt(self, prompt: str | Sequence[int], chat: bool, system: str | None) -> list[int]:
        if isinstance(prompt, str):
            if not chat:
                return self.tokenize(prompt)
            messages = ([("system", system)] if system is not None else []) + [("user", prompt)]
            return self.chat_tokens(messages)
        if chat:
            raise InvalidArgumentError("chat", "needs a text prompt, not token ids", "token ids")
        return [int(t) for t in prompt]

    def _stream(self, ids: list[int], args) -> Iterator[str]:
        # The engine reports text through a callback; a worker thread runs it (the GIL is released
        # while tokens are computed) and this generator hands the pieces on.
        pieces: queue.Queue = queue.Queue()
        cancel = threading.Event()
        done = object()

        def on_text(piece: str) -> None:
            if cancel.is_set():
                raise _Cancelled()
            pieces.put(piece)

        def work() -> None:
            try:
                self._native.generate(ids, args, on_text)
                pieces.put(done)
            except BaseException as e:  # noqa: BLE001 - handed to the reader, which re-raises
                pieces.put(e)

        worker = threading.Thread(target=work, name="kallpa-generate", daemon=True)
        entry = (cancel, worker)
        with _running_lock:
            _running.add(entry)
        worker.start()
        try:
            while True:
                item = pieces.get()
                if item is done:
                    return
                if isinstance(item, _Cancelled):
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            cancel.set()
            worker.join()
            with _running_lock:
                _running.discard(entry)
