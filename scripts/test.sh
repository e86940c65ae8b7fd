#!/usr/bin/env bash
# Builds and tests everything, as CI does:
#   1. scripts/setup.sh (system packages, .venv, the model), then scripts/setup.sh --with-torch
#      (the integrations' pinned packages: torch CPU, transformers, gguf, kvpress) in the
#      background while step 2 compiles
#   2. Release build in build/ (CUDA on when nvcc is found) and every ctest
#   3. the Python package: pip install into .venv (build dir build-python/), then pytest
#      (python/tests; then tests/cli on step 2's command-line tool, with the binding comparisons)
#      while step 4's build compiles in the background
#   4. ASan + UBSan build (clang, RelWithDebInfo, CPU only, no C++ examples) in build-asan/ and
#      the ctests except the slow, sanitizer-neutral ones (labels packaging, compile_fail)
#   5. ThreadSanitizer (scripts/tsan.sh) and fuzzing, every libFuzzer target for 30 s
#      (scripts/fuzz.sh); both need clang and are reported NOT RUN without it. The fuzz targets
#      are built by step 4 (KVPOLICY_FUZZ=ON: they link the sanitizer build's own engine and C
#      ABI, compiled once for both), or in build-fuzz/ when the sanitizer build is not clang's
# Build directories persist and ccache is used, so re-runs are incremental. Exits non-zero if
# any step fails; the last line is a summary.
# Environment: KVPOLICY_BUILD_DIR, KVPOLICY_ASAN_BUILD_DIR (build directories), KVPOLICY_JOBS
# (default: nproc), KVPOLICY_ASAN_OPT_FLAGS (default "-O1 -g1"), CXX_ASAN / CC_ASAN
# (the sanitizer build's compilers, default clang++ / clang), CCACHE_DIR (default:
# $HOME/.cache/ccache), KVPOLICY_FUZZ_SECONDS (per fuzz target, default 30).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

BUILD_DIR=${KVPOLICY_BUILD_DIR:-build}
ASAN_DIR=${KVPOLICY_ASAN_BUILD_DIR:-build-asan}
JOBS=${KVPOLICY_JOBS:-$(nproc)}
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/ccache}
# Paths relative to the checkout, so a fresh clone elsewhere (CI) reuses cached objects.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
# Idle OpenMP threads yield instead of spinning (busy 2-core CI machines: 20-40x slower otherwise).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
T0=$SECONDS

log() { echo "test.sh: $*"; }

# The system packages, .venv with numpy/pytest/the build requirements, and the model first. The
# integrations' pinned packages (torch, transformers, kvpress: about 4 GB of wheels, mostly
# download time on a fresh machine) then install in the background while the release build
# compiles; nothing runs the venv's python until the wait before the release tests.
LOG_DIR=$(mktemp -d)
torch_pid=""
asan_pid=""
# The background jobs run in sessions of their own (setsid): on an early exit the trap stops them
# with everything they started (pip, ninja, the compilers).
trap 'for p in $torch_pid $asan_pid; do kill -- "-$p" 2>/dev/null || kill "$p" 2>/dev/null || true; done; rm -rf "$LOG_DIR"' EXIT
bash scripts/setup.sh
TORCH_LOG=$LOG_DIR/setup-torch.log
setsid -w bash scripts/setup.sh --with-torch >"$TORCH_LOG" 2>&1 &
torch_pid=$!
torch_t0=$SECONDS
log "installing the integrations' packages in the background (scripts/setup.sh --with-torch)"

# -Werror on the project's own targets (dependencies are -isystem): a new warning fails CI.
# The command-line tool's tests (ctest cli.compress) run with the venv's python (numpy, pytest).
common=(-G Ninja -DKVPOLICY_WERROR=ON "-DKVPOLICY_TEST_PYTHON=$PWD/.venv/bin/python")
have_ccache=0
if command -v ccache >/dev/null 2>&1; then
  have_ccache=1
  common+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  log "ccache in ${CCACHE_DIR}"
fi

