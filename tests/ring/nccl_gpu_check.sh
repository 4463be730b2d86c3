#!/usr/bin/env bash
# The NCCL transport's check on a GPU machine (docs/scale-out.md), in two halves:
#
#   bash tests/ring/nccl_gpu_check.sh pack [BUILD]   # here, once kallpa, kallpa_tests and
#                                                    # kallpa_transport_roundtrip are built in BUILD
#                                                    # (default build): writes .gpu/nccl/bundle.tar.xz
#   bash tests/ring/nccl_gpu_check.sh run            # there, carrying .gpu/nccl: the one command
#
# The GPU machine is a bare CUDA image without kallpa's Debian packages, so the programs travel with
# the libraries they load, as tools/gpu-bundle.sh packs them. NCCL (218 MB, over what one call
# carries) does not travel: kallpa loads it at run time, and `run` points the loader at the
# machine's own (the toolkit's, or PyTorch's nvidia-nccl wheel's).
# `run` does, each step under a timeout (about a minute in all):
#   nvidia-smi -L, and the CUDA devices the runtime sees (the probe the tests' skips read);
#   kallpa_tests --gtest_filter='ProcessGroupTransports.*:NcclComm.*': one rank's all-gathers and
#     broadcasts byte-exact; two ranks as threads, byte-exact with a device each, or, with one
#     device, both refused with the reason;
#   kallpa_transport_roundtrip nccl: the same through the transport the CLI selects, one rank;
#   kallpa --ring-transport nccl backends: the selection succeeds;
#   with mpirun there and 2 or more devices: tests/ring/transport_test.py nccl_np2 and
#     transport_mismatch (two processes); otherwise a line that says why not.
# Writes $OUT/nccl-gpu-check.txt (./nccl-gpu-check.txt without OUT). Exit status 0 when every step
# that ran passed.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
BUNDLE_DIR=.gpu/nccl

pack() {
  local build=${1:-build}
  local programs=("$build/tools/kallpa/kallpa" "$build/tests/kallpa_tests" "$build/tests/ring/kallpa_transport_roundtrip")
  stage=$(mktemp -d)  # global: the EXIT trap runs after this function has returned
  trap 'rm -rf "$stage"' EXIT
  mkdir -p "$stage/bin" "$stage/lib" "$BUNDLE_DIR"
  for p in "${programs[@]}"; do
    [[ -x "$p" ]] || { echo "nccl_gpu_check: $p is missing (build it first)" >&2; exit 1; }
    strip -o "$stage/bin/$(basename "$p")" "$p"
  done
  # The C and C++ runtimes and the CUDA driver are the GPU machine's.
  local system_libs='^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|librt\.|libpthread\.|libstdc\+\+|libgcc_s|libcuda\.)'
  ldd "${programs[@]}" | awk '/=> \//{print $1, $3}' | sort -u | while read -r name path; do
    if [[ ! "$name" =~ $system_libs ]]; then cp -L "$path" "$stage/lib/$name"; fi
  done
  tar -C "$stage" -cJf "$BUNDLE_DIR/bundle.tar.xz" bin lib
  echo "nccl_gpu_check: $BUNDLE_DIR/bundle.tar.xz ($(du -h "$BUNDLE_DIR/bundle.tar.xz" | cut -f1)): $(cd "$stage" && echo bin/* lib/*)"
}

run() {
  local report=${OUT:-.}/nccl-gpu-check.txt
  local stash
  stash=$(mktemp -d)
  tar -C "$stash" -xJf "$BUNDLE_DIR/bundle.tar.xz" || { echo "nccl_gpu_check: no $BUNDLE_DIR/bundle.tar.xz (pack it, carry it)"; exit 1; }
  export LD_LIBRARY_PATH="$stash/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  if ! ldconfig -p | grep -q libnccl.so.2; then
    local sites found
    sites=$(timeout 60 python3 -c "import site; print(' '.join(site.getsitepackages()))" 2> /dev/null)
    # shellcheck disable=SC2086  # sites is a list of folders
    found=$(find /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets $sites -name libnccl.so.2 -print -quit 2> /dev/null)
    [[ -n "$found" ]] || { echo "nccl_gpu_check: no libnccl.so.2 on this machine"; exit 1; }
    echo "libnccl.so.2: $found"
    LD_LIBRARY_PATH="$(dirname "$found"):$LD_LIBRARY_PATH"
  fi
  local bin=$stash/bin failures=()
  export KALLPA_QUARANTINE_JOURNAL=off
  step() {  # step NAME SECONDS COMMAND...: runs it, remembers a failure (77: skipped)
    local name=$1 secs=$2
    shift 2
    echo
    echo "== $name"
    timeout "$secs" "$@"
    local rc=$?
    echo "$name: exit $rc"
    if [[ $rc -ne 0 && $rc -ne 77 ]]; then failures+=("$name (exit $rc)"); fi
  }
  {
    step nvidia-smi 30 nvidia-smi -L
    step probe 60 "$bin/kallpa_transport_roundtrip" --probe
    step gtest 180 "$bin/kallpa_tests" --gtest_filter='ProcessGroupTransports.*:NcclComm.*'
    step roundtrip-np1 120 "$bin/kallpa_transport_roundtrip" nccl
    step cli-select 120 "$bin/kallpa" --ring-transport nccl --no-health-check backends
    local devices
    devices=$("$bin/kallpa_transport_roundtrip" --probe | sed -n 's/^nccl built, \([0-9]*\) CUDA devices$/\1/p')
    if ! command -v mpirun > /dev/null; then
      echo
      echo "== two processes: skipped: no mpirun on this machine"
    elif [[ "${devices:-0}" -lt 2 ]]; then
      echo
      echo "== two processes: skipped: ${devices:-0} CUDA device(s); two ranks need one each"
    else
      for t in nccl_np2 transport_mismatch; do
        step "$t" 300 python3 tests/ring/transport_test.py "$(command -v mpirun)" "$bin/kallpa_transport_roundtrip" "$bin/kallpa" "$t"
      done
    fi
    echo
    if [[ ${#failures[@]} -eq 0 ]]; then echo "nccl_gpu_check: every step that ran passed"; else echo "nccl_gpu_check: FAILED: ${failures[*]}"; fi
  } 2>&1 | tee "$report"
  grep -q "every step that ran passed" "$report"
}

case "${1:-}" in
  pack) pack "${2:-build}" ;;
  run) run ;;
  *)
    sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
