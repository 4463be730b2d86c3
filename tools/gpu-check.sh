#!/usr/bin/env bash
# One-shot check of kallpa's CUDA path on a machine with an NVIDIA GPU (made for an H200; any sm_80+
# works): build (Release, CUDA on, for this GPU's architecture), nvidia-smi, the CUDA tests and the
# conformance matrix for cuda-flash and cudnn, `kallpa bench attention` for both on prefill and
# decode shapes, PyTorch SDPA (flash and cuDNN backends) on the same shapes when torch imports, and
# the engine on the GPU (--device cuda --strict: golden text, NumPy logits check, bench model). Writes one JSON
# ($OUT/gpu-check.json, else ./gpu-check-out/) and prints a table with ratios. Every step is under
# `timeout`; the whole run is sized for 8 minutes. Exit status: 0 when every step that ran passed.
#
# Environment:
#   KALLPA_GPU_PREBUILT  a folder holding tools/gpu-bundle.sh's bundle, extracted (bin/, lib/): skip
#                        the configure and build (a bare CUDA image lacks kallpa's Debian packages)
#   KALLPA_GPU_STEPS     which steps run (default: "tests bench torch engine"; "ncu" adds Nsight Compute
#                        on the prefill kernel; "lab" runs cuda-flash's kernel lab, bench/lab/cuda-flash:
#                        each kept generation checked against a CPU reference and timed beside the
#                        production kernels)
#   KALLPA_GPU_BUILD_DIR the build folder when building here (default build-gpu)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT_DIR=${OUT:-./gpu-check-out}
mkdir -p "$OUT_DIR"
# Each step's output, as files. The device tool brings back at most 8 files from $OUT: there they
# are kept aside and come back as one archive beside gpu-check.json.
DETAILS=$OUT_DIR
if [[ -n "${OUT:-}" ]]; then DETAILS=$(mktemp -d); fi
BUILD=${KALLPA_GPU_BUILD_DIR:-build-gpu}
JOBS=$(nproc)
failures=()
step() { echo; echo "== $* ($(date -u +%T))"; }
record() {  # record NAME RC: remember failed steps (rc 77 = skipped)
  if [[ $2 -ne 0 && $2 -ne 77 ]]; then failures+=("$1 (exit $2)"); fi
  echo "$1: exit $2" >> "$DETAILS/steps.txt"
}
: > "$DETAILS/steps.txt"

step "nvidia-smi"
timeout 30 nvidia-smi 2>&1 | tee "$DETAILS/nvidia-smi.txt"
record nvidia-smi "${PIPESTATUS[0]}"

# cuda-flash's prefill runs on wgmma on compute capability 9.0 and on mma.sync elsewhere.
COMPUTE_CAP=$(timeout 30 nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2> /dev/null | head -1 | tr -d ' ')
if [[ "$COMPUTE_CAP" == "9.0" ]]; then kernel=forward_wgmma; else kernel=forward_tensor_core; fi
echo "compute capability ${COMPUTE_CAP:-unknown}: cuda-flash's prefill runs $kernel"

STEPS=" ${KALLPA_GPU_STEPS:-tests bench torch engine} "
wants() { [[ "$STEPS" == *" $1 "* ]]; }
PREBUILT=${KALLPA_GPU_PREBUILT:-}
PY=${KALLPA_PYTHON:-python3}
if [[ -x .venv/bin/python3 ]] && .venv/bin/python3 -c "import torch" 2>/dev/null; then PY=.venv/bin/python3; fi

# kallpa dlopens cuBLAS (libcublas.so.13), cuDNN (libcudnn.so.9) and, for the ring's nccl
# transport, NCCL (libnccl.so.2): where the loader does not know them, look in the toolkit and in
# Python's site-packages (PyTorch's nvidia-* wheels bring all three).
python_sites=$(timeout 60 python3 -c "import site; print(' '.join(site.getsitepackages()))" 2>/dev/null)
for lib in libcublas.so.13 libcudnn.so.9 libnccl.so.2; do
  if ! ldconfig -p | grep -q "$lib"; then
    # shellcheck disable=SC2086  # python_sites is a list of folders
    found=$(find /usr/local/cuda/lib64 /usr/local/cuda/targets $python_sites -name "$lib" -print -quit 2>/dev/null)
    if [[ -n "$found" ]]; then
      echo "$lib: $found"
      LD_LIBRARY_PATH="$(dirname "$found")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      export LD_LIBRARY_PATH
    else
      echo "$lib: not found (the backends that need it will say so)"
    fi
  fi