nvcc=$(command -v nvcc || true)
if [[ -z $nvcc && -x /usr/local/cuda/bin/nvcc ]]; then nvcc=/usr/local/cuda/bin/nvcc; fi
if [[ -n $nvcc ]]; then
  cuda=(-DKVPOLICY_CUDA=ON "-DCMAKE_CUDA_COMPILER=$nvcc")
  ((have_ccache)) && cuda+=(-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  log "CUDA on ($nvcc)"
else
  cuda=(-DKVPOLICY_CUDA=OFF)
  log "CUDA off (no nvcc)"
fi

failed=()
summary=()
# wait_torch: waits for the background `setup.sh --with-torch`, once; a failure is a failed stage.
torch_waited=0
wait_torch() {
  ((torch_waited)) && return 0
  torch_waited=1
  local rc=0
  wait "$torch_pid" || rc=$?
  if ((rc == 0)); then
    log "integrations' packages installed ($((SECONDS - torch_t0))s after the start)"
    summary+=("setup-torch $((SECONDS - torch_t0))s")
  else
    cat "$TORCH_LOG"
    log "=== setup-torch FAILED (exit ${rc})"
    summary+=("setup-torch FAILED")
    failed+=("setup-torch")
  fi
  torch_pid=""
}
skips=()  # "stage: what (why)" for everything that did not run: a skip is not a pass
# logged NAME CMD...: runs CMD with its output shown and kept in $LOG_DIR/NAME.log.
logged() {
  local name=$1
  shift
  bash -c '"$@" 2>&1 | tee "$0"; exit "${PIPESTATUS[0]}"' "$LOG_DIR/$name.log" "$@"
}
# note_skips NAME: adds the tests that ctest or pytest skipped in stage NAME to `skips`.
note_skips() {
  local name=$1 t
  [[ -f $LOG_DIR/$name.log ]] || return 0
  # ctest lists them under "The following tests did not run:" as "  308 - gpu.all (Skipped)".
  while read -r t; do
    case $t in
      gpu.*) skips+=("${name}: ${t} (no GPU)") ;;
      *) skips+=("${name}: ${t}") ;;
    esac
  done < <(sed -n 's/^[[:space:]]*[0-9]* - \(.*\) (Skipped)$/\1/p' "$LOG_DIR/$name.log")
  # pytest -rs: "SKIPPED [1] python/tests/test_kvpress.py:20: could not import 'torch': ..."
  while read -r t; do
    skips+=("${name}: ${t}")
  done < <(sed -n 's/^SKIPPED \[[0-9]*\] //p' "$LOG_DIR/$name.log")
}
not_run=()
# stage NAME CMD...: runs one step, records its time; a failure is recorded, not fatal.
stage() {
  local name=$1 t=$SECONDS rc=0
  shift
  log "=== ${name}: $*"
  "$@" || rc=$?
  if ((rc == 0)); then
    summary+=("${name} $((SECONDS - t))s")
  else
    summary+=("${name} FAILED")
    failed+=("$name")
    log "=== ${name} FAILED (exit ${rc})"
  fi
  return "$rc"
}

# 1. Release build, all tests. Position-independent static libraries (executables stay PIE, as
# GCC builds them by default here): the Python module of step 2 links the engine, the Policy
# instances and the profile reader as PIC, so their objects are then the same compilation as
# here and ccache hands them over instead of compiling them again.
if stage release-configure cmake -S . -B "$BUILD_DIR" "${common[@]}" "${cuda[@]}" \
     -DCMAKE_BUILD_TYPE=Release -DKVPOLICY_SANITIZE=OFF -DCMAKE_POSITION_INDEPENDENT_CODE=ON &&
   stage release-build cmake --build "$BUILD_DIR" -j "$JOBS"; then
  wait_torch
  stage release-ctest logged release-ctest ctest --test-dir "$BUILD_DIR" --output-on-failure \
    --no-tests=error -j "$JOBS" || true
  note_skips release-ctest
fi

wait_torch  # (when the release build failed)

# 2. Python package: build the extension (build-python/, ccache) into .venv, which setup.sh made
# with the build requirements. Its tests run in step 3, beside the sanitizer build. The build
# folder sits at the same depth as step 1's (not pyproject's build-python/<wheel tag>) and uses
# step 1's compiler (by the same path: ccache keys on it; left alone, scikit-build-core takes
# Python's configured g++), so that with CCACHE_BASEDIR the library units both builds compile
# alike are one ccache entry.
py_ok=0
py_cxx=()
rel_cxx=$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$BUILD_DIR/CMakeCache.txt" 2>/dev/null || true)
[[ -n $rel_cxx ]] && py_cxx=("--config-settings=cmake.define.CMAKE_CXX_COMPILER=$rel_cxx")
stage python-install env CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
  .venv/bin/python -m pip install --no-build-isolation --disable-pip-version-check \
  --config-settings=build-dir=build-python "${py_cxx[@]}" \
  --config-settings=cmake.define.KVPOLICY_WERROR=ON . && py_ok=1

