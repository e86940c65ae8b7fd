"""The accuracy benchmark's tasks (benchmarks/accuracy) on the reference engine, in a notebook:

    m = kvpolicy.Model()
    kvpolicy.tasks.retrieval(m, ["snapkv", "tova"], budgets=[0.1, 0.2], task="niah",
                             length=1024, prompts=4, regimes=("known", "agnostic"))
    kvpolicy.tasks.passkey(m, ["snapkv", "tova"], budgets=[0.1, 0.2], length=1024)
    kvpolicy.tasks.fidelity(m, ["snapkv", "knorm"], budgets=[0.2])

Each prompt is prefilled once with the full cache (recording the queries and h2o statistics the
policies read) and forked per (policy, budget), as ``kvpolicy_accuracy`` does. Prompt
construction and scoring are the C++ benchmark's own code.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Sequence

from . import _core
from ._engine import Engine, Model
from ._policy import Policy

FULL = "streaming"  # with budget 1.0: the full cache
TASKS = tuple(_core.retrieval_tasks())  # passkey, niah, multikey, multivalue, vartrack
_corpora: Dict[tuple, object] = {}


def _recorder(model: Model, policies: Iterable[str]) -> Engine:
    window = max([0] + [Policy(p).query_window for p in policies])
    return Engine(model, FULL, budget=1.0, record_queries=window, record_attention=True)


def _reconstruct_if_read(full: Engine, policies: Iterable[str]) -> None:
    # kvzip's forks copy the scores of one reconstruction pass over the prompt.
    if any("reconstruction" in Policy(p).needs for p in policies):
        full.reconstruct()


def passkey(model: Model, policies: Sequence[str] = ("snapkv",),
            budgets: Sequence[float] = (0.2,), *, length: int = 1024,
            depths: Sequence[float] = (0.0, 0.5, 1.0), max_new: int = 16,
            seed: int = 7) -> List[Dict[str, object]]:
    """Passkey retrieval: a 5-digit key hidden at each depth (0..1) of ``length`` tokens of
    filler; correct when the greedy answer's first 5-digit number is the key. One row per
    (policy, budget, depth), plus the full cache's rows (policy "full", budget 1.0)."""
    rows: List[Dict[str, object]] = []
    for depth in depths:
        ids, key = _core.passkey_prompt(model._m, length, float(depth), seed)
        full = _recorder(model, policies)
        full.prefill(ids)
        _reconstruct_if_read(full, policies)
        cells = [("full", 1.0)] + [(p, b) for p in policies for b in budgets]
        for policy, budget in cells:
            e = full.fork(FULL if policy == "full" else policy, budget=budget)
            e.compress_now()
            answer = model.decode(e.generate(max_new))
            rows.append(dict(policy=policy, budget=budget, depth=float(depth), tokens=len(ids),
                             key=key, answer=answer,
                             correct=_core.first_five_digits(answer) == key))
    return rows


def fidelity(model: Model, policies: Sequence[str] = ("snapkv",),
             budgets: Sequence[float] = (0.2,), *,
             text: str = "/usr/share/common-licenses/GPL-3", prompt_tokens: int = 1024,
             cont_tokens: int = 128) -> List[Dict[str, object]]:
    """Teacher-forced continuation of a real text: mean KL(full || policy) in nats, top-1
    agreement with the full cache and the NLL change, per (policy, budget). Policies that
    compress while decoding (h2o) are fed token by token."""
    name, prompt, cont = _core.fidelity_text(model._m, text, prompt_tokens, cont_tokens)
    full = _recorder(model, policies)
    full.prefill(prompt)
    _reconstruct_if_read(full, policies)
    ref = _core.reference_run(full.fork(FULL, budget=1.0)._e, cont)
    rows: List[Dict[str, object]] = []
    for policy in policies:
        for budget in budgets:
            e = full.fork(policy, budget=budget)
            e.compress_now()
            r = _core.compare_run(e._e, cont, ref)
            rows.append(dict(policy=policy, budget=budget, text=name, full_nll=ref.nll, **r))
    return rows


def retrieval(model: Model, policies: Sequence[str] = ("snapkv",),
              budgets: Sequence[float] = (0.2,), *, task: str = "niah", length: int = 1024,
              prompts: int = 4, regimes: Sequence[str] = ("known", "agnostic"),
              prompt_set: str = "eval", first: int = 0, greedy_tokens: int = 0,
              threads: int = 0) -> List[Dict[str, object]]:
    """RULER-style retrieval (``task`` in TASKS) in both regimes, as ``kvpolicy_accuracy`` runs
    it: "known" compresses the prompt with its question, "agnostic" compresses the context and
    then appends the question and answer uncompressed. One row per (prompt, regime, policy,
    budget) with ``em`` (greedy decoding reproduces the answer), ``logp`` (the answer's
    log-probability, nats), ``dlogp`` (minus the full cache's) and ``kept`` (kept fraction of the
    cached tokens), plus the full cache's ``full_em`` / ``full_logp``. Prompts ``first ..
    first + prompts - 1`` of the ``prompt_set`` ("eval", or "calibration" for tuning: other
    corpora and seeds)."""
    key = (id(model._m), prompt_set)
    if key not in _corpora:
        _corpora[key] = (model, _core.load_corpora(model._m, prompt_set))
    corpora = _corpora[key][1]
    window = max([1] + [Policy(p).query_window for p in policies])
    grid = [(p, float(b)) for p in policies for b in budgets]
    rows: List[Dict[str, object]] = []
    for index in range(first, first + prompts):
        r = _core.run_retrieval(model._m, corpora, task, length, index, grid, list(regimes),
                                window, threads, greedy_tokens)
        for c in r["cells"]:
            rows.append(dict(task=task, length=length, index=index, tokens=r["tokens"],
                             source=r["source"], answer=r["answer"], full_em=r["full_em"],
                             full_logp=r["full_logp"], **c))
    return rows
