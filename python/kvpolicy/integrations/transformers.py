"""A transformers ``Cache`` whose KV cache is a ``kvpolicy.Session``: compression inside
``model.generate()`` (and plain ``model(...)`` calls), after the prefill and while decoding.

    import kvpolicy.integrations.transformers as kvt     # registers attn_implementation="kvpolicy"
    model = AutoModelForCausalLM.from_pretrained(..., dtype=torch.float32,
                                                 attn_implementation="kvpolicy")
    cache = kvt.KVPolicyCache(model, "snapkv | adakv", budget=0.2)
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=64, do_sample=False)
    cache.memory()        # bytes of K/V held (fp32 rows, or packed tiles for int2/int4/kivi)

Needs torch and transformers (kvpolicy does not depend on them; ``scripts/setup.sh --with-torch``
installs the pinned versions).

How it works. Every attention layer of the model calls ``past_key_values.update(k, v, layer)``
with the new tokens' post-RoPE keys and values, then the attention function of
``config._attn_implementation``. The cache holds nothing itself: ``update`` hands the new tokens
through, and the attention function registered here as ``"kvpolicy"`` appends them, with the
post-RoPE queries, to one ``kvpolicy.Session`` (float32, one per cache; layers, KV heads, query
heads and head_dim from the model config), computes the layer's output with ``Session.attend``
and calls ``Session.compress_if_due``. The Session's first compression of a layer (right after
the prefill's attention) compresses the prompt to the budget; later ones run every ``interval``
new tokens (h2o: every token).

What attention computes (``Session.attend``): softmax(q k^T / sqrt(d) + log(count)) v per query
head over its KV head (GQA: query head h reads KV head h // (Hq / Hkv), as transformers'
repeat_kv), causal among the tokens of a multi-token call, over each head's own ragged length.
This is the model's own attention when nothing is compressed: at budget 1.0 the logits equal the
sdpa path to fp32 rounding (python/tests/test_transformers_cache.py checks it).
- Per-head budgets (adakv, ams, pyramid/depthkv across layers) are stored without padding in the
  attention: each KV head attends over exactly its own rows. Storage is one buffer per layer,
  ``[kv_heads][capacity][head_dim]``, one capacity for all heads of the layer: after the
  prefill compression it is set to the longest head's target + ``interval`` when decode-time
  compression bounds the heads (then it never grows), else to the longest head (then it grows by
  doubling as tokens come in). Shorter heads leave their rows past their length allocated but
  unused.
  ``memory()`` counts the K/V rows held (what a tight allocator needs), ``storage_bytes()`` the
  buffers allocated.
- Mergers (semantic, nearest) fold evicted tokens into kept rows, and attention adds each row's
  log(count) to its logit (proportional attention). The cache does not see token text, so
  ``semantic`` cuts chunks every ``chunk`` tokens rather than at delimiter tokens (kvpolicy's own
  engine passes delimiter flags, so its merged rows can differ).
- Quantizers (int2, int4, kivi; alone or after a scorer) keep the survivors packed after the
  prefill compression (the fp32 storage is released) and attention reads the packed tiles
  (``quant::packed_attention``); ``memory()`` reports the packed bytes. A packed cache is
  compressed once: no decode-time eviction (h2o, ``interval > 0``) with a quantizer.

Budgets: ``budget`` (kept fraction of the prompt, per KV head), ``budget_tokens`` (tokens per KV
head) or ``budget_total`` (tokens over a layer's KV heads), as ``kvpolicy.Session``. A token budget
above the prompt lets the cache grow to it before decode-time compression starts.
``interval``: tokens between decode-time compressions (0, the default: the policy's own, every
token for h2o, never for the others), each compressing every head back to the target the prefill
compression fixed; a head then holds between target and target + interval tokens.

Supported: decoder-only models whose attention is plain scaled dot-product attention over
post-RoPE (or any position-encoded) q and k with scaling 1/sqrt(head_dim) and a causal mask:
Llama and its relatives (tested on SmolLM2, a Llama). Refused with an error that says why:
sliding-window or chunked layers, attention logit soft-capping, attention sinks, another scaling,
batch size > 1, padding or custom attention masks, dtypes other than float32, tensors off the
CPU, beam search and other cache reordering, cropping (assisted decoding), output_attentions.
Without a ``KVPolicyCache`` (a ``DynamicCache``, ``use_cache=False``) ``"kvpolicy"`` attention is
transformers' sdpa, so one model serves both.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Tuple

try:
    import torch
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface
except ImportError as e:  # pragma: no cover - depends on the optional packages
    raise ImportError("kvpolicy.integrations.transformers needs torch and transformers "
                      "(pip install torch transformers); kvpolicy itself does not depend on "
                      "them") from e

import numpy as np

from .._policy import Policy
from .._session import Session
from ._rope import model_rope_inv_freq

ATTN_IMPLEMENTATION = "kvpolicy"

# The (cache, layer, keys, values) that the last update() handed through, per thread: the
# attention function that transformers calls right after it picks them up.
_pending = threading.local()


def register() -> str:
    """Registers ``"kvpolicy"`` with transformers' AttentionInterface (and sdpa's mask builder
    under the same name); idempotent, done on import. Returns the name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, kvpolicy_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION


