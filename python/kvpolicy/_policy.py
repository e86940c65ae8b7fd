"""Policy: a compression policy from a spec string, applied to whole caches held by numpy (or any
DLPack producer)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from . import _core
from ._arrays import as_array, as_cache, budget_args, dlpack_device


@dataclass
class CompressResult:
    """What a compression event kept.

    ``indices``: int32 ``[L][H][K]``, the kept token indices of each (layer, KV head), ascending,
    padded with -1 past ``counts[l, h]`` (K = the largest count; per-head budgets can differ,
    e.g. with ``adakv``). ``counts``: int64 ``[L][H]``.
    ``keys`` / ``values``: ``[L][H][K][d]`` views of the compacted caches (``None`` for
    ``select``): row ``j < counts[l, h]`` of head (l, h) is the token ``indices[l, h, j]``; rows
    past the count are stale. With ``inplace=True`` they are views of the arrays you passed.
    ``scores``: float32 ``[L][H][T]`` when ``return_scores=True`` (higher = keep).
    A 3-d input ``[H][T][d]`` gives results without the layer axis.
    ``warning``: non-empty when the selection departed from the policy to honour the budget (a
    budget below the scorer's protected window keeps the newest tokens); it is also issued as a
    ``RuntimeWarning``.
    """

    indices: np.ndarray
    counts: np.ndarray
    keys: Optional[np.ndarray] = None
    values: Optional[np.ndarray] = None
    scores: Optional[np.ndarray] = None
    warning: str = ""

    def kept(self, layer: int, head: Optional[int] = None) -> np.ndarray:
        """Kept token indices of one (layer, head); for a 3-d input, ``kept(head)``."""
        if self.indices.ndim == 2:
            if head is not None:
                raise TypeError("kept: the input was 3-d [heads][tokens][dim]; call kept(head)")
            return self.indices[layer, : self.counts[layer]]
        if head is None:
            raise TypeError("kept: call kept(layer, head)")
        return self.indices[layer, head, : self.counts[layer, head]]


@dataclass
class HeadShard:
    """Tensor parallelism over KV heads: this rank holds heads ``[first_head, first_head + H)``
    of the model's ``model_heads`` (H: the heads of the cache you pass), and ranks
    ``0 .. ranks-1`` hold ascending, contiguous ranges. Every rank calls ``select`` /
    ``compress`` with the same policy and budget and keeps exactly what one call over every head
    keeps for its heads. Policies whose stages combine heads (``Policy.spans_heads``: adakv,
    tova, expected) exchange a few numbers through ``all_gather``, your communicator:
    ``all_gather(data: bytes) -> bytes`` returns every rank's ``data`` (the same length on every
    rank) concatenated in rank order; anything ``memoryview`` accepts will do (bytes, a numpy
    array). With torch.distributed::

        def all_gather(data):
            t = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
            out = torch.empty(len(data) * world, dtype=torch.uint8, device=device)
            dist.all_gather_into_tensor(out, t)
            return out.cpu().numpy()

    ``all_gather`` may be None for policies that combine no heads. An error in one rank's
    arguments is raised on every rank. Bytes exchanged per event: README, "Tensor
    parallelism"."""

    rank: int
    ranks: int
    first_head: int
    model_heads: int
    all_gather: Optional[Callable[[bytes], Any]] = None

    def _args(self) -> tuple:
        fn = self.all_gather
        return (self.rank, self.ranks, self.first_head, self.model_heads,
                None if fn is None else (lambda data: bytes(memoryview(fn(data)))))



def _freqs(rope_inv_freq) -> list:
    """The model's inverse RoPE frequencies as a host list of float32 values ([] if not given)."""
    if rope_inv_freq is None:
        return []
    return np.asarray(rope_inv_freq, dtype=np.float32).reshape(-1).tolist()

