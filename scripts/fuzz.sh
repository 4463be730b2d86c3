#!/usr/bin/env bash
# Fuzzes with libFuzzer what takes untrusted input or keeps state (tests/fuzz/*_fuzz.cpp): gguf
# (the loader, through the engine's load and a short generation), request (OpenAI bodies),
# tokenizer (round trips, chat templates), problem_spec, attention (tampered problems, every CPU
# backend against reference), kv_cache (the paged cache and its prefix cache against a model) and
# scheduler (batched texts equal each request alone). Builds build-fuzz/ with clang (ASan + UBSan
# + coverage; installs clang and libFuzzer from Debian when missing), then runs each target for a
# while, starting from its saved corpus in tests/fuzz/corpus/<target>.
#
#   bash scripts/fuzz.sh                      # every target, 120 s each
#   bash scripts/fuzz.sh --seconds 600 gguf   # one target, longer
#
# New coverage accumulates in build-fuzz/corpus/<target> (not committed). A finding (crash,
# sanitizer report, failed property, timeout, memory blow-up) is saved under
# build-fuzz/findings/<target>/ and makes the script exit 1. Once it is fixed, copy the input into
# tests/fuzz/corpus/<target>/: ctest's fuzz.<target> replays that corpus on every test run.
#
# Environment: KALLPA_JOBS (build jobs, default 2).
set -euo pipefail

seconds=120
targets=()
while (($#)); do
  case "$1" in
    --seconds) seconds=$2; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    -*) echo "fuzz.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
    *) targets+=("$1") ;;
  esac
  shift
done
((${#targets[@]})) || targets=(gguf request tokenizer problem_spec kv_cache attention scheduler)

cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD
jobs="${KALLPA_JOBS:-2}"

# clang-14 and its runtime (libFuzzer, sanitizers): Debian 12's default clang.
need=()
for pkg in clang-14 libclang-rt-14-dev; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || need+=("$pkg")
done
if ((${#need[@]})); then
  echo "fuzz: installing ${need[*]}"
  sudo=()
  [[ $(id -u) -eq 0 ]] || sudo=(sudo)
  "${sudo[@]}" apt-get update -q
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q "${need[@]}"
fi

CC=clang-14 CXX=clang++-14 cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=Fuzz -DKALLPA_WITH_CUDA=OFF \
  -DKALLPA_BUILD_TESTS=OFF -DKALLPA_BUILD_BENCH=OFF
cmake --build build-fuzz -j"$jobs" --target "${targets[@]/#/fuzz_}"

# The real vocabulary for the tokenizer target when setup has installed the model.
export KALLPA_FUZZ_TOKENIZER_MODEL="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
status=0
for t in "${targets[@]}"; do
  corpus="build-fuzz/corpus/$t"
  findings="build-fuzz/findings/$t"
  mkdir -p "$corpus" "$findings"
  echo "== fuzz $t for $seconds s"
  # -rss_limit_mb: a parser that allocates what a header claims, before checking it against the
  # bytes there, is a finding. -timeout: so is one input that takes seconds.
  if ! "build-fuzz/tests/fuzz/fuzz_$t" "$corpus" "tests/fuzz/corpus/$t" -max_total_time="$seconds" \
      -rss_limit_mb=2048 -timeout=10 -max_len=65536 -print_final_stats=1 -artifact_prefix="$findings/"; then
    echo "== fuzz $t: FINDING, saved in $findings/ (replay: build/tests/fuzz/fuzz_$t FILE)" >&2
    status=1
  fi
done
exit $status
