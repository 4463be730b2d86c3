#!/usr/bin/env bash
# Runs clang-tidy (14) with the checks in .clang-tidy over kallpa's C++ sources; exits non-zero on
# any finding. Needs a configured build directory (its compile_commands.json); CUDA sources are
# left out (configure with -DKALLPA_WITH_CUDA=OFF). Not part of CI: the whole tree takes far longer
# than the build on 2 cores.
#
#   bash scripts/tidy.sh                        # every .cpp under src/ and tools/, build dir build/
#   bash scripts/tidy.sh src/core src/server    # only files under these paths
#
# Environment: KALLPA_TIDY_BUILD (build directory, default build), KALLPA_JOBS (default 2).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build="${KALLPA_TIDY_BUILD:-build}"
jobs="${KALLPA_JOBS:-2}"
if [[ ! -f $build/compile_commands.json ]]; then
  echo "tidy.sh: no $build/compile_commands.json; configure first, e.g." >&2
  echo "  cmake -S . -B $build -DCMAKE_BUILD_TYPE=Release -DKALLPA_WITH_CUDA=OFF" >&2
  exit 2
fi
tidy=$(command -v clang-tidy-14 || command -v clang-tidy || true)
[[ -n $tidy ]] || { echo "tidy.sh: clang-tidy not found (apt-get install clang-tidy)" >&2; exit 2; }

paths=("$@")
((${#paths[@]})) || paths=(src tools)
mapfile -t files < <(git ls-files -- "${paths[@]}" | grep -E '\.cpp$')
((${#files[@]})) || { echo "tidy.sh: no .cpp files under ${paths[*]}" >&2; exit 2; }
# Only files the build compiles (a file of a backend that is switched off has no compile command).
mapfile -t files < <(python3 - "$build/compile_commands.json" "${files[@]}" <<'EOF'
import json, os, sys
known = {os.path.realpath(e["file"]) for e in json.load(open(sys.argv[1]))}
for f in sys.argv[2:]:
    if os.path.realpath(f) in known:
        print(f)
EOF
)
echo "tidy.sh: ${#files[@]} files, $jobs jobs, $tidy"
start=$SECONDS
# Each file's findings as clang-tidy prints them, without its count of (suppressed) compiler
# warnings; a finding makes that clang-tidy, and so xargs and this script, fail.
# shellcheck disable=SC2016  # the inner script expands its own arguments
if ! printf '%s\n' "${files[@]}" |
  xargs -P "$jobs" -I{} bash -c 'set -o pipefail
    "$0" -p "$1" --quiet --extra-arg=-Wno-unknown-warning-option "$2" 2>&1 |
      { grep -v -E "^[0-9]+ warnings? (and [0-9]+ errors? )?generated\.$" || true; }' "$tidy" "$build" {}
then
  echo "tidy.sh: findings above ($((SECONDS - start)) s)" >&2
  exit 1
fi
echo "tidy.sh: clean (${#files[@]} files in $((SECONDS - start)) s)"
