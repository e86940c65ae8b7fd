import numpy as np
import pytest


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def cache(rng, L=2, H=3, T=40, d=32, dtype=np.float32):
    """Random keys/values [L][H][T][d] (distinct norms, so knorm has no ties)."""
    k = rng.standard_normal((L, H, T, d)).astype(dtype)
    v = rng.standard_normal((L, H, T, d)).astype(dtype)
    return k, v