done

if [[ -n "$PREBUILT" ]]; then
  step "prebuilt programs from $PREBUILT (tools/gpu-bundle.sh)"
  export LD_LIBRARY_PATH="$PREBUILT/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  KALLPA="$PREBUILT/bin/kallpa"
  TESTS="$PREBUILT/bin/kallpa_tests"
  LOGITS_TOOL="$PREBUILT/bin/kallpa_logits_tool"
  PROBE="$PREBUILT/bin/kallpa_wgmma_probe"
  LAB_DIR="$PREBUILT/bin"
  ldd "$KALLPA" | grep "not found" && { record prebuilt-libs 1; echo "missing libraries"; exit 1; }
  record prebuilt-libs 0
else
  step "configure + build ($BUILD, Release, CUDA for the local GPU, -j$JOBS)"
  NVCC=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
  cudnn_args=()
  # No cuDNN headers in the toolkit or the system: use the one PyTorch's wheels bring, if any.
  if [[ ! -e /usr/local/cuda/include/cudnn_graph.h && ! -e /usr/include/cudnn_graph.h ]]; then
    cudnn_dir=$(timeout 60 python3 -c "import nvidia.cudnn, os; print(os.path.dirname(nvidia.cudnn.__file__) if nvidia.cudnn.__file__ else list(nvidia.cudnn.__path__)[0])" 2>/dev/null)
    if [[ -n "$cudnn_dir" && -e "$cudnn_dir/include/cudnn_graph.h" && -e "$cudnn_dir/lib/libcudnn.so.9" ]]; then
      echo "cuDNN from PyTorch's wheel: $cudnn_dir"
      cudnn_args=(-DKALLPA_CUDNN_INCLUDE_DIR="$cudnn_dir/include" -DKALLPA_CUDNN_LIBRARY="$cudnn_dir/lib/libcudnn.so.9")
      export LD_LIBRARY_PATH="$cudnn_dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
  fi
  lab_args=()
  if wants lab; then lab_args=(-DKALLPA_BUILD_LAB=ON); fi
  timeout 90 cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DKALLPA_WITH_CUDA=ON -DKALLPA_BUILD_BENCH=OFF \
    -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES=native "${cudnn_args[@]}" "${lab_args[@]}" \
    > "$DETAILS/configure.txt" 2>&1
  rc=$?; record configure $rc; grep -E "kallpa:" "$DETAILS/configure.txt"
  if [[ $rc -ne 0 ]]; then
    tail -30 "$DETAILS/configure.txt"
    echo "configure failed. kallpa needs the Debian packages of scripts/setup.sh (KALLPA_APT_PACKAGES: fmt, spdlog,"
    echo "nlohmann-json, CLI11, GoogleTest, Highway, OpenBLAS, PCRE2, ...); a bare GPU image lacks them."
    exit 1
  fi
  start=$(date +%s)
  probe_target=()
  if grep -q "kallpa_wgmma_probe" "$BUILD/Makefile" "$BUILD/build.ninja" 2> /dev/null; then probe_target=(kallpa_wgmma_probe); fi
  # The lab's programs that this build has (the Hopper generations need CUDA 12 or later).
  lab_targets=()
  if wants lab; then
    for v in 1 2 3 4 6 7 8; do
      if grep -q "cuda_flash_lab_v$v" "$BUILD/Makefile" "$BUILD/build.ninja" 2> /dev/null; then lab_targets+=("cuda_flash_lab_v$v"); fi
    done
  fi
  timeout 300 cmake --build "$BUILD" -j"$JOBS" --target kallpa kallpa_tests kallpa_logits_tool "${probe_target[@]}" \
    "${lab_targets[@]}" > "$DETAILS/build.txt" 2>&1
  rc=$?; record build $rc
  echo "build: exit $rc in $(( $(date +%s) - start )) s"
  if [[ $rc -ne 0 ]]; then grep -E "error|Error" "$DETAILS/build.txt" | head -30; echo "build failed"; exit 1; fi
  KALLPA="$BUILD/tools/kallpa/kallpa"
  TESTS="$BUILD/tests/kallpa_tests"
  LOGITS_TOOL="$BUILD/tests/engine/kallpa_logits_tool"
  PROBE="$BUILD/src/backends/cuda/kallpa_wgmma_probe"
  LAB_DIR="$BUILD/bench/lab/cuda-flash"
