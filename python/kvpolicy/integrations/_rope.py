"""The RoPE frequencies of a transformers model, for kvpolicy scorers that rotate queries to
future positions (``expected``)."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np


def model_rope_inv_freq(model: Any, head_dim: Optional[int] = None) -> Optional[np.ndarray]:
    """The inverse RoPE frequencies ``[head_dim // 2]`` of the model's first rotary embedding
    (its ``inv_freq`` buffer, float32) when it rotates the whole head (``head_dim // 2``
    frequencies, checked when ``head_dim`` is given); None otherwise (no rotary embedding, no
    ``modules()``, partial RoPE, a vision tower's), and then ``expected`` refuses with a message
    unless its spec gives ``theta=``. Models with several rotary embeddings (Gemma3's local and
    global layers) get the first one's."""
    modules = getattr(model, "modules", None)
    if not callable(modules):
        return None
    for module in modules():
        inv = getattr(module, "inv_freq", None)
        if inv is not None and hasattr(inv, "detach"):
            f = inv.detach().float().cpu().numpy().reshape(-1)
            return f if head_dim is None or 2 * f.shape[0] == head_dim else None
    return None
