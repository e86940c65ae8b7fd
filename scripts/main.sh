#!/usr/bin/env bash
# The project's main job: set-up, a native Release build, then the accuracy + throughput
# benchmark on the bundled model (build-release/benchmarks/kvpolicy_accuracy; arguments are
# passed on to it, e.g. --quick, --suite full, --shard 0/4 or --help). It prints markdown tables
# with 95% intervals and writes accuracy-results/results.json, report.md and *.png. The default
# run takes about 10 minutes on 2 cores; --suite full about an hour.
# The kernel micro-benchmarks (Google Benchmark) are build-release/benchmarks/kvpolicy_bench.
# Environment: KVPOLICY_RELEASE_BUILD_DIR (default build-release), KVPOLICY_JOBS (default nproc),
# CCACHE_DIR (default $HOME/.cache/ccache).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

BUILD_DIR=${KVPOLICY_RELEASE_BUILD_DIR:-build-release}
JOBS=${KVPOLICY_JOBS:-$(nproc)}
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/ccache}
# Paths relative to the checkout, so a fresh clone elsewhere reuses cached objects.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}

log() { echo "main.sh: $*"; }

bash scripts/setup.sh

args=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DKVPOLICY_NATIVE=ON -DKVPOLICY_SANITIZE=OFF
      -DKVPOLICY_BUILD_TESTS=OFF -DKVPOLICY_BUILD_BENCHMARKS=ON)
if command -v ccache >/dev/null 2>&1; then
  args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
nvcc=$(command -v nvcc || true)
if [[ -z $nvcc && -x /usr/local/cuda/bin/nvcc ]]; then nvcc=/usr/local/cuda/bin/nvcc; fi
if [[ -n $nvcc ]]; then
  args+=(-DKVPOLICY_CUDA=ON "-DCMAKE_CUDA_COMPILER=$nvcc")
  log "CUDA on ($nvcc)"
else
  args+=(-DKVPOLICY_CUDA=OFF)
  log "CUDA off (no nvcc)"
fi

log "configuring ${BUILD_DIR}"
cmake -S . -B "$BUILD_DIR" "${args[@]}"
log "building kvpolicy_accuracy and kvpolicy_bench"
if ! cmake --build "$BUILD_DIR" --target kvpolicy_accuracy kvpolicy_bench -j "$JOBS"; then
  log "the build failed (benchmarks/CMakeLists.txt defines the targets)"
  exit 1
fi

# OpenMP workers spin for a short while (GOMP_SPINCOUNT iterations, about 0.1 ms)
# before they sleep. A decode step opens about 150 short parallel regions (4 projections and the
# attention per layer); with OMP_WAIT_POLICY=passive every one of them waits for a sleeping worker
# to be woken, and 2-thread decode was no faster than 1 thread (measured: 17.3 ms per step with
# passive, 8.6 ms with GOMP_SPINCOUNT=10000, 8.1 ms spinning without limit; prefill the same).
# The short limit keeps an oversubscribed machine from losing its cores to spinning threads.
export GOMP_SPINCOUNT=${GOMP_SPINCOUNT:-10000}
bench="$BUILD_DIR/benchmarks/kvpolicy_accuracy"
log "running $bench $*"
exec "$bench" "$@"
