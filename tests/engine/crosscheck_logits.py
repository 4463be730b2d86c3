#!/usr/bin/env python3
"""kallpa's forward pass against an independent NumPy one (tools/reference/llama_numpy.py) on the
synthetic fixture for several weight types, and on the real model when it is present. With
KALLPA_DEVICE set (opencl, cuda), the same checks run with the model entirely on that device.

Exit codes: 0 pass, 1 mismatch, 77 skipped (numpy or gguf not installed).
"""
import json
import os
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import gguf  # noqa: F401
except ImportError as e:
    print(f"SKIP: {e} (pip install numpy gguf)")
    sys.exit(77)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tools", "reference"))
import llama_numpy  # noqa: E402

TOOL = sys.argv[1]


def kallpa_logits(model, ids):
    out = subprocess.run([TOOL, model] + [str(i) for i in ids], capture_output=True, text=True)
    if out.returncode == 77:
        print(f"SKIP: {out.stderr.strip()}")
        sys.exit(77)
    if out.returncode != 0:
        raise RuntimeError(f"{TOOL} failed ({out.returncode}): {out.stderr.strip()}")
    return np.array(json.loads(out.stdout))


def numpy_logits(model, ids):
    cfg, tensors = llama_numpy.load(model)
    return llama_numpy.forward(cfg, tensors, ids)


def check(label, model, ids, tol):
    ours, ref = kallpa_logits(model, ids), numpy_logits(model, ids)
    err = float(np.abs(ours - ref).max())
    scale = float(np.abs(ref).max())
    ok = err <= tol * max(scale, 1.0) and int(ours.argmax()) == int(ref.argmax())
    print(f"{'ok  ' if ok else 'FAIL'} {label}: max |diff| {err:.3g} (allowed {tol * max(scale, 1.0):.3g}), "
          f"argmax {int(ours.argmax())} vs {int(ref.argmax())}")
    return ok


def main():
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for mtype in ["q4_1", "q8_0", "q4_0", "f16", "f32"]:
            path = os.path.join(tmp, f"synthetic-{mtype}.gguf")
            subprocess.run([TOOL, "--write-synthetic", path, "--matrix-type", mtype], check=True)
            ids = [(3 + 37 * i) % 290 + 3 for i in range(24)]
            # Relative to the largest logit: f16 KV storage and f32 accumulation, no more.
            ok &= check(f"synthetic {mtype}", path, ids, 2e-3)
    real = os.environ.get("KALLPA_MODEL") or os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
    if os.path.exists(real):
        ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
               19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
        ok &= check("SmolLM2-135M Q4_1 chat prompt", real, ids, 2e-3)
    else:
        print(f"note: real model not found at {real}; only the synthetic fixtures were checked")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
