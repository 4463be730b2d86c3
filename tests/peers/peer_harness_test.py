#!/usr/bin/env python3
"""Tests of bench/peer_llama_cpp.py: its readers of llama.cpp's output formats and its mapping of
ggml's FLASH_ATTN_EXT cases onto kallpa problem specs, and the MUL_MAT --test-file lines of the
matmul comparison (pure functions, on samples of the real formats), then whole runs against the
real `kallpa` binary (and, for --matmul, a stand-in quant_matmul_bench) with stand-in llama.cpp
programs that print fixed results in those formats, so the ratios it reports can be checked
exactly.

  python3 peer_harness_test.py --kallpa PATH [--model PATH]
"""
import argparse
import importlib.util
import json
import math
import stat
import subprocess
import sys
import tempfile
import textwrap
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "peer_llama_cpp.py"
spec = importlib.util.spec_from_file_location("peer_llama_cpp", SCRIPT)
peer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peer)

ARGS = None  # set in main

GQA_DECODE = ("hsk=64,hsv=64,nh=8,nr23=[4,1],kv=8192,nb=1,mask=1,sinks=0,max_bias=0.000000,"
              "logit_softcap=0.000000,prec=f32,type_K=f16,type_V=f16,permute=[0,1,2,3],kv_view=1,"
              "v_is_view_of_k=0,n_kv_max=0")


def case(**changes):
    params = peer.split_params(GQA_DECODE)
    params.update({k: str(v) for k, v in changes.items()})
    return params


