#!/usr/bin/env bash
# One command for a machine with a GPU: configure and build kvpolicy with CUDA (Release), or take
# programs built elsewhere (--prebuilt), then run every CPU-vs-CUDA agreement case ([gpu]: among
# them the spec-string device pipeline, the C ABI's and the tensor-parallel runs) one process
# each, the CUDA benchmarks, python/tests/test_device.py (--prebuilt with a Python package) and
# compute-sanitizer. Prints what it ran and a summary; exits non-zero if a step failed or the GPU
# cases were skipped.
#
#   scripts/device_check.sh                 # on the GPU machine, from the repository root
#   scripts/device_check.sh --fetch-debs    # on a networked dev machine, beforehand (see below)
#   scripts/device_check.sh --bundle DIR [--python PY]   # on the dev machine: build, then copy
#                                           # the programs and their non-system libraries to DIR
#   scripts/device_check.sh --prebuilt DIR  # on the GPU machine: run DIR's programs, build nothing
#
# Device time is scarce and a GPU machine may have no compilers' dependencies (Eigen, Catch2):
# --bundle builds on the dev machine (BUILD_DIR, CUDA archs 80;90 as in CI, so ccache serves it)
# and packs into DIR/bundle.tar.xz: bin/ (the test and benchmark programs, stripped), lib/ (their
# libraries that are not glibc's or the compiler's) and, with --python PY, python/ (the kvpolicy
# package with _core built for PY: pass the GPU machine's Python version, e.g. a pyenv 3.12).
# Carry DIR (it must stay under the device tool's 64 MiB with the tree) and run --prebuilt there,
# which unpacks it. The programs need the GPU machine's glibc and libstdc++ to be as new as the
# dev machine's.
#
# Environment: BUILD_DIR (default build-device), PY_BUILD_DIR (--python: default $BUILD_DIR-py),
# CASE_TIMEOUT, BENCH_TIMEOUT, PY_TIMEOUT, SANITIZER_TIMEOUT (seconds; 0: no compute-sanitizer),
# SANITIZER_TOOLS (default memcheck), CUDA_ARCHS (default "native": only the GPU
# present, which keeps nvcc time down), JOBS (default nproc), OUT (if set, logs are copied there).
#
# Offline GPU machines: scripts/setup.sh installs the apt packages when it can reach a mirror. If
# it cannot, run `scripts/device_check.sh --fetch-debs` on a machine that can; it downloads the
# .deb files into .device-debs/ (add `/.device-debs/` to .git/info/exclude and carry that
# folder), and this script unpacks them with dpkg -x before configuring.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
BUILD_DIR=${BUILD_DIR:-build-device}
CUDA_ARCHS=${CUDA_ARCHS:-native}
JOBS=${JOBS:-$(nproc)}
DEBS_DIR=.device-debs
# Header-only and library packages the build needs (apt names, Debian 12).
DEB_PACKAGES=(libeigen3-dev catch2 libbenchmark-dev libbenchmark1debian xtl-dev libxtensor-dev)

log() { echo "device_check: $*"; }
declare -a SUMMARY=()
STATUS=0
record() {  # record <name> <rc>
  if [[ $2 -eq 0 ]]; then SUMMARY+=("PASS  $1"); else SUMMARY+=("FAIL  $1 (rc=$2)"); STATUS=1; fi
}
finish() {
  echo
  log "summary"
  for s in "${SUMMARY[@]}"; do echo "  $s"; done
  if [[ -n ${OUT:-} && -d ${OUT:-} ]]; then
    for f in "${LOGS[@]}"; do [[ -f $f ]] && cp -f "$f" "$OUT"/; done
    printf '%s\n' "${SUMMARY[@]}" >"$OUT/device_check_summary.txt"
  fi
  exit "$STATUS"
}