def kvpolicy_attention(module: Any, query: "torch.Tensor", key: "torch.Tensor",
                       value: "torch.Tensor", attention_mask: Optional["torch.Tensor"],
                       dropout: float = 0.0, scaling: Optional[float] = None,
                       **kwargs: Any) -> Tuple["torch.Tensor", None]:
    """transformers attention function ``"kvpolicy"``: the layer's attention over the
    ``KVPolicyCache`` whose ``update`` ran just before; sdpa when there is none."""
    item = getattr(_pending, "item", None)
    if item is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    _pending.item = None
    cache, layer, k, v = item
    if layer != getattr(module, "layer_idx", layer) or k is not key:
        raise RuntimeError(f"KVPolicyCache: attention of layer {getattr(module, 'layer_idx', '?')} "
                           f"did not receive what update() handed through for layer {layer}; "
                           "the model transforms keys between the cache and attention, which "
                           "this cache does not support")
    return cache._attend(module, layer, query, k, v, attention_mask, dropout, scaling, kwargs)


class _SessionLayer(CacheLayerMixin):
    """One layer's view of a KVPolicyCache for transformers' bookkeeping (lengths, mask sizes);
    the K/V live in the cache's Session."""

    is_sliding = False
    is_compileable = False

    def __init__(self, cache: "KVPolicyCache", index: int) -> None:
        super().__init__()
        self._cache = cache
        self._index = index
        self.max_batch_size = 1
        self.max_cache_len = -1

    def lazy_initialization(self, key_states: "torch.Tensor", value_states: "torch.Tensor" = None) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, cache_kwargs=None):
        return self._cache.update(key_states, value_states, self._index, cache_kwargs)

    def get_seq_length(self) -> int:
        return self._cache._seen[self._index]

    def get_mask_sizes(self, cache_position: "torch.Tensor") -> Tuple[int, int]:
        # Masks are built over original positions (what attention sees uncompressed); the
        # kvpolicy attention checks that a mask is the plain causal one and then ignores it.
        return self._cache._seen[self._index] + int(cache_position.shape[0]), 0

    def get_max_cache_shape(self) -> int:
        return -1

    def reset(self) -> None:
        self._cache.reset()

    def offload(self) -> None:
        raise NotImplementedError("KVPolicyCache: offloading is not supported (the cache lives "
                                  "in host memory already)")

    prefetch = offload

    def reorder_cache(self, beam_idx: "torch.LongTensor") -> None:
        raise NotImplementedError("KVPolicyCache holds one sequence: beam search and other "
                                  "cache reordering are not supported")

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("KVPolicyCache: a compressed cache cannot be cropped back to a "
                                  "position (assisted decoding, contrastive search)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise NotImplementedError("KVPolicyCache holds one sequence: num_beams and "
                                      "num_return_sequences must be 1")

    def batch_select_indices(self, indices: "torch.Tensor") -> None:
        raise NotImplementedError("KVPolicyCache holds one sequence; it cannot select batch rows")