class Policy:
    """A KV-cache compression policy built from a spec string, e.g.
    ``Policy("snapkv(window=32) | adakv")`` (scorer | allocators | merger | quantizer; see the
    README's policy table). A quantizer alone (``Policy("int2")``) keeps every token, packed by
    a Session; its selection accepts only budgets that keep everything. An unknown stage or parameter raises ValueError listing what is valid.

    Caches are ``[layers][kv_heads][tokens][head_dim]`` (or ``[kv_heads][tokens][head_dim]`` for
    one layer), float32 or float16, any non-negative strides (HND or NHD layouts as views).
    Queries are ``[layers][q_heads][n][head_dim]``: the last n queries (post-RoPE), for scorers
    that read them (snapkv, tova, h2o without ``accumulated``, ams).

    CUDA tensors (torch, CuPy, any DLPack producer) are compressed where they are, on the CUDA
    device path (the README's "A spec-string policy on the GPU"): the same kept sets as on the
    host (expected attention: see below). Pass keys, values and queries on one device; the
    device path takes every built-in scorer (snapkv, h2o from queries, tova, knorm, keydiff,
    streaming, expected, and kvzip with ``reconstruction`` on the same device) and the allocators
    uniform, pyramid, depthkv, adakv and ams (a first event: no credit state), and refuses
    mergers and quantizers (Session stages), ``accumulated`` / ``observed``, ``return_scores``
    and ``inplace=False`` by name. ``shard`` works there too, except with tova and expected
    (their scorers combine heads: the host path only); adakv then exchanges on the host.
    ``rope_inv_freq`` (expected attention) stays a host array there too. Expected attention's
    device scores equal the host's to fp32 rounding, so its kept sets can differ at near-ties. It needs
    kvpolicy built with CUDA (``kvpolicy._core.cuda_built``; ``pip install . -C
    cmake.define.KVPOLICY_CUDA=ON``); otherwise it checks the arguments (all but the kernels'
    own shape limits), then raises RuntimeError. float32, float16 and bfloat16 tensors; the
    call runs on the tensors' device. ``stream``: the CUDA stream to run on, as an integer handle (e.g.
    ``torch.cuda.current_stream().cuda_stream``; None: the legacy default stream); the
    producers order their pending work before it (``__dlpack__(stream=...)``), and the call
    returns when the stream has finished (the selection is downloaded). It allocates its
    workspace per call (cudaMalloc); an engine's hot path should use the C++ or C entry with its
    own workspace.
    """

    def __init__(self, spec: str) -> None:
        self._p = _core.Policy(spec)

    @property
    def spec(self) -> str:
        """The normalized spec string."""
        return self._p.spec

    @property
    def scorer(self) -> str:
        return self._p.scorer

    @property
    def quantizer(self) -> str:
        """The quantizer stage's name ('' without one)."""
        return self._p.quantizer

    @property
    def merger(self) -> str:
        """The merger stage's name ('' without one)."""
        return self._p.merger

    @property
    def allocators(self) -> list[str]:
        """Names of the allocator stages, in order."""
        return list(self._p.allocators)

    @property
    def query_window(self) -> int:
        """Queries the policy reads: 0 none, -1 all of them (h2o without accumulated state)."""
        return self._p.query_window

    @property
    def needs(self) -> frozenset[str]:
        """What the policy reads: a subset of {'keys', 'values', 'queries', 'accumulated',
        'reconstruction'}."""
        return frozenset(n for n in self._p.needs.split(",") if n)

    @property
    def spans_heads(self) -> bool:
        """True when a stage combines KV heads (adakv, tova, expected): under tensor parallelism
        (``shard=``) the ranks then exchange data through ``HeadShard.all_gather``."""
        return self._p.spans_heads

    def __repr__(self) -> str:
        return f"Policy({self.spec!r})"

    def select(self, keys: Any, values: Any = None, queries: Any = None, *,
               budget: float = 0.25, budget_tokens: Optional[int] = None,
               budget_total: Optional[int] = None, accumulated: Any = None,
               observed: Any = None, reconstruction: Any = None, return_scores: bool = False,
               first_layer: int = 0, model_layers: int = 0,
               rope_inv_freq: Any = None, shard: Optional[HeadShard] = None,
               stream: Optional[int] = None) -> CompressResult:
        """Which tokens the policy keeps; nothing is written. ``budget`` is the kept fraction of
        each head's tokens; ``budget_tokens`` a count per (layer, head); ``budget_total`` a count
        over all heads (allocators split it). ``accumulated``: float32 ``[L][H][T]`` attention
        sums (h2o's state), ``observed`` the number of queries behind each sum (for
        ``h2o(normalize=true)``). ``reconstruction``: float32 ``[L][H][T]`` context-reconstruction
        scores for ``kvzip``, from your own reconstruction pass (``Session.reconstruct`` computes
        them for you). ``first_layer`` / ``model_layers``: where the given layers sit in
        the model, for layer allocators (pyramid, depthkv) when a model is compressed one layer
        at a time (0: the cache holds every layer). ``rope_inv_freq``: the model's inverse RoPE
        frequencies ``[head_dim // 2]`` for scorers that rotate queries to future positions
        (``expected``; otherwise its spec needs ``theta=``). ``shard``: this rank's share of
        the model's KV heads under tensor parallelism (see ``HeadShard``)."""
        return self._run(keys, values, queries, (accumulated, observed, reconstruction), budget,
                         budget_tokens, budget_total, compact=False, inplace=False,
                         scores=return_scores,
                         first_layer=first_layer, model_layers=model_layers,
                         rope_inv_freq=rope_inv_freq, shard=shard, stream=stream)

    def compress(self, keys: Any, values: Any, queries: Any = None, *, budget: float = 0.25,
                 budget_tokens: Optional[int] = None, budget_total: Optional[int] = None,
                 accumulated: Any = None, observed: Any = None, reconstruction: Any = None,
                 inplace: bool = True, return_scores: bool = False,
                 first_layer: int = 0, model_layers: int = 0,
                 rope_inv_freq: Any = None, shard: Optional[HeadShard] = None,
                 stream: Optional[int] = None) -> CompressResult:
        """Selects (as ``select``) and compacts keys and values: the kept tokens of every head
        move to the front of its rows, in order. ``inplace=True`` writes into the given arrays
        (they must be writable and not share memory); ``inplace=False`` works on copies. NaN or
        Inf anywhere in the inputs raises ValueError before anything is written (host arrays;
        device tensors are not scanned). The GIL is released while the library works. CUDA
        tensors: see the class docstring; ``keys`` / ``values`` of the result are then slices of
        the tensors you passed."""
        return self._run(keys, values, queries, (accumulated, observed, reconstruction), budget,
                         budget_tokens, budget_total, compact=True, inplace=inplace,
                         scores=return_scores,
                         first_layer=first_layer, model_layers=model_layers,
                         rope_inv_freq=rope_inv_freq, shard=shard, stream=stream)

    def _run(self, keys, values, queries, state, budget, budget_tokens, budget_total, *,
             compact, inplace, scores, first_layer, model_layers,
             rope_inv_freq=None, shard=None, stream=None) -> CompressResult:
        kind, value = budget_args(budget, budget_tokens, budget_total)
        tensors = (("keys", keys), ("values", values), ("queries", queries))
        if any(dlpack_device(x) is not None for _, x in tensors):
            extra = dict(zip(("accumulated", "observed", "reconstruction"), state),
                         return_scores=scores or None)
            return self._run_device(tensors, kind, value, compact=compact, inplace=inplace,
                                    first_layer=first_layer, model_layers=model_layers,
                                    stream=stream, extra=extra, freqs=_freqs(rope_inv_freq),
                                    shard=shard)
        if stream is not None:
            raise ValueError("stream: given, but no tensor is on a CUDA device")
        k, lifted = as_cache(keys, "keys")
        v = None if values is None else _same_rank(values, "values", lifted)
        q = None if queries is None else _same_rank(queries, "queries", lifted)
        acc, obs, rec = (_state(x, name, lifted)
                         for x, name in zip(state, ("accumulated", "observed", "reconstruction")))
        if compact and v is None:
            raise ValueError("values: compress needs the values to compact (use select for the "
                             "selection alone)")
        if compact and not inplace:
            k, v = np.array(k, copy=True), np.array(v, copy=True)
        elif compact and np.may_share_memory(k, v):
            raise ValueError("values: shares memory with keys; compacting both in place would "
                             "corrupt them")
        idx, counts, sc, warning = self._p._run(k, v, q, acc, obs, rec, kind, value, first_layer,
                                                model_layers, compact, scores, _freqs(rope_inv_freq),
                                                None if shard is None else shard._args())
        if warning:
            warnings.warn(f"kvpolicy: {warning}", RuntimeWarning, stacklevel=3)
        width = idx.shape[2]
        res = CompressResult(idx, counts, scores=sc, warning=warning)
        if compact:
            res.keys, res.values = k[:, :, :width], v[:, :, :width]
        if lifted:
            res.indices, res.counts = res.indices[0], res.counts[0]
            res.keys = None if res.keys is None else res.keys[0]
            res.values = None if res.values is None else res.values[0]
            res.scores = None if res.scores is None else res.scores[0]
        return res


    def _run_device(self, tensors, kind, value, *, compact, inplace, first_layer, model_layers,
                    stream, extra, freqs, shard) -> CompressResult:
        """The CUDA device path (see the class docstring)."""
        where = {name: dlpack_device(x) for name, x in tensors if x is not None}
        device = where["keys"] if where.get("keys") else next(d for d in where.values() if d)
        for name, d in where.items():
            if d is None:
                raise ValueError(f"{name}: a host array while another tensor is on DLPack "
                                 f"device {device}; pass keys, values and queries on one device")
        rec = extra.pop("reconstruction", None)
        if rec is not None and dlpack_device(rec) is None:
            raise ValueError("reconstruction: a host array while the cache is on a CUDA device; "
                             "pass the scores on the cache's device")
        for name, x in extra.items():
            if x is not None:
                raise ValueError(f"{name}: not taken by the device path (CUDA tensors); use "
                                 "host arrays for it")
        if compact and not inplace:
            raise ValueError("inplace: the device path compacts CUDA tensors in place; pass "
                             "copies (e.g. tensor.clone()) for inplace=False")
        if stream is not None and (isinstance(stream, bool) or not isinstance(stream, int)
                                   or stream < 0):
            raise TypeError(f"stream: expected a CUDA stream handle (int >= 0), got {stream!r}")
        # DLPack's stream argument: 1 = the legacy default stream, else the handle.
        dl_stream = 1 if not stream else stream
        caps = [None if x is None else x.__dlpack__(stream=dl_stream) for _, x in tensors]
        rec_cap = None if rec is None else rec.__dlpack__(stream=dl_stream)
        idx, counts, _, warning = self._p._run_device(*caps, kind, value, first_layer,
                                                      model_layers, compact, stream or 0, freqs,
                                                      rec_cap,
                                                      None if shard is None else shard._args())
        if warning:
            warnings.warn(f"kvpolicy: {warning}", RuntimeWarning, stacklevel=4)
        keys, values = tensors[0][1], tensors[1][1]
        lifted = len(keys.shape) == 3
        width = idx.shape[2]
        res = CompressResult(idx, counts, warning=warning)
        if compact:
            cut = (slice(None), slice(0, width)) if lifted else \
                (slice(None), slice(None), slice(0, width))
            res.keys, res.values = keys[cut], values[cut]
        if lifted:
            res.indices, res.counts = res.indices[0], res.counts[0]
        return res


def _state(x: Any, name: str, lifted: bool) -> Optional[np.ndarray]:
    if x is None:
        return None
    a = as_array(x, name)
    return a[np.newaxis] if lifted and a.ndim == 2 else a


def _same_rank(x: Any, name: str, lifted: bool) -> np.ndarray:
    a, was3 = as_cache(x, name)
    if was3 != lifted:
        raise ValueError(f"{name}: {3 if was3 else 4}-d while keys are {3 if lifted else 4}-d")
    return a