fi

step "kallpa backends"
timeout 60 "$KALLPA" backends 2>&1 | tee "$DETAILS/backends.txt"
record backends "${PIPESTATUS[0]}"

if wants tests; then
  step "wgmma building blocks (Hopper only)"
  if [[ -x "$PROBE" ]]; then
    timeout 60 "$PROBE" 2>&1 | tee "$DETAILS/wgmma-probe.txt"
    rc=${PIPESTATUS[0]}; [[ $rc -eq 2 ]] && rc=77  # 2: not a compute capability 9.0 device
    record wgmma-probe "$rc"
  else
    echo "skipped: no kallpa_wgmma_probe in this build"; record wgmma-probe 77
  fi
  step "CUDA tests and the conformance matrix for cuda-flash and cudnn"
  timeout 240 "$TESTS" \
    --gtest_filter='Cuda*:Cudnn*:Conformance/ConformanceBackend.PassesFullMatrix/cuda_flash:Conformance/ConformanceBackend.PassesFullMatrix/cudnn' \
    > "$DETAILS/tests.txt" 2>&1
  rc=$?; record tests $rc
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|cuda_flash|cudnn: |Failure|skipped [0-9]+ case" "$DETAILS/tests.txt" | head -60
fi

# Prefill: bf16, causal, D=128, Sq=Skv 4k-16k with Llama-3-8B's heads (32 query, 8 KV); the same
# non-causal (cudnn's single-operation SDPA has no causal mask); decode: one query per sequence,
# 8 sequences over 32k keys (1 GiB of K/V per call: HBM-bound).
PREFILL=()
for n in 4096 8192 16384; do
  PREFILL+=("b=1,sq=$n,skv=$n,hq=32,hkv=8,d=128,dtype=bf16,causal" "b=1,sq=$n,skv=$n,hq=32,hkv=8,d=128,dtype=bf16")
done
DECODE=("b=8,sq=1,skv=32768,hq=32,hkv=8,d=128,dtype=bf16")
spec_args=()
for s in "${PREFILL[@]}" "${DECODE[@]}"; do spec_args+=(--spec "$s"); done

if wants bench; then
  step "kallpa bench attention -b cuda-flash,cudnn"
  timeout 150 "$KALLPA" bench attention -b cuda-flash,cudnn "${spec_args[@]}" --min-time 0.2 --json \
    > "$DETAILS/kallpa-bench.json" 2> "$DETAILS/kallpa-bench.log"
  rc=$?; record kallpa-bench $rc; tail -5 "$DETAILS/kallpa-bench.log"
fi

# Nsight Compute on the prefill kernel, one launch (8k tokens, non-causal): where its time goes.
# Only when asked for (KALLPA_GPU_STEPS has "ncu").
if wants ncu; then
  step "ncu: the prefill kernel on one 8k launch"
  NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2> /dev/null || true)
  if [[ -n "$NCU" ]]; then
    # Past the start-up self-check's small launches, one of the benchmark's.
    timeout 120 "$NCU" --clock-control none -k regex:flash_forward_ --launch-skip 4 -c 1 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section ComputeWorkloadAnalysis --section SchedulerStats --section MemoryWorkloadAnalysis --section InstructionStats \
      "$KALLPA" bench attention -b cuda-flash --spec "b=1,sq=8192,skv=8192,hq=32,hkv=8,d=128,dtype=bf16" \
      --min-time 0.05 > "$DETAILS/ncu.txt" 2>&1
    record ncu $?
    grep -E "Duration|Registers Per|Achieved Occupancy|Compute \(SM\) Throughput|Memory Throughput|Issued Ipc|No Eligible|Warp Cycles Per Issued|Stall" \
      "$DETAILS/ncu.txt" | head -16
  else
    echo "skipped: no ncu"; record ncu 77
  fi