class Readers(unittest.TestCase):
    def test_split_params_keeps_brackets_whole(self):
        p = peer.split_params("a=1,nr23=[4,2],permute=[0,2,1,3],t=f16")
        self.assertEqual(p, {"a": "1", "nr23": "[4,2]", "permute": "[0,2,1,3]", "t": "f16"})
        with self.assertRaises(peer.PeerError):
            peer.split_params("a=1,oops")

    def test_gqa_decode_case_maps_to_the_same_problem(self):
        spec, why = peer.fa_case_to_spec(peer.split_params(GQA_DECODE))
        self.assertEqual(why, "")
        self.assertEqual(spec, "b=1,sq=1,skv=8192,hq=32,hkv=8,d=64,dtype=f32,kv_dtype=f16")

    def test_batch_head_dims_softcap_and_alibi_carry_over(self):
        spec, _ = peer.fa_case_to_spec(case(hsk=192, hsv=128, nr23="[2,3]", nb=512, type_K="bf16",
                                            type_V="bf16", logit_softcap=30.0, max_bias=8.0))
        self.assertEqual(spec, "b=3,sq=512,skv=8192,hq=16,hkv=8,d=192,dv=128,dtype=f32,kv_dtype=bf16,"
                               "softcap=30,alibi")

    def test_cases_without_a_counterpart_say_why(self):
        for changes, reason in [({"type_K": "q8_0", "type_V": "q8_0"}, "K/V types q8_0/q8_0"),
                                ({"type_V": "bf16"}, "two types"),
                                ({"sinks": 1}, "sinks"),
                                ({"n_kv_max": 512}, "n_kv_max"),
                                ({"v_is_view_of_k": 1}, "view of K"),
                                ({"permute": "[0,2,1,3]"}, "permuted")]:
            spec, why = peer.fa_case_to_spec(case(**changes))
            self.assertIsNone(spec, changes)
            self.assertIn(reason, why, changes)
        self.assertIsNone(peer.fa_case_to_spec({"hsk": "64"})[0])

    def test_test_backend_ops_console_lines(self):
        text = ("Backend 1/1: CPU\n"
                f"  FLASH_ATTN_EXT({GQA_DECODE}):                120 runs -  5417.13 us/run -  67.11 MFLOP/run - "
                "\x1b[1;34m 12.39 GFLOPS\x1b[0m\n"
                "  FLASH_ATTN_EXT(hsk=64,type_K=q1_0): not supported [CPU]\n"
                "  Backend CPU: \x1b[1;32mOK\x1b[0m\n")
        cases = peer.parse_test_backend_ops(text)
        self.assertEqual(len(cases), 1)
        self.assertEqual(cases[0]["params"], GQA_DECODE)
        self.assertEqual(cases[0]["runs"], 120)
        self.assertAlmostEqual(cases[0]["seconds"], 5417.13e-6)

    def test_matmul_test_file_line_is_a_mul_mat_of_the_shape(self):
        # op, result type, result ne, op params, sources: type, ne, nb (bytes), then the name.
        line = peer.mm_test_file_line("q4_K", 640, 1024, 512).split()
        self.assertEqual(line[:8], ["29", "0", "640", "512", "1", "1", "0", "2"])
        self.assertEqual(line[8:17], ["12", "1024", "640", "1", "1", "144", "576", str(576 * 640), str(576 * 640)])
        self.assertEqual(line[17:26], ["0", "1024", "512", "1", "1", "4", "4096", str(4096 * 512), str(4096 * 512)])
        self.assertEqual(line[26], "kallpa_q4_K_m640_k1024_n512")
        self.assertEqual(len(line), 27)

    def test_matmul_console_lines_and_quant_bench_json(self):
        text = ("Backend 1/1: CPU\n"
                "  MUL_MAT(name=kallpa_q5_0_m1024_k640_n1,type=f32,ne=[1024,1,1,1],op_params=[],"
                "sources=q5_0[640,1024,1,1],f32[640,1,1,1]):      8192 runs -    40.25 us/run -  446 kB/run - "
                "\x1b[1;34m   8.14 GB/s\x1b[0m\n"
                "  MUL_MAT(type=f32,ne=[4,4,1,1]):   10 runs -  1.00 us/run\n")
        got = peer.parse_test_backend_ops_matmul(text)
        self.assertEqual(list(got), ["kallpa_q5_0_m1024_k640_n1"])
        self.assertAlmostEqual(got["kallpa_q5_0_m1024_k640_n1"], 40.25e-6)
        bench = {"benchmarks": [
            {"name": "BM_GemmaMatmul/rows:1024/cols:640/b:1/type:6/act:2/threads:1/real_time",
             "run_type": "iteration", "real_time": 30.5, "time_unit": "us"},
            {"name": "BM_GemmaMatmul/rows:1024/cols:640/b:1/type:6/act:2/threads:1/real_time_median",
             "run_type": "aggregate", "real_time": 99.0, "time_unit": "us"},
            {"name": "BM_BlockTypeGemv/rows:576/cols:1536/b:1/type:6/act:0/threads:1/isa:0/real_time",
             "run_type": "iteration", "real_time": 7.0, "time_unit": "us"}]}
        self.assertEqual(peer.parse_quant_bench(json.dumps(bench)), {(6, 1024, 640, 1, 2): 30.5e-6})
        with self.assertRaises(peer.PeerError):
            peer.parse_quant_bench(json.dumps({"benchmarks": []}))

    def test_llama_bench_json(self):
        rows = [{"n_prompt": 512, "n_gen": 0, "n_depth": 0, "avg_ts": 196.6},
                {"n_prompt": 0, "n_gen": 128, "n_depth": 2048, "avg_ts": 61.25}]
        self.assertEqual(peer.parse_llama_bench(json.dumps(rows)), {("pp512", 0): 196.6, ("tg128", 2048): 61.25})
        with self.assertRaises(peer.PeerError):
            peer.parse_llama_bench("| model | size |")

    def test_batched_bench_jsonl(self):
        text = ('main: n_kv_max = 4096\n'
                '{"pp": 16, "tg": 128, "pl": 1, "speed_pp": 150.4, "speed_tg": 58.79}\n'
                '{"pp": 16, "tg": 128, "pl": 16, "speed_pp": 205.8, "speed_tg": 154.37}\n')
        self.assertEqual(peer.parse_batched_bench(text), {1: 58.79, 16: 154.37})
        with self.assertRaises(peer.PeerError):
            peer.parse_batched_bench("|    PP |     TG |\n")

    def test_summary_is_the_median_of_per_round_ratios(self):
        s = peer.summarise([10.0, 30.0, 20.0], [5.0, 10.0, 20.0])
        self.assertEqual((s["kallpa"], s["peer"]), (20.0, 10.0))
        self.assertEqual((s["ratio"], s["ratio_min"], s["ratio_max"]), (2.0, 1.0, 3.0))


