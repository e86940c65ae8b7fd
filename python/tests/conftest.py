import os

# Idle OpenMP threads yield instead of spinning (libgomp reads this when kvpolicy._core loads):
# on a busy 2-core machine spinning makes the engine tests many times slower (scripts/test.sh
# exports it too).
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def cache(rng, L=2, H=3, T=40, d=32, dtype=np.float32):
    """Random keys/values [L][H][T][d] (distinct norms, so knorm has no ties)."""
    k = rng.standard_normal((L, H, T, d)).astype(dtype)
    v = rng.standard_normal((L, H, T, d)).astype(dtype)
    return k, v
