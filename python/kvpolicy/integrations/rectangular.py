"""Ragged selections in rectangular caches.

kvpolicy keeps a different number of tokens per KV head when an allocator says so (adakv, ams,
pyramid across layers). A cache that stores one tensor ``[batch][heads][tokens][dim]`` per layer
(transformers' DynamicCache, hence kvpress) cannot hold rows of different lengths, so a layer
keeps ``width`` = its longest row for every head: each shorter row is filled up with its own
best-scored evicted tokens. The selection itself is unchanged; only the memory saving of the
shorter rows is lost (and the filled-in tokens take part in attention).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .._policy import CompressResult


def rectangular_indices(result: CompressResult, width: Optional[int] = None) -> np.ndarray:
    """Kept indices ``[L][H][width]`` (int64, ascending per row) from a 4-d ``select`` result:
    every row holds its own selection, filled up to ``width`` (default: the longest row) with
    the best-scored tokens it did not keep. Needs ``return_scores=True`` when rows differ."""
    idx, counts = result.indices, result.counts
    if idx.ndim != 3:
        raise ValueError("result: expected a 4-d select result ([layers][heads][K] indices)")
    w = int(counts.max(initial=0)) if width is None else int(width)
    if w < counts.max(initial=0):
        raise ValueError(f"width: {w} is below the longest row ({counts.max()})")
    L, H = counts.shape
    out = np.empty((L, H, w), dtype=np.int64)
    for l in range(L):
        for h in range(H):
            n = int(counts[l, h])
            row = idx[l, h, :n].astype(np.int64)
            if n < w:
                if result.scores is None:
                    raise ValueError("result: rows differ in length; select with "
                                     "return_scores=True to fill them by score")
                s = result.scores[l, h].astype(np.float64).copy()
                if w > s.shape[0]:
                    raise ValueError(f"width: {w} exceeds the {s.shape[0]} tokens of the cache")
                s[row] = np.inf  # kept tokens first, then the best of the others
                order = np.argsort(-s, kind="stable")[:w]
                row = order
            out[l, h] = np.sort(row)
    return out
