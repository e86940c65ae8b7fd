"""Session: the KV cache of one sequence for prefill + decode-time compression (float32)."""

from __future__ import annotations

import warnings
from typing import Any, Optional, Tuple

import numpy as np

from . import _core
from ._arrays import as_array, budget_args
from ._policy import Policy


class Session:
    """Per-sequence cache state, all layers, as an engine uses it. Per layer: ``append`` new
    tokens' K/V (and queries when the policy reads them), ``attend`` over the cache,
    ``compress_if_due`` (the first call compresses the prefill to the budget; later calls
    compress back every ``decode_interval`` tokens, every token for h2o). Storage is per layer
    and head; heads can hold different lengths (per-head budgets).

    Arrays are float32 ``[heads][n][head_dim]`` (KV heads for k/v, query heads for q), any
    non-negative strides. ``budget`` is a ratio of the prefill, ``budget_tokens`` a count per
    head, ``budget_total`` a count over a layer's heads. ``record_queries`` /
    ``record_attention``: keep queries / h2o statistics even when the policy reads none.
    ``rope_inv_freq``: the model's inverse RoPE frequencies ``[head_dim // 2]`` (Hugging Face's
    ``rotary_emb.inv_freq``), for scorers that rotate queries to future positions
    (``expected``); without them such a scorer needs ``theta=`` in its spec.
    """

    def __init__(self, policy: Policy | str, *, layers: int, kv_heads: int, q_heads: int,
                 head_dim: int, budget: float = 1.0, budget_tokens: Optional[int] = None,
                 budget_total: Optional[int] = None, decode_interval: int = 0,
                 record_queries: int = 0, record_attention: bool = False,
                 initial_capacity: int = 256, rope_inv_freq: Any = None) -> None:
        pol = policy if isinstance(policy, Policy) else Policy(policy)
        kind, value = budget_args(budget, budget_tokens, budget_total)
        freqs = [] if rope_inv_freq is None else \
            np.asarray(rope_inv_freq, dtype=np.float32).reshape(-1).tolist()
        self.policy = pol
        self._s = _core.Session(pol._p, layers, kv_heads, q_heads, head_dim, kind, value,
                                record_queries, record_attention, decode_interval,
                                initial_capacity, freqs)

    layers = property(lambda self: self._s.layers)
    kv_heads = property(lambda self: self._s.kv_heads)
    q_heads = property(lambda self: self._s.q_heads)
    head_dim = property(lambda self: self._s.head_dim)

    @property
    def decode_interval(self) -> int:
        """Tokens between decode-time compressions (0: none after the prefill's)."""
        return self._s.decode_interval

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V held (fp32 rows, or packed tiles with a quantizer)."""
        return self._s.kv_bytes

    def append(self, layer: int, k: Any, v: Any, q: Any = None) -> None:
        """Appends n tokens to every KV head of ``layer``: k, v ``[Hkv][n][d]``, q ``[Hq][n][d]``
        (required when the policy reads queries)."""
        self._s.append(layer, as_array(k, "k"), as_array(v, "v"),
                       None if q is None else as_array(q, "q"))

    def attend(self, layer: int, q: Any) -> np.ndarray:
        """Attention of the last n tokens' queries ``[Hq][n][d]`` (causal among them) over the
        layer's cache; returns float32 ``[Hq][n][d]``. Accumulates h2o statistics."""
        return self._s.attend(layer, as_array(q, "q"))

    def reconstruct(self, layer: int, k: Any, v: Any, q: Any) -> np.ndarray:
        """One chunk of a context-reconstruction pass at ``layer``, for the ``kvzip`` scorer.
        After the prefill, the engine runs a teacher-forced pass that repeats the context in
        chunks ("Repeat the previous context exactly." followed by the context's tokens). For
        each chunk it passes the chunk's post-RoPE k, v ``[Hkv][n][d]`` and q ``[Hq][n][d]``
        here instead of ``append`` + ``attend``. Returns their causal attention over the cache
        and the chunk's earlier tokens, float32 ``[Hq][n][d]``. Each cached token's score rises
        to the largest attention probability it receives. The chunk is not kept."""
        return self._s.reconstruct(layer, as_array(k, "k"), as_array(v, "v"), as_array(q, "q"))

    def clear_reconstruction(self) -> None:
        """Zeroes every layer's reconstruction scores, so that a new pass starts from zero."""
        self._s.clear_reconstruction()

    def reconstructed(self, layer: int) -> bool:
        """True once ``reconstruct`` ran on ``layer`` (since the last clear)."""
        return self._s.reconstructed(layer)

    def reconstruction(self, layer: int, head: int) -> np.ndarray:
        """Reconstruction scores (float32) of the tokens held by (layer, head)."""
        return self._s.reconstruction(layer, head)

    def compress_if_due(self, layer: int) -> bool:
        """Compresses ``layer`` if due; True if it compacted."""
        done = self._s.compress_if_due(layer)
        self._warn()
        return done

    def _warn(self) -> None:
        w = self._s.take_warning()
        if w:
            warnings.warn(f"kvpolicy: {w}", RuntimeWarning, stacklevel=3)

    def compress(self, layer: int) -> Tuple[np.ndarray, np.ndarray]:
        """Compresses ``layer`` now; returns (indices ``[1][H][K]`` padded with -1, counts
        ``[1][H]``), indices into the cache rows as they were before."""
        out = self._s.compress(layer)
        self._warn()
        return out

    def lengths(self, layer: int) -> np.ndarray:
        """Tokens held per KV head (int64 ``[H]``)."""
        return self._s.lengths(layer)

    def budgets(self, layer: int) -> np.ndarray:
        """Per-head targets fixed by the first compression (empty before it)."""
        return self._s.budgets(layer)

    def keys(self, layer: int, head: int) -> np.ndarray:
        """A copy of the keys held by (layer, head), ``[length][d]`` in cache order."""
        return self._s.keys(layer, head)

    def values(self, layer: int, head: int) -> np.ndarray:
        """A copy of the values held by (layer, head), ``[length][d]``."""
        return self._s.values(layer, head)

    def positions(self, layer: int, head: int) -> np.ndarray:
        """Original positions (int32) of the tokens held by (layer, head)."""
        return self._s.positions(layer, head)

    def log_counts(self, layer: int, head: int) -> np.ndarray:
        """log(count) per held row (merged tokens; 0 without a merger)."""
        return self._s.log_counts(layer, head)

    def capacity(self, layer: int) -> int:
        """Tokens of storage per KV head of ``layer`` (every head of a layer shares one
        capacity, at least its longest head; it grows by doubling)."""
        return self._s.capacity(layer)

    def reserve(self, layer: int, tokens: int) -> None:
        """Sets the storage of ``layer`` to ``tokens`` per KV head, or to its longest head if
        that is more (grows or shrinks it; the cache is unchanged)."""
        self._s.reserve(layer, tokens)

    def shrink_to_fit(self) -> None:
        """Gives back the storage compression freed: every layer's capacity becomes its longest
        head (at least 1 token). Later appends grow it again by doubling."""
        self._s.shrink_to_fit()

    def packed(self, layer: int, head: int) -> Any:
        """The packed cache (``kvpolicy.PackedCache``'s base) of (layer, head) of a quantized
        layer: ``packed_tokens``, ``residual_tokens``, ``memory_bytes``, ``decode()``."""
        return self._s.packed(layer, head)

    def quantized(self, layer: int) -> bool:
        """True once a policy with a quantizer packed ``layer`` (keys/values are then gone)."""
        return self._s.quantized(layer)