fi

# cuda-flash's kernel lab: each kept generation checks itself against a CPU reference, then times
# itself beside the production kernels (exit 77: not for this GPU). Only when asked for.
if wants lab; then
  step "cuda-flash kernel lab (bench/lab/cuda-flash)"
  ran=0
  for v in 1 2 3 4 6 7 8; do
    program="$LAB_DIR/cuda_flash_lab_v$v"
    [[ -x "$program" ]] || continue
    ran=1
    timeout 120 "$program" 2>&1 | tee "$DETAILS/lab-v$v.txt"
    record "lab-v$v" "${PIPESTATUS[0]}"
  done
  if [[ $ran -eq 0 ]]; then echo "skipped: no lab programs in $LAB_DIR (-DKALLPA_BUILD_LAB=ON builds them)"; record lab 77; fi
fi

if wants torch; then
  step "PyTorch SDPA (flash, cuDNN) on the same shapes"
  if command -v "$PY" > /dev/null && timeout 60 "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    timeout 150 "$PY" tools/torch_sdpa_bench.py --out "$DETAILS/torch-sdpa.json" --min-time 0.2 "${PREFILL[@]}" "${DECODE[@]}"
    record torch-sdpa $?
  else
    echo "skipped: python3 with a CUDA-enabled torch is not importable"
    record torch-sdpa 77
  fi
fi

