"""kallpa from Python: the attention library on NumPy and PyTorch tensors, and the engine.

    import kallpa
    o = kallpa.attention(q, k, v, causal=True)          # q [B, Sq, Hq, D], k/v [B, Skv, Hkv, D]
    print(kallpa.explain(q, k, v, causal=True))         # which backend, and why
    model = kallpa.Model("models/SmolLM2-135M-Instruct.Q4_1.gguf")
    for piece in model.generate("The capital of France is", max_tokens=16, stream=True): ...

With PyTorch imported before kallpa (or after ``import kallpa.torch_ops``), the operator
``torch.ops.kallpa.attention`` is registered for torch.compile graphs. docs/python.md has the rest.
"""

import sys

from ._attention import BackendInfo, Explanation, Verdict, attention, backends, explain
from ._engine import Model
from ._errors import (BackendError, BackendLostError, Error, ErrorCode, InternalError, InvalidArgumentError,
                      NotFoundError, OutOfMemoryError, ParseError, UnsupportedError)
from ._kallpa import contract_version

__all__ = [
    "attention", "explain", "backends", "Model", "Verdict", "Explanation", "BackendInfo", "contract_version",
    "Error", "ErrorCode", "InvalidArgumentError", "UnsupportedError", "BackendError", "NotFoundError", "ParseError",
    "OutOfMemoryError", "InternalError", "BackendLostError",
]

if "torch" in sys.modules:
    from . import torch_ops  # noqa: F401  (registers torch.ops.kallpa.*)
