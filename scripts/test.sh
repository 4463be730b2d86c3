#!/usr/bin/env bash
# Builds kallpa (Release, build/, incremental) and runs every test, the Python package's pytest suite
# (python/tests, against build/python) included; exits non-zero on any failure.
#
#   bash scripts/test.sh                 # all tests
#   bash scripts/test.sh --sanitize      # also build build-san (ASan + UBSan; no CUDA, benchmarks or
#                                        # lab) and run the tests and `kallpa conformance --quick`
#                                        # (every CPU backend) there; CI runs this
#   bash scripts/test.sh --tsan          # also build build-tsan (ThreadSanitizer) and run the tests
#                                        # that start threads (pool, engine, scheduler, decode, server,
#                                        # the scheduler fuzz corpus)
#   bash scripts/test.sh -- -R cli       # extra arguments after -- go to ctest
#
# Environment: KALLPA_JOBS (default 2), KALLPA_CMAKE_ARGS (extra configure arguments, every tree;
# the sanitizer trees still leave CUDA, benchmarks and the lab out), KALLPA_TEST_SANITIZE=1 (same as
# --sanitize), KALLPA_TEST_TSAN=1 (same as --tsan).
# The last line is a ctest-style summary over every run: "100% tests passed, 0 tests failed out of N".
set -euo pipefail

sanitize="${KALLPA_TEST_SANITIZE:-0}"
tsan="${KALLPA_TEST_TSAN:-0}"
ctest_args=()
while (($#)); do
  case "$1" in
    --sanitize) sanitize=1 ;;
    --tsan) tsan=1 ;;
    --) shift; ctest_args=("$@"); break ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "test.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
  shift
done

cd "$(dirname "${BASH_SOURCE[0]}")/.."
jobs="${KALLPA_JOBS:-2}"

total=0  # tests run, over every tree; a failure ends the script before the summary
log=$(mktemp)
trap 'rm -f "$log"' EXIT

build_and_test() {  # build_and_test DIR BUILD_TYPE [configure arguments...]
  local dir=$1 type=$2 start=$SECONDS
  shift 2
  echo "== $type build in $dir"
  # Arguments given here come after KALLPA_CMAKE_ARGS, so a tree's own settings win.
  # shellcheck disable=SC2086  # KALLPA_CMAKE_ARGS is a list of arguments on purpose
  cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE="$type" ${KALLPA_CMAKE_ARGS:-} "$@"
  cmake --build "$dir" -j"$jobs"
  echo "== $type build took $((SECONDS - start)) s; testing"
  start=$SECONDS
  ctest --test-dir "$dir" -j"$jobs" --output-on-failure "${ctest_args[@]}" "${tree_ctest_args[@]}" | tee "$log"
  count_ctest "$log"
  echo "== $type tests took $((SECONDS - start)) s"
}

