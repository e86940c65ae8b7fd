"""kvpolicy: KV-cache compression policies for LLM inference (Python bindings).

    import numpy as np, kvpolicy
    k = np.random.rand(2, 4, 256, 64).astype(np.float32)   # [layers][kv_heads][tokens][dim]
    v = np.random.rand(2, 4, 256, 64).astype(np.float32)
    q = np.random.rand(2, 12, 16, 64).astype(np.float32)   # the last 16 queries
    r = kvpolicy.Policy("snapkv(window=16)").compress(k, v, q, budget=0.25)
    r.indices, r.counts, r.keys.shape                       # kept tokens, compacted in place
"""

from ._engine import Engine, Model, Tokenizer, default_model_path
from ._policy import CompressResult, HeadShard, Policy
from ._quant import PackedCache, Quantizer, packed_attention
from ._session import Session
from . import tasks

__version__ = "0.1.0"

__all__ = [
    "CompressResult", "Engine", "HeadShard", "Model", "PackedCache", "Policy", "Quantizer", "Session",
    "Tokenizer", "default_model_path", "packed_attention", "tasks", "__version__",
]
