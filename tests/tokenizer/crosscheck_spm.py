#!/usr/bin/env python3
"""Cross-checks kallpa's SentencePiece BPE tokenizer against Hugging Face `tokenizers` on the real
Gemma-3-270M vocabulary (tokenizer.ggml.model "llama", 262144 tokens, byte fallback).

The reference is built independently from the file's own vocabulary, read with the `gguf`
package: a `tokenizers` BPE model whose merges are derived from the scores (every split of a NORMAL
token into two vocabulary pieces, ranked by the merged token's score, highest first), byte
fallback to <0xNN>, spaces replaced by U+2581 (with a prepended one when add_space_prefix), the
CONTROL tokens as special added tokens and the USER_DEFINED ones as added tokens. kallpa loads the
same GGUF file itself (kallpa_tokenize_tool --gguf). Compared on the hand-written corpus of
crosscheck.py (Unicode, emoji, CJK, code, whitespace runs, newlines, tabs), Gemma's control-token
texts and seeded random mixtures: token ids, decode and streamed decode (both must give the text
back byte for byte, byte fallback spelling every byte; a literal U+2581 comes back as a space).

Exit status: 0 all equal; 1 any mismatch; 77 skipped (python packages or the model missing).

  crosscheck_spm.py --tool build/tests/support/kallpa_tokenize_tool [--model FILE] [--random N]

The model: --model, else $KALLPA_GEMMA_MODEL, else $KALLPA_MODEL_DIR/gemma-3-270m-q4_k_m.gguf,
else <repo>/models/gemma-3-270m-q4_k_m.gguf (where scripts/fetch_model.sh --model gemma3-270m
puts it).
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from crosscheck import CORPUS, Report, find_model, pkg_version, random_corpus, skip  # noqa: E402

MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

GEMMA_CORPUS = [
    "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n",
    "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n",
    "<start_of_turn><end_of_turn><start_of_turn>",
    "almost special: <start_of_turn and end_of_turn> and <end_of_turn",
    "<eos> <pad> <unk> <mask> <unused0> <unused42>x",
    "text<start_of_image>more text<end_of_image>",
    "tabs\t\t\tand\t\t\t\t\tmore tabs",
    "spaces        eight of them, and 31 more:                               end",
    "\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n",
    "</iframe></footer><table><tr><td>cell</td></tr></table>",
    "    def method(self):\n        return {'a': [1, 2, 3]}\n",
    "∮ E⋅da = Q,  n → ∞, ∑ f(i) = ∏ g(i), ∀x∈ℝ: ⌈x⌉ = −⌊−x⌋",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕄𝕒𝕥𝕙 𝒮𝒸𝓇𝒾𝓅𝓉 and rare: 𓀀𓀁 𐎀𐎁 ꙮ",
    "  ",
    " leading space",
    "trailing space ",
]


def read_vocab(path, gguf):
    f = gguf.GGUFReader(path).fields

    def scalar(key, default=None):
        return f[key].contents() if key in f else default

    return {
        "model": scalar("tokenizer.ggml.model"),
        "tokens": f["tokenizer.ggml.tokens"].contents(),
        "scores": [float(s) for s in f["tokenizer.ggml.scores"].contents()],
        "token_types": [int(t) for t in f["tokenizer.ggml.token_type"].contents()],
        "add_space_prefix": bool(scalar("tokenizer.ggml.add_space_prefix", True)),
    }


def build_hf(vocab, tk):
    """SentencePiece BPE as a `tokenizers` BPE: merges derived from the scores."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    tokens, scores, types = vocab["tokens"], vocab["scores"], vocab["token_types"]
    ids = {}
    for i, t in enumerate(tokens):
        ids.setdefault(t, i)
    ranked = []
    for i, t in enumerate(tokens):
        if types[i] != NORMAL or len(t) < 2:
            continue
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            if a in ids and b in ids:
                ranked.append((-scores[i], ids[a], ids[b], a, b))
    ranked.sort()
    merges = [(a, b) for _, _, _, a, b in ranked]
    tok = Tokenizer(models.BPE(vocab=ids, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    norm = [normalizers.Replace(" ", "\u2581")]
    if vocab["add_space_prefix"]:
        norm.insert(0, normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(norm)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    return tok, len(merges)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tool", required=True, help="path to kallpa_tokenize_tool")
    ap.add_argument("--model", help="GGUF file (default: see above)")
    ap.add_argument("--random", type=int, default=400, help="number of seeded random texts (default 400)")
    ap.add_argument("--seed", type=int, default=20261207)
    args = ap.parse_args()

    try:
        import gguf
        import tokenizers
    except ImportError as e:
        skip(f"python package missing ({e.name}): pip install -r scripts/requirements.txt")

    model = find_model(args.model, "KALLPA_GEMMA_MODEL", MODEL_FILE)
    if not os.path.isfile(model):
        skip(f"model not found at {model} (run scripts/fetch_model.sh --model gemma3-270m)")
    if not os.access(args.tool, os.X_OK):
        print(f"FAIL: {args.tool} is not an executable")
        return 1

    vocab = read_vocab(model, gguf)
    if vocab["model"] != "llama":
        skip(f"{model} has tokenizer model {vocab['model']!r}, not SentencePiece ('llama')")
    hf, n_merges = build_hf(vocab, tokenizers)
    rng = random.Random(args.seed)
    gemma_words = ["<start_of_turn>", "<end_of_turn>", "<bos>", "\n", "\n\n", "\t\t", "   ", "▁", "<0x41>"]
    randoms = random_corpus(args.random, args.seed)
    randoms = [r + rng.choice(gemma_words) + s for r, s in zip(randoms, reversed(randoms))]
    texts = CORPUS + GEMMA_CORPUS + randoms
    print(f"model {model}: {len(vocab['tokens'])} tokens, {n_merges} merges derived from the scores; "
          f"tokenizers {tokenizers.__version__}, gguf {pkg_version('gguf')}; {len(texts)} texts")

    report = Report()
    with tempfile.TemporaryDirectory(prefix="kallpa-spm-") as work:
        ipath = os.path.join(work, "input.json")
        with open(ipath, "w", encoding="utf-8") as fh:
            json.dump({"texts": texts, "chats": [], "add_special": False, "parse_special": True}, fh,
                      ensure_ascii=False)
        proc = subprocess.run([args.tool, "--gguf", model, "--input", ipath], capture_output=True)
        if proc.returncode != 0:
            print(f"FAIL: kallpa_tokenize_tool exited with {proc.returncode}: "
                  f"{proc.stderr.decode('utf-8', 'replace')}")
            return 1
        out = json.loads(proc.stdout.decode("utf-8"))

    n_tokens = 0
    for text, res in zip(texts, out["results"]):
        want = hf.encode(text, add_special_tokens=False).ids
        got = res["ids"]
        n_tokens += len(got)
        if got != want:
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            report.fail("ids", text, kallpa_ids=got, hf_ids=want, first_difference=first,
                        kallpa_tokens=[hf.id_to_token(i) for i in got], hf_tokens=[hf.id_to_token(i) for i in want])
        hf_decoded = hf.decode(want, skip_special_tokens=False)
        # Byte fallback spells every byte, so decoding gives the text back, except that a literal
        # U+2581 in the input decodes as a space (it is SentencePiece's space mark), in both.
        if res["decoded"] != text.replace("\u2581", " "):
            report.fail("decode round trip", text, kallpa_decoded=res["decoded"], hf_decoded=hf_decoded)
        if res["streamed"] != res["decoded"]:
            report.fail("streamed decode", text, streamed=res["streamed"], decoded=res["decoded"])

    print(f"kallpa: loaded the tokenizer from the GGUF in {out['load_seconds'] * 1e3:.0f} ms; "
          f"{len(texts)} texts, {out['bytes']} bytes, {n_tokens} tokens, encode {out['encode_seconds'] * 1e3:.1f} ms")
    if report.failures:
        print(f"FAIL: {report.failures} mismatch(es)")
        return 1
    print("OK: kallpa's SentencePiece BPE matches Hugging Face tokenizers on every text (ids, decode, streamed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
