#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/: a clang build of the project with KVPOLICY_SANITIZE and
# KVPOLICY_FUZZ, ASan + UBSan + libFuzzer) and runs each for a while on a fresh copy of its seed
# corpus (fuzz/seeds/<target>/):
#   bash scripts/fuzz.sh [seconds] [target...]     # default: 30 s, every target
# One summary line per target (runs, runs/s, coverage edges, features, corpus, result); exits
# non-zero if a target crashed, leaked, hit a sanitizer report or a contract check (FINDING), or
# timed out on one input. The input that did it is under $BUILD_DIR/artifacts/<target>/; run
# the target ($BUILD_DIR/fuzz/<target>) on that file to reproduce.
# Environment: KVPOLICY_FUZZ_BUILD_DIR (default build-fuzz: configured here with the fuzz targets
# and the library units they link, nothing else; a build directory that was configured with
# KVPOLICY_FUZZ=ON is used as it is: scripts/test.sh passes its sanitizer build, which compiled
# the targets already), KVPOLICY_JOBS (build jobs, and
# targets run at once; default nproc), KVPOLICY_FUZZ_KEEP_CORPUS=1 (keep and grow
# $BUILD_DIR/corpus/<target> between runs instead of starting from the seeds), CXX (default
# clang++), CCACHE_DIR (default $HOME/.cache/ccache), ASAN_OPTIONS / UBSAN_OPTIONS (added to;
# detect_leaks is set here).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

SECONDS_PER_TARGET=${1:-30}
shift || true
ALL_TARGETS=(fuzz_spec fuzz_c_api fuzz_profile fuzz_tokenizer fuzz_gguf)
TARGETS=("$@")
((${#TARGETS[@]})) || TARGETS=("${ALL_TARGETS[@]}")
BUILD_DIR=${KVPOLICY_FUZZ_BUILD_DIR:-build-fuzz}
JOBS=${KVPOLICY_JOBS:-$(nproc)}
[[ $JOBS =~ ^[0-9]+$ ]] && ((JOBS >= 1)) || { echo "fuzz.sh: KVPOLICY_JOBS must be >= 1, got '$JOBS'"; exit 2; }
CXX_FUZZ=${CXX:-clang++}
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/ccache}
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}

log() { echo "fuzz.sh: $*"; }

[[ $SECONDS_PER_TARGET =~ ^[0-9]+$ ]] || { log "seconds must be a number, got '$SECONDS_PER_TARGET'"; exit 2; }
for t in "${TARGETS[@]}"; do
  [[ " ${ALL_TARGETS[*]} " == *" $t "* ]] || { log "unknown target '$t' (${ALL_TARGETS[*]})"; exit 2; }
done
if ! command -v "$CXX_FUZZ" >/dev/null 2>&1; then
  log "$CXX_FUZZ not found: libFuzzer needs clang (Debian: apt-get install clang libclang-rt-14-dev libomp-14-dev)"
  exit 2
fi

# Longest input per target: a spec string, a few KB of C ABI calls, a profile of 512 layers, a
# paragraph of text; fuzz_gguf takes the size of its largest seed (libFuzzer's default).
max_len() {
  case $1 in
    fuzz_spec) echo 512 ;;
    fuzz_c_api) echo 4096 ;;
    fuzz_profile) echo 8192 ;;
    fuzz_tokenizer) echo 1024 ;;
    *) echo 0 ;;
  esac
}

