"""The RoPE frequencies of a transformers model, for kvpolicy scorers that rotate queries to
future positions (``expected``)."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np


def model_rope_inv_freq(model: Any) -> Optional[np.ndarray]:
    """The inverse RoPE frequencies ``[head_dim // 2]`` of the model's first rotary embedding
    (its ``inv_freq`` buffer, float32), or None when it has none. Models with several rotary
    embeddings (Gemma3's local and global layers) get the first one's."""
    for module in model.modules():
        inv = getattr(module, "inv_freq", None)
        if inv is not None and hasattr(inv, "detach"):
            return inv.detach().float().cpu().numpy()
    return None