class KVPolicyCache(Cache):
    """A transformers Cache backed by one ``kvpolicy.Session`` (float32, batch size 1).

    ``model``: the model that will use it, loaded in float32 on the CPU with
    ``attn_implementation="kvpolicy"`` (or switched with
    ``model.set_attn_implementation("kvpolicy")``). ``policy``: a kvpolicy spec or Policy.
    ``budget`` / ``budget_tokens`` / ``budget_total``: as ``kvpolicy.Session`` (one of the last
    two, or a ratio of the prompt). ``interval``: tokens between decode-time compressions (0:
    the policy's default, every token for h2o and never for the others). ``initial_capacity``:
    tokens per head allocated up front. ``fit_storage``: after a layer's prefill compression,
    size its storage to what it will hold (target + interval tokens per head with decode-time
    compression, else its longest head). See the module docstring for what is supported.
    """

    def __init__(self, model: Any, policy: Policy | str = "snapkv", *, budget: float = 1.0,
                 budget_tokens: Optional[int] = None, budget_total: Optional[int] = None,
                 interval: int = 0, initial_capacity: int = 256,
                 fit_storage: bool = True) -> None:
        config = _checked_config(model)
        self.policy = policy if isinstance(policy, Policy) else Policy(policy)
        if "reconstruction" in self.policy.needs:
            raise ValueError(f"KVPolicyCache: scorer '{self.policy.scorer}' reads the scores of a "
                             "pass that repeats the context, which model.generate() does not run "
                             "(kvpolicy.Session.reconstruct takes that pass's queries, keys and "
                             "values)")
        self.num_layers = int(config.num_hidden_layers)
        self.q_heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.q_heads)
        self.head_dim = int(getattr(config, "head_dim", None)
                            or config.hidden_size // config.num_attention_heads)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
            raise ValueError(f"interval: expected an int >= 0 (0: the policy's default), "
                             f"got {interval!r}")
        self._session_args = dict(layers=self.num_layers, kv_heads=self.kv_heads,
                                  q_heads=self.q_heads, head_dim=self.head_dim, budget=budget,
                                  budget_tokens=budget_tokens, budget_total=budget_total,
                                  decode_interval=interval, initial_capacity=initial_capacity,
                                  rope_inv_freq=model_rope_inv_freq(model, self.head_dim))
        self.session = Session(self.policy, **self._session_args)
        self.fit_storage = bool(fit_storage)
        self._needs_queries = "queries" in self.policy.needs
        super().__init__(layers=[_SessionLayer(self, l) for l in range(self.num_layers)])
        self._reset_counters()

    def _reset_counters(self) -> None:
        self._seen: List[int] = [0] * self.num_layers
        # Compression events per layer (the prefill's, then decode-time ones).
        self.compressions: List[int] = [0] * self.num_layers

    # --- what transformers calls ------------------------------------------------------------

    def update(self, key_states: "torch.Tensor", value_states: "torch.Tensor", layer_idx: int,
               cache_kwargs: Optional[Dict[str, Any]] = None) -> Tuple["torch.Tensor", "torch.Tensor"]:
        """Hands the new tokens' K/V ``[1][Hkv][n][d]`` through to the kvpolicy attention
        function, which appends them to the Session together with the queries."""
        stale = getattr(_pending, "item", None)
        if stale is not None and stale[0] is self:
            _pending.item = None
            raise RuntimeError("KVPolicyCache: the attention of layer "
                               f"{stale[1]} did not run through kvpolicy; load the model with "
                               "attn_implementation='kvpolicy' (import "
                               "kvpolicy.integrations.transformers first) or call "
                               "model.set_attn_implementation('kvpolicy')")
        if not 0 <= layer_idx < self.num_layers:
            raise IndexError(f"KVPolicyCache: layer {layer_idx} is outside [0, {self.num_layers})")
        _check_tensor(key_states, "key_states", self.kv_heads, self.head_dim)
        _check_tensor(value_states, "value_states", self.kv_heads, self.head_dim)
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)
        self._seen[layer_idx] += int(key_states.shape[2])
        _pending.item = (self, layer_idx, key_states, value_states)
        return key_states, value_states

    def _attend(self, module: Any, layer: int, query: "torch.Tensor", k: "torch.Tensor",
                v: "torch.Tensor", mask: Optional["torch.Tensor"], dropout: float,
                scaling: Optional[float], kwargs: Dict[str, Any]) -> Tuple["torch.Tensor", None]:
        d = self.head_dim
        if scaling is not None and abs(float(scaling) * d ** 0.5 - 1.0) > 1e-6:
            raise ValueError(f"KVPolicyCache: the model scales attention logits by {scaling}, "
                             f"kvpolicy's attention by 1/sqrt(head_dim) = {d ** -0.5:.6g}")
        if dropout:
            raise ValueError("KVPolicyCache: attention dropout (training mode) is not supported; "
                             "call model.eval()")
        for name, what in (("sliding_window", "sliding-window attention"),
                           ("softcap", "attention logit soft-capping"),
                           ("s_aux", "attention sinks")):
            if kwargs.get(name) is not None:
                raise ValueError(f"KVPolicyCache: {what} is not supported")
        if kwargs.get("output_attentions"):
            raise ValueError("KVPolicyCache: output_attentions is not supported (attention "
                             "weights are not materialized)")
        _check_tensor(query, "query", self.q_heads, d)
        n = int(query.shape[2])
        if int(k.shape[2]) != n:
            raise ValueError(f"KVPolicyCache: {n} queries for {int(k.shape[2])} new keys")
        self._check_mask(mask, layer, n)
        q = query[0].detach()
        s = self.session
        s.append(layer, k[0].detach(), v[0].detach(), q if self._needs_queries else None)
        out = s.attend(layer, q)
        if s.compress_if_due(layer):
            self.compressions[layer] += 1
            if self.fit_storage and self.compressions[layer] == 1:
                self._fit_storage(layer)
        return torch.from_numpy(out).transpose(0, 1).unsqueeze(0), None

    def _fit_storage(self, layer: int) -> None:
        """After a layer's first compression: storage for what the layer will hold. With
        decode-time compression a head never holds more than its target + interval, so that is
        reserved once (no regrowth while decoding), unless it is far beyond what the layer holds
        now (a budget for a long generation: the storage then grows by doubling as needed);
        without, the storage shrinks to the longest head."""
        s = self.session
        longest = max(1, int(s.lengths(layer).max()))
        cap = longest
        every = s.decode_interval
        if every > 0:
            bound = int(s.budgets(layer).max()) + every
            if bound <= max(2 * longest, longest + 1024):
                cap = max(bound, longest)
        s.reserve(layer, cap)

    def _check_mask(self, mask: Optional["torch.Tensor"], layer: int, n: int) -> None:
        """A mask must be the plain causal one over original positions (transformers builds one
        for a multi-token call on a non-empty cache); anything else means padding."""
        if mask is None:
            return
        seen = self._seen[layer] - n
        allowed = mask if mask.dtype == torch.bool else mask == 0
        if allowed.dim() != 4 or allowed.shape[0] != 1 or allowed.shape[-2] != n:
            raise ValueError(f"KVPolicyCache: unexpected attention mask of shape "
                             f"{tuple(mask.shape)}")
        kv = int(allowed.shape[-1])
        causal = (torch.arange(kv, device=allowed.device)[None, :]
                  <= torch.arange(seen, seen + n, device=allowed.device)[:, None])
        if kv != seen + n or not torch.equal(allowed[0, 0], causal):
            raise ValueError("KVPolicyCache: the attention mask is not the plain causal mask "
                             "(padding, or a custom mask); the cache holds one unpadded sequence")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens processed so far (original positions), not the tokens held."""
        return self._seen[layer_idx] if 0 <= layer_idx < self.num_layers else 0

    def get_mask_sizes(self, cache_position: "torch.Tensor", layer_idx: int) -> Tuple[int, int]:
        return self.layers[layer_idx].get_mask_sizes(cache_position)

    def reset(self) -> None:
        """Empties the cache (a fresh Session with the same policy and budget)."""
        self.session = Session(self.policy, **self._session_args)
        _pending.item = None
        self._reset_counters()

    @property
    def max_batch_size(self) -> int:
        return 1

    @property
    def max_cache_len(self) -> int:
        return -1

    # --- what the cache holds -------------------------------------------------------------------

    def memory(self) -> int:
        """Bytes of K and V held (``Session.kv_bytes``): fp32 rows of every head's own length
        (2 x head_dim x 4 bytes per token and KV head), or for a quantized layer its packed
        caches' bytes (tiles, scales, key norms and the fp32 residual window)."""
        return int(self.session.kv_bytes)

    def storage_bytes(self) -> int:
        """Bytes of K/V storage allocated: per fp32 layer ``kv_heads x capacity x head_dim x 4``
        for K and for V (see ``fit_storage``), per quantized layer its packed caches' bytes.
        Per-token bookkeeping (positions, statistics) is not counted."""
        total = 0
        for l in range(self.num_layers):
            if self.session.quantized(l):
                total += sum(int(self.session.packed(l, h).memory_bytes)
                             for h in range(self.kv_heads))
            else:
                total += 2 * self.kv_heads * self.session.capacity(l) * self.head_dim * 4
        return total

    def lengths(self, layer: int) -> np.ndarray:
        """Tokens held per KV head of ``layer``."""
        return self.session.lengths(layer)

    def positions(self, layer: int, head: int) -> np.ndarray:
        """Original positions of the tokens held by (layer, KV head), ascending."""
        return self.session.positions(layer, head)

    def budgets(self, layer: int) -> np.ndarray:
        """Per-head targets fixed by the layer's first compression (empty before it)."""
        return self.session.budgets(layer)

    def __repr__(self) -> str:
        return (f"KVPolicyCache({self.policy.spec!r}, layers={self.num_layers}, "
                f"seen={self._seen[0]}, memory={self.memory()} B)")


