"""Quantizers (int2, int4, kivi): encode / decode whole caches, and a packed cache per KV head
with attention over the packed form (float32)."""

from __future__ import annotations

from typing import Any, Sequence, Tuple

import numpy as np

from . import _core
from ._arrays import as_array, as_cache

Part = str  # "keys" | "values"


class Quantizer:
    """One quantizer stage from its spec: ``"int2"``, ``"int4(group=64)"``,
    ``"kivi(bits=4)"`` (parameters as in the README's policy table).

    ``encode`` packs keys (per channel over groups of ``group`` tokens; int2/int4 rotate and
    divide by the token norm first) or values (per token over groups of ``group`` channels) into
    uint8 rows ``[L][H][packed_bytes(T, d)]``; ``decode`` returns the original space.
    """

    def __init__(self, spec: str = "int2") -> None:
        self._q = _core.Quantizer(spec)

    spec = property(lambda self: self._q.spec)
    bits = property(lambda self: self._q.bits)
    group = property(lambda self: self._q.group)
    residual = property(lambda self: self._q.residual)
    rotate = property(lambda self: self._q.rotate)
    token_norm = property(lambda self: self._q.token_norm)

    def __repr__(self) -> str:
        return f"Quantizer({self.spec!r})"

    def bytes_per_token(self, head_dim: int) -> float:
        """Packed bytes per token and KV head, K + V (+ key norm)."""
        return self._q.bytes_per_token(head_dim)

    def packed_bytes(self, tokens: int, head_dim: int, part: Part = "keys") -> int:
        """Bytes of one (layer, head) row of ``tokens`` tokens."""
        return self._q.packed_bytes(tokens, head_dim, part)

    def encode(self, x: Any, part: Part = "keys") -> np.ndarray:
        """Packs float32 ``x`` ``[L][H][T][d]`` (or ``[H][T][d]``) into uint8 ``[L][H][bytes]``."""
        a, lifted = as_cache(x, "x")
        out = self._q._encode(a, part)
        return out[0] if lifted else out

    def decode(self, packed: Any, tokens: int, head_dim: int, part: Part = "keys") -> np.ndarray:
        """Unpacks ``encode``'s output to float32 ``[L][H][tokens][head_dim]``."""
        p = as_array(packed, "packed")
        lifted = p.ndim == 2
        out = self._q._decode(p[np.newaxis] if lifted else p, tokens, head_dim, part)
        return out[0] if lifted else out


class PackedCache(_core.PackedCache):
    """The quantized cache of one KV head: appended tokens go through an fp32 residual window of
    ``quantizer.residual`` tokens; older whole groups are packed. ``append(k, v)`` takes float32
    ``[n][d]``; ``decode()`` gives back ``(k, v)`` ``[size][d]`` in the original space."""

    def __init__(self, quantizer: Quantizer | str, head_dim: int) -> None:
        q = quantizer if isinstance(quantizer, Quantizer) else Quantizer(quantizer)
        super().__init__(q._q, head_dim)

    def append(self, k: Any, v: Any) -> None:  # type: ignore[override]
        super().append(as_array(k, "k"), as_array(v, "v"))

    def decode(self) -> Tuple[np.ndarray, np.ndarray]:  # type: ignore[override]
        return super().decode()


def packed_attention(heads: Sequence[PackedCache], q: Any, causal: bool = False) -> np.ndarray:
    """Attention of float32 queries ``[Hq][n][d]`` over one layer's packed KV heads (GQA: Hq a
    multiple of ``len(heads)``), read tile by tile without dequantizing the cache; returns
    float32 ``[Hq][n][d]``. ``causal``: the queries are the cache's last n tokens."""
    return _core.packed_attention(list(heads), as_array(q, "q"), causal)
