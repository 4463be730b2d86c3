#!/usr/bin/env bash
# Builds the llama.cpp that kallpa's peer comparisons run against, from a pinned source: the
# llama-cpp-python 0.3.36 sdist on PyPI (its vendor/llama.cpp), checked by SHA-256, so every
# comparison in bench/results/ names one exact llama.cpp. Prints the folder of the built programs
# (llama-bench, llama-batched-bench, test-backend-ops, llama-simple, llama-completion, llama-server) on stdout;
# libllama.so and libggml*.so lie in the same folder.
#
#   bash bench/build_llama_cpp.sh                 # fetch (or reuse) the sdist, configure, build
#   bash bench/build_llama_cpp.sh --sdist FILE    # use a copy of the sdist already on disk
#   JOBS=2 NICE=10 bash bench/build_llama_cpp.sh  # parallel jobs (default 2), nice level (default 10)
#
# The build is Release with GGML_NATIVE=ON (this machine's instruction set, as a user's own build
# would be), shared libraries, llama.cpp's tests and tools, and no network code (no curl, no
# OpenSSL). Idempotent: the sdist is downloaded and unpacked once; CMake rebuilds only what changed.
#
# Environment: KALLPA_LLAMA_CPP_CACHE (default ${XDG_CACHE_HOME:-$HOME/.cache}/kallpa/llama.cpp),
# PYTHON (default python3, for `pip download`), JOBS, NICE.
set -euo pipefail

log() { echo "build_llama_cpp: $*" >&2; }
die() { echo "build_llama_cpp: error: $*" >&2; exit 1; }

version="0.3.36"
sdist_name="llama_cpp_python-${version}.tar.gz"
sdist_sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
targets=(llama-bench llama-batched-bench test-backend-ops llama-simple llama-completion llama llama-server)

sdist_arg=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --sdist) [[ $# -ge 2 ]] || die "--sdist needs a file"; sdist_arg="$2"; shift 2 ;;
    -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (try --help)" ;;
  esac
done

cache="${KALLPA_LLAMA_CPP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kallpa/llama.cpp}"
python="${PYTHON:-python3}"
jobs="${JOBS:-2}"
niceness="${NICE:-10}"
src_root="$cache/src-${version}"
src="$src_root/llama_cpp_python-${version}/vendor/llama.cpp"
build="$cache/build-${version}"

sha256_of() { sha256sum "$1" | cut -d' ' -f1; }

mkdir -p -- "$cache" || die "cannot create $cache"
sdist="$cache/$sdist_name"

if [[ ! -f "$sdist" ]] || [[ "$(sha256_of "$sdist")" != "$sdist_sha256" ]]; then
  rm -f -- "$sdist"
  if [[ -n "$sdist_arg" ]]; then
    [[ -f "$sdist_arg" ]] || die "no such file: $sdist_arg"
    cp -- "$sdist_arg" "$sdist.part"
  else
    log "downloading llama-cpp-python==${version} (sdist) from PyPI"
    dl="$(mktemp -d "$cache/.dl.XXXXXX")"
    trap 'rm -rf -- "$dl"' EXIT
    "$python" -m pip download --quiet --no-deps --no-binary :all: --dest "$dl" \
      "llama-cpp-python==${version}" || die "pip download failed"
    [[ -f "$dl/$sdist_name" ]] || die "pip did not produce $sdist_name"
    mv -- "$dl/$sdist_name" "$sdist.part"
  fi
  got="$(sha256_of "$sdist.part")"
  if [[ "$got" != "$sdist_sha256" ]]; then
    rm -f -- "$sdist.part"
    die "$sdist_name has SHA-256 $got, expected $sdist_sha256"
  fi
  mv -- "$sdist.part" "$sdist"
  rm -rf -- "$src_root"
fi

if [[ ! -f "$src/CMakeLists.txt" ]]; then
  log "unpacking $sdist_name"
  rm -rf -- "$src_root" "$src_root.part"
  mkdir -p -- "$src_root.part"
  tar xzf "$sdist" -C "$src_root.part"
  mv -- "$src_root.part" "$src_root"
  [[ -f "$src/CMakeLists.txt" ]] || die "the sdist has no vendor/llama.cpp"
fi

if [[ ! -f "$build/CMakeCache.txt" ]]; then
  log "configuring in $build"
  cmake -S "$src" -B "$build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON \
    -DBUILD_SHARED_LIBS=ON \
    -DLLAMA_BUILD_TESTS=ON \
    -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_EXAMPLES=ON \
    -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_CURL=OFF \
    -DGGML_CCACHE=OFF >&2 || die "cmake configure failed"
fi

log "building ${targets[*]} (-j${jobs}, nice ${niceness})"
nice -n "$niceness" cmake --build "$build" -j "$jobs" --target "${targets[@]}" >&2 ||
  die "cmake build failed"

bin="$build/bin"
for t in llama-bench llama-batched-bench test-backend-ops llama-simple; do
  [[ -x "$bin/$t" ]] || die "missing $bin/$t after the build"
done
echo "$bin"