def _check_tensor(x: "torch.Tensor", name: str, heads: int, d: int) -> None:
    if x.dim() != 4 or x.shape[1] != heads or x.shape[3] != d:
        raise ValueError(f"KVPolicyCache: {name} has shape {tuple(x.shape)}, expected "
                         f"[1][{heads}][n][{d}]")
    if x.shape[0] != 1:
        raise ValueError(f"KVPolicyCache: batch size {x.shape[0]}; the cache holds one sequence "
                         "(use one cache per sequence; num_beams and num_return_sequences must "
                         "be 1)")
    if x.dtype != torch.float32:
        raise TypeError(f"KVPolicyCache: {name} is {x.dtype}; kvpolicy's Session is float32 "
                        "(load the model with dtype=torch.float32)")
    if x.device.type != "cpu":
        raise ValueError(f"KVPolicyCache: {name} is on {x.device}; kvpolicy's Session runs on "
                         "the CPU (keep the model there)")


def _checked_config(model: Any) -> Any:
    """The model's decoder config, after refusing what the kvpolicy attention cannot compute."""
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"model: expected a transformers model, got {type(model).__name__}")
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    name = getattr(config, "model_type", type(config).__name__)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"model: {name} is an encoder-decoder model; KVPolicyCache supports "
                         "decoder-only models")
    impl = getattr(getattr(model, "config", config), "_attn_implementation", None)
    if impl != ATTN_IMPLEMENTATION:
        raise ValueError(f"model: attention implementation is {impl!r}; load the model with "
                         "attn_implementation='kvpolicy' (import "
                         "kvpolicy.integrations.transformers first) or call "
                         "model.set_attn_implementation('kvpolicy')")
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ValueError(f"model: {name} has layers of type "
                         f"{sorted(set(layer_types) - {'full_attention'})}; KVPolicyCache "
                         "supports full causal attention in every layer")
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True):
        raise ValueError(f"model: {name} uses sliding-window attention ({window} tokens), "
                         "which KVPolicyCache does not support")
    for attr in ("attn_logit_softcapping", "attention_chunk_size"):
        if getattr(config, attr, None) is not None:
            raise ValueError(f"model: {name} sets {attr}, which KVPolicyCache does not support")
    for attr in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
        if not isinstance(getattr(config, attr, None), int):
            raise ValueError(f"model: {name}'s config has no {attr}; KVPolicyCache supports "
                             "Llama-style decoder-only models")
    params = getattr(model, "parameters", None)
    p = next(iter(params()), None) if callable(params) else None
    if p is not None and p.dtype != torch.float32:
        raise TypeError(f"model: weights are {p.dtype}; kvpolicy's Session is float32 (load the "
                        "model with dtype=torch.float32)")
    if p is not None and p.device.type != "cpu":
        raise ValueError(f"model: weights are on {p.device}; kvpolicy's Session runs on the CPU")
    return config


register()