count_ctest() {  # adds ctest's "N% tests passed, F tests failed out of T" line to the totals
  local line
  line=$(grep -E '^[0-9]+% tests passed, [0-9]+ tests failed out of [0-9]+' "$1" | tail -n 1) || true
  [[ -n $line ]] || return 0
  total=$((total + ${line##* out of }))
}

# The Python package's tests, against the module and Python files in build/python (the tree just
# built, not whatever is installed in .venv). Skipped, saying so, when the module was not built.
python_tests() {
  local start=$SECONDS line
  if ! compgen -G "build/python/kallpa/_kallpa*.so" >/dev/null; then
    echo "== pytest skipped: the Python package was not built (no nanobind in .venv; see scripts/setup.sh)"
    return 0
  fi
  echo "== pytest python/tests"
  PYTHONPATH="$PWD/build/python" .venv/bin/python3 -m pytest -q -p no:cacheprovider python/tests | tee "$log"
  line=$(grep -E '^[0-9]+ passed' "$log" | tail -n 1) || true
  [[ -z $line ]] || total=$((total + ${line%% passed*}))
  echo "== pytest took $((SECONDS - start)) s"
}

# The sanitizer trees: no CUDA (its tests need a GPU), no benchmarks and no lab (the Release tree
# compiles those), and no -Werror: at -O1 GCC 12 warns inside its own AVX-512 intrinsics
# (`-Wuninitialized` on _mm512_unpacklo_epi32), which the Release tree does not see.
sanitizer_tree_args=(-DKALLPA_WITH_CUDA=OFF -DKALLPA_BUILD_BENCH=OFF -DKALLPA_BUILD_LAB=OFF -DKALLPA_WERROR=OFF)

tree_ctest_args=()
build_and_test build Release
if ((${#ctest_args[@]} == 0)); then
  python_tests
fi
if [[ $sanitize == 1 ]]; then
  # intercept_tls_get_addr=0: GCC 12's LeakSanitizer reads the dynamic TLS blocks of dlopen'ed
  # libraries (PoCL's) through a table it cannot always parse, and its tracer then dies with
  # SIGSEGV at exit ("Tracer caught signal 11") after a passing test; static TLS is still scanned.
  export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:intercept_tls_get_addr=0}"
  export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
  # Leaks inside third-party PJRT plugins are theirs (tests/sanitizers/lsan.supp says which).
  export LSAN_OPTIONS="${LSAN_OPTIONS:-suppressions=$PWD/tests/sanitizers/lsan.supp}"
  # The plugin's first contact (a child process loading XLA's CPU plugin) is several times slower
  # under ASan than the production deadline allows for on a busy 2-core machine.
  export KALLPA_PJRT_PROBE_TIMEOUT="${KALLPA_PJRT_PROBE_TIMEOUT:-600}"
  # Left to the Release tree: the benchmark smoke tests; the multi-rank MPI runs of the real
  # model and of the 4-rank conformance (OpenMPI's runtime under ASan is slow and its leaks are its
  # own; the ring's arithmetic and the context-parallel engine run here in process, RingBlocks.* and
  # ContextParallel.*, and the 2-rank ring tests still run under mpirun); the conformance matrix
  # through XLA's CPU plugins (its time is XLA compiling each shape, not kallpa's code, which the
  # other pjrt.* tests run here); cpu-flash's default tier, whose quick tier runs below; and the
  # real model's seeded texts batched against alone (server.batching_real_model: thousands of the
  # real model's tokens take minutes under ASan, and the invariance it checks is cpu-flash's and
  # the scheduler's, which CpuFlash.BatchInvariant and Scheduler.* check here); the openai client
  # over every parameter and the structured-output answers, each ~100 real-model requests (about
  # 4 minutes apiece under ASan; the server's parsing, streaming and error paths run here in
  # server.api, server.transport and server.real_model); and the TPU ahead-of-time compiles
  # (pjrt.tpu_aot.*: libtpu's compiler, not kallpa's code).
  if ((${#ctest_args[@]} == 0)); then
    tree_ctest_args=(-E '^(bench\.|ring\.(cp_generate_np[24]|conformance_np4)$|pjrt\.conformance_quick\.|pjrt\.tpu_aot\.|conformance\.full\.|server\.(batching_real_model|openai_compat|structured_output)$)')
  fi
  build_and_test build-san Sanitize "${sanitizer_tree_args[@]}"
  tree_ctest_args=()
  # The conformance suite's quick matrix on every backend this tree registers (reference,
  # cpu-flash, cpu-gemm, and opencl-flash where an OpenCL device is found), under the sanitizers.
  echo "== conformance --quick under ASan + UBSan"
  start=$SECONDS
  build-san/tools/kallpa/kallpa conformance --quick
  total=$((total + 1))
  echo "== conformance took $((SECONDS - start)) s"
fi
if [[ $tsan == 1 ]]; then
  # The tests that start threads; the conformance matrix and OpenCL run single calls (and PoCL's
  # own threads are not instrumented). OpenBLAS's threads are not instrumented either, so it runs
  # on the caller's. A race ends the process (exit 66), which fails its test.
  export OPENBLAS_NUM_THREADS=1
  export TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}"
  if ((${#ctest_args[@]} == 0)); then
    ctest_args=(-R '^(ThreadPool|Scheduler|Engine|EngineRealModel|KvCache|Sampler|QuantKernels|Dispatcher|HealthCheck|FaultTolerance|Plugin)\.|^CpuFlash\.(DecodeSplitKv|DecodeV8MatchesReference|ThreadCountIndependent|ConcurrentRuns)$|^server\.(api|batching|lifecycle)$|^fuzz\.scheduler$')
  fi
  build_and_test build-tsan ThreadSanitize "${sanitizer_tree_args[@]}"
fi
echo "== all tests passed"
echo "100% tests passed, 0 tests failed out of $total"
