#!/usr/bin/env bash
# Determinism of the kept sets across builds and thread counts (README, "Determinism"):
#   1. builds kvpolicy_keptsets twice: portable (Release, no -march=native, as scripts/test.sh
#      builds the tests) in build-det-portable/, native (Release, -march=native, as
#      scripts/main.sh builds the benchmark) in build-det-native/;
#   2. runs it on the accuracy benchmark's retrieval prompts (default 3 per task at 1024 tokens,
#      both regimes, the default suite's policies plus semantic and int2, budgets 0.1 and 0.2):
#      each build with 1 and with 2 threads; then each build once on synthetic K/V/Q that are the
#      same bits in both builds (--synthetic), which separates the policies' own arithmetic from
#      the model's forward pass;
#   3. compares the runs (benchmarks/accuracy/compare_keptsets.py):
#      - 1 vs 2 threads, per build: kept sets and caches (before and after compression) must
#        be bit-identical;
#      - portable vs native: differences are reported, and every differing kept set must be a
#        near-tie in both builds' numbers: the tokens that differ within 1e-4 (relative) of
#        each other's scores at the cut, or, for ams, the cumulative mass within 1e-4 of a
#        segment target.
# Arguments go to every kvpolicy_keptsets run, e.g. --prompts 1 --tasks passkey,niah.
# Results: determinism-results/*.json and *.txt (the comparisons). Exit status 1 if a check
# fails. Environment: KVPOLICY_DET_PORTABLE_DIR, KVPOLICY_DET_NATIVE_DIR (build directories),
# KVPOLICY_DET_OUT (results), KVPOLICY_JOBS (default nproc), CCACHE_DIR.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PORTABLE=${KVPOLICY_DET_PORTABLE_DIR:-build-det-portable}
NATIVE=${KVPOLICY_DET_NATIVE_DIR:-build-det-native}
OUT=${KVPOLICY_DET_OUT:-determinism-results}
JOBS=${KVPOLICY_JOBS:-$(nproc)}
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/ccache}
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}

log() { echo "determinism.sh: $*"; }

bash scripts/setup.sh

common=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DKVPOLICY_CUDA=OFF -DKVPOLICY_SANITIZE=OFF
        -DKVPOLICY_BUILD_TESTS=OFF -DKVPOLICY_BUILD_BENCHMARKS=ON)
command -v ccache >/dev/null 2>&1 && common+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
for build in portable native; do
  if [[ $build == native ]]; then dir=$NATIVE native=ON; else dir=$PORTABLE native=OFF; fi
  log "configuring $dir (KVPOLICY_NATIVE=$native)"
  cmake -S . -B "$dir" "${common[@]}" -DKVPOLICY_NATIVE=$native >/dev/null
  log "building $dir/benchmarks/kvpolicy_keptsets"
  cmake --build "$dir" --target kvpolicy_keptsets -j "$JOBS"
done

mkdir -p "$OUT"
run() {  # run NAME BUILD_DIR THREADS ARGS...
  local name=$1 dir=$2 threads=$3
  shift 3
  log "run $name: $dir/benchmarks/kvpolicy_keptsets --threads $threads $*"
  "$dir/benchmarks/kvpolicy_keptsets" --threads "$threads" --out "$OUT/$name.json" "$@"
}
run portable-1t "$PORTABLE" 1 "$@"
run portable-2t "$PORTABLE" 2 "$@"
run native-1t "$NATIVE" 1 "$@"
run native-2t "$NATIVE" 2 "$@"
run portable-synthetic "$PORTABLE" 2 --synthetic --prompts 2
run native-synthetic "$NATIVE" 2 --synthetic --prompts 2

failed=()
compare() {  # compare NAME A B CHECK-FLAGS...
  local name=$1 a=$2 b=$3
  shift 3
  log "=== $name"
  local rc=0
  python3 benchmarks/accuracy/compare_keptsets.py "$OUT/$a.json" "$OUT/$b.json" "$@" \
    >"$OUT/$name.txt" || rc=$?
  cat "$OUT/$name.txt"
  ((rc == 0)) || failed+=("$name")
}
compare threads-portable portable-1t portable-2t --expect-identical --expect-kv-identical
compare threads-native native-1t native-2t --expect-identical --expect-kv-identical
compare portable-vs-native portable-2t native-2t --max-margin 1e-4
compare portable-vs-native-synthetic portable-synthetic native-synthetic --max-margin 1e-4

if ((${#failed[@]})); then
  log "FAILED: ${failed[*]} (see $OUT/*.txt)"
  exit 1
fi
log "PASSED: 1 vs 2 threads identical in both builds; portable vs native differ only at"\
    "near-ties (see $OUT/*.txt)"