# 3. Sanitizer build, compiled in the background (its output in a log, shown when it fails)
# while the Python tests run: those leave a core idle much of the time (Python-bound), and a
# fresh machine's compile fills it. LeakSanitizer needs ptrace, which some containers forbid:
# probe it. The sanitizer build uses clang (GCC builds the release one, so CI compiles the
# project with both): clang compiles the instrumented units about 15% faster than GCC 12 (test
# batch tests_7.cpp: 93 s against 110 s). Without a clang that links ASan + UBSan programs
# (Debian: clang and libclang-rt-14-dev), GCC.
asan_cxx=${CXX_ASAN:-clang++}
asan_cc=${CC_ASAN:-$([[ $asan_cxx == *clang* ]] && echo "${asan_cxx/clang++/clang}" || echo cc)}
links_sanitized() {  # links_sanitized COMPILER LANG
  command -v "$1" >/dev/null 2>&1 || return 1
  mkdir -p "$ASAN_DIR"
  printf 'int main(void) { return 0; }\n' |
    "$1" -x "$2" -fsanitize=address,undefined - -o "$ASAN_DIR/sanitizer_link_probe" >/dev/null 2>&1
}
if ! links_sanitized "$asan_cxx" c++ || ! links_sanitized "$asan_cc" c; then
  log "$asan_cxx/$asan_cc cannot link ASan + UBSan programs: the sanitizer build uses c++/cc"
  asan_cxx=c++ asan_cc=cc
fi
# A build directory configured with another compiler is started afresh (CMake cannot switch).
if [[ -f $ASAN_DIR/CMakeCache.txt ]] &&
   ! grep -qx "CMAKE_CXX_COMPILER:[A-Z]*=$(command -v "$asan_cxx")" "$ASAN_DIR/CMakeCache.txt"; then
  log "$ASAN_DIR was configured with another compiler: removing it"
  rm -rf "$ASAN_DIR"
fi
probe_lsan() {
  mkdir -p "$ASAN_DIR"
  local src="$ASAN_DIR/lsan_probe.cpp" exe="$ASAN_DIR/lsan_probe"
  printf '#include <vector>\nint main() { std::vector<int> v(8); return v[0]; }\n' >"$src"
  "$asan_cxx" -fsanitize=address -g "$src" -o "$exe" >/dev/null 2>&1 &&
    ASAN_OPTIONS=detect_leaks=1 "$exe" >/dev/null 2>&1
}
if probe_lsan; then
  leaks=1
  log "LeakSanitizer works here: detect_leaks=1"
else
  leaks=0
  log "LeakSanitizer does not work here (no ptrace?): detect_leaks=0"
fi

# Set before the build: it runs the instrumented test program to list its tests (Python ignores
# these).
export ASAN_OPTIONS="detect_leaks=${leaks}:check_initialization_order=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"

# -O1 -g1 instead of RelWithDebInfo's -O2 -g: instrumented template-heavy code compiles about
# 2.4x faster, and reports still carry function names and file:line. No -DNDEBUG: Eigen's own
# index and size assertions stay on under the sanitizers (and in the fuzz targets built here).
asan_opt=${KVPOLICY_ASAN_OPT_FLAGS:--O1 -g1}
# The fuzz targets (fuzz/) join the sanitizer build when it is clang's: they link its engine and C
# ABI, which are then compiled once for the sanitizer tests and the fuzzers (step 5).
asan_fuzz=OFF
[[ $asan_cxx == *clang* ]] && asan_fuzz=ON
asan_pid=""
if stage asan-configure cmake -S . -B "$ASAN_DIR" "${common[@]}" -DKVPOLICY_CUDA=OFF \
     "-DCMAKE_CXX_COMPILER=$(command -v "$asan_cxx")" "-DCMAKE_C_COMPILER=$(command -v "$asan_cc")" \
     -DKVPOLICY_BUILD_EXAMPLES=OFF \
     -DKVPOLICY_SANITIZE=ON "-DKVPOLICY_FUZZ=${asan_fuzz}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
     "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=${asan_opt}" -DKVPOLICY_BUILD_BENCHMARKS=OFF; then
  log "=== asan-build (in the background, beside the Python tests): cmake --build $ASAN_DIR -j $JOBS"
  setsid -w cmake --build "$ASAN_DIR" -j "$JOBS" >"$LOG_DIR/asan-build.log" 2>&1 &
  asan_pid=$!
  asan_t0=$SECONDS