def write_program(directory: Path, name: str, body: str) -> str:
    """A stand-in for a llama.cpp program: a Python script printing what the real one would."""
    path = directory / name
    path.write_text(f"#!{sys.executable}\nimport json, sys\nargs = sys.argv[1:]\n" + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


class WholeRuns(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = Path(self.tmp.name)

    def tearDown(self):
        self.tmp.cleanup()

    def harness(self, *args):
        res = subprocess.run([sys.executable, str(SCRIPT), "--kallpa", ARGS.kallpa, *args], capture_output=True,
                             text=True, timeout=600)
        self.assertGreaterEqual(res.returncode, 0, res.stderr)
        return res

    def test_attention_ratios_come_from_both_programs_timings(self):
        small = GQA_DECODE.replace("nh=8,", "nh=2,").replace("kv=8192", "kv=256")
        tbo = write_program(self.dir, "test-backend-ops", f"""
            assert args[:6] == ["perf", "-o", "FLASH_ATTN_EXT", "-b", "CPU", "-p"], args
            print("  FLASH_ATTN_EXT({small}):   100 runs -   250.00 us/run - 1 MFLOP/run - 4 GFLOPS")
            print("  FLASH_ATTN_EXT({small.replace('type_K=f16,type_V=f16', 'type_K=q8_0,type_V=q8_0')}): "
                  "  100 runs -   250.00 us/run - 1 MFLOP/run - 4 GFLOPS")
        """)
        out = self.dir / "report.json"
        res = self.harness("--test-backend-ops", tbo, "--rounds", "2", "--json", str(out))
        self.assertEqual(res.returncode, 0, res.stderr)
        report = json.loads(out.read_text())
        rows = report["attention"]["rows"]
        self.assertEqual([r["spec"] for r in rows], ["b=1,sq=1,skv=256,hq=8,hkv=2,d=64,dtype=f32,kv_dtype=f16"])
        r = rows[0]
        self.assertAlmostEqual(r["peer_ms"], 0.25)
        self.assertGreater(r["kallpa_ms"], 0)
        # The peer's time is the same in both rounds, so the median (the mean, of two) of the per-round
        # ratios is its time over kallpa's as the report gives it (the harmonic mean of its rounds).
        self.assertTrue(r["ratio_min"] <= r["ratio"] <= r["ratio_max"])
        self.assertTrue(math.isclose(r["ratio"], 0.25 / r["kallpa_ms"], rel_tol=1e-9))
        self.assertEqual([s["why"] for s in report["attention"]["skipped"]],
                         ["K/V types q8_0/q8_0 (the contract has f32, f16 and bf16 K/V)"])
        self.assertIn(r["spec"], res.stdout)
        self.assertIn("left out:", res.stdout)

    def test_model_and_batched_ratios_divide_kallpa_by_the_peer(self):
        if not Path(ARGS.model).is_file():
            self.skipTest(f"no model at {ARGS.model}")
        lb = write_program(self.dir, "llama-bench", """
            p, n, d = (int(args[args.index(f)+1].split(",")[0]) for f in ("-p", "-n", "-d"))
            print(json.dumps([{"n_prompt": p, "n_gen": 0, "n_depth": d, "avg_ts": 100.0},
                              {"n_prompt": 0, "n_gen": n, "n_depth": d, "avg_ts": 10.0}]))
        """)
        bb = write_program(self.dir, "llama-batched-bench", """
            for pl in args[args.index("-npl")+1].split(","):
                print(json.dumps({"pl": int(pl), "speed_tg": 5.0 * int(pl)}))
        """)
        out = self.dir / "report.json"
        res = self.harness("--model", ARGS.model, "--llama-bench", lb, "--llama-batched-bench", bb, "--rounds", "1",
                           "--threads", "2", "-p", "16", "-n", "4", "-B", "1,2", "--batch-prompt", "4",
                           "--batch-gen", "4", "--json", str(out))
        self.assertEqual(res.returncode, 0, res.stderr)
        report = json.loads(out.read_text())
        tests = {(r["test"], r["depth"]): r for r in report["model"]}
        self.assertEqual(set(tests), {("pp16", 0), ("tg4", 0)})
        self.assertAlmostEqual(tests[("pp16", 0)]["ratio"], tests[("pp16", 0)]["kallpa"] / 100.0)
        self.assertAlmostEqual(tests[("tg4", 0)]["ratio"], tests[("tg4", 0)]["kallpa"] / 10.0)
        batched = {r["sequences"]: r for r in report["batched"]}
        self.assertEqual(set(batched), {1, 2})
        self.assertAlmostEqual(batched[2]["ratio"], batched[2]["kallpa"] / 10.0)
        self.assertAlmostEqual(batched[2]["peer_scaling"], 2.0)
        self.assertAlmostEqual(batched[2]["kallpa_scaling"], batched[2]["kallpa"] / batched[1]["kallpa"])

    def test_matmul_ratios_pair_each_case_with_its_kallpa_run(self):
        tbo = write_program(self.dir, "test-backend-ops", """
            assert args[:4] == ["perf", "-b", "CPU", "--test-file"], args
            for line in open(args[4]):
                f = line.split()
                us = 100.0 if f[3] == "1" else 4000.0  # n = 1: 100 us, n = 512: 4 ms
                print(f"  MUL_MAT(name={f[-1]},type=f32,ne=[{f[2]},{f[3]},1,1],op_params=[],"
                      f"sources=x[1,1,1,1],f32[1,1,1,1]):  10 runs - {us:8.2f} us/run - 1 kB/run")
        """)
        qb = write_program(self.dir, "quant_matmul_bench", """
            assert "--benchmark_format=json" in args, args
            ids = {"q5_0": 6, "q8_0": 8, "q4_K": 12, "q6_K": 14}
            shapes = [("q5_0", 1024, 640), ("q5_0", 256, 640), ("q5_0", 2048, 640), ("q4_K", 640, 1024),
                      ("q4_K", 640, 2048), ("q6_K", 640, 2048), ("q8_0", 256, 640), ("q8_0", 262144, 640)]
            runs = []
            for t, rows, cols in shapes:
                for b, act, us in ((1, 2, 50.0), (1, 0, 200.0), (512, 2, 800.0), (512, 0, 1000.0)):
                    name = f"BM_GemmaMatmul/rows:{rows}/cols:{cols}/b:{b}/type:{ids[t]}/act:{act}/threads:1/real_time"
                    runs.append({"name": name, "run_type": "iteration", "real_time": us, "time_unit": "us"})
            print(json.dumps({"benchmarks": runs}))
        """)
        out = self.dir / "report.json"
        res = self.harness("--test-backend-ops", tbo, "--matmul", "--quant-bench", qb, "--rounds", "2", "--json",
                           str(out))
        self.assertEqual(res.returncode, 0, res.stderr)
        rows = json.loads(out.read_text())["matmul"]
        # 8 shapes at batch 1 and 7 at batch 512 (not the output head), q16 and f32 each.
        self.assertEqual(len(rows), (8 + 7) * 2)
        for r in rows:
            want = {(1, "q16"): 100 / 50, (1, "f32"): 100 / 200, (512, "q16"): 4000 / 800,
                    (512, "f32"): 4000 / 1000}[(r["n"], r["activations"])]
            self.assertAlmostEqual(r["ratio"], want, msg=r)
            self.assertAlmostEqual(r["ratio_best"], want, msg=r)
        self.assertIn("kallpa_q4_K_m640_k2048_n512", [peer.mm_case_name(r["type"], r["m"], r["k"], r["n"])
                                                      for r in rows])

    def test_cases_without_counterparts_are_listed_not_timed(self):
        quantised = GQA_DECODE.replace("type_K=f16,type_V=f16", "type_K=q4_0,type_V=q4_0")
        tbo = write_program(self.dir, "test-backend-ops", f"""
            print("  FLASH_ATTN_EXT({quantised}):   100 runs -   250.00 us/run - 1 MFLOP/run - 4 GFLOPS")
        """)
        res = self.harness("--test-backend-ops", tbo, "--rounds", "2")
        self.assertEqual(res.returncode, 0, res.stderr)
        self.assertIn("no case that test-backend-ops timed has a counterpart", res.stdout)
        self.assertIn("left out: " + quantised + ": K/V types q4_0/q4_0", res.stdout)
        self.assertNotIn("bench attention", res.stderr)  # kallpa was not run

    def test_output_a_reader_cannot_take_is_named_and_fails_the_run(self):
        if not Path(ARGS.model).is_file():
            self.skipTest(f"no model at {ARGS.model}")
        bb = write_program(self.dir, "llama-batched-bench", """
            print(json.dumps({"pl": 1, "speed": 3.0}))
        """)
        res = self.harness("--model", ARGS.model, "--llama-batched-bench", bb, "--rounds", "1", "-B", "1",
                           "--batch-prompt", "4", "--batch-gen", "2")
        self.assertEqual(res.returncode, 1)
        self.assertIn("llama-batched-bench: unreadable output (KeyError: 'speed_tg')", res.stderr)
        self.assertNotIn("Traceback", res.stderr)

    def test_a_failing_peer_is_named_and_fails_the_run(self):
        tbo = write_program(self.dir, "test-backend-ops", """
            print("ggml_backend_load_best: no CPU backend", file=sys.stderr)
            sys.exit(3)
        """)
        res = self.harness("--test-backend-ops", tbo, "--rounds", "1")
        self.assertEqual(res.returncode, 1)
        self.assertIn("test-backend-ops perf: exit 3: ggml_backend_load_best: no CPU backend", res.stderr)
        res = self.harness("--test-backend-ops", str(self.dir / "missing"), "--rounds", "1")
        self.assertEqual(res.returncode, 1)
        self.assertIn("cannot run", res.stderr)
        res = self.harness("--rounds", "1")
        self.assertEqual(res.returncode, 2)
        self.assertIn("give at least one of", res.stderr)


def main():
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--kallpa", required=True)
    ap.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ARGS, rest = ap.parse_known_args()
    unittest.main(argv=[sys.argv[0], "-v", *rest])


if __name__ == "__main__":
    main()
