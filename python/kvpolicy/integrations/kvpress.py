"""A kvpress press that delegates scoring and selection to kvpolicy.

    from kvpress import KVPressTextGenerationPipeline
    from kvpolicy.integrations.kvpress import KVPolicyPress
    press = KVPolicyPress("snapkv(window=32) | adakv", compression_ratio=0.5)
    pipe(context, question=question, press=press)        # or: with press(model): model(...)

Needs torch and kvpress (``pip install kvpress``); kvpolicy does not install them. Like every
kvpress press it compresses once, after the prefill of each attention layer (kvpress's forward
hook); the press computes what the policy reads from the layer (post-RoPE queries of the last
``query_window`` tokens from ``q_proj`` and the rotary embeddings, or the attention weights when
the model returns them), calls ``kvpolicy.Policy.select`` on CPU copies (zero-copy for float32 /
float16 CPU tensors) and gathers the kept rows into the cache.

What transformers' cache cannot hold, and what the press therefore refuses or approximates:
- ragged per-head budgets (adakv, ams, and any head-level allocator): a DynamicCache layer is
  one rectangular tensor, so every head keeps as many rows as the layer's longest one, filled up
  with its best-scored evicted tokens (``kvpolicy.integrations.rectangular``); the selection is
  kvpolicy's, the memory saving is that of the longest row. ``kept_counts`` records the real
  per-head counts of the last call.
- mergers (semantic, nearest): their rows carry log(count), which attention must add to the
  logits; transformers' attention has no such term. Rejected.
- quantizers (int2, int4, kivi): packed tiles need kvpolicy's packed attention. Rejected (use
  transformers' QuantizedCache separately if you want quantization).
- decode-time eviction (h2o at every step, Session.decode_interval): kvpress compresses the
  prefill only; h2o here is its prefill form (accumulated attention of the prompt's queries,
  kvpress's ObservedAttention).
- state across events (h2o sums during decoding, ams credit): none, one event per layer.
kvpress's ObservedAttentionPress is ``h2o(recent_tokens=0,normalize=true)`` here (attention
weights needed: load the model with ``attn_implementation="eager"``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

try:
    import torch
    from kvpress.presses.base_press import BasePress
except ImportError as e:  # pragma: no cover - depends on the optional packages
    raise ImportError("kvpolicy.integrations.kvpress needs torch and kvpress "
                      "(pip install kvpress); kvpolicy itself does not depend on them") from e

import numpy as np

from .._policy import Policy
from .rectangular import rectangular_indices


def _rotate_half(x: "torch.Tensor") -> "torch.Tensor":
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def window_queries(module: Any, hidden_states: "torch.Tensor", n: int,
                   position_embeddings: Tuple["torch.Tensor", "torch.Tensor"]) -> "torch.Tensor":
    """Post-RoPE queries ``[B][Hq][n][d]`` of the last n positions of a Llama-style attention
    layer (q_proj, half-split rotary embedding as transformers applies it)."""
    B, T, _ = hidden_states.shape
    d = module.head_dim
    q = module.q_proj(hidden_states[:, T - n:])
    q = q.view(B, n, -1, d).transpose(1, 2)
    if hasattr(module, "q_norm"):  # Qwen3-style per-head norm before RoPE
        q = module.q_norm(q)
    cos, sin = position_embeddings
    cos, sin = cos[:, T - n:].unsqueeze(1), sin[:, T - n:].unsqueeze(1)
    return q * cos + _rotate_half(q) * sin


def _host(x: "torch.Tensor") -> "torch.Tensor":
    """A CPU float32/float16 tensor (the same memory when it already is one)."""
    x = x.detach()
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float16):
        x = x.to("cpu", torch.float32)
    return x


@dataclass
class KVPolicyPress(BasePress):
    """kvpress press running a kvpolicy spec. ``compression_ratio``: fraction of each layer's
    tokens removed (kvpress's convention; kept per head = max(1, int(T * (1 - ratio))), as
    kvpress's ScorerPress computes it)."""

    spec: str = "snapkv"
    compression_ratio: float = 0.0
    timings: List[Tuple[int, float]] = field(default_factory=list, repr=False)
    kept_counts: Optional[np.ndarray] = field(default=None, repr=False)
    last_selection: List[Any] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.compression_ratio < 1.0:
            raise ValueError(f"compression_ratio: {self.compression_ratio} is outside [0, 1)")
        self.policy = Policy(self.spec)
        if self.policy.merger:
            raise ValueError(f"spec: merger '{self.policy.merger}' needs log(count) in the "
                             "attention logits, which transformers' attention does not add")
        if self.policy.quantizer:
            raise ValueError(f"spec: quantizer '{self.policy.quantizer}' needs kvpolicy's packed "
                             "attention; transformers' cache stores full-precision rows")
        self.model_layers = 0

    def __post_init_from_model__(self, model: Any) -> None:
        self.model_layers = int(model.config.num_hidden_layers)

    def compress(self, module: Any, hidden_states: "torch.Tensor", keys: "torch.Tensor",
                 values: "torch.Tensor", attentions: Optional["torch.Tensor"],
                 kwargs: dict) -> Tuple["torch.Tensor", "torch.Tensor"]:
        if self.compression_ratio == 0:
            return keys, values
        t0 = time.perf_counter()
        B, H, T, _ = keys.shape
        n_keep = max(1, int(T * (1 - self.compression_ratio)))
        needs = self.policy.needs
        acc = obs = None
        q = None
        if "accumulated" in needs and attentions is not None:
            # Attention sums of the prompt's queries, GQA group mean (as the Session records it),
            # and how many queries saw each key (T - t under the causal mask).
            a = attentions.detach().to("cpu", torch.float32).sum(dim=2)
            acc = a.view(B, H, -1, T).mean(dim=2).contiguous().numpy()
            seen = np.arange(T, 0, -1, dtype=np.float32)
            obs = np.ascontiguousarray(np.broadcast_to(seen, (1, H, T)))
        elif "queries" in needs or "accumulated" in needs:
            w = self.policy.query_window
            n = T if w < 0 else min(w, T)
            q = _host(window_queries(module, hidden_states, n, kwargs["position_embeddings"]))
        k, v = _host(keys), _host(values)
        if q is not None and q.dtype != k.dtype:
            q = q.to(k.dtype)
        rows = []
        counts = []
        for b in range(B):
            r = self.policy.select(k[b:b + 1].numpy(), v[b:b + 1].numpy(),
                                   None if q is None else q[b:b + 1].contiguous().numpy(),
                                   budget_tokens=n_keep,
                                   accumulated=None if acc is None else acc[b:b + 1],
                                   observed=obs,
                                   return_scores=True, first_layer=int(module.layer_idx),
                                   model_layers=self.model_layers)
            rows.append(r)
            counts.append(r.counts[0])
        width = max(int(c.max()) for c in counts)
        idx = np.stack([rectangular_indices(r, width)[0] for r in rows])  # [B][H][width]
        self.kept_counts = np.stack(counts)
        self.last_selection = rows  # kvpolicy's own (possibly ragged) selections, per batch row
        gather = torch.from_numpy(idx).to(keys.device).unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
        keys = keys.gather(2, gather).contiguous()
        values = values.gather(2, gather).contiguous()
        self.timings.append((int(module.layer_idx), time.perf_counter() - t0))
        return keys, values
