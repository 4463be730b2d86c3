#!/usr/bin/env python3
"""Writes tiny synthetic GGUF fixtures with the PyPI `gguf` package (gguf-py, llama.cpp's own
writer), independent of kallpa's C++ writer.

    python3 tools/gguf/make_fixtures.py --out DIR

Writes into DIR:
  tiny_llama_q4_1.gguf     2 layers, dim 64, 4 heads, 2 kv heads, ff 128, vocab 299 (GPT-2 byte-level
                           vocab + 40 merges, like SmolLM2: <|endoftext|>, <|im_start|>, <|im_end|>
                           first), token_embd Q8_0, matrices Q4_1, norms F32, tied output (the real
                           model's layout in miniature)
  tiny_llama_q4_0.gguf     matrices Q4_0, token_embd F16, untied output.weight Q4_0
  tiny_llama_mixed.gguf    matrices BF16 (q, k, v, o) / F16 (ffn), token_embd F32, output Q8_0
  tiny_llama_f32.gguf      everything F32 (a forward-pass reference can use the values as stored)
  types.gguf               one [96 x 5] tensor per type (F32 F16 BF16 Q8_0 Q4_0 Q4_1), one [512 x 5]
                           tensor per block type gguf-py cannot quantise to (Q5_0 Q5_1 IQ4_NL Q2_K
                           Q3_K Q4_K Q5_K Q6_K: random bytes with sane f16 scales, incl. a zero, a
                           negative and a subnormal one), a 3-d F32 and a 1-d F16 tensor, and metadata
                           of every value type incl. nested arrays
  expected.json            what types.gguf's metadata holds (the nested arrays gguf-py cannot read back)
  corrupt/*.gguf           byte-level corruptions of tiny_llama_q4_1.gguf and bad models
  corrupt/manifest.json    for each: the stage that must fail ("load" or "llama"), code and field

Weights are uniform random with a fixed seed (numpy default_rng), so the files are reproducible.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
from pathlib import Path

import numpy as np

try:
    import gguf
    from gguf import GGMLQuantizationType as QT
    from gguf import GGUFValueType as VT
except ImportError:  # pragma: no cover
    sys.exit("make_fixtures.py needs the PyPI packages gguf and numpy (pip install gguf numpy)")


# --- vocabulary (same as kallpa's C++ synthetic_vocab()) ---

def bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable-unicode mapping, indexed by byte value."""
    printable = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, n = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return [out[b] for b in range(256)]


MERGES = [
    ("Ġ", "t"), ("h", "e"), ("Ġ", "a"), ("i", "n"), ("Ġt", "he"), ("e", "r"), ("o", "n"), ("Ġ", "s"),
    ("r", "e"), ("Ġ", "w"), ("a", "t"), ("Ġ", "o"), ("e", "n"), ("Ġ", "c"), ("i", "s"), ("Ġ", "b"),
    ("o", "r"), ("e", "s"), ("Ġ", "f"), ("a", "n"), ("Ġ", "p"), ("Ġ", "m"), ("i", "t"), ("l", "l"),
    ("Ġ", "i"), ("a", "r"), ("Ġa", "n"), ("Ġ", "d"), ("in", "g"), ("o", "u"), ("Ġ", "h"), ("Ġi", "s"),
    ("Ġan", "d"), ("Ġo", "f"), ("Ġt", "o"), ("Ġ", "Ġ"), ("ĠĠ", "ĠĠ"), ("Ċ", "Ċ"), ("1", "2"), ("Ġw", "or"),
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def vocab() -> tuple[list[str], list[int], list[str]]:
    tokens = list(SPECIALS) + bytes_to_unicode() + [a + b for a, b in MERGES]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    merges = [f"{a} {b}" for a, b in MERGES]
    return tokens, types, merges


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")


# --- tensors ---

# Byte offsets of the f16 scales (d, and dmin/m) in one block of each type written as random bytes
# (ggml's block layouts; src/ops/quant_types.h lists them).
SCALE_OFFSETS = {
    QT.Q5_0: (0,), QT.Q5_1: (0, 2), QT.IQ4_NL: (0,), QT.Q2_K: (80, 82), QT.Q3_K: (108,),
    QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,),
}


def random_blocks(rng: np.random.Generator, qtype: QT, rows: int, cols: int) -> np.ndarray:
    """rows x cols elements of qtype as random bytes ([rows, bytes per row]) whose scales are finite
    f16 values of either sign in [1e-3, 5e-2]; block 0 of row 0 has zero scales, block 0 of row 1
    subnormal ones, so the edge cases are part of every comparison."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    per_row = cols // block
    for at in SCALE_OFFSETS[qtype]:
        scale = (rng.uniform(1e-3, 5e-2, n) * rng.choice([-1.0, 1.0], n)).astype(np.float16)
        scale[0] = 0.0
        scale[per_row] = np.float16(3e-6)  # subnormal in f16
        raw[:, at:at + 2] = scale.view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, per_row * size)

def encode(values: np.ndarray, qtype: QT) -> tuple[np.ndarray, QT]:
    """values: float32 [rows, cols] (numpy order); returns the array gguf-py writes (raw bytes for
    quantised types) and the type."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if qtype == QT.F32:
        return values, qtype
    if qtype == QT.F16:
        return values.astype(np.float16), qtype
    return gguf.quants.quantize(values, qtype), qtype