if wants engine; then
  step "engine golden test on the GPU, and SmolLM2 tokens/s there"
  if ls models/*.gguf > /dev/null 2>&1; then
    # Text on stdout, the summary line (timings, device, fallbacks) on stderr.
    timeout 120 "$KALLPA" generate --device cuda --strict --chat -p "What is the capital of France?" --temp 0 -n 32 \
      > "$DETAILS/golden-gpu.txt" 2> "$DETAILS/golden-gpu.log"
    rc=$?; record golden-gpu $rc; cat "$DETAILS/golden-gpu.txt"; tail -2 "$DETAILS/golden-gpu.log"
    timeout 120 "$KALLPA" generate --chat -p "What is the capital of France?" --temp 0 -n 32 > "$DETAILS/golden-cpu.txt" 2>/dev/null
    if cmp -s "$DETAILS/golden-gpu.txt" "$DETAILS/golden-cpu.txt"; then echo "GPU text == CPU text"; else
      echo "GPU text differs from CPU text (see $DETAILS/golden-*.txt)"; fi
    grep -q Paris "$DETAILS/golden-gpu.txt" || record golden-gpu-paris 1
    timeout 120 "$KALLPA" bench model --device cuda -r 3 --json > "$DETAILS/bench-model-gpu.json" 2> "$DETAILS/bench-model-gpu.log"
    record bench-model-gpu $?; cat "$DETAILS/bench-model-gpu.json"
  else
    echo "skipped: no model in models/ (scripts/fetch_model.sh fetches it)"; record golden-gpu 77
  fi
  # The engine's device tests and its NumPy golden check with every op on the GPU (--strict).
  timeout 120 "$TESTS" --gtest_filter='DeviceOps*:Devices/DeviceMatchesCpu*' > "$DETAILS/device-ops-tests.txt" 2>&1
  record device-ops-tests $?; tail -3 "$DETAILS/device-ops-tests.txt"
  if "$PY" -c "import numpy, gguf" 2>/dev/null; then
    KALLPA_DEVICE=cuda timeout 180 "$PY" tests/engine/crosscheck_logits.py "$LOGITS_TOOL" \
      > "$DETAILS/golden-numpy-gpu.txt" 2>&1
    record golden-numpy-gpu $?; cat "$DETAILS/golden-numpy-gpu.txt"
  else
    echo "skipped: numpy/gguf not importable for the NumPy golden check"; record golden-numpy-gpu 77
  fi
fi

step "summary"
"$PY" - "$DETAILS" <<'PYEOF'
import json, os, sys
out = sys.argv[1]
def load(name, key=None):
    try:
        with open(os.path.join(out, name)) as f:
            data = json.load(f)
        return data.get(key, []) if key else data
    except (OSError, ValueError):
        return [] if key or name.endswith("bench.json") else {}
kallpa = load("kallpa-bench.json")
torch_doc = load("torch-sdpa.json")
rows = kallpa + (torch_doc.get("rows", []) if isinstance(torch_doc, dict) else [])
def canonical(shape):  # kallpa prints its canonical spec; compare as sets of key=value items
    return ",".join(sorted(shape.split(",")))
table, label = {}, {}
for r in rows:
    table.setdefault(canonical(r["shape"]), {})[r["backend"]] = r
    label.setdefault(canonical(r["shape"]), r["shape"])
# cuda-flash, then the vendor paths.
names = ["cuda-flash", "cudnn", "torch-flash", "torch-cudnn"]
print(f"{'shape':58s} " + " ".join(f"{n:>11s}" for n in names) + "  flash/torch-flash  flash/cudnn")
for shape, by in table.items():
    decode = any(r.get("decode") for r in by.values())
    unit = "GB/s" if decode else "TFLOP/s"
    def val(n):
        r = by.get(n)
        if not r or not r.get("ran"):
            return None
        return r["gbps"] if decode else r["gflops"] / 1e3
    cell = {n: val(n) for n in names}
    ratio = lambda a, b: f"{a / b:6.2f}" if a and b else "     -"
    best = lambda ns: max([cell[n] for n in ns if cell[n]] or [0]) or None
    best_cudnn = best(["cudnn", "torch-cudnn"])
    print(f"{label[shape]:58s} " + " ".join(f"{cell[n]:11.1f}" if cell[n] else f"{'-':>11s}" for n in names) +
          f"  {ratio(cell['cuda-flash'], cell['torch-flash']):>17s}"
          f"  {ratio(cell['cuda-flash'], best_cudnn):>11s}  ({unit})")
notes = [f"{r['backend']} on {r['shape']}: {r.get('note')}" for r in rows if not r.get("ran")]
for n in notes:
    print("not run:", n)
steps = open(os.path.join(out, "steps.txt")).read().split("\n")
doc = {"steps": [s for s in steps if s], "kallpa_bench": kallpa, "torch_sdpa": torch_doc,
       "tests_tail": open(os.path.join(out, "tests.txt")).read()[-4000:] if os.path.exists(os.path.join(out, "tests.txt")) else "",
       "nvidia_smi": open(os.path.join(out, "nvidia-smi.txt")).read() if os.path.exists(os.path.join(out, "nvidia-smi.txt")) else ""}
# The lab's output per generation (KALLPA_GPU_STEPS=lab): its checks and timings as printed.
doc["lab"] = {name[:-4]: open(os.path.join(out, name)).read()[-4000:]
              for name in sorted(os.listdir(out)) if name.startswith("lab-v") and name.endswith(".txt")}
with open(os.path.join(out, "gpu-check.json"), "w") as f:
    json.dump(doc, f, indent=2)
print(f"wrote {os.path.join(out, 'gpu-check.json')}")
PYEOF
record summary $?
if [[ "$DETAILS" != "$OUT_DIR" ]]; then
  cp "$DETAILS/gpu-check.json" "$OUT_DIR/" 2> /dev/null
  tar -C "$DETAILS" -czf "$OUT_DIR/gpu-check-details.tar.gz" .
fi

echo
if [[ ${#failures[@]} -gt 0 ]]; then
  echo "FAILED steps: ${failures[*]}"
  exit 1
fi
echo "every step that ran passed"
