#!/usr/bin/env bash
# Fetches the sources of llama.cpp's Jinja engine (common/jinja/, with the two small helpers it
# uses, common/json.{h,cpp} and common/unicode.{h,cpp}), its MIT licence and llama.cpp's collection
# of real chat templates (models/templates/*.jinja, for the tests) into third_party/llama-jinja/,
# where CMake builds them as the kallpa_jinja library. Prints that folder on stdout.
#
#   bash scripts/fetch_jinja.sh
#   KALLPA_LLAMA_CPP_SDIST=/path/llama_cpp_python-0.3.36.tar.gz bash scripts/fetch_jinja.sh  # no download
#
# Source: the llama-cpp-python==0.3.36 sdist on PyPI (it vendors llama.cpp), pinned by SHA-256;
# a local copy given in KALLPA_LLAMA_CPP_SDIST is checked against the same hash. Why this engine:
# docs/chat-templates.md. Idempotent: a folder whose stamp names the pinned hash is kept; anything
# else is replaced. The files are extracted into a temporary folder and renamed into place.
#
# Environment: KALLPA_LLAMA_CPP_SDIST (a local copy of the sdist), PYTHON (default python3).
set -euo pipefail

readonly SDIST_SPEC="llama-cpp-python==0.3.36"
readonly SDIST_FILE="llama_cpp_python-0.3.36.tar.gz"
readonly SDIST_SHA256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
readonly ROOT="llama_cpp_python-0.3.36/vendor/llama.cpp"

log() { echo "fetch_jinja: $*" >&2; }
die() { echo "fetch_jinja: error: $*" >&2; exit 1; }

for arg in "$@"; do
  case "$arg" in
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$arg' (try --help)" ;;
  esac
done

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$repo/third_party/llama-jinja"
python="${PYTHON:-python3}"

if [[ -f "$dest/STAMP" && "$(cat "$dest/STAMP")" == "$SDIST_SHA256" ]]; then
  echo "$dest"
  exit 0
fi

mkdir -p -- "$repo/third_party" || die "cannot create $repo/third_party"
work="$(mktemp -d "$repo/third_party/.fetch.XXXXXX")" || die "cannot create a temporary folder"
trap 'rm -rf -- "$work"' EXIT

sdist="${KALLPA_LLAMA_CPP_SDIST:-}"
if [[ -z "$sdist" ]]; then
  log "downloading $SDIST_SPEC (the sdist, about 77 MB) from PyPI ..."
  "$python" -m pip download --no-deps --no-binary=:all: --no-build-isolation --no-cache-dir \
    --disable-pip-version-check --quiet "$SDIST_SPEC" -d "$work/dl" >&2 || die "pip download of $SDIST_SPEC failed (is PyPI reachable?)"
  sdist="$work/dl/$SDIST_FILE"
fi
[[ -f "$sdist" ]] || die "$sdist not found"
got="$(sha256sum "$sdist" | cut -d' ' -f1)"
[[ "$got" == "$SDIST_SHA256" ]] || die "SHA-256 mismatch for $sdist: got $got, expected $SDIST_SHA256"

log "extracting common/jinja, common/json, common/unicode, LICENSE and models/templates"
tar -xzf "$sdist" -C "$work" --wildcards \
  "$ROOT/common/jinja/*" "$ROOT/common/json.h" "$ROOT/common/json.cpp" "$ROOT/common/unicode.h" \
  "$ROOT/common/unicode.cpp" "$ROOT/LICENSE" "$ROOT/models/templates/*.jinja" || die "cannot extract from $sdist"
out="$work/out"
mkdir -p "$out/templates"
mv "$work/$ROOT/common" "$out/common"
mv "$work/$ROOT/LICENSE" "$out/LICENSE"
mv "$work/$ROOT/models/templates/"*.jinja "$out/templates/"
echo "$SDIST_SHA256" >"$out/STAMP"

rm -rf -- "$dest.old"
[[ -e "$dest" ]] && mv -- "$dest" "$dest.old"
mv -- "$out" "$dest" || die "cannot move the sources into $dest"
rm -rf -- "$dest.old"
log "saved $dest"
echo "$dest"
