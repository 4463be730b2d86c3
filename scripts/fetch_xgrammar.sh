#!/usr/bin/env bash
# Fetches the C++ core of xgrammar (the grammar engine behind structured output: cpp/ without its
# Python bindings, include/, the header-only picojson and dlpack it includes, its Apache-2.0
# LICENSE and NOTICE) into third_party/xgrammar/, where CMake builds it as the kallpa_xgrammar
# library. Prints that folder on stdout.
#
#   bash scripts/fetch_xgrammar.sh
#   KALLPA_XGRAMMAR_SDIST=/path/xgrammar-0.2.9.tar.gz bash scripts/fetch_xgrammar.sh  # no download
#
# Source: the xgrammar==0.2.9 sdist on PyPI, pinned by SHA-256; a local copy given in
# KALLPA_XGRAMMAR_SDIST is checked against the same hash. `pip download` cannot fetch this sdist
# (it builds the package's metadata, which needs CMake to configure xgrammar), so the file is
# found through the index's JSON simple API (PEP 691) at pip's configured index (PIP_INDEX_URL,
# default PyPI) and downloaded by Python's urllib. Why this engine: docs/structured-output.md.
# Idempotent: a folder whose stamp names the pinned hash is kept; anything else is replaced.
#
# Environment: KALLPA_XGRAMMAR_SDIST (a local copy of the sdist), PYTHON (default python3).
set -euo pipefail

readonly SDIST_FILE="xgrammar-0.2.9.tar.gz"
readonly SDIST_SHA256="87b466bca2475e29bb0323abc62c6c33cbcbcff47e5fb800a3e2099ac9620b90"
readonly ROOT="xgrammar-0.2.9"

log() { echo "fetch_xgrammar: $*" >&2; }
die() { echo "fetch_xgrammar: error: $*" >&2; exit 1; }

for arg in "$@"; do
  case "$arg" in
    -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$arg' (try --help)" ;;
  esac
done

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$repo/third_party/xgrammar"
python="${PYTHON:-python3}"

if [[ -f "$dest/STAMP" && "$(cat "$dest/STAMP")" == "$SDIST_SHA256" ]]; then
  echo "$dest"
  exit 0
fi

mkdir -p -- "$repo/third_party" || die "cannot create $repo/third_party"
work="$(mktemp -d "$repo/third_party/.fetch.XXXXXX")" || die "cannot create a temporary folder"
trap 'rm -rf -- "$work"' EXIT

sdist="${KALLPA_XGRAMMAR_SDIST:-}"
if [[ -z "$sdist" ]]; then
  log "downloading $SDIST_FILE (about 2.8 MB) from the package index ..."
  sdist="$work/$SDIST_FILE"
  "$python" - "$SDIST_FILE" "$sdist" <<'PY' || die "download of $SDIST_FILE failed (is the package index reachable?)"
import json, os, ssl, sys, urllib.parse, urllib.request
name, out = sys.argv[1], sys.argv[2]
index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
cafile = os.environ.get("PIP_CERT") or None
ctx = ssl.create_default_context(cafile=cafile)
req = urllib.request.Request(index + "/xgrammar/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
with urllib.request.urlopen(req, context=ctx, timeout=120) as r:
    files = json.load(r)["files"]
url = next(f["url"] for f in files if f["filename"] == name)
url = urllib.parse.urljoin(index + "/xgrammar/", url)
with urllib.request.urlopen(url, context=ctx, timeout=300) as r, open(out, "wb") as f:
    f.write(r.read())
PY
fi
[[ -f "$sdist" ]] || die "$sdist not found"
got="$(sha256sum "$sdist" | cut -d' ' -f1)"
[[ "$got" == "$SDIST_SHA256" ]] || die "SHA-256 mismatch for $sdist: got $got, expected $SDIST_SHA256"

log "extracting cpp/, include/, picojson, dlpack's headers, LICENSE and NOTICE"
tar -xzf "$sdist" -C "$work" "$ROOT/cpp" "$ROOT/include" "$ROOT/3rdparty/picojson/picojson.h" \
  "$ROOT/3rdparty/dlpack/include" "$ROOT/LICENSE" "$ROOT/NOTICE" || die "cannot extract from $sdist"
out="$work/out"
mkdir -p "$out/3rdparty"
mv "$work/$ROOT/cpp" "$out/cpp"
rm -rf -- "$out/cpp/tvm_ffi" "$out/cpp/CMakeLists.txt"  # the Python bindings
mv "$work/$ROOT/include" "$out/include"
mv "$work/$ROOT/3rdparty/picojson" "$out/3rdparty/picojson"
mv "$work/$ROOT/3rdparty/dlpack" "$out/3rdparty/dlpack"
mv "$work/$ROOT/LICENSE" "$work/$ROOT/NOTICE" "$out/"
echo "$SDIST_SHA256" >"$out/STAMP"

rm -rf -- "$dest.old"
[[ -e "$dest" ]] && mv -- "$dest" "$dest.old"
mv -- "$out" "$dest" || die "cannot move the sources into $dest"
rm -rf -- "$dest.old"
log "saved $dest"
echo "$dest"
