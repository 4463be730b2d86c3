#!/usr/bin/env python3
"""Times torch.nn.functional.scaled_dot_product_attention with its flash and cuDNN backends on
kallpa problem specs (the `kallpa bench attention --spec` grammar, the keys used here: b, sq, skv,
hq, hkv, d, dtype, causal), so that tools/gpu-check.sh can put PyTorch beside cuda-flash and cudnn.

FLOPs follow kallpa's convention: 4 * Sq * Skv * D * Hq * B, halved for causal when Sq == Skv.
Decode rows (Sq == 1) also report K/V bytes read per second.

Usage: torch_sdpa_bench.py --out FILE.json [--min-time S] SPEC [SPEC ...]
"""
import argparse
import json
import statistics
import sys


def parse_spec(text):
    spec = {"b": 1, "sq": 1, "skv": 1, "hq": 1, "hkv": 0, "d": 64, "dtype": "f16", "causal": False}
    for item in text.split(","):
        if "=" in item:
            key, value = item.split("=", 1)
            if key not in spec:
                raise ValueError(f"{text}: key '{key}' is not supported by this script")
            spec[key] = value if key == "dtype" else int(value)
        elif item == "causal":
            spec["causal"] = True
        else:
            raise ValueError(f"{text}: flag '{item}' is not supported by this script")
    if spec["hkv"] == 0:
        spec["hkv"] = spec["hq"]
    return spec


def time_call(torch, fn, min_time):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    total = 0.0
    while len(times) < 5 or total < min_time:
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        t = start.elapsed_time(stop) / 1e3
        times.append(t)
        total += t
        if len(times) >= 200:
            break
    return statistics.median(times), len(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--min-time", type=float, default=0.3)
    parser.add_argument("specs", nargs="+")
    args = parser.parse_args()
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        import torch.nn.functional as F
    except ImportError as e:
        print(f"torch_sdpa_bench: skipped, PyTorch is not importable: {e}", file=sys.stderr)
        return 77
    if not torch.cuda.is_available():
        print("torch_sdpa_bench: skipped, torch.cuda.is_available() is False", file=sys.stderr)
        return 77

    dtypes = {"f16": torch.float16, "bf16": torch.bfloat16}
    backends = {"torch-flash": SDPBackend.FLASH_ATTENTION, "torch-cudnn": SDPBackend.CUDNN_ATTENTION}
    rows = []
    for text in args.specs:
        s = parse_spec(text)
        if s["dtype"] not in dtypes:
            print(f"{text}: dtype {s['dtype']} is not timed (f16/bf16 only)", file=sys.stderr)
            continue
        dt = dtypes[s["dtype"]]
        gen = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(s["b"], s["hq"], s["sq"], s["d"], device="cuda", dtype=dt, generator=gen)
        k = torch.randn(s["b"], s["hkv"], s["skv"], s["d"], device="cuda", dtype=dt, generator=gen)
        v = torch.randn(s["b"], s["hkv"], s["skv"], s["d"], device="cuda", dtype=dt, generator=gen)
        # PyTorch's is_causal is top-left aligned; kallpa's bottom-right mask is the same only when
        # Sq == Skv, so other causal shapes are not compared.
        if s["causal"] and s["sq"] != s["skv"]:
            print(f"{text}: causal with Sq != Skv differs in alignment; skipped", file=sys.stderr)
            continue
        flops = 4.0 * s["sq"] * s["skv"] * s["d"] * s["hq"] * s["b"]
        if s["causal"]:
            flops /= 2
        kv_bytes = 2.0 * s["b"] * s["skv"] * s["hkv"] * s["d"] * q.element_size()
        for name, backend in backends.items():
            row = {"backend": name, "shape": text, "decode": s["sq"] == 1, "ran": False}
            gqa = s["hq"] != s["hkv"]
            try:
                with sdpa_kernel([backend]):
                    def call():
                        return F.scaled_dot_product_attention(q, k, v, is_causal=s["causal"], enable_gqa=gqa)
                    seconds, runs = time_call(torch, call, args.min_time)
                row.update(ran=True, seconds=seconds, runs=runs, gflops=flops / seconds / 1e9,
                           gbps=kv_bytes / seconds / 1e9, enable_gqa=gqa)
            except Exception as e:  # a backend that refuses the shape says why, in the JSON
                row["note"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            rows.append(row)
            print(f"{name:12s} {text:60s} " + (f"{row['seconds'] * 1e3:9.3f} ms {row['gflops']:9.1f} GFLOP/s"
                                               if row["ran"] else f"not run: {row['note']}"), file=sys.stderr)
        del q, k, v
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "cuda": torch.version.cuda,
                   "cudnn": torch.backends.cudnn.version(), "device": torch.cuda.get_device_name(0),
                   "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
