#!/usr/bin/env bash
# The GPU machine's half of tools/gpu-bundle.sh, for a machine that gets the bundle in two calls
# (the device tool carries at most 64 MiB a call; the model alone is 98 MB), run from the repo root:
#
#   bash tools/gpu-unbundle.sh stash   # call 1, carrying .gpu/bundle.tar.xz .gpu/model.part-00 .gpu/wheels:
#                                      # extracts the programs, installs the gguf wheel, keeps part 00
#   bash tools/gpu-unbundle.sh check   # call 2, carrying .gpu/model.part-01 .gpu/model.sha256 (while the
#                                      # machine is still warm): joins and verifies the model, then runs
#                                      # tools/gpu-check.sh on the extracted programs
#   bash tools/gpu-unbundle.sh kernels # one call, carrying .gpu/bundle.tar.xz: the attention kernels'
#                                      # steps of gpu-check.sh (tests bench torch ncu lab), no model
#
# Environment: KALLPA_GPU_STASH (default /root/kg) where the bundle is kept between the calls; what
# else gpu-check.sh reads (KALLPA_GPU_STEPS, OUT).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
stash=${KALLPA_GPU_STASH:-/root/kg}
model_name=SmolLM2-135M-Instruct.Q4_1.gguf

case "${1:-}" in
  stash)
    mkdir -p "$stash" || exit 1
    tar -C "$stash" -xJf .gpu/bundle.tar.xz || exit 1
    cp .gpu/model.part-00 "$stash/" || exit 1
    if ls .gpu/wheels/*.whl > /dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target "$stash/site" .gpu/wheels/*.whl ||
        echo "gpu-unbundle: the wheels did not install (the NumPy check will skip)"
    fi
    LD_LIBRARY_PATH="$stash/lib" ldd "$stash/bin/kallpa" | grep "not found" && exit 1
    LD_LIBRARY_PATH="$stash/lib" timeout 60 "$stash/bin/kallpa" backends
    ;;
  check)
    [[ -e "$stash/model.part-00" ]] || { echo "gpu-unbundle: no $stash/model.part-00: run 'stash' first (same machine)"; exit 1; }
    cat "$stash/model.part-00" .gpu/model.part-01 > "$stash/$model_name" || exit 1
    echo "$(cat .gpu/model.sha256)  $stash/$model_name" | sha256sum -c - || exit 1
    # A model already in models/ stays (so does a run here); else the joined one is linked there.
    if [[ ! -e "models/$model_name" ]]; then mkdir -p models && ln -s "$stash/$model_name" "models/$model_name"; fi
    export PYTHONPATH="$stash/site${PYTHONPATH:+:$PYTHONPATH}"
    KALLPA_GPU_PREBUILT="$stash" bash tools/gpu-check.sh
    ;;
  kernels)
    # One call, no model: the attention kernels' tests and benchmarks (and ncu), not the engine.
    mkdir -p "$stash" && tar -C "$stash" -xJf .gpu/bundle.tar.xz || exit 1
    KALLPA_GPU_STEPS=${KALLPA_GPU_STEPS:-tests bench torch ncu lab} KALLPA_GPU_PREBUILT="$stash" bash tools/gpu-check.sh
    ;;
  *)
    sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