# A folder named by KVPOLICY_FUZZ_BUILD_DIR must have been configured with the fuzz targets, and is
# used as it is. The default folder is configured afresh when it was not, or with another
# compiler than $CXX_FUZZ (e.g. a build-fuzz/ from before the targets became part of the
# project's build): its CMake cache goes, its corpus/ and artifacts/ stay.
fuzz_configured() {
  grep -qiE '^KVPOLICY_FUZZ:BOOL=(ON|1|TRUE|YES|Y)$' "$BUILD_DIR/CMakeCache.txt"
}
if [[ -f $BUILD_DIR/CMakeCache.txt ]]; then
  if [[ -n ${KVPOLICY_FUZZ_BUILD_DIR:-} ]]; then
    if ! fuzz_configured; then
      log "$BUILD_DIR was not configured with -DKVPOLICY_FUZZ=ON (and KVPOLICY_SANITIZE=ON, clang)"
      exit 2
    fi
  elif ! fuzz_configured ||
       ! grep -qx "CMAKE_CXX_COMPILER:[A-Z]*=$(command -v "$CXX_FUZZ")" "$BUILD_DIR/CMakeCache.txt"; then
    log "$BUILD_DIR is not a fuzz build of $CXX_FUZZ: configuring it afresh (corpus/ and artifacts/ kept)"
    rm -rf "$BUILD_DIR/CMakeCache.txt" "$BUILD_DIR/CMakeFiles"
  fi
