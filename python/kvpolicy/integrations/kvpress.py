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

Budgets mean kept tokens: ``compression_ratio`` removes that fraction of each layer's tokens
(kept per head = max(1, int(T * (1 - ratio))), as kvpress's ScorerPress computes it), and every
head attends to exactly what the policy kept for it:
- ragged per-head budgets (adakv, ams, pyramid across layers): a DynamicCache layer is one
  rectangular tensor and transformers builds one attention mask from layer 0's length, so every
  layer holds as many rows as the longest head of the model. The rows a head did not keep (its
  best-scored evicted tokens, ``kvpolicy.integrations.rectangular``, and padding) are masked out
  of attention with kvpress's key masking, as kvpress's AdaKVPress does (``ragged="mask"``, the
  default; needs a non-eager attention implementation, which kvpress patches). ``ragged="attend"``
  lets the filled-in tokens take part in attention instead (more tokens than asked for).
  ``kept_fraction`` reports the tokens the policy kept, ``held_fraction`` the rows the cache
  holds (the memory), both over the last prefill.
- a budget below the scorer's protected window (snapkv's 64-query window on a short prompt)
  keeps the newest tokens up to the budget, with a RuntimeWarning.

What transformers' cache cannot hold, and what the press therefore refuses:
- mergers (semantic, nearest): their rows carry log(count), which attention must add to the
  logits; transformers' attention has no such term.
- quantizers (int2, int4, kivi, alone or after a scorer): packed tiles need kvpolicy's packed
  attention (kvpolicy.Session); transformers' cache stores full-precision rows.