fi

# The pytest tests (python/tests), then tests/cli again on the Release build's command-line
# tool, now with its comparisons against the freshly installed binding (marker `binding`; the
# ctest cli.compress, which runs before the install, deselects them). A pytest run of its own:
# both folders have a conftest.py, which one pytest process cannot import side by side.
if ((py_ok)); then
  stage python-pytest logged python-pytest .venv/bin/python -m pytest python/tests -q -rs || true
  note_skips python-pytest
  stage cli-pytest logged cli-pytest \
    env KVPOLICY_CLI="$(realpath -m "$BUILD_DIR/src/cli/kvpolicy")" \
    .venv/bin/python -m pytest tests/cli -q -rs || true
  note_skips cli-pytest
fi

if [[ -n $asan_pid ]]; then
  rc=0
  wait "$asan_pid" || rc=$?
  asan_pid=""
  if ((rc == 0)); then
    tail -n 2 "$LOG_DIR/asan-build.log"
    log "=== asan-build done, $((SECONDS - asan_t0))s after it started"
    summary+=("asan-build $((SECONDS - asan_t0))s (beside the Python tests)")
    stage asan-ctest logged asan-ctest ctest --test-dir "$ASAN_DIR" --output-on-failure \
      --no-tests=error -j "$JOBS" -LE 'packaging|compile_fail' || true
    note_skips asan-ctest
  else
    cat "$LOG_DIR/asan-build.log"
    log "=== asan-build FAILED (exit ${rc})"
    summary+=("asan-build FAILED")
    failed+=("asan-build")
  fi
fi

# 4. ThreadSanitizer: a small executable (the stress test and the C ABI), not the whole suite.
if command -v "${CXX_TSAN:-clang++}" >/dev/null 2>&1; then
  stage tsan bash scripts/tsan.sh || true
else
  log "=== tsan NOT RUN: ${CXX_TSAN:-clang++} not found (scripts/tsan.sh needs clang)"
  not_run+=("tsan")
fi

# 5. Fuzzing: each libFuzzer target on a copy of its seeds (fuzz/seeds/), built by the sanitizer
# build (step 3) when it has them (its engine and C ABI are the fuzzers'), else by fuzz.sh in
# build-fuzz/. Crash inputs: $ASAN_DIR/artifacts/<target>/ (or build-fuzz/artifacts/).
fuzz_env=(CXX="${CXX_FUZZ:-clang++}")
[[ $asan_fuzz == ON && -f $ASAN_DIR/CMakeCache.txt ]] && fuzz_env+=(KVPOLICY_FUZZ_BUILD_DIR="$ASAN_DIR")
if command -v "${CXX_FUZZ:-clang++}" >/dev/null 2>&1; then
  stage fuzz env "${fuzz_env[@]}" bash scripts/fuzz.sh "${KVPOLICY_FUZZ_SECONDS:-30}" || true
else
  log "=== fuzz NOT RUN: ${CXX_FUZZ:-clang++} not found (scripts/fuzz.sh needs clang)"
  not_run+=("fuzz")
fi

total=$((SECONDS - T0))
skipped=""
((${#not_run[@]})) && skipped=" | NOT RUN: ${not_run[*]}"
if ((${#skips[@]})); then
  log "skipped, not counted as passed:"
  for t in "${skips[@]}"; do log "  ${t}"; done
  skipped+=" | skipped: ${#skips[@]} (listed above)"
fi
if ((${#failed[@]})); then
  log "FAILED: ${failed[*]} | $(IFS=,; echo "${summary[*]}")${skipped} | total ${total}s"
  exit 1
fi
log "PASSED | $(IFS=,; echo "${summary[*]}")${skipped} | total ${total}s"
