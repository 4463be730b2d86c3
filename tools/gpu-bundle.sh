#!/usr/bin/env bash
# Packs kallpa's built programs for a GPU machine that cannot build them itself (a bare CUDA image:
# no fmt, spdlog, Highway, OpenBLAS, ... and no package registry), so that tools/gpu-check.sh runs
# there on the prebuilt programs (KALLPA_GPU_PREBUILT) instead of configuring and compiling (which
# costs device minutes).
#
#   bash tools/gpu-bundle.sh [BUILD_DIR] [OUT_DIR]      # defaults: build, .gpu
#
# Writes OUT_DIR/bundle.tar.xz: bin/ (kallpa, kallpa_tests, kallpa_logits_tool, stripped; also
# cuda-flash's lab programs, cuda_flash_lab_v*, where the build has them: -DKALLPA_BUILD_LAB=ON) and lib/
# (every shared library they load except the C/C++ runtime and the CUDA driver, which the GPU
# machine has in newer, compatible versions). cuBLAS and cuDNN are not packed: kallpa dlopens them
# and gpu-check.sh finds the GPU machine's own. Also OUT_DIR/wheels/ with the pure-Python gguf wheel
# the NumPy logits check needs, and the model split into OUT_DIR/model.part-* pieces, each under
# the device tool's 64 MiB per call (the 98 MB model does not travel in one call);
# tools/gpu-unbundle.sh (which reads the default OUT_DIR, .gpu) joins them and checks the SHA-256.
#
# The build must target the GPU's architecture (the default CMAKE_CUDA_ARCHITECTURES 80;90 does
# for A100/H100/H200).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
OUT_DIR=${2:-.gpu}
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib" "$OUT_DIR"

programs=("$BUILD/tools/kallpa/kallpa" "$BUILD/tests/kallpa_tests" "$BUILD/tests/engine/kallpa_logits_tool")
for p in "${programs[@]}"; do
  [[ -x "$p" ]] || { echo "gpu-bundle: $p is missing (build it first)" >&2; exit 1; }
  strip -o "$stage/bin/$(basename "$p")" "$p"
done
# The wgmma building blocks' check, where this build has it (CUDA 12+).
probe="$BUILD/src/backends/cuda/kallpa_wgmma_probe"
if [[ -x "$probe" ]]; then strip -o "$stage/bin/kallpa_wgmma_probe" "$probe"; fi
# cuda-flash's kernel lab (gpu-check.sh runs it with KALLPA_GPU_STEPS=lab); it loads the same
# libraries as kallpa.
for lab in "$BUILD"/bench/lab/cuda-flash/cuda_flash_lab_v*; do
  if [[ -x "$lab" ]]; then strip -o "$stage/bin/$(basename "$lab")" "$lab"; fi
done
# The C and C++ runtimes stay: the GPU image has them (newer versions load older programs).
system_libs='^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|librt\.|libpthread\.|libstdc\+\+|libgcc_s|libcuda\.)'
ldd "${programs[@]}" | awk '/=> \//{print $1, $3}' | sort -u | while read -r name path; do
  if [[ ! "$name" =~ $system_libs ]]; then cp -L "$path" "$stage/lib/$name"; fi
done
# OpenCL's ICD loader reads vendor files from /etc; the GPU machine's own (if any) stand.
tar -C "$stage" -cJf "$OUT_DIR/bundle.tar.xz" bin lib
echo "gpu-bundle: $OUT_DIR/bundle.tar.xz ($(du -h "$OUT_DIR/bundle.tar.xz" | cut -f1)): $(cd "$stage" && echo bin/* lib/*)"

mkdir -p "$OUT_DIR/wheels"
if ! ls "$OUT_DIR"/wheels/gguf-*.whl > /dev/null 2>&1; then
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$OUT_DIR/wheels" \
    "$(grep -E '^gguf==' scripts/requirements.txt)" || echo "gpu-bundle: no gguf wheel (the NumPy check will skip)" >&2
fi

model=$(bash scripts/fetch_model.sh)
rm -f "$OUT_DIR"/model.part-*
split -n 2 -d "$model" "$OUT_DIR/model.part-"
sha256sum "$model" | cut -d' ' -f1 > "$OUT_DIR/model.sha256"
parts=("$OUT_DIR"/model.part-*)
echo "gpu-bundle: model in ${#parts[@]} parts: ${parts[*]}"
