import os

# Idle OpenMP threads yield instead of spinning (libgomp reads this when kvpolicy._core loads):
# on a busy 2-core machine spinning makes the engine tests many times slower (scripts/test.sh
# exports it too).
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import threading  # noqa: E402

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


def bundled_hf_model(attn_implementation: str):
    """The bundled GGUF model loaded by transformers (dequantized to float32, eval mode), for the
    integration tests; skips the calling test module when the model file is missing."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    import kvpolicy
    path = kvpolicy.default_model_path()
    if not os.path.exists(path):
        pytest.skip(f"bundled model not found at {path} (scripts/fetch_model.sh)")
    torch.set_num_threads(2)
    hf_logging.disable_progress_bar()
    m = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                             gguf_file=os.path.basename(path),
                                             dtype=torch.float32,
                                             attn_implementation=attn_implementation)
    m.eval()
    return m


class AllGatherGroup:
    """An in-memory all-gather among threads that stand for tensor-parallel ranks."""

    def __init__(self, ranks):
        self.ranks = ranks
        self.parts = [None] * ranks
        self.barrier = threading.Barrier(ranks, timeout=20)

    def member(self, rank):
        def all_gather(data):
            self.parts[rank] = bytes(data)
            self.barrier.wait()
            out = b"".join(self.parts)
            self.barrier.wait()  # every rank has read the parts before the next call writes
            return np.frombuffer(out, dtype=np.uint8)  # anything memoryview takes
        return all_gather