def add(writer: gguf.GGUFWriter, name: str, values: np.ndarray, qtype: QT) -> None:
    data, t = encode(values, qtype)
    if qtype in (QT.F32, QT.F16):
        writer.add_tensor(name, data)
    else:  # data holds the bytes ([rows, bytes per row]); gguf-py derives the element shape
        writer.add_tensor(name, data, raw_dtype=t)


def write_llama(path: Path, matrix_type: QT, embd_type: QT, output_type: QT | None, seed: int,
                skip_keys: tuple[str, ...] = (), overrides: dict | None = None,
                ffn_type: QT | None = None) -> None:
    """A tiny Llama. output_type None: tied embeddings. overrides: tensor name -> (values, type)."""
    n_layer, n_embd, n_head, n_head_kv, n_ff, ctx = 2, 64, 4, 2, 128, 256
    head_dim = n_embd // n_head
    tokens, types, merges = vocab()
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")

    def kv(key: str, fn, *args):
        if key not in skip_keys:
            fn(*args)

    kv("general.name", w.add_name, "kallpa synthetic llama")
    kv("llama.block_count", w.add_block_count, n_layer)
    kv("llama.context_length", w.add_context_length, ctx)
    kv("llama.embedding_length", w.add_embedding_length, n_embd)
    kv("llama.feed_forward_length", w.add_feed_forward_length, n_ff)
    kv("llama.attention.head_count", w.add_head_count, n_head)
    kv("llama.attention.head_count_kv", w.add_head_count_kv, n_head_kv)
    kv("llama.rope.freq_base", w.add_rope_freq_base, 10000.0)
    kv("llama.attention.layer_norm_rms_epsilon", w.add_layer_norm_rms_eps, 1e-5)
    kv("llama.rope.dimension_count", w.add_rope_dimension_count, head_dim)
    kv("llama.vocab_size", w.add_vocab_size, len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    kv("tokenizer.ggml.tokens", w.add_token_list, tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)

    overrides = overrides or {}

    def matrix(name: str, rows: int, cols: int, qtype: QT, scale: float) -> None:
        values = rng.uniform(-scale, scale, size=(rows, cols)).astype(np.float32)
        if name in overrides:
            values, qtype = overrides[name]
        add(w, name, values, qtype)

    def norm(name: str, n: int) -> None:
        values = (1.0 + rng.uniform(-0.2, 0.2, size=(n,))).astype(np.float32)
        if name in overrides:
            values, qt = overrides[name]
            add(w, name, values, qt)
        else:
            add(w, name, values, QT.F32)

    q, kvd, ff = head_dim * n_head, head_dim * n_head_kv, n_ff
    matrix("token_embd.weight", len(tokens), n_embd, embd_type, 1.0)
    norm("output_norm.weight", n_embd)
    if output_type is not None:
        matrix("output.weight", len(tokens), n_embd, output_type, 0.2)
    for i in range(n_layer):
        b = f"blk.{i}."
        norm(b + "attn_norm.weight", n_embd)
        matrix(b + "attn_q.weight", q, n_embd, matrix_type, 0.2)
        matrix(b + "attn_k.weight", kvd, n_embd, matrix_type, 0.2)
        matrix(b + "attn_v.weight", kvd, n_embd, matrix_type, 0.2)
        matrix(b + "attn_output.weight", n_embd, q, matrix_type, 0.2)
        norm(b + "ffn_norm.weight", n_embd)
        matrix(b + "ffn_gate.weight", ff, n_embd, ffn_type or matrix_type, 0.2)
        matrix(b + "ffn_up.weight", ff, n_embd, ffn_type or matrix_type, 0.2)
        matrix(b + "ffn_down.weight", n_embd, ff, ffn_type or matrix_type, 0.2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def bf16_raw(values: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (round to nearest even), as uint8 [rows, cols * 2]."""
    return gguf.quants.quantize(np.ascontiguousarray(values, dtype=np.float32), QT.BF16)


def write_types(path: Path, expected_path: Path) -> None:
    rng = np.random.default_rng(7)
    w = gguf.GGUFWriter(str(path), "kallpa-types")
    expected = {}

    def put(key, val, vtype, sub=None, exp=None):
        w.add_key_value(key, val, vtype, sub)
        expected[key] = {"type": vtype.name.lower(), "value": exp if exp is not None else val}

    put("t.u8", 200, VT.UINT8)
    put("t.i8", -100, VT.INT8)
    put("t.u16", 60000, VT.UINT16)
    put("t.i16", -30000, VT.INT16)
    put("t.u32", 4000000000, VT.UINT32)
    put("t.i32", -2000000000, VT.INT32)
    put("t.u64", 0xFEDCBA9876543210, VT.UINT64)
    put("t.i64", -9000000000000000000, VT.INT64)
    put("t.f32", 1.5, VT.FLOAT32)
    put("t.f64", -2.25, VT.FLOAT64)
    put("t.bool", True, VT.BOOL)
    put("t.string", "héllo wörld ✓", VT.STRING)
    put("t.arr_i32", [1, -2, 3], VT.ARRAY, VT.INT32)
    put("t.arr_f32", [0.5, -1.0, 3.25], VT.ARRAY, VT.FLOAT32)
    put("t.arr_bool", [True, False, True], VT.ARRAY, VT.BOOL)
    put("t.arr_u64", [1, 2**63], VT.ARRAY, VT.UINT64)
    put("t.arr_str", ["x", "", "yz", "日本"], VT.ARRAY, VT.STRING)
    put("t.nested", [[1, 2], [3]], VT.ARRAY, VT.ARRAY)
    put("t.nested_str", [["a", "b"], ["c"]], VT.ARRAY, VT.ARRAY)

    values = {}
    for qt in (QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1):
        v = rng.uniform(-2.0, 2.0, size=(5, 96)).astype(np.float32)
        v[0, :32] = 0.0                       # an all-zero block
        v[1, :32] = np.linspace(-1, 1, 32)    # a regular block
        name = f"w.{qt.name.lower()}"
        if qt == QT.BF16:
            w.add_tensor(name, bf16_raw(v), raw_dtype=QT.BF16)
        else:
            add(w, name, v, qt)
        values[name] = qt.name
    for qt in SCALE_OFFSETS:
        name = f"w.{qt.name.lower()}"
        w.add_tensor(name, random_blocks(rng, qt, 5, 512), raw_dtype=qt)
        values[name] = qt.name
    add(w, "x.f32_3d", rng.uniform(-1, 1, size=(2, 3, 4)).astype(np.float32), QT.F32)
    add(w, "x.f16_1d", rng.uniform(-1, 1, size=(7,)).astype(np.float32), QT.F16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    expected_path.write_text(json.dumps({"metadata": expected, "tensors": values}, indent=1, ensure_ascii=False))


# --- corrupt variants ---

def tensor_field_positions(path: Path) -> list[dict]:
    """Byte positions of each tensor info's fields, from gguf-py's reader."""
    r = gguf.GGUFReader(str(path))
    out = []
    for t in r.tensors:
        start = t.field.offset
        name_len = len(t.name.encode("utf-8"))
        n_dims = len(t.shape)
        p = start + 8 + name_len
        out.append({"name": t.name, "n_dims_at": p, "dims_at": p + 4, "type_at": p + 4 + 8 * n_dims,
                    "offset_at": p + 4 + 8 * n_dims + 4, "data_offset": int(t.data_offset), "nbytes": int(t.n_bytes)})
    return out


def write_corrupt(base: Path, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    good = base.read_bytes()
    pos = tensor_field_positions(base)
    manifest = {}

    def variant(name: str, data: bytes, stage: str, code: str, field: str) -> None:
        (out / name).write_bytes(data)
        manifest[name] = {"stage": stage, "code": code, "field": field}

    def patched(at: int, fmt: str, value) -> bytes:
        b = bytearray(good)
        struct.pack_into("<" + fmt, b, at, value)
        return bytes(b)

    variant("empty.gguf", b"", "load", "parse_error", "header.magic")
    variant("wrong_magic.gguf", b"GGML" + good[4:], "load", "parse_error", "header.magic")
    variant("version_99.gguf", patched(4, "I", 99), "load", "parse_error", "header.version")
    variant("huge_tensor_count.gguf", patched(8, "Q", 1 << 60), "load", "parse_error", "header.tensor_count")
    variant("huge_kv_count.gguf", patched(16, "Q", 1 << 62), "load", "parse_error", "header.kv_count")
    # 40 bytes: the counts in the header cannot fit in what is left.
    variant("truncated_header.gguf", good[:40], "load", "parse_error", "header.kv_count")
    # Cut inside the token list: the counts fit, the array does not.
    r = gguf.GGUFReader(str(base))
    keys = [k for k in r.fields if not k.startswith("GGUF.")]
    tok = keys.index("tokenizer.ggml.tokens")
    variant("truncated_metadata.gguf", good[: r.fields["tokenizer.ggml.tokens"].offset + 200], "load", "parse_error",
            f"kv[{tok}](tokenizer.ggml.tokens).count")
    last = len(pos) - 1
    variant("truncated_data.gguf", good[: pos[last]["data_offset"] + 10], "load", "parse_error",
            f"tensor_infos[{last}].offset")
    variant("bad_offset.gguf", patched(pos[5]["offset_at"], "Q", 1 << 40), "load", "parse_error",
            "tensor_infos[5].offset")
    # Offsets are relative to the data section; a misaligned one is caught before the range check.
    rel = int(r.tensors[5].data_offset - r.data_offset)
    variant("misaligned.gguf", patched(pos[5]["offset_at"], "Q", rel + 8), "load", "parse_error",
            "tensor_infos[5].offset")
    variant("unknown_type.gguf", patched(pos[5]["type_at"], "I", 200), "load", "parse_error", "tensor_infos[5].type")
    variant("five_dims.gguf", patched(pos[5]["n_dims_at"], "I", 5), "load", "parse_error", "tensor_infos[5].n_dims")
    variant("dims_overflow.gguf", patched(pos[5]["dims_at"], "Q", 1 << 63), "load", "parse_error",
            "tensor_infos[5].dims[0]")

    # Whole-model variants written by gguf-py: they parse, but are not valid Llama models.
    write_llama(out / "missing_key.gguf", QT.Q4_1, QT.Q8_0, None, 3, skip_keys=("llama.block_count",))
    manifest["missing_key.gguf"] = {"stage": "llama", "code": "not_found", "field": "llama.block_count"}
    rng = np.random.default_rng(5)
    write_llama(out / "bad_shape.gguf", QT.Q4_1, QT.Q8_0, None, 3,
                overrides={"blk.0.attn_k.weight": (rng.uniform(-1, 1, (48, 64)).astype(np.float32), QT.Q4_1)})
    manifest["bad_shape.gguf"] = {"stage": "llama", "code": "invalid_argument", "field": "blk.0.attn_k.weight"}
    write_llama(out / "unsupported_type.gguf", QT.Q4_1, QT.Q8_0, None, 3,
                overrides={"blk.1.ffn_up.weight": (rng.uniform(-1, 1, (128, 64)).astype(np.float32), QT.MXFP4)})
    manifest["unsupported_type.gguf"] = {"stage": "llama", "code": "unsupported", "field": "blk.1.ffn_up.weight"}
    # A block type kallpa computes with, one block's f16 scale d an infinity (0x7c00): the model
    # must refuse it naming the tensor, not compute inf/NaN.
    write_llama(out / "nonfinite_scale.gguf", QT.Q4_1, QT.Q8_0, None, 3,
                overrides={"blk.0.ffn_gate.weight": (rng.uniform(-1, 1, (128, 64)).astype(np.float32), QT.Q5_1)})
    rb = gguf.GGUFReader(str(out / "nonfinite_scale.gguf"))
    gate = next(t for t in rb.tensors if t.name == "blk.0.ffn_gate.weight")
    b = bytearray((out / "nonfinite_scale.gguf").read_bytes())
    struct.pack_into("<H", b, int(gate.data_offset) + 3 * 24, 0x7C00)  # block 3's d
    (out / "nonfinite_scale.gguf").write_bytes(bytes(b))
    manifest["nonfinite_scale.gguf"] = {"stage": "llama", "code": "invalid_argument", "field": "blk.0.ffn_gate.weight"}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def write_truncated_kquant(types: Path, out: Path) -> None:
    """types.gguf cut in the middle of its Q4_K tensor: the loader must name that tensor's offset."""
    pos = tensor_field_positions(types)
    i = next(j for j, p in enumerate(pos) if p["name"] == "w.q4_k")
    (out / "truncated_q4_k.gguf").write_bytes(types.read_bytes()[: pos[i]["data_offset"] + pos[i]["nbytes"] // 2])
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["truncated_q4_k.gguf"] = {"stage": "load", "code": "parse_error", "field": f"tensor_infos[{i}].offset"}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    write_llama(args.out / "tiny_llama_q4_1.gguf", QT.Q4_1, QT.Q8_0, None, 1)
    write_llama(args.out / "tiny_llama_q4_0.gguf", QT.Q4_0, QT.F16, QT.Q4_0, 2)
    write_llama(args.out / "tiny_llama_mixed.gguf", QT.BF16, QT.F32, QT.Q8_0, 4, ffn_type=QT.F16)
    write_llama(args.out / "tiny_llama_f32.gguf", QT.F32, QT.F32, QT.F32, 6)
    write_types(args.out / "types.gguf", args.out / "expected.json")
    write_corrupt(args.out / "tiny_llama_q4_1.gguf", args.out / "corrupt")
    write_truncated_kquant(args.out / "types.gguf", args.out / "corrupt")
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