MODE=build
PREBUILT=""
BUNDLE_PY=""
case ${1:-} in
  --bundle | --prebuilt)
    [[ -n ${2:-} ]] || { log "$1 needs a directory"; exit 2; }
    MODE=${1#--}; PREBUILT=${2%/}
    if [[ ${3:-} == --python ]]; then
      [[ $MODE == bundle && -n ${4:-} ]] || { log "--python PY goes with --bundle"; exit 2; }
      BUNDLE_PY=$4
    fi ;;
  --fetch-debs | "") ;;
  *) log "unknown option '$1' (valid: --fetch-debs, --bundle DIR [--python PY], --prebuilt DIR)"; exit 2 ;;
esac

if [[ ${1:-} == --fetch-debs ]]; then
  mkdir -p "$DEBS_DIR"
  (cd "$DEBS_DIR" && apt-get download "${DEB_PACKAGES[@]}") || { log "apt-get download failed"; exit 1; }
  log "downloaded into $DEBS_DIR/:" "$DEBS_DIR"/*.deb
  log "add '/$DEBS_DIR/' to .git/info/exclude and carry '$DEBS_DIR' to the GPU machine"
  exit 0
fi

export PATH="/usr/local/cuda/bin:$PATH"
LOGS=()  # logs to copy to $OUT

# ---- bundle (dev machine): build, then copy programs and libraries ------------------------------
if [[ $MODE == bundle ]]; then
  generator=()
  command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
  launcher=()
  command -v ccache >/dev/null 2>&1 && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  if [[ -z $PREBUILT || ( -e $PREBUILT && -n $(ls -A "$PREBUILT" 2>/dev/null) && ! -f $PREBUILT/bundle.tar.xz
        && ! -f $PREBUILT/bin/kvpolicy_tests ) ]]; then
    log "$PREBUILT exists and is not a bundle: refusing to replace it"; exit 2
  fi
  mkdir -p "$BUILD_DIR"
  cmake -S . -B "$BUILD_DIR" "${generator[@]}" "${launcher[@]}" -DCMAKE_BUILD_TYPE=Release -DKVPOLICY_CUDA=ON \
    -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" -DKVPOLICY_CUDA_ARCHITECTURES="80;90" \
    -DKVPOLICY_BUILD_TESTS=ON -DKVPOLICY_BUILD_BENCHMARKS=ON \
    >"$BUILD_DIR/device_check_configure.log" 2>&1 \
    || { log "configure failed: $BUILD_DIR/device_check_configure.log"; exit 1; }
  cmake --build "$BUILD_DIR" -j "$JOBS" --target kvpolicy_tests kvpolicy_bench || exit 1
  programs=("$BUILD_DIR/tests/kvpolicy_tests" "$BUILD_DIR/benchmarks/kvpolicy_bench")
  rm -rf "$PREBUILT" && mkdir -p "$PREBUILT/bin" "$PREBUILT/lib"
  if [[ -n $BUNDLE_PY ]]; then
    PY_BUILD_DIR=${PY_BUILD_DIR:-$BUILD_DIR-py}
    pyb=$("$BUNDLE_PY" -m pybind11 --cmakedir 2>/dev/null || .venv/bin/python -m pybind11 --cmakedir) \
      || { log "pybind11 not found (for $BUNDLE_PY or in .venv)"; exit 1; }
    mkdir -p "$PY_BUILD_DIR"
    cmake -S . -B "$PY_BUILD_DIR" "${generator[@]}" "${launcher[@]}" -DCMAKE_BUILD_TYPE=Release \
      -DKVPOLICY_PYTHON=ON -DKVPOLICY_BUILD_TESTS=OFF -DKVPOLICY_BUILD_BENCHMARKS=OFF \
      -DKVPOLICY_BUILD_CLI=OFF -DKVPOLICY_BUILD_EXAMPLES=OFF -DKVPOLICY_INSTALL=OFF -DKVPOLICY_CUDA=ON \
      -DKVPOLICY_CUDA_ARCHITECTURES="80;90" \
      -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" -DPython_EXECUTABLE="$BUNDLE_PY" -Dpybind11_DIR="$pyb" \
      >"$PY_BUILD_DIR/device_check_configure.log" 2>&1 \
      || { log "configure failed: $PY_BUILD_DIR/device_check_configure.log"; exit 1; }
    cmake --build "$PY_BUILD_DIR" -j "$JOBS" --target _core || exit 1
    mkdir -p "$PREBUILT/python/kvpolicy"
    cp python/kvpolicy/*.py "$PREBUILT/python/kvpolicy/"
    core=$(find "$PY_BUILD_DIR/python" -maxdepth 1 -name '_core*.so' | head -1)
    [[ -n $core ]] || { log "no _core module in $PY_BUILD_DIR/python"; exit 1; }
    cp "$core" "$PREBUILT/python/kvpolicy/" && strip "$PREBUILT/python/kvpolicy/$(basename "$core")"
    programs+=("$core")
  fi
  for p in "${programs[@]:0:2}"; do cp "$p" "$PREBUILT/bin/" && strip "$PREBUILT/bin/$(basename "$p")"; done
  # Libraries outside glibc, libgcc and libstdc++ (the GPU machine's own, newer ones serve those).
  ldd "${programs[@]}" | awk '/=> \//{print $3}' | sort -u | while read -r lib; do
    case $(basename "$lib") in
      libc.so* | libm.so* | libdl.so* | libpthread.so* | librt.so* | libgcc_s.so* | libstdc++.so* | ld-linux*) ;;
      *) cp -L "$lib" "$PREBUILT/lib/" ;;
    esac
  done
  log "bundle in $PREBUILT ($(du -sh "$PREBUILT" | cut -f1)):"
  find "$PREBUILT" -type f | sort | sed 's/^/  /'
  # Packed (xz: about a fifth of the size), so that it travels under the 64 MiB; --prebuilt
  # unpacks it with Python's tarfile (no xz program needed there).
  tar -C "$PREBUILT" -cf - bin lib $( [[ -d $PREBUILT/python ]] && echo python) | xz -T"$JOBS" -6 >"$PREBUILT.tar.xz" \
    && rm -rf "$PREBUILT" && mkdir -p "$PREBUILT" && mv "$PREBUILT.tar.xz" "$PREBUILT/bundle.tar.xz" || exit 1
  log "packed: $PREBUILT/bundle.tar.xz ($(du -sh "$PREBUILT/bundle.tar.xz" | cut -f1)); carry $PREBUILT"
  exit 0
fi

# ---- the programs ------------------------------------------------------------------------------
if [[ $MODE == prebuilt ]]; then
  PREBUILT=$(cd "$PREBUILT" && pwd) || exit 1
  if [[ -f $PREBUILT/bundle.tar.xz && ! -d $PREBUILT/bin ]]; then
    python3 -c 'import sys, tarfile
t = tarfile.open(sys.argv[1])
try:
    t.extractall(sys.argv[2], filter="data")
except TypeError:  # Python without extraction filters
    t.extractall(sys.argv[2])' \
      "$PREBUILT/bundle.tar.xz" "$PREBUILT" || { log "could not unpack $PREBUILT/bundle.tar.xz"; exit 1; }
  fi
  TESTS=$PREBUILT/bin/kvpolicy_tests
  BENCH=$PREBUILT/bin/kvpolicy_bench
  export LD_LIBRARY_PATH="$PREBUILT/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  LOG_DIR=$PREBUILT/logs
  mkdir -p "$LOG_DIR"
  missing=$(ldd "$TESTS" "$BENCH" 2>&1 | grep "not found" | sort -u)
  [[ -z $missing ]] || log "libraries not found: $missing"
  [[ -z $missing ]]; record "the prebuilt programs' libraries resolve" "$?"
else
  LOG_DIR=$BUILD_DIR
  mkdir -p "$BUILD_DIR"
  # ---- dependencies ----
  if [[ -x scripts/setup.sh ]]; then
    log "running scripts/setup.sh"
    scripts/setup.sh || log "setup.sh failed (offline machine?); continuing with what is installed"
  fi
  if compgen -G "$DEBS_DIR/*.deb" >/dev/null; then
    for deb in "$DEBS_DIR"/*.deb; do
      pkg=$(dpkg-deb -f "$deb" Package)
      if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed'; then
        log "unpacking $deb"
        dpkg -x "$deb" / || log "could not unpack $deb"
      fi
    done
    ldconfig 2>/dev/null || true
  fi
fi

# ---- the machine -------------------------------------------------------------------------------
log "nvcc: $(nvcc --version 2>/dev/null | tail -1 || echo 'not found')"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader
else
  log "nvidia-smi not found"
fi

# ---- configure + build (build mode) ------------------------------------------------------------
if [[ $MODE == build ]]; then
  generator=()
  command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
  bench=OFF
  if compgen -G "/usr/lib/*/cmake/benchmark" >/dev/null || compgen -G "/usr/lib/cmake/benchmark" >/dev/null \
     || compgen -G "/usr/local/lib/cmake/benchmark" >/dev/null; then
    bench=ON
  else
    log "Google Benchmark is not installed: skipping the CUDA benchmarks"
  fi
  log "configuring $BUILD_DIR (CUDA archs: $CUDA_ARCHS, benchmarks: $bench)"
  LOGS+=("$LOG_DIR/device_check_configure.log" "$LOG_DIR/device_check_build.log")
  cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DKVPOLICY_CUDA=ON \
    -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" -DKVPOLICY_CUDA_ARCHITECTURES="$CUDA_ARCHS" \
    -DKVPOLICY_BUILD_TESTS=ON -DKVPOLICY_BUILD_BENCHMARKS=$bench 2>&1 | tee "$LOG_DIR/device_check_configure.log"
  rc=${PIPESTATUS[0]}
  record "configure" "$rc"
  [[ $rc -eq 0 ]] || finish
  targets=(kvpolicy_cuda kvpolicy_tests)
  [[ $bench == ON ]] && targets+=(kvpolicy_bench)
  log "building ${targets[*]} with $JOBS jobs"
  start=$(date +%s)
  cmake --build "$BUILD_DIR" -j "$JOBS" --target "${targets[@]}" 2>&1 | tee "$LOG_DIR/device_check_build.log" | tail -20
  rc=${PIPESTATUS[0]}
  record "build (${targets[*]}) in $(( $(date +%s) - start )) s" "$rc"
  [[ $rc -eq 0 ]] || finish
  TESTS=$BUILD_DIR/tests/kvpolicy_tests
  BENCH=$BUILD_DIR/benchmarks/kvpolicy_bench
