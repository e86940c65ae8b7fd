"""Array intake shared by the wrappers: numpy arrays pass through untouched; DLPack tensors
(torch, JAX, CuPy on the host, ...) are imported with ``numpy.from_dlpack``, which shares their
memory; anything else raises TypeError naming the argument. The C++ side then checks dtype,
rank, shape and strides without copying."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

# DLPack device types (dlpack.h) whose memory numpy reads: the host, and CUDA's pinned host memory.
_HOST_DEVICES = (1, 3)  # kDLCPU, kDLCUDAHost


def dlpack_device(x: Any) -> Optional[Tuple[int, int]]:
    """``(device type, device id)`` of a DLPack tensor outside host memory (a CUDA tensor:
    type 2), or None for numpy arrays, host tensors and anything else."""
    if x is None or isinstance(x, np.ndarray) or not hasattr(x, "__dlpack_device__"):
        return None
    kind, index = x.__dlpack_device__()
    kind = int(getattr(kind, "value", kind))
    return None if kind in _HOST_DEVICES else (kind, int(index))


def as_array(x: Any, name: str) -> np.ndarray:
    """``x`` as a numpy array sharing its memory, or TypeError naming ``name``."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x)
        except (TypeError, BufferError, RuntimeError, ValueError) as e:
            # e.g. bfloat16 (numpy has no such dtype).
            raise TypeError(f"{name}: cannot view this {type(x).__name__} as a numpy array "
                            f"through DLPack ({e}); pass a float32/float16 tensor") from e
    raise TypeError(f"{name}: expected a numpy array or a DLPack tensor, got {type(x).__name__}")


def as_cache(x: Any, name: str) -> Tuple[np.ndarray, bool]:
    """A cache ``[L][H][T][d]`` (a 3-d ``[H][T][d]`` is one layer: a view with L = 1).
    Returns the 4-d array and whether it was lifted from 3-d."""
    a = as_array(x, name)
    if a.ndim == 3:
        return a[np.newaxis], True
    if a.ndim != 4:
        raise ValueError(f"{name}: expected a 4-d array [layers][heads][tokens][head_dim] "
                         f"(or 3-d [heads][tokens][head_dim]), got {a.ndim} dimensions")
    return a, False


def budget_args(budget: float | None, budget_tokens: int | None,
                budget_total: int | None) -> Tuple[str, float]:
    """(kind, value) for the C++ side: 'r' ratio, 't' tokens per head, 'T' tokens in total."""
    given = [n for n, v in (("budget_tokens", budget_tokens), ("budget_total", budget_total))
             if v is not None]
    if len(given) > 1:
        raise ValueError("budget: pass at most one of budget_tokens and budget_total")
    if budget_tokens is not None:
        return "t", float(_count(budget_tokens, "budget_tokens"))
    if budget_total is not None:
        return "T", float(_count(budget_total, "budget_total"))
    if budget is None or isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"budget: expected a ratio in [0, 1] (float), got {budget!r}")
    if not 0.0 <= float(budget) <= 1.0:
        raise ValueError(f"budget: ratio {budget} is outside [0, 1] (use budget_tokens= for a "
                         "token count per head)")
    return "r", float(budget)


def _count(n: Any, name: str) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {n!r}")
    if n < 0:
        raise ValueError(f"{name}: must be >= 0, got {n}")
    return int(n)
