#!/usr/bin/env python3
"""Cross-checks kallpa's tokenizer against Hugging Face `tokenizers` on the real SmolLM2 vocabulary.

Reads tokenizer.ggml.* from the GGUF with the `gguf` package, builds an independent HF tokenizer
from the same vocabulary and merges (BPE + Digits(individual_digits) + ByteLevel pre-tokenizer, the
CONTROL tokens as special added tokens), dumps the vocabulary as JSON for kallpa_tokenize_tool,
and compares token ids on a varied corpus: hand-written texts (English, code, numbers, accents,
CJK, emoji, whitespace runs, tabs/newlines, special tokens) plus seeded random mixtures. Also
checks decode round trips (batch and streamed), ChatML prompts (rendered text against the GGUF's
own Jinja chat template when jinja2 is installed, ids against HF) and, on the same vocabulary, the
"gpt2", "llama3" and "qwen2" pre-tokenizers against HF built from those models' original regexes.

Exit status: 0 all equal; 1 any mismatch (each printed with the text and both id lists);
77 skipped (python packages or the model missing), with the reason.

  crosscheck.py --tool build/src/tokenizer/kallpa_tokenize_tool [--model FILE] [--random N]

The model: --model, else $KALLPA_MODEL, else $KALLPA_MODEL_DIR/SmolLM2-135M-Instruct.Q4_1.gguf,
else <repo>/models/SmolLM2-135M-Instruct.Q4_1.gguf (where scripts/fetch_model.sh puts it).
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

SKIP = 77
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

# token_type values (GGUF / llama.cpp)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# The original Hugging Face regexes (tokenizer.json of Llama 3 and Qwen2), written independently of
# kallpa's expansions of (?i:...).
LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+")

CORPUS = [
    # English
    "Hello world",
    "Hello, world! How are you doing today?",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's fine, but we'd've known. DON'T SHOUT. You're, we've, I'd, she'll.",
    "What is the capital of France?",
    "  leading spaces and trailing spaces   ",
    "multiple     spaces    between     words",
    "line one\nline two\n\nline four\r\nwindows line\rold mac",
    "\ttab\tseparated\tvalues\t\t\tend",
    "trailing newline\n",
    "\n\n\n",
    " ",
    "a",
    "",
    "mixed \t \n whitespace \n\t runs",
    "Mr. O'Neil's dog—a \"good boy\"—barked… twice!?",
    "e-mail: someone@example.com, url: https://example.org/path?q=1&r=2#frag",
    "ALL CAPS AND lower and MiXeD CaSe",
    # numbers
    "12345",
    "3.14",
    "3.14159265358979 and 2.71828",
    "In 2024, 1,234,567 people paid $19.99 (or €15,50) each; 0.5% got 100% refunds.",
    "phone: +1 (555) 010-9999, zip 90210, version v1.2.3-rc4",
    "0x1F 0b1010 1e-9 6.022e23 -42 +7",
    "Fullwidth １２３ and Arabic-Indic ٣٤٥ and superscript x² and ½ and Ⅻ",
    # code
    "def foo(x):\n    return x ** 2 + 1  # square\n",
    "int main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}",
    "for (auto& [k, v] : m) { std::cout << k << '=' << v << \"\\n\"; }",
    "const f = async (a, b) => { await g(a?.b ?? c); };",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC;",
    "<div class=\"x\">&nbsp;&lt;tag&gt;</div>",
    "    indented\n        more indented\n            deepest",
    "if x != y && (a || !b) { return; } // done",
    "```python\nprint('hi')\n```",
    "$ git commit -m 'fix: off-by-one' && make -j2",
    # accents and scripts
    "naïve café résumé coöperate façade São Paulo Zürich Ångström",
    "Ça va? Où est la bibliothèque? ¿Dónde está? ¡Olé!",
    "Straße, Æsir, Øresund, Łódź, Čeština, Ελληνικά, Русский язык",
    "中文文本测试，包括标点符号。",
    "日本語のテキスト、ひらがなとカタカナ。",
    "한국어 텍스트 테스트",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "ไทย ภาษา",
    "combining: e\u0301 a\u0308 n\u0303 (decomposed) vs é ä ñ",
    # emoji
    "😀",
    "I love 🍕 and 🍣! 👍🏽",
    "family: 👨‍👩‍👧‍👦 flag: 🇫🇷 heart: ❤️ keycap: 1️⃣",
    "emoji😀glued🎉to👋words",
    # unusual whitespace and controls
    "non\u00a0breaking\u00a0space",
    "ideographic\u3000space",
    "line\u2028separator and para\u2029separator",
    "next\u0085line",
    "ogham\u1680space and en\u2002em\u2003thin\u2009spaces",
    "zero\u200bwidth\u200cjoiners\u200d",
    "controls \x01\x02\x1b[0m \x7f end",
    "file\x1cgroup\x1drecord\x1eunit\x1f",
    # special tokens
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text before<|endoftext|>text after",
    "<|im_start|><|im_end|><|im_start|>",
    "almost special: <|im_start| and |im_end|> and <|endoftext",
    "<file_sep><filename>main.py<gh_stars>100",
    "<jupyter_code>print(1)<jupyter_output>1<empty_output>",
    "nested <<|im_end|>> brackets",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Write a haiku about 12345 cats 🐱."},
     {"role": "assistant", "content": "Cats nap in the sun,\nnumbers purr: one, two, three, four…"},
     {"role": "user", "content": "  Again,\tplease!\n"}],
]


def random_corpus(n, seed):
    rng = random.Random(seed)
    pools = [
        "abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789", "0123456789",
        "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~", " ", "  ", "\t", "\n", "\r\n",
        "éèêëàâäîïôöùûüçñßøåæœ", "ΑΒΓαβγδεζηθλμπσω", "абвгдеёжзийклмнопрст", "中文字测试汉语言",
        "ひらがなカタカナ", "한국어텍스트", "مرحبا", "नमस्ते", "😀🎉👍🍕🐱❤️🇫🇷👨‍👩‍👧",
        "\u0301\u0308\u0303", "\u00a0\u3000\u2028\u0085\u1680\u2009\u200b", "１２３٣٤²½Ⅻ",
    ]
    words = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'LL", "the", " the", "and", "ing",
             "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_", "http://", "::", "->", "...", "    "]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 24)):
            if rng.random() < 0.2:
                parts.append(rng.choice(words))
            else:
                pool = rng.choice(pools)
                parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 6))))
        out.append("".join(parts))
    return out


def pkg_version(name):
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:  # noqa: BLE001 - informational only
        return "?"


def skip(reason):
    print(f"SKIP: {reason}")
    sys.exit(SKIP)


def find_model(arg, env="KALLPA_MODEL", model_file=MODEL_FILE):
    """The model: the argument, else $env, else model_file in $KALLPA_MODEL_DIR or models/."""
    if arg:
        return arg
    if os.environ.get(env):
        return os.environ[env]
    if os.environ.get("KALLPA_MODEL_DIR"):
        return os.path.join(os.environ["KALLPA_MODEL_DIR"], model_file)
    return os.path.join(REPO, "models", model_file)


def read_gguf_tokenizer(path, gguf):
    reader = gguf.GGUFReader(path)
    f = reader.fields

    def strings(key):
        field = f[key]
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    def ints(key):
        field = f[key]
        return [int(field.parts[i][0]) for i in field.data]

    def scalar(key, default=None):
        if key not in f:
            return default
        field = f[key]
        v = field.parts[field.data[0]]
        if field.types[0] == gguf.GGUFValueType.STRING:
            return bytes(v).decode("utf-8")
        return v.tolist()[0]

    return {
        "model": scalar("tokenizer.ggml.model"),
        "pre": scalar("tokenizer.ggml.pre", "default"),
        "tokens": strings("tokenizer.ggml.tokens"),
        "token_types": ints("tokenizer.ggml.token_type") if "tokenizer.ggml.token_type" in f else [],
        "merges": strings("tokenizer.ggml.merges"),
        "bos_id": scalar("tokenizer.ggml.bos_token_id"),
        "eos_id": scalar("tokenizer.ggml.eos_token_id"),
        "unk_id": scalar("tokenizer.ggml.unknown_token_id"),
        "pad_id": scalar("tokenizer.ggml.padding_token_id"),
        "add_bos": bool(scalar("tokenizer.ggml.add_bos_token", False)),
        "add_eos": bool(scalar("tokenizer.ggml.add_eos_token", False)),
    }, scalar("tokenizer.chat_template")


def build_hf(vocab, pre, tk):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    ids = {t: i for i, t in enumerate(vocab["tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in vocab["merges"]]
    tok = Tokenizer(models.BPE(vocab=ids, merges=merges, fuse_unk=False, byte_fallback=False))
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif pre == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre in ("llama3", "qwen2"):
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_RE if pre == "llama3" else QWEN2_RE), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        raise ValueError(pre)
    tok.decoder = decoders.ByteLevel()
    types = vocab["token_types"]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(vocab["tokens"], types) if ty == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(vocab["tokens"], types) if ty == USER_DEFINED])
    return tok


def run_tool(tool, vocab, texts, chats, workdir, tag):
    vpath = os.path.join(workdir, f"vocab-{tag}.json")
    ipath = os.path.join(workdir, f"input-{tag}.json")
    with open(vpath, "w", encoding="utf-8") as fh:
        json.dump(vocab, fh, ensure_ascii=False)
    with open(ipath, "w", encoding="utf-8") as fh:
        json.dump({"texts": texts, "chats": chats, "add_special": True, "parse_special": True}, fh,
                  ensure_ascii=False)
    proc = subprocess.run([tool, "--vocab", vpath, "--input", ipath], capture_output=True)
    if proc.returncode != 0:
        print(f"FAIL: kallpa_tokenize_tool exited with {proc.returncode}: "
              f"{proc.stderr.decode('utf-8', 'replace')}")
        sys.exit(1)
    return json.loads(proc.stdout.decode("utf-8"))


class Report:
    def __init__(self):
        self.failures = 0
        self.printed = 0

    def fail(self, what, text, **details):
        self.failures += 1
        if self.printed >= 25:
            return
        self.printed += 1
        print(f"MISMATCH [{what}] text={text!r}")
        for k, v in details.items():
            print(f"    {k}: {v}")


def compare_ids(report, what, hf, texts, results):
    for text, res in zip(texts, results):
        want = hf.encode(text, add_special_tokens=False).ids
        got = res["ids"]
        if got != want:
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            report.fail(what, text, kallpa_ids=got, hf_ids=want, first_difference=first,
                        kallpa_tokens=[hf.id_to_token(i) for i in got],
                        hf_tokens=[hf.id_to_token(i) for i in want],
                        kallpa_pieces=res["pieces"])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tool", required=True, help="path to kallpa_tokenize_tool")
    ap.add_argument("--model", help="GGUF file (default: see above)")
    ap.add_argument("--random", type=int, default=400, help="number of seeded random texts (default 400)")
    ap.add_argument("--seed", type=int, default=20261130)
    args = ap.parse_args()

    try:
        import gguf  # noqa: F401
        import tokenizers  # noqa: F401
    except ImportError as e:
        skip(f"python package missing ({e.name}): pip install 'tokenizers>=0.19' 'gguf>=0.10'")
    import gguf
    import tokenizers

    model = find_model(args.model)
    if not os.path.isfile(model):
        skip(f"model not found at {model} (run scripts/fetch_model.sh, or set KALLPA_MODEL)")
    if not os.access(args.tool, os.X_OK):
        print(f"FAIL: {args.tool} is not an executable")
        return 1

    vocab, chat_template = read_gguf_tokenizer(model, gguf)
    if vocab["model"] != "gpt2" or vocab["pre"] != "smollm":
        skip(f"this cross-check is written for SmolLM2 (model gpt2, pre smollm); "
             f"{model} has model={vocab['model']!r} pre={vocab['pre']!r}")
    texts = CORPUS + random_corpus(args.random, args.seed)
    print(f"model {model}: {len(vocab['tokens'])} tokens, {len(vocab['merges'])} merges, pre={vocab['pre']}; "
          f"tokenizers {tokenizers.__version__}, gguf {pkg_version('gguf')}; "
          f"{len(CORPUS)} hand-written + {args.random} random texts")

    report = Report()
    with tempfile.TemporaryDirectory(prefix="kallpa-tok-") as work:
        # 1. SmolLM2 as it is: ids, round trips, chats.
        hf = build_hf(vocab, "smollm", tokenizers)
        t0 = time.perf_counter()
        out = run_tool(args.tool, vocab, texts, CHATS, work, "smollm")
        wall = time.perf_counter() - t0
        compare_ids(report, "smollm", hf, texts, out["results"])
        n_tokens = n_exact = 0
        for text, res in zip(texts, out["results"]):
            n_tokens += len(res["ids"])
            # Round trip: the text itself, less the bytes the vocabulary cannot represent (both
            # implementations drop those), i.e. what HF decodes from its own ids.
            want = hf.decode(hf.encode(text, add_special_tokens=False).ids, skip_special_tokens=False)
            if res["decoded"] != want:
                report.fail("decode round trip", text, kallpa_decoded=res["decoded"], hf_decoded=want)
            if res["streamed"] != res["decoded"]:
                report.fail("streamed decode", text, streamed=res["streamed"], decoded=res["decoded"])
            if want == text:
                n_exact += 1

        try:
            import jinja2
        except ImportError:
            jinja2 = None
            print("note: jinja2 not installed; chat text checked against ids only")
        for msgs, res in zip(CHATS, out["chats"]):
            if jinja2 is not None and chat_template:
                want_text = jinja2.Environment().from_string(chat_template).render(
                    messages=msgs, add_generation_prompt=True)
                if res["text"] != want_text:
                    report.fail("chat template text", json.dumps(msgs), kallpa=res["text"], gguf_jinja=want_text)
            want = hf.encode(res["text"], add_special_tokens=False).ids
            if res["ids"] != want:
                report.fail("chat ids", res["text"], kallpa_ids=res["ids"], hf_ids=want)
            if res["ids_structured"] != want:
                report.fail("chat ids (encode_chatml)", res["text"], kallpa_ids=res["ids_structured"], hf_ids=want)

        # 2. The other pre-tokenizers, on the same vocabulary (the BPE stage is the same).
        for pre in ("gpt2", "llama3", "qwen2"):
            v = dict(vocab, pre=pre)
            o = run_tool(args.tool, v, texts, [], work, pre)
            compare_ids(report, pre, build_hf(vocab, pre, tokenizers), texts, o["results"])

    mb = out["bytes"] / 1e6
    print(f"kallpa: {len(texts)} texts, {out['bytes']} bytes, {n_tokens} tokens; encode {out['encode_seconds']*1e3:.1f} ms "
          f"({mb / max(out['encode_seconds'], 1e-9):.1f} MB/s), regex JIT {'on' if out['jit'] else 'off'}; "
          f"tool wall time {wall:.2f} s (includes loading the vocabulary); "
          f"{n_exact}/{len(texts)} texts round-trip byte for byte (the others hold bytes the vocabulary lacks)")
    if report.failures:
        print(f"FAIL: {report.failures} mismatch(es)")
        return 1
    print("OK: kallpa matches Hugging Face tokenizers on every text (smollm ids, decode, streamed decode, chat; "
          "gpt2/llama3/qwen2 pre-tokenizers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
