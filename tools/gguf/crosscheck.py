#!/usr/bin/env python3
"""Cross-checks kallpa's GGUF reader and tensor kernels against the independent gguf-py reader and
gguf.quants (PyPI: gguf, numpy).

    python3 tools/gguf/crosscheck.py --dump build/tests/gguf/kallpa_gguf_dump --work DIR [--model-dir models]

1. Writes the fixtures (make_fixtures.py) into DIR with gguf-py.
2. For every good fixture (and the real SmolLM2 model when present): kallpa's metadata (keys in
   order, value types, values), tensor infos (name, type, shape, absolute data offset, byte size),
   version and alignment must equal what gguf.GGUFReader reads; the Llama config must load.
3. Dequantisation of every tensor of types.gguf (F32 F16 BF16 Q8_0 Q4_0 Q4_1 from gguf.quants'
   quantiser; Q5_0 Q5_1 IQ4_NL Q2_K Q3_K Q4_K Q5_K Q6_K as random blocks with sane scales), and of
   rows of the real model, must equal gguf.quants.dequantize bit for bit.
4. Matrix products: kallpa's y = W x must match (a) NumPy emulating the same Q8 activation scheme
   within 1e-5 relative and (b) the exact float64 product within the bound the activation
   quantisation allows.
5. Every corrupt fixture must fail at the stated stage with the stated error code and field.
Exit status: 0 pass, 1 failure, 77 skipped (gguf or numpy missing).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

try:
    import numpy as np
    import gguf
    from gguf import GGMLQuantizationType as QT
except ImportError as e:
    print(f"SKIP: {e} (pip install gguf numpy)")
    sys.exit(77)

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures  # noqa: E402

failures: list[str] = []


def check(cond: bool, what: str) -> None:
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def dump(exe: Path, path: Path, *args: str) -> dict:
    out = subprocess.run([str(exe), str(path), *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def py_value(field) -> object:
    main = field.types[0]
    if main == gguf.GGUFValueType.ARRAY and len(field.types) > 1 and field.types[1] == gguf.GGUFValueType.ARRAY:
        return None  # gguf-py cannot read nested arrays back; compared with expected.json instead
    v = field.contents()
    return v


def same_value(a, b, vtype: str) -> bool:
    if isinstance(b, list):
        return isinstance(a, list) and len(a) == len(b) and all(same_value(x, y, vtype) for x, y in zip(a, b))
    if vtype in ("float32",) or isinstance(b, float):
        return float(np.float32(a)) == float(np.float32(b)) if vtype == "float32" else float(a) == float(b)
    if isinstance(b, (bool, np.bool_)):
        return bool(a) == bool(b)
    return a == b


TYPE_NAMES = {
    "UINT8": "uint8", "INT8": "int8", "UINT16": "uint16", "INT16": "int16", "UINT32": "uint32", "INT32": "int32",
    "FLOAT32": "float32", "BOOL": "bool", "STRING": "string", "ARRAY": "array", "UINT64": "uint64", "INT64": "int64",
    "FLOAT64": "float64",
}


def compare_file(exe: Path, path: Path, llama: bool, expected: dict | None = None) -> dict:
    name = path.name
    k = dump(exe, path, *(["--llama"] if llama else []))
    check(k["ok"], f"{name}: kallpa failed to load: {k.get('error')}")
    if not k["ok"]:
        return k
    r = gguf.GGUFReader(str(path))
    fields = {n: f for n, f in r.fields.items() if not n.startswith("GGUF.")}
    check(k["version"] == int(r.fields["GGUF.version"].contents()), f"{name}: version")
    check(k["alignment"] == r.alignment, f"{name}: alignment {k['alignment']} vs {r.alignment}")
    check([m["key"] for m in k["metadata"]] == list(fields), f"{name}: metadata keys/order differ")
    for m in k["metadata"]:
        f = fields.get(m["key"])
        if f is None:
            continue
        check(m["type"] == TYPE_NAMES[f.types[0].name], f"{name}: {m['key']} type {m['type']} vs {f.types[0].name}")
        if m["type"] == "array":
            check(m["element_type"] == TYPE_NAMES[f.types[1].name], f"{name}: {m['key']} element type")
        want = py_value(f)
        if want is None:
            if expected and m["key"] in expected:
                exp = expected[m["key"]]["value"]
                got = [item["value"] for item in m["value"]]
                check(got == exp, f"{name}: nested {m['key']}: {got} vs {exp}")
            continue
        vtype = TYPE_NAMES[f.types[-1].name]
        check(same_value(m["value"], want, vtype), f"{name}: value of {m['key']}: {str(m['value'])[:80]} vs {str(want)[:80]}")
        if expected and m["key"] in expected:
            check(same_value(m["value"], expected[m["key"]]["value"], vtype), f"{name}: {m['key']} vs what was written")
    check(len(k["tensors"]) == len(r.tensors), f"{name}: tensor count")
    for kt, rt in zip(k["tensors"], r.tensors):
        ok = (kt["name"] == rt.name and kt["type"] == rt.tensor_type.name and kt["ne"] == [int(x) for x in rt.shape]
              and kt["file_offset"] == int(rt.data_offset) and kt["nbytes"] == int(rt.n_bytes))
        check(ok, f"{name}: tensor {rt.name}: kallpa {kt} vs gguf-py {rt.tensor_type.name} {list(rt.shape)} "
                  f"@{rt.data_offset} {rt.n_bytes}B")
    if llama:
        check("error" not in k["llama"], f"{name}: llama config: {k['llama']}")
    return k


def gguf_dequant(t, rows: int | None = None) -> np.ndarray:
    data = t.data if rows is None else t.data[:rows]
    return gguf.quants.dequantize(np.asarray(data), t.tensor_type).astype(np.float32).reshape(-1)


def q8_activation_dot(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """NumPy emulation of kallpa's scheme: x rows quantised per block of 32 (d = amax/127, q = round
    half to even of x * 127/amax), integer dots with the dequantised-weight integers are not needed:
    y = sum_blocks sum_j w_j * q_j * d (in float64) approximates the same value."""
    xb = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    amax = np.abs(xb).max(axis=2, keepdims=True)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        idv = np.where(d != 0, np.float32(127) / np.where(amax == 0, 1, amax), 0).astype(np.float32)
    q = np.rint(xb * idv)  # numpy rint: round half to even, like the kernels
    xq = (q * d).reshape(x.shape).astype(np.float64)
    return xq @ w.astype(np.float64).T


def check_matmul(exe: Path, path: Path, tensor, work: Path, batch: int, seed: int) -> None:
    name = f"{path.name}:{tensor.name}"
    w = gguf_dequant(tensor).reshape(int(tensor.shape[1]), int(tensor.shape[0]))  # [rows, cols]
    rng = np.random.default_rng(seed)
    x = rng.uniform(-2, 2, size=(batch, w.shape[1])).astype(np.float32)
    xf = work / f"x_{seed}.f32"
    x.tofile(xf)
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    absdot = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
    # Exact activations (the default): only f32 rounding separates y from the float64 product.
    k = dump(exe, path, "--matmul", tensor.name, "--x", str(xf), "--batch", str(batch), "--activations", "f32")
    check("matmul" in k, f"{name}: f32-activation matmul failed: {k.get('matmul_error')}")
    if "matmul" in k:
        y = np.asarray(k["matmul"], dtype=np.float64).reshape(batch, w.shape[0])
        err = np.abs(y - exact)
        check(bool(np.all(err <= 1e-5 * absdot + 1e-6)),
              f"{name}: f32 activations vs exact float64 product: max err {err.max():.3g}")
    # Q8 activations: llama.cpp's integer scheme, emulated in NumPy.
    k = dump(exe, path, "--matmul", tensor.name, "--x", str(xf), "--batch", str(batch), "--activations", "q8")
    check("matmul" in k, f"{name}: matmul failed: {k.get('matmul_error')}")
    if "matmul" not in k:
        return
    y = np.asarray(k["matmul"], dtype=np.float64).reshape(batch, w.shape[0])
    quant = tensor.tensor_type in (QT.Q8_0, QT.Q4_0, QT.Q4_1)
    if quant:
        emu = q8_activation_dot(w, x)
        err = np.abs(y - emu)
        check(bool(np.all(err <= 1e-5 * absdot + 1e-6)),
              f"{name}: vs NumPy Q8-activation emulation: max err {err.max():.3g}")
        amax = np.abs(x.reshape(batch, -1, 32)).max(axis=2)                      # [batch, blocks]
        wabs = np.abs(w.astype(np.float64)).reshape(w.shape[0], -1, 32).sum(axis=2)  # [rows, blocks]
        bound = (amax @ wabs.T) / 254.0 * 1.01 + 1e-5 * absdot + 1e-6
    else:
        bound = 1e-5 * absdot + 1e-6
    err = np.abs(y - exact)
    check(bool(np.all(err <= bound)), f"{name}: vs exact float64 product: max err {err.max():.3g}, "
                                       f"max allowed {bound.min():.3g}..{bound.max():.3g}")
    print(f"ok  matmul {name} batch {batch} ({k.get('quant_isa')}): max |y - exact| = {np.abs(y - exact).max():.3g}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", required=True, type=Path)
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--model-dir", type=Path, default=None)
    args = ap.parse_args()
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, str(Path(make_fixtures.__file__)), "--out", str(work)], check=True,
                   stdout=subprocess.DEVNULL)

    expected = json.loads((work / "expected.json").read_text())
    compare_file(args.dump, work / "types.gguf", False, expected["metadata"])
    for f in ("tiny_llama_q4_1.gguf", "tiny_llama_q4_0.gguf", "tiny_llama_mixed.gguf", "tiny_llama_f32.gguf"):
        compare_file(args.dump, work / f, True)
        print(f"ok  {f}: metadata, tensor infos and llama config agree with gguf-py")

    # Dequantisation, bit for bit, every type.
    r = gguf.GGUFReader(str(work / "types.gguf"))
    names = [t.name for t in r.tensors]
    k = dump(args.dump, work / "types.gguf", *sum((["--dequant", n] for n in names), []))
    for t in r.tensors:
        got = np.asarray(k["dequant"][t.name], dtype=np.float32)
        want = gguf_dequant(t)
        same = got.shape == want.shape and np.array_equal(got, want)
        check(same, f"types.gguf: dequant {t.name} ({t.tensor_type.name}) differs from gguf.quants: "
                    f"max diff {np.abs(got - want).max() if got.shape == want.shape else 'shape'}")
        if same:
            print(f"ok  dequant {t.tensor_type.name:5s} {t.name}: bit-identical to gguf.quants ({got.size} values)")
    for i, t in enumerate(r.tensors):
        if t.name.startswith("w."):
            for batch in (1, 3, 8):
                check_matmul(args.dump, work / "types.gguf", t, work, batch, 100 * i + batch)
    rl = gguf.GGUFReader(str(work / "tiny_llama_q4_1.gguf"))
    for t in rl.tensors:
        if t.name in ("blk.1.ffn_down.weight", "token_embd.weight"):
            check_matmul(args.dump, work / "tiny_llama_q4_1.gguf", t, work, 5, 7)

    # Corrupt fixtures.
    manifest = json.loads((work / "corrupt" / "manifest.json").read_text())
    for fname, want in manifest.items():
        k = dump(args.dump, work / "corrupt" / fname, "--llama")
        if want["stage"] == "load":
            err = k.get("error") if not k["ok"] else None
        else:
            check(k["ok"], f"corrupt/{fname}: should load, got {k.get('error')}")
            err = k.get("llama", {}).get("error")
        ok = err is not None and err["code"] == want["code"] and err["field"] == want["field"]
        check(ok, f"corrupt/{fname}: expected {want['code']} at {want['field']}, got {err}")
        if ok:
            print(f"ok  corrupt/{fname}: {err['code']} {err['field']}: {err['message'][:90]}")

    # The real model, when present.
    model = (args.model_dir / "SmolLM2-135M-Instruct.Q4_1.gguf") if args.model_dir else None
    if model and model.exists():
        compare_file(args.dump, model, True)
        rm = gguf.GGUFReader(str(model))
        by_name = {t.name: t for t in rm.tensors}
        k = dump(args.dump, model, "--dequant", "token_embd.weight:64", "--dequant", "blk.0.ffn_down.weight:64",
                 "--dequant", "output_norm.weight")
        for n, rows in (("token_embd.weight", 64), ("blk.0.ffn_down.weight", 64), ("output_norm.weight", None)):
            got = np.asarray(k["dequant"][n], dtype=np.float32)
            want = gguf_dequant(by_name[n], rows)
            check(np.array_equal(got, want), f"{model.name}: dequant {n} differs from gguf.quants")
        check_matmul(args.dump, model, by_name["blk.0.attn_q.weight"], work, 4, 11)
        print(f"ok  {model.name}: metadata, {len(rm.tensors)} tensor infos, llama config, dequant, matmul")
    else:
        print("note: real model not present (scripts/fetch_model.sh); skipped its cross-check")

    if failures:
        print(f"{len(failures)} failure(s)")
        return 1
    print("all cross-checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
