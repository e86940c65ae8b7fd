#!/usr/bin/env bash
# The project's main job: a native Release build and the throughput benchmark
# (build-release/benchmarks/kvpolicy_bench; arguments are passed on to it). The accuracy
# benchmark replaces it as the main job once it exists.
# Environment: KVPOLICY_RELEASE_BUILD_DIR (default build-release), KVPOLICY_JOBS (default nproc),
# CCACHE_DIR (default $HOME/.cache/ccache).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

BUILD_DIR=${KVPOLICY_RELEASE_BUILD_DIR:-build-release}
JOBS=${KVPOLICY_JOBS:-$(nproc)}
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/ccache}

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
log "building kvpolicy_bench"
if ! cmake --build "$BUILD_DIR" --target kvpolicy_bench -j "$JOBS"; then
  log "could not build the kvpolicy_bench target (benchmarks/CMakeLists.txt defines it)"
  exit 1
fi

bench="$BUILD_DIR/benchmarks/kvpolicy_bench"
log "running $bench $*"
exec "$bench" "$@"