fi

# ---- agreement tests on the GPU: every [gpu] case in a process of its own ----------------------
# (a kernel fault leaves the CUDA context unusable: one process per case keeps the others' results)
GPU_LOG=$LOG_DIR/device_check_gpu_tests.log
LOGS+=("$GPU_LOG")
: >"$GPU_LOG"
mapfile -t cases < <("$TESTS" --list-test-names-only "[gpu]" | sed '/^$/d')
((${#cases[@]} > 0)); record "list the [gpu] cases (${#cases[@]} found)" "$?"
log "running ${#cases[@]} [gpu] cases, one process each"
n_pass=0; n_fail=0; n_skip=0
for c in "${cases[@]}"; do
  spec=$(printf '%s' "$c" | sed 's/[],[\\]/\\&/g')  # Catch2: escape , [ ] and \ in a test name
  start=$(date +%s%N)
  timeout "${CASE_TIMEOUT:-180}" "$TESTS" "$spec" --durations yes >"$LOG_DIR/case.log" 2>&1
  rc=$?
  ms=$(( ($(date +%s%N) - start) / 1000000 ))
  secs=$((ms / 1000)).$(( (ms % 1000) / 100 ))
  { echo "===== $c (rc=$rc, ${secs} s)"; cat "$LOG_DIR/case.log"; } >>"$GPU_LOG"
  if grep -q "skipped:" "$LOG_DIR/case.log"; then
    n_skip=$((n_skip + 1)); SUMMARY+=("SKIP  [gpu] $c")
  elif [[ $rc -eq 0 ]] && grep -q "All tests passed" "$LOG_DIR/case.log"; then
    n_pass=$((n_pass + 1)); SUMMARY+=("PASS  [gpu] $c (${secs} s)")
  else
    n_fail=$((n_fail + 1)); SUMMARY+=("FAIL  [gpu] $c (rc=$rc, ${secs} s)"); STATUS=1
  fi
done
rm -f "$LOG_DIR/case.log"
log "[gpu] cases: $n_pass passed, $n_fail failed, $n_skip skipped (no usable GPU)"
((n_skip == 0 && ${#cases[@]} > 0)) || STATUS=1

if [[ $MODE == build ]]; then
  log "running the CPU halves and host checks ([agreement]~[gpu])"
  LOGS+=("$LOG_DIR/device_check_cpu_tests.log")
  "$TESTS" "[agreement]~[gpu]" 2>&1 | tee "$LOG_DIR/device_check_cpu_tests.log" | tail -3
  record "kvpolicy_tests [agreement]~[gpu]" "${PIPESTATUS[0]}"
fi

# ---- CUDA benchmarks ---------------------------------------------------------------------------
if [[ -x $BENCH ]]; then
  filter='[Cc][Uu][Dd][Aa]|[Gg][Pp][Uu]'
  log "running CUDA benchmarks (filter: $filter)"
  LOGS+=("$LOG_DIR/device_check_bench.log")
  # One run: the CUDA benchmarks judge no CPU ratio target (--repeats defaults to 3 for those).
  timeout "${BENCH_TIMEOUT:-300}" "$BENCH" --benchmark_filter="$filter" --repeats=1 2>&1 \
    | tee "$LOG_DIR/device_check_bench.log"
  record "kvpolicy_bench (CUDA)" "${PIPESTATUS[0]}"
else
  log "no benchmark binary (benchmarks off or not built)"
fi

# ---- Python: CUDA tensors through DLPack -------------------------------------------------------
if [[ $MODE == prebuilt && -d $PREBUILT/python/kvpolicy ]]; then
  log "running python/tests/test_device.py with $PREBUILT/python on $(python3 --version 2>&1)"
  LOGS+=("$LOG_DIR/device_check_python.log")
  PYTHONPATH="$PREBUILT/python" timeout "${PY_TIMEOUT:-240}" python3 -m pytest -q -rs \
    -p no:cacheprovider python/tests/test_device.py 2>&1 | tee "$LOG_DIR/device_check_python.log" | tail -15
  rc=${PIPESTATUS[0]}
  grep -Eq "^SKIPPED" "$LOG_DIR/device_check_python.log" && [[ $rc -eq 0 ]] && rc=2
  record "pytest python/tests/test_device.py (no skips)" "$rc"
fi

# ---- compute-sanitizer over the [gpu] cases -------------------------------------------------------
# SANITIZER_TOOLS (default memcheck; racecheck and synccheck check the kernels' shared-memory
# use and barriers), each run bounded by SANITIZER_TIMEOUT seconds (0: none run).
if [[ ${SANITIZER_TIMEOUT:-240} -gt 0 ]] && command -v compute-sanitizer >/dev/null 2>&1; then
  for tool in ${SANITIZER_TOOLS:-memcheck}; do
    log "compute-sanitizer --tool $tool over [gpu] (at most ${SANITIZER_TIMEOUT:-240} s)"
    LOGS+=("$LOG_DIR/device_check_$tool.log")
    timeout "${SANITIZER_TIMEOUT:-240}" compute-sanitizer --tool "$tool" --error-exitcode 9 \
      --print-limit 30 "$TESTS" "[gpu]" >"$LOG_DIR/device_check_$tool.log" 2>&1
    rc=$?
    tail -5 "$LOG_DIR/device_check_$tool.log"
    if [[ $rc -eq 124 ]]; then  # incomplete, not failed: its summary line says so
      SUMMARY+=("TIME  compute-sanitizer $tool [gpu]: stopped at SANITIZER_TIMEOUT=${SANITIZER_TIMEOUT:-240} s")
    else
      record "compute-sanitizer $tool [gpu]" "$rc"
    fi
  done
fi

finish
