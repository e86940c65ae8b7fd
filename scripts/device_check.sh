#!/usr/bin/env bash
# One command for a machine with a GPU: configure and build kvpolicy with CUDA (Release), run the
# CPU-vs-CUDA agreement tests ([gpu]), the spec-string device pipeline against the CPU path, then
# the CUDA benchmarks if the build has any (bench_cuda_policy: a policy end to end, GPU vs CPU).
# Prints what it ran and a summary; exits non-zero if a step failed or the GPU tests were skipped.
#
#   scripts/device_check.sh                 # on the GPU machine, from the repository root
#   scripts/device_check.sh --fetch-debs    # on a networked dev machine, beforehand (see below)
#
# Environment: BUILD_DIR (default build-device), CUDA_ARCHS (default "native": only the GPU
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
  if [[ -n ${OUT:-} && -d ${OUT:-} ]]; then cp -f "$BUILD_DIR"/device_check_*.log "$OUT"/ 2>/dev/null || true; fi
  exit "$STATUS"
}

if [[ ${1:-} == --fetch-debs ]]; then
  mkdir -p "$DEBS_DIR"
  (cd "$DEBS_DIR" && apt-get download "${DEB_PACKAGES[@]}") || { log "apt-get download failed"; exit 1; }
  log "downloaded into $DEBS_DIR/:" "$DEBS_DIR"/*.deb
  log "add '/$DEBS_DIR/' to .git/info/exclude and carry '$DEBS_DIR' to the GPU machine"
  exit 0
fi

export PATH="/usr/local/cuda/bin:$PATH"

# ---- 1. dependencies -------------------------------------------------------------------------
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

# ---- 2. the machine ----------------------------------------------------------------------------
log "nvcc: $(nvcc --version 2>/dev/null | tail -1 || echo 'not found')"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
else
  log "nvidia-smi not found"
fi

# ---- 3. configure + build ----------------------------------------------------------------------
generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
# Build the benchmarks only when some use the CUDA backend (nvcc and device time are scarce) and
# Google Benchmark is installed.
bench=OFF
if grep -rqsE "cuda_backend|kvpolicy/cuda/" benchmarks/; then
  if compgen -G "/usr/lib/*/cmake/benchmark" >/dev/null || compgen -G "/usr/lib/cmake/benchmark" >/dev/null \
     || compgen -G "/usr/local/lib/cmake/benchmark" >/dev/null; then
    bench=ON
  else
    log "benchmarks/ has CUDA benchmarks but Google Benchmark is not installed: skipping them"
  fi
else
  log "benchmarks/ has no CUDA benchmarks yet"
fi
mkdir -p "$BUILD_DIR"
log "configuring $BUILD_DIR (CUDA archs: $CUDA_ARCHS, benchmarks: $bench)"
cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DKVPOLICY_CUDA=ON \
  -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" -DKVPOLICY_CUDA_ARCHITECTURES="$CUDA_ARCHS" \
  -DKVPOLICY_BUILD_TESTS=ON -DKVPOLICY_BUILD_BENCHMARKS=$bench 2>&1 | tee "$BUILD_DIR/device_check_configure.log"
rc=${PIPESTATUS[0]}
record "configure" "$rc"
[[ $rc -eq 0 ]] || finish

targets=(kvpolicy_cuda kvpolicy_tests)
[[ $bench == ON ]] && targets+=(kvpolicy_bench)
log "building ${targets[*]} with $JOBS jobs"
start=$(date +%s)
cmake --build "$BUILD_DIR" -j "$JOBS" --target "${targets[@]}" 2>&1 | tee "$BUILD_DIR/device_check_build.log" | tail -20
rc=${PIPESTATUS[0]}
record "build (${targets[*]}) in $(( $(date +%s) - start )) s" "$rc"
[[ $rc -eq 0 ]] || finish

# ---- 4. agreement tests on the GPU ------------------------------------------------------------
log "running the [gpu] agreement tests"
"$BUILD_DIR/tests/kvpolicy_tests" "[gpu]" --durations yes 2>&1 | tee "$BUILD_DIR/device_check_gpu_tests.log"
rc=${PIPESTATUS[0]}
if grep -q "skipped:" "$BUILD_DIR/device_check_gpu_tests.log"; then
  log "the GPU tests were skipped: no usable GPU on this machine"
  [[ $rc -eq 0 ]] && rc=2
fi
record "kvpolicy_tests [gpu]" "$rc"

# The spec-string device pipeline end to end (cuda::select/compress/compress_paged and the C ABI's
# kvp_cuda_compress against the CPU path): already in [gpu] above; run again on its own so that
# the summary has its own line.
log "running the spec-string device pipeline ([gpu][device_policy], [gpu][c_api])"
"$BUILD_DIR/tests/kvpolicy_tests" "[gpu][device_policy],[gpu][c_api]" 2>&1 \
  | tee "$BUILD_DIR/device_check_device_policy.log" | tail -3
rc=${PIPESTATUS[0]}
grep -q "skipped:" "$BUILD_DIR/device_check_device_policy.log" && [[ $rc -eq 0 ]] && rc=2
record "device policy from spec strings (cuda::compress, kvp_cuda_compress)" "$rc"

log "running the CPU halves and host checks ([agreement]~[gpu])"
"$BUILD_DIR/tests/kvpolicy_tests" "[agreement]~[gpu]" 2>&1 | tee "$BUILD_DIR/device_check_cpu_tests.log" | tail -3
record "kvpolicy_tests [agreement]~[gpu]" "${PIPESTATUS[0]}"

(cd "$BUILD_DIR" && ctest -L gpu --output-on-failure 2>&1 | tail -5; exit "${PIPESTATUS[0]}")
record "ctest -L gpu" "$?"

# ---- 5. CUDA benchmarks, if any --------------------------------------------------------------
if [[ -x $BUILD_DIR/benchmarks/kvpolicy_bench ]]; then
  filter='[Cc][Uu][Dd][Aa]|[Gg][Pp][Uu]'
  if "$BUILD_DIR/benchmarks/kvpolicy_bench" --benchmark_list_tests 2>/dev/null | grep -Eq "$filter"; then
    log "running CUDA benchmarks (filter: $filter)"
    # One run: the CUDA benchmarks judge no CPU ratio target (--repeats defaults to 3 for those).
    "$BUILD_DIR/benchmarks/kvpolicy_bench" --benchmark_filter="$filter" --repeats=1 2>&1 \
      | tee "$BUILD_DIR/device_check_bench.log"
    record "kvpolicy_bench (CUDA)" "${PIPESTATUS[0]}"
  else
    log "kvpolicy_bench has no CUDA benchmarks yet"
  fi
else
  log "no benchmark binary (benchmarks off or not built)"
fi

finish