- decode-time eviction (h2o at every step, Session.decode_interval): kvpress compresses the
  prefill only; h2o here is its prefill form (accumulated attention of the prompt's queries,
  kvpress's ObservedAttention, which needs ``attn_implementation="eager"``).
- state across events (h2o sums during decoding, ams credit): none, one event per layer.
kvpress's ObservedAttentionPress is ``h2o(preset=observed)`` here, and its
ExpectedAttentionPress is ``expected`` (the press passes the model's RoPE frequencies; with a
window of at least the prompt's length, the default 1024, the scores are kvpress's).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

try:
    import torch
    from kvpress.presses.base_press import BasePress, is_prefilling
except ImportError as e:  # pragma: no cover - depends on the optional packages
    raise ImportError("kvpolicy.integrations.kvpress needs torch and kvpress "
                      "(pip install kvpress); kvpolicy itself does not depend on them") from e

import numpy as np

from .._policy import Policy
from ._rope import model_rope_inv_freq
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


def _uses_eager(module: Any) -> bool:
    config = getattr(module, "config", None)
    return getattr(config, "_attn_implementation", None) == "eager"


@dataclass
class KVPolicyPress(BasePress):
    """kvpress press running a kvpolicy spec. ``compression_ratio``: fraction of each layer's
    tokens removed (kvpress's convention; kept per head = max(1, int(T * (1 - ratio))), as
    kvpress's ScorerPress computes it). ``ragged``: "mask" (default) or "attend", what the rows
    a head did not keep do in attention (see the module docstring)."""

    spec: str = "snapkv"
    compression_ratio: float = 0.0
    ragged: str = "mask"
    timings: List[Tuple[int, float]] = field(default_factory=list, repr=False)
    kept_counts: Optional[np.ndarray] = field(default=None, repr=False)
    last_selection: List[Any] = field(default_factory=list, repr=False)
    # Per layer of the last prefill, summed over batch rows and KV heads: (tokens before
    # compression, tokens the policy kept, rows the cache holds).
    layer_stats: Dict[int, Tuple[int, int, int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.compression_ratio < 1.0:
            raise ValueError(f"compression_ratio: {self.compression_ratio} is outside [0, 1)")
        if self.ragged not in ("mask", "attend"):
            raise ValueError(f"ragged: '{self.ragged}' is not 'mask' or 'attend'")
        self.policy = Policy(self.spec)
        if self.policy.merger:
            raise ValueError(f"spec: merger '{self.policy.merger}' needs log(count) in the "
                             "attention logits, which transformers' attention does not add")
        if self.policy.quantizer:
            raise ValueError(f"spec: quantizer '{self.policy.quantizer}' needs kvpolicy's packed "
                             "attention (kvpolicy.Session); transformers' cache stores "
                             "full-precision rows")
        if "reconstruction" in self.policy.needs:
            raise ValueError(f"spec: scorer '{self.policy.scorer}' reads the scores of a pass "
                             "that repeats the context, which KVPolicyPress does not run "
                             "(kvpress's KVzipPress does; in kvpolicy: Engine.reconstruct, or "
                             "Session.reconstruct from your own forward pass)")
        self.model_layers = 0
        self._rope: Optional[np.ndarray] = None  # the model's inverse RoPE frequencies
        self._hooked: List[int] = []  # the layers kvpress hooks (Gemma3: not the sliding ones)
        self._modules: Dict[int, Any] = {}

    def post_init_from_model(self, model: Any) -> None:
        """kvpress calls this when the press is entered (``with press(model)``)."""
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
            else model.config
        self.model_layers = int(config.num_hidden_layers)
        self._rope = model_rope_inv_freq(model)  # used where it covers the head (compress)
        # kvpress hooks every decoder layer but Gemma3's sliding-window ones (BasePress.__call__).
        inner = getattr(model, "model", None)
        inner = getattr(inner, "language_model", inner)
        layers = getattr(inner, "layers", None)
        gemma3 = type(model).__name__ == "Gemma3ForConditionalGeneration"
        self._hooked = list(range(self.model_layers)) if layers is None else [
            i for i, layer in enumerate(layers)
            if not (gemma3 and getattr(layer.self_attn, "is_sliding", False))]

    # The spelling of kvpress releases before 0.5 (and of earlier kvpolicy versions).
    __post_init_from_model__ = post_init_from_model

    @property
    def kept_fraction(self) -> float:
        """Tokens the policy kept / tokens before compression, over the last prefill."""
        tokens = sum(t for t, _, _ in self.layer_stats.values())
        return sum(k for _, k, _ in self.layer_stats.values()) / tokens if tokens else 1.0

    @property
    def held_fraction(self) -> float:
        """Cache rows held / tokens before compression, over the last prefill (the memory)."""
        tokens = sum(t for t, _, _ in self.layer_stats.values())
        return sum(h for _, _, h in self.layer_stats.values()) / tokens if tokens else 1.0

    def forward_hook(self, module: Any, input: Any, kwargs: dict, output: Any) -> Any:
        output = super().forward_hook(module, input, kwargs, output)
        q_len = kwargs["hidden_states"].shape[1]
        if (is_prefilling(kwargs["cache_position"], q_len) and self.compression_ratio > 0
                and self._hooked and int(module.layer_idx) == self._hooked[-1]):
            self._equalize(kwargs["past_key_values"])
        return output

    def _equalize(self, cache: Any) -> None:
        """Pads every layer to the model's longest, the padding masked: one attention mask from
        layer 0's length must fit every layer for any later multi-token forward."""
        lengths = {l: cache.layers[l].keys.shape[2] for l in self._modules}
        width = max(lengths.values(), default=0)
        for l, n in lengths.items():
            if n == width:
                continue
            module = self._modules[l]
            if _uses_eager(module):
                raise RuntimeError(
                    f"KVPolicyPress('{self.spec}'): layers keep different numbers of rows, and "
                    "masking the padding needs kvpress's attention patch, which transformers' "
                    "eager attention does not run; load the model with attn_implementation="
                    "'sdpa' (or use a spec with the same budget in every layer)")
            layer = cache.layers[l]
            B, H = layer.keys.shape[:2]
            pad = width - n
            layer.keys = torch.cat([layer.keys, layer.keys[:, :, :1].expand(-1, -1, pad, -1)], 2)
            layer.values = torch.cat([layer.values, layer.values[:, :, :1].expand(-1, -1, pad, -1)],
                                     2)
            dev = layer.keys.device
            b, h, t = torch.meshgrid(torch.arange(B, device=dev), torch.arange(H, device=dev),
                                     torch.arange(n, width, device=dev), indexing="ij")
            extra = (b.flatten(), h.flatten(), t.flatten())
            old = getattr(module, "masked_key_indices", None)
            module.masked_key_indices = extra if old is None else tuple(
                torch.cat([o, e.to(o.device)]) for o, e in zip(old, extra))
            tokens, kept, _ = self.layer_stats[l]
            self.layer_stats[l] = (tokens, kept, B * H * width)

    def compress(self, module: Any, hidden_states: "torch.Tensor", keys: "torch.Tensor",
                 values: "torch.Tensor", attentions: Optional["torch.Tensor"],
                 kwargs: dict) -> Tuple["torch.Tensor", "torch.Tensor"]:
        layer_idx = int(module.layer_idx)
        if layer_idx == (self._hooked[0] if self._hooked else 0):  # a new prefill
            self.layer_stats = {}
            self._modules = {}
        module.masked_key_indices = None
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
        # The model's RoPE frequencies where they rotate the whole head (not partial RoPE).
        rope = self._rope if self._rope is not None and \
            2 * self._rope.shape[0] == keys.shape[-1] else None
        rows = []
        counts = []
        for b in range(B):
            r = self.policy.select(k[b:b + 1].numpy(), v[b:b + 1].numpy(),
                                   None if q is None else q[b:b + 1].contiguous().numpy(),
                                   budget_tokens=n_keep,
                                   accumulated=None if acc is None else acc[b:b + 1],
                                   observed=obs,
                                   return_scores=True, first_layer=layer_idx,
                                   model_layers=self.model_layers, rope_inv_freq=rope)
            rows.append(r)
            counts.append(r.counts[0])
        width = max(int(c.max()) for c in counts)
        idx = np.stack([rectangular_indices(r, width)[0] for r in rows])  # [B][H][width]
        self.kept_counts = np.stack(counts)
        self.last_selection = rows  # kvpolicy's own (possibly ragged) selections, per batch row
        self._modules[layer_idx] = module
        self.layer_stats[layer_idx] = (B * H * T, int(self.kept_counts.sum()), B * H * width)
        if self.ragged == "mask" and int(self.kept_counts.min()) < width:
            # Positions (in the gathered rows) of tokens a head did not keep: masked out.
            filled = np.stack([~np.isin(idx[b, h], rows[b].kept(0, h)) for b in range(B)
                               for h in range(H)]).reshape(B, H, width)
            if _uses_eager(module):
                raise RuntimeError(
                    f"KVPolicyPress('{self.spec}'): heads keep different numbers of tokens, and "
                    "masking the fill-up needs kvpress's attention patch, which transformers' "
                    "eager attention does not run; load the model with attn_implementation="
                    "'sdpa', or pass ragged='attend' to let the filled-in tokens take part")
            module.masked_key_indices = tuple(torch.from_numpy(a).to(keys.device)
                                              for a in np.nonzero(filled))
        gather = torch.from_numpy(idx).to(keys.device).unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
        keys = keys.gather(2, gather).contiguous()
        values = values.gather(2, gather).contiguous()
        self.timings.append((layer_idx, time.perf_counter() - t0))
        return keys, values