fi
if [[ ! -f $BUILD_DIR/CMakeCache.txt ]]; then
  cc_fuzz=$CXX_FUZZ
  [[ $cc_fuzz == *clang++* ]] && cc_fuzz=${cc_fuzz/clang++/clang}
  # Only what the targets link: the engine, the C ABI, the Policy instances, the profile reader.
  # -O1 with line tables, as the sanitizer build of scripts/test.sh.
  cmake_args=(-S . -B "$BUILD_DIR" "-DCMAKE_CXX_COMPILER=$CXX_FUZZ" "-DCMAKE_C_COMPILER=$cc_fuzz"
              -DKVPOLICY_SANITIZE=ON -DKVPOLICY_FUZZ=ON -DKVPOLICY_CUDA=OFF
              -DKVPOLICY_BUILD_TESTS=OFF -DKVPOLICY_BUILD_BENCHMARKS=OFF
              -DKVPOLICY_BUILD_EXAMPLES=OFF -DKVPOLICY_BUILD_CLI=OFF -DKVPOLICY_INSTALL=OFF
              -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1")
  command -v ninja >/dev/null 2>&1 && cmake_args+=(-G Ninja)
  command -v ccache >/dev/null 2>&1 && cmake_args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  log "configure: cmake ${cmake_args[*]}"
  mkdir -p "$BUILD_DIR"
  cmake "${cmake_args[@]}" >"$BUILD_DIR/configure.log" 2>&1 || { cat "$BUILD_DIR/configure.log"; exit 1; }
fi
log "build: ${TARGETS[*]}"
cmake --build "$BUILD_DIR" -j "$JOBS" --target "${TARGETS[@]}"

# LeakSanitizer needs ptrace, which some containers forbid: check that it runs and reports a
# real leak before relying on it.
probe="$BUILD_DIR/lsan_probe"
printf '#include <cstdlib>\nint main() { void* volatile p = std::malloc(64); p = nullptr; return 0; }\n' \
  >"$probe.cpp"
leaks=0 leaks_word=no
if "$CXX_FUZZ" -fsanitize=address -g "$probe.cpp" -o "$probe" >/dev/null 2>&1 &&
   ! ASAN_OPTIONS=detect_leaks=1 "$probe" >"$probe.log" 2>&1 &&
   grep -q "LeakSanitizer: detected memory leaks" "$probe.log"; then
  leaks=1 leaks_word=yes
  log "LeakSanitizer works here: leaks are findings"
else
  log "LeakSanitizer does not work here (no ptrace?): leaks are NOT checked"
fi
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=${leaks}"
# One OpenMP thread, whatever a call asks for (OMP_THREAD_LIMIT caps num_threads clauses too, e.g.
# the C ABI's params->threads): each target is one process on one core, its results and coverage
# do not depend on scheduling, and libomp starts no worker threads, whose per-thread state it
# allocates lazily and never frees (libFuzzer's per-input leak check reported it as a leak).
export OMP_NUM_THREADS=1 OMP_THREAD_LIMIT=1

# run_target T: one libFuzzer run; its summary line goes to $BUILD_DIR/T.result, and a line
# starting with FAIL to $BUILD_DIR/T.failed.
run_target() {
  local t=$1 corpus="$BUILD_DIR/corpus/$1" artifacts="$BUILD_DIR/artifacts/$1" logf="$BUILD_DIR/$1.log"
  rm -f "$BUILD_DIR/$t.result" "$BUILD_DIR/$t.failed"
  [[ ${KVPOLICY_FUZZ_KEEP_CORPUS:-0} == 1 ]] || rm -rf "$corpus"
  mkdir -p "$corpus" "$artifacts"
  if compgen -G "fuzz/seeds/$t/*" >/dev/null; then cp -n fuzz/seeds/"$t"/* "$corpus"/; fi
  local args=(-max_total_time="$SECONDS_PER_TARGET" -timeout=30 -rss_limit_mb=2560
              -detect_leaks=$leaks -print_final_stats=1 -artifact_prefix="$artifacts/")
  local len
  len=$(max_len "$t")
  ((len > 0)) && args+=(-max_len="$len")
  [[ -f fuzz/$t.dict ]] && args+=(-dict="fuzz/$t.dict")
  log "=== $t: $BUILD_DIR/fuzz/$t ${args[*]} $corpus"
  local rc=0
  "$BUILD_DIR/fuzz/$t" "${args[@]}" "$corpus" >"$logf" 2>&1 || rc=$?
  local runs rate last cov ft corp result=PASS
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$logf" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$logf" | tail -1)
  last=$(grep -E '^#[0-9]+[[:space:]]+(DONE|pulse|NEW|REDUCE|INITED)' "$logf" | tail -1 || true)
  cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
  ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
  corp=$(sed -n 's/.* corp: \([0-9]*\).*/\1/p' <<<"$last")
  if ((rc != 0)) || grep -qE 'ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)|runtime error:|^FINDING:' "$logf"; then
    result="FAIL (exit $rc; log $logf; input $(ls -t "$artifacts" 2>/dev/null | head -1))"
    # (A run killed without a report, e.g. by the OOM killer, has no such line: still a failure.)
    { grep -E 'ERROR: |runtime error:|^FINDING:|SUMMARY:' "$logf" || true; } |
      sed -n '1,5s/^/    /p' >"$BUILD_DIR/$t.failed"
  fi
  echo "$t: ${SECONDS_PER_TARGET}s, ${runs:-?} runs (${rate:-?}/s), cov ${cov:-?}, ft ${ft:-?}, corpus ${corp:-?}: $result" \
    >"$BUILD_DIR/$t.result"
  log "$(cat "$BUILD_DIR/$t.result")"
}

# The targets run side by side, $JOBS at a time (each libFuzzer process uses one core), so CI's
# 5 x 30 s take 90 s of wall time on 2 cores.
for t in "${TARGETS[@]}"; do
  while (($(jobs -rp | wc -l) >= JOBS)); do wait -n || true; done
  run_target "$t" &
done
wait

failed=()
summary=()
for t in "${TARGETS[@]}"; do
  if [[ -f $BUILD_DIR/$t.result ]]; then
    summary+=("$(cat "$BUILD_DIR/$t.result")")
  else
    summary+=("$t: no result (the run did not finish)")
    failed+=("$t")
    continue
  fi
  if [[ -f $BUILD_DIR/$t.failed ]]; then
    failed+=("$t")
    cat "$BUILD_DIR/$t.failed"
  fi
done

log "summary (leaks checked: $leaks_word):"
for s in "${summary[@]}"; do echo "  $s"; done
if ((${#failed[@]})); then
  log "FAILED: ${failed[*]}"
  exit 1
fi
log "PASSED"
