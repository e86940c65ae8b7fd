"""The reference engine: a Llama-family GGUF model (the bundled SmolLM2-135M-Instruct by
default) run in fp32 with a kvpolicy Session as its KV cache, so a notebook can compare
policies on a real model in a few lines."""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _core
from ._arrays import budget_args
from ._policy import Policy

Tokenizer = _core.Tokenizer


def default_model_path() -> str:
    """``$KVPOLICY_MODEL``, else ``${KVPOLICY_CACHE:-~/.cache/kvpolicy}/SmolLM2-135M-Instruct.Q4_1.gguf``
    (``scripts/fetch_model.sh`` downloads it there)."""
    return _core.default_model_path()


class Model:
    """A GGUF model, weights dequantized once to fp32 (immutable; many Engines can share it)."""

    def __init__(self, path: Optional[str] = None) -> None:
        p = os.fspath(path) if path is not None else default_model_path()
        self.path = p
        self._m = _core.Model.load(p)

    @property
    def config(self) -> Dict[str, object]:
        """Hyper-parameters: n_layers, n_head, n_head_kv, head_dim, n_vocab, ..."""
        return self._m.config

    @property
    def tokenizer(self) -> "Tokenizer":
        """Byte-level BPE tokenizer: ``encode(text, parse_special=True, add_bos=False)``,
        ``decode(ids) -> bytes``, ``apply_chat_template([(role, content), ...])``."""
        return self._m.tokenizer

    def encode(self, text: str) -> List[int]:
        return self._m.tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._m.tokenizer.decode(list(ids)).decode("utf-8", errors="replace")

    def chat_prompt(self, user: str) -> List[int]:
        """Token ids of a one-message chat prompt in the model's template, ready to generate."""
        text = self._m.tokenizer.apply_chat_template([("user", user)], True)
        return self._m.tokenizer.encode(text)

    def engine(self, policy: Policy | str = "streaming", *, budget: float = 1.0,
               budget_tokens: Optional[int] = None, budget_total: Optional[int] = None,
               **kw: object) -> "Engine":
        return Engine(self, policy, budget=budget, budget_tokens=budget_tokens,
                      budget_total=budget_total, **kw)  # type: ignore[arg-type]

    def generate(self, prompt: str, policy: Policy | str = "streaming", *, budget: float = 1.0,
                 budget_tokens: Optional[int] = None, max_new: int = 32,
                 chat: bool = True) -> str:
        """Greedy continuation of ``prompt`` (as a chat message when ``chat``) whose cache is
        compressed by ``policy`` to ``budget`` after the prefill."""
        ids = self.chat_prompt(prompt) if chat else self.encode(prompt)
        e = self.engine(policy, budget=budget, budget_tokens=budget_tokens)
        e.prefill(ids)
        out = e.generate(max_new)
        eos = self._m.tokenizer.eos
        return self.decode([t for t in out if t != eos])


class Engine:
    """One sequence on a Model. ``prefill(ids)`` runs the prompt and compresses every layer to
    the budget; ``step(id)`` / ``generate(n)`` decode (h2o evicts at every step);
    ``teacher_force(ids)`` scores a continuation; ``fork(policy, budget)`` copies a full-cache
    state (prefilled with ``record_queries`` >= the policy's window, ``record_attention`` for
    h2o) into another policy without a new prefill."""

    def __init__(self, model: Model, policy: Policy | str = "streaming", *, budget: float = 1.0,
                 budget_tokens: Optional[int] = None, budget_total: Optional[int] = None,
                 threads: int = 0, prefill_chunk: int = 512, record_queries: int = 0,
                 record_attention: bool = False, decode_interval: int = 0,
                 _engine: Optional[_core.Engine] = None) -> None:
        self.model = model
        if _engine is not None:
            self._e = _engine
            return
        spec = policy.spec if isinstance(policy, Policy) else str(policy)
        kind, value = budget_args(budget, budget_tokens, budget_total)
        self._e = _core.Engine(model._m, spec, kind, value, threads, prefill_chunk,
                               record_queries, record_attention, decode_interval)

    def prefill(self, tokens: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Logits of the last prompt position ``[vocab]`` (all positions ``[n][vocab]``)."""
        out = self._e.prefill(list(tokens), all_logits)
        return out if all_logits else out[0]

    def extend(self, tokens: Sequence[int], all_logits: bool = False) -> np.ndarray:
        out = self._e.extend(list(tokens), all_logits)
        return out if all_logits else out[0]

    def step(self, token: int) -> np.ndarray:
        """Feeds one token; returns the logits of the next one ``[vocab]``."""
        return self._e.step(int(token))

    def generate(self, max_new: int, stop: Optional[Sequence[int]] = None) -> List[int]:
        """Greedy tokens, up to ``max_new``, ending after a stop id (default: EOS, included)."""
        return self._e.generate(max_new, None if stop is None else list(stop))

    def teacher_force(self, continuation: Sequence[int]) -> Tuple[np.ndarray, List[int]]:
        """(log p of each continuation token, greedy argmax at each point)."""
        return self._e.teacher_force(list(continuation))

    def fork(self, policy: Policy | str, *, budget: float = 1.0,
             budget_tokens: Optional[int] = None) -> "Engine":
        spec = policy.spec if isinstance(policy, Policy) else str(policy)
        kind, value = budget_args(budget, budget_tokens, None)
        return Engine(self.model, _engine=self._e.fork(spec, kind, value))

    def reconstruct(self, chunk: int = 2048, first: int = 0) -> None:
        """Runs the context-reconstruction pass for ``kvzip``: the model repeats the cached
        tokens from position ``first`` on, teacher-forced in chunks of ``chunk`` tokens. Only
        the reconstruction scores change. An engine whose own policy is ``kvzip`` runs it
        inside ``prefill``. A recording full-cache engine runs it once, and its forks then
        copy the scores."""
        self._e.reconstruct(chunk, first)

    def compress_now(self) -> None:
        self._e.compress_now()

    def reset(self) -> None:
        self._e.reset()

    @property
    def position(self) -> int:
        return self._e.position

    @property
    def kv_bytes(self) -> int:
        return self._e.kv_bytes

    @property
    def last_logits(self) -> np.ndarray:
        """Logits after the last processed token ``[vocab]`` (what ``generate`` reads next)."""
        return self._e.last_logits

    def lengths(self, layer: int) -> List[int]:
        return self._e.lengths(layer)

    def positions(self, layer: int, head: int) -> List[int]:
        """Original positions of the tokens held by (layer, KV head), ascending."""
        return self._e.positions(layer, head)
