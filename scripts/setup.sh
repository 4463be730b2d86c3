#!/usr/bin/env bash
# Sets up kallpa on a fresh Debian 12 machine: installs the packages it needs (apt-get, only when
# something is missing), makes .venv with the Python packages the cross-check tests use, fetches
# the two default models (SmolLM2-135M-Instruct Q4_1 and Gemma-3-270M Q4_K_M, pinned SHA-256) into
# models/, fetches the jinja engine's sources (scripts/fetch_jinja.sh, pinned SHA-256) and the
# grammar engine's (scripts/fetch_xgrammar.sh, pinned SHA-256), the PJRT
# header and CPU plugins (scripts/fetch_pjrt.sh, pinned SHA-256) into a cache, builds Release into
# build/, installs the Python package (python/, `import kallpa`) into .venv from that build, and
# runs the main job: a greedy chat answer from the model.
# Idempotent: a second run installs nothing and rebuilds only what changed.
#
#   bash scripts/setup.sh            # install, build, run the demo
#   bash scripts/setup.sh --no-run   # install and build only
#
# Environment: KALLPA_JOBS (parallel build jobs, default 2), KALLPA_CMAKE_ARGS (extra configure
# arguments, e.g. "-DKALLPA_WERROR=ON"), KALLPA_WITH_LIBTPU=1 (also fetch libtpu; docs/tpu.md),
# KALLPA_NO_TORCH=1 (leave PyTorch out of .venv: about 5 GB; its Python tests then skip).
set -euo pipefail

# Debian packages the project uses. Later work appends to this list (and adds steps below, such as
# fetching a model); keep it the single place that names them.
KALLPA_APT_PACKAGES=(
  cmake g++ make pkg-config python3 python3-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev nlohmann-json3-dev libfmt-dev libspdlog-dev
  libhwy-dev libopenblas-dev libpcre2-dev libicu-dev
  python3-venv python3-pip
  libboost1.74-dev
  pocl-opencl-icd ocl-icd-opencl-dev opencl-headers opencl-clhpp-headers clinfo
  libopenmpi-dev openmpi-bin
)

run_main_job=1
for arg in "$@"; do
  case "$arg" in
    --no-run) run_main_job=0 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown argument '$arg' (try --help)" >&2; exit 2 ;;
  esac
done

cd "$(dirname "${BASH_SOURCE[0]}")/.."
jobs="${KALLPA_JOBS:-2}"

# 1. Packages: install only what is missing; `apt-get update` only when something is.
missing=()
for pkg in "${KALLPA_APT_PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$pkg")
  fi
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo=()
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || { echo "setup: need root or sudo to install ${missing[*]}" >&2; exit 1; }
    sudo=(sudo)
  fi
  "${sudo[@]}" apt-get update
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
else
  echo "setup: all ${#KALLPA_APT_PACKAGES[@]} packages present"
fi

# 2. Python packages for the tests' independent cross-checks, in the project's own venv (Debian's
#    system Python refuses global pip installs). Skipped when already satisfied.
python="${PYTHON:-python3}"
if [[ ! -x .venv/bin/python3 ]]; then
  "$python" -m venv .venv
fi
if ! .venv/bin/python3 -m pip install --disable-pip-version-check -q -r scripts/requirements.txt; then
  echo "setup: could not install scripts/requirements.txt; the Python cross-check tests will be skipped" >&2
fi
# PyTorch (the CUDA wheel PyPI serves; it runs on the CPU too) for the Python package's torch tests.
if [[ "${KALLPA_NO_TORCH:-0}" != 1 ]] &&
  ! .venv/bin/python3 -m pip install --disable-pip-version-check -q -r scripts/requirements-torch.txt; then
  echo "setup: could not install PyTorch; the Python package's torch tests will be skipped" >&2
fi

# 3. The default models (idempotent; verified by SHA-256).
bash scripts/fetch_model.sh --model smollm2 >/dev/null
bash scripts/fetch_model.sh --model gemma3-270m >/dev/null
bash scripts/fetch_model.sh --model minilm >/dev/null

# 3b. llama.cpp's Jinja engine for the chat templates GGUF files carry, into third_party/
#     (idempotent; pinned SHA-256; docs/chat-templates.md). The venv's Python downloads it: pip
#     reads the sdist's metadata with its build backend, scikit-build-core, which the venv has.
PYTHON=.venv/bin/python3 bash scripts/fetch_jinja.sh >/dev/null
# 3c. xgrammar's C++ core, the grammar engine of structured output, into third_party/ (idempotent;
#     pinned SHA-256; docs/structured-output.md).
PYTHON=.venv/bin/python3 bash scripts/fetch_xgrammar.sh >/dev/null

# 4. The PJRT C API header and two XLA CPU plugins (API 0.115 and 0.81) for the pjrt backend and
#    its tests, into a cache outside the repo (idempotent; pinned SHA-256); with
#    KALLPA_WITH_LIBTPU=1 also libtpu (Google Cloud terms), for the ahead-of-time TPU compile tests.
if [[ "${KALLPA_WITH_LIBTPU:-0}" == 1 ]]; then
  bash scripts/fetch_pjrt.sh --tpu >/dev/null
else
  bash scripts/fetch_pjrt.sh >/dev/null
fi

# 5. Build (Release, incremental).
# shellcheck disable=SC2086  # KALLPA_CMAKE_ARGS is a list of arguments on purpose
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release ${KALLPA_CMAKE_ARGS:-}
cmake --build build -j"$jobs"

# 6. The Python package into .venv (docs/python.md), from the tree just built: scikit-build-core
#    reuses build/ (its generator, no build isolation), so nothing is compiled twice. The module is
#    built when .venv has nanobind (CMake's KALLPA_BUILD_PYTHON=AUTO). scikit-build-core's configure
#    points CMAKE_INSTALL_PREFIX at its staging folder; step 5's configure then runs again to give
#    the tree its own back.
if compgen -G "build/python/kallpa/_kallpa*.so" >/dev/null; then
  cache_value() { sed -n "s/^$1:[A-Z]*=//p" build/CMakeCache.txt; }
  generator=$(cache_value CMAKE_GENERATOR)
  CMAKE_GENERATOR="$generator" CMAKE_BUILD_PARALLEL_LEVEL="$jobs" .venv/bin/python3 -m pip install \
    --disable-pip-version-check -q --no-build-isolation --no-deps -C build-dir="$PWD/build" \
    -C cmake.define.KALLPA_BUILD_PYTHON=AUTO ./python
  # shellcheck disable=SC2086  # KALLPA_CMAKE_ARGS is a list of arguments on purpose
  cmake -S . -B build -U CMAKE_INSTALL_PREFIX -DCMAKE_BUILD_TYPE=Release ${KALLPA_CMAKE_ARGS:-} >/dev/null
  .venv/bin/python3 -c "import kallpa"
  echo "setup: the Python package is installed in .venv (import kallpa)"
else
  echo "setup: the Python package was not built (no nanobind in .venv); 'import kallpa' will not work" >&2
fi

# 7. The main job.
if ((run_main_job)); then
  echo
  build/tools/kallpa/kallpa generate --chat -p "What is the capital of France?" --temp 0 -n 64
fi
