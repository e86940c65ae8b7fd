#!/usr/bin/env bash
# The long form of the Session soak (tests/session/test_soak.cpp; issue 19, long runs):
#   bash scripts/soak.sh [steps]        # default 100000
# Builds the Release test binary (incremental: the build directory of scripts/test.sh and
# ccache; configured like test.sh's release build if it does not exist yet), then runs the soak
# test case alone with KVPOLICY_SOAK_STEPS=steps and prints the steps, the wall time, the peak
# memory (max RSS from /usr/bin/time when installed) and the result. The seed is fixed (19)
# unless KVPOLICY_SOAK_SEED is set; a failure prints the seed and step to rerun it.
# Needs what scripts/setup.sh installs (it is not run here: the soak needs no model or venv).
# Environment: KVPOLICY_BUILD_DIR (default build), KVPOLICY_JOBS (default nproc), CCACHE_DIR
# (default $HOME/.cache/ccache), KVPOLICY_SOAK_SEED.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

STEPS=${1:-100000}
BUILD_DIR=${KVPOLICY_BUILD_DIR:-build}
JOBS=${KVPOLICY_JOBS:-$(nproc)}
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/ccache}
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}

log() { echo "soak.sh: $*"; }

if [[ ! $STEPS =~ ^[0-9]+$ ]] || ((STEPS < 100)); then
  log "steps must be a whole number >= 100, got '${STEPS}'"
  exit 2
fi

if [[ ! -f $BUILD_DIR/CMakeCache.txt ]]; then
  args=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DKVPOLICY_SANITIZE=OFF)
  command -v ccache >/dev/null 2>&1 &&
    args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  nvcc=$(command -v nvcc || true)
  if [[ -z $nvcc && -x /usr/local/cuda/bin/nvcc ]]; then nvcc=/usr/local/cuda/bin/nvcc; fi
  if [[ -n $nvcc ]]; then args+=(-DKVPOLICY_CUDA=ON "-DCMAKE_CUDA_COMPILER=$nvcc"); else args+=(-DKVPOLICY_CUDA=OFF); fi
  log "configuring ${BUILD_DIR}"
  cmake -S . -B "$BUILD_DIR" "${args[@]}"
fi
log "building kvpolicy_tests in ${BUILD_DIR}"
cmake --build "$BUILD_DIR" --target kvpolicy_tests -j "$JOBS"

exe=$BUILD_DIR/tests/kvpolicy_tests
out=$(mktemp)
trap 'rm -f "$out"' EXIT
log "running the soak: ${STEPS} steps, seed ${KVPOLICY_SOAK_SEED:-19}"
t0=$(date +%s%N)
rc=0
if [[ -x /usr/bin/time ]]; then
  KVPOLICY_SOAK_STEPS=$STEPS /usr/bin/time -v -o "$out" "$exe" "[soak]" || rc=$?
  rss="$(sed -n 's/^[[:space:]]*Maximum resident set size (kbytes): //p' "$out") kB"
else
  KVPOLICY_SOAK_STEPS=$STEPS "$exe" "[soak]" || rc=$?
  rss="n/a (no /usr/bin/time; see VmHWM above)"
fi
ms=$((($(date +%s%N) - t0) / 1000000))
result=$( ((rc == 0)) && echo PASSED || echo "FAILED (exit ${rc})")
log "$(printf 'steps %d | wall %d.%01d s | max RSS %s | %s' "$STEPS" $((ms / 1000)) $((ms % 1000 / 100)) "$rss" "$result")"
exit "$rc"
