"""KVPolicyPress inside kvpress's own KVPressTextGenerationPipeline, on the bundled model (the
GGUF file of scripts/fetch_model.sh, loaded by transformers and dequantized to fp32).

Needs torch, transformers, gguf and kvpress (scripts/setup.sh --with-torch installs the pinned
versions; scripts/test.sh does). Without them every test here is skipped, and scripts/test.sh's
summary lists the skips as not run.

What is checked:
- every spec of the README's policy table that the adapter accepts runs through the pipeline,
  with a question and without one, and keeps exactly the requested number of tokens per layer;
- the kept sets equal those of the matching kvpress press on the same prefill, and the answers
  through the pipeline are the same;
- the hook kvpress calls (post_init_from_model) reaches the press;
- a budget below the protected window keeps the newest tokens, with a warning;
- what the adapter refuses raises an error that says why.
"""

from __future__ import annotations

import os
import warnings

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # no GGUF loading bars in CI logs

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")
kvpress = pytest.importorskip("kvpress")

from transformers import AutoTokenizer, DynamicCache  # noqa: E402
from kvpress import (AdaKVPress, ExpectedAttentionPress, KeyDiffPress, KnormPress,  # noqa: E402
                     KVPressTextGenerationPipeline,
                     ObservedAttentionPress, PyramidKVPress, SnapKVPress, StreamingLLMPress,
                     TOVAPress)

import kvpolicy  # noqa: E402
from conftest import bundled_hf_model  # noqa: E402
from kvpolicy.integrations._rope import model_rope_inv_freq  # noqa: E402
from kvpolicy.integrations.kvpress import KVPolicyPress, window_queries  # noqa: E402

RATIO = 0.8  # compression_ratio: keep 20%
KEY = "48213"
QUESTION = "What is the pass key mentioned in the text?"


def _context() -> str:
    """About 400 tokens of real, non-repetitive text (base-files' GPL-3) with a pass key: at
    RATIO, 20% of it is more than snapkv's 64-query window, so kvpress's SnapKV breaks no ties
    inside the window (it ranks the window tokens equal; kvpolicy keeps the newest)."""
    with open("/usr/share/common-licenses/GPL-3", encoding="utf-8") as f:
        text = " ".join(f.read().split())
    head, tail = text[3000:3850], text[3850:4700]
    return f"{head} The pass key is {KEY}. Remember it. {tail}"


@pytest.fixture(scope="module")
def model():
    m = bundled_hf_model("sdpa")
    path = kvpolicy.default_model_path()
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return m, tok


@pytest.fixture(scope="module")
def pipe(model):
    m, tok = model
    return KVPressTextGenerationPipeline(model=m, tokenizer=tok)


def _set_attention(m, impl: str) -> None:
    if hasattr(m, "set_attn_implementation"):
        m.set_attn_implementation(impl)
    else:
        m.config._attn_implementation = impl


def _context_ids(pipe) -> torch.Tensor:
    return pipe.preprocess(_context(), [""], answer_prefix="", max_context_length=1 << 20)["context_ids"]


def _prefill(m, ids: torch.Tensor, press=None) -> DynamicCache:
    """One prefill of ``ids`` as the pipeline runs it, compressed by ``press`` if given."""
    cache = DynamicCache()
    with torch.no_grad(), (press(m) if press is not None else _null()):
        m.model(input_ids=ids, past_key_values=cache)
    return cache


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _kept_sets(m, full: DynamicCache, cache: DynamicCache):
    """Per (layer, KV head): the original token indices whose rows the compressed cache holds
    and attends to (rows matched exactly against the uncompressed prefill's keys; rows masked
    out by kvpress's key masking, as AdaKV and KVPolicyPress's fill-up use, are left out)."""
    out = []
    for l, layer in enumerate(m.model.layers):
        ref, got = full.layers[l].keys[0], cache.layers[l].keys[0]  # [H][T][d], [H][n][d]
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        hidden = set()
        if masked is not None:
            hidden = {(int(h), int(t)) for b, h, t in zip(*masked) if int(b) == 0}
        sets = []
        for h in range(ref.shape[0]):
            eq = (got[h][:, None, :] == ref[h][None, :, :]).all(-1)  # [n][T]
            assert eq.any(-1).all(), f"layer {l}, head {h}: a cached row is no prompt token's key"
            rows = [int(eq[i].nonzero()[0, 0]) for i in range(got.shape[1])
                    if (h, i) not in hidden]
            sets.append(set(rows))
        out.append(sets)
    return out


# The README policy table's specs that the adapter accepts (scorers, and allocators after
# snapkv); mergers and quantizers are refused (test_refused).
_PROFILES = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "profiles")
# The proportional rule (one sensitivity per layer) and the marginal rule (loss curves).
_PROFILE = os.path.abspath(os.path.join(_PROFILES, "SmolLM2-135M-Instruct.snapkv-0.2.json"))
_CURVES = os.path.abspath(os.path.join(_PROFILES, "SmolLM2-135M-Instruct.snapkv.json"))
ACCEPTED = ["snapkv", "h2o", "streaming", "tova", "knorm", "keydiff", "expected", "snapkv | uniform",
            "snapkv | pyramid", f"snapkv | depthkv(profile={_PROFILE})",
            f"snapkv | depthkv(profile={_CURVES})",
            "snapkv | adakv", "snapkv | ams", "snapkv(preset=kvpress)", "snapkv | pyramid | adakv"]


def _spec_id(spec):
    """Test id: the spec, with a profile path shortened to its file name."""
    head, sep, rest = spec.partition("(profile=")
    return head + sep + os.path.basename(rest) if sep else spec


@pytest.mark.parametrize("spec", ACCEPTED, ids=[_spec_id(s) for s in ACCEPTED])
def test_every_accepted_spec_runs_in_the_pipeline(pipe, spec):
    T = _context_ids(pipe).shape[1]
    n_keep = max(1, int(T * (1 - RATIO)))
    press = KVPolicyPress(spec, compression_ratio=RATIO)
    with_q = pipe(_context(), question=QUESTION, press=press, max_new_tokens=4)["answer"]
    assert isinstance(with_q, str)
    # Budgets mean kept tokens: every layer's heads keep n_keep per head on average (allocators
    # move budget between heads and layers, never add to it).
    assert press.model_layers == pipe.model.config.num_hidden_layers  # kvpress's hook reached us
    assert press.kept_fraction == pytest.approx(n_keep / T, abs=1e-12)
    ragged = any(a in spec for a in ("adakv", "ams", "pyramid", "depthkv"))
    if not ragged:  # one budget for every head and layer: nothing filled up or padded
        assert press.held_fraction == press.kept_fraction
    no_q = pipe(_context(), press=press, max_new_tokens=4)["answer"]
    assert isinstance(no_q, str)
    assert press.kept_fraction == pytest.approx(n_keep / T, abs=1e-12)


def test_ragged_layers_stay_consistent_for_a_multi_token_question(pipe):
    # The failure of the rectangular fill-up: layers of different lengths broke the causal mask
    # of the question's forward ("size of tensor a (159) must match ... b (158)").
    m = pipe.model
    press = KVPolicyPress("snapkv | adakv", compression_ratio=RATIO)
    cache = _prefill(m, _context_ids(pipe), press)
    lengths = {cache.layers[l].keys.shape[2] for l in range(len(cache.layers))}
    assert len(lengths) == 1
    q = pipe.tokenizer.encode(QUESTION, return_tensors="pt", add_special_tokens=False)
    T0 = cache.get_seq_length()
    with torch.no_grad():
        out = m(input_ids=q, past_key_values=cache,
                position_ids=torch.arange(T0, T0 + q.shape[1]).unsqueeze(0))
    assert torch.isfinite(out.logits).all()
    # Every head attends to exactly its own kept tokens: the rest are masked.
    for l, layer in enumerate(m.model.layers):
        counts = press.layer_stats[l][1]
        masked = layer.self_attn.masked_key_indices
        n_masked = 0 if masked is None else len(masked[0])
        assert counts + n_masked == T0 * cache.layers[l].keys.shape[1]


# kvpress presses and the kvpolicy specs that are the same method (README policy table).
PAIRS = [
    ("snapkv", lambda r: SnapKVPress(compression_ratio=r)),
    ("streaming(sinks=4)", lambda r: StreamingLLMPress(compression_ratio=r)),
    ("tova", lambda r: TOVAPress(compression_ratio=r)),
    ("knorm", lambda r: KnormPress(compression_ratio=r)),
    ("keydiff", lambda r: KeyDiffPress(compression_ratio=r)),
    ("snapkv | adakv(alpha=0.2)",
     lambda r: AdaKVPress(SnapKVPress(compression_ratio=r), alpha_safeguard=0.2)),
    # The press passes the model's RoPE frequencies; the ~400-token prompt is within the default
    # window, so every prompt query feeds the statistics, as in kvpress.
    ("expected", lambda r: ExpectedAttentionPress(compression_ratio=r)),
    ("expected(eps=0.01) | adakv(alpha=0.2)",
     lambda r: AdaKVPress(ExpectedAttentionPress(compression_ratio=r, epsilon=1e-2),
                          alpha_safeguard=0.2)),
]


def test_expected_scores_equal_kvpress_expected_attention(pipe):
    # Scores, not only kept sets: kvpress scores the pre-RoPE queries of the hidden states at
    # absolute positions; kvpolicy rotates the post-RoPE queries by their offsets. The two must
    # agree to fp32 rounding on every layer of the real model (sinks left out: kvpress pads them
    # with its max + 1, kvpolicy protects them and gives them the layer's max + 1).
    m = pipe.model
    ids = _context_ids(pipe)
    pol = kvpolicy.Policy("expected")
    errs = []

    class Both(ExpectedAttentionPress):
        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            ref = self.score(module, hidden_states, keys, values, attentions, kwargs)[0]
            T = keys.shape[2]
            q = window_queries(module, hidden_states, T, kwargs["position_embeddings"])
            r = pol.select(keys.detach().numpy(), values.detach().numpy(),
                           q.detach().numpy(), budget_tokens=T // 5, return_scores=True,
                           rope_inv_freq=rope)
            ours = torch.from_numpy(np.asarray(r.scores)[0])
            a, b = ref[:, 4:].double(), ours[:, 4:].double()
            errs.append(float((a - b).abs().max() / a.abs().max()))
            return keys, values

    rope = model_rope_inv_freq(m, 64)
    assert rope is not None and rope.shape == (32,)
    with torch.no_grad(), Both(compression_ratio=0.5)(m):
        m.model(input_ids=ids)
    assert len(errs) == len(m.model.layers)
    assert max(errs) < 1e-4, errs


@pytest.mark.parametrize("spec,make", PAIRS, ids=[p[0] for p in PAIRS])
def test_kept_sets_and_answers_equal_kvpress(pipe, spec, make):
    m = pipe.model
    ids = _context_ids(pipe)
    full = _prefill(m, ids)
    ours = _kept_sets(m, full, _prefill(m, ids, KVPolicyPress(spec, compression_ratio=RATIO)))
    theirs = _kept_sets(m, full, _prefill(m, ids, make(RATIO)))
    for l, (a, b) in enumerate(zip(ours, theirs)):
        for h, (sa, sb) in enumerate(zip(a, b)):
            if spec == "knorm" and sa != sb:
                # RoPE keeps a key's norm, so in layer 0 (keys from the token alone) a repeated
                # token ties with itself at every position: torch's topk breaks such ties in no
                # specified order, kvpolicy by recency (benchmarks/kvpress_compare.md). Every
                # token the two disagree on ties with the cut to rounding.
                norms = full.layers[l].keys[0, h].double().norm(dim=-1)
                cut = norms[sorted(sa)].max()
                for t in sa ^ sb:
                    assert abs(float(norms[t] - cut)) <= 1e-6 * float(cut), f"layer {l}, head {h}"
                continue
            assert sa == sb, f"layer {l}, head {h}: {sorted(sa ^ sb)} differ"
    ans_ours = pipe(_context(), question=QUESTION,
                    press=KVPolicyPress(spec, compression_ratio=RATIO), max_new_tokens=12)["answer"]
    ans_theirs = pipe(_context(), question=QUESTION, press=make(RATIO),
                      max_new_tokens=12)["answer"]
    assert ans_ours == ans_theirs


def test_observed_attention_equals_kvpress_with_eager_attention(pipe):
    m = pipe.model
    _set_attention(m, "eager")
    try:
        ids = _context_ids(pipe)
        full = _prefill(m, ids)
        spec = "h2o(recent_tokens=0,normalize=true)"
        ours = _kept_sets(m, full, _prefill(m, ids, KVPolicyPress(spec, compression_ratio=RATIO)))
        theirs = _kept_sets(m, full, _prefill(m, ids, ObservedAttentionPress(compression_ratio=RATIO)))
        assert ours == theirs
        # Per-head budgets need key masking, which eager attention does not run: a clear error.
        with pytest.raises(RuntimeError, match="eager attention does not run"):
            _prefill(m, ids, KVPolicyPress("h2o | adakv", compression_ratio=RATIO))
    finally:
        _set_attention(m, "sdpa")


def test_pyramid_layer_budgets_follow_kvpress_schedule(pipe):
    # The hook kvpress calls (post_init_from_model) gives the press the layer count, so the
    # pyramid schedule is kvpress's: per-layer kept counts as PyramidKVPress's, to the token
    # (kvpress plans with the fractional T * (1 - ratio) and rounds each layer on its own;
    # kvpolicy with the integer per-head budget, its layers summing to it exactly).
    m = pipe.model
    ids = _context_ids(pipe)
    T = ids.shape[1]
    press = KVPolicyPress("snapkv | pyramid", compression_ratio=0.4)  # the schedule is active
    _prefill(m, ids, press)
    cache = _prefill(m, ids, PyramidKVPress(compression_ratio=0.4))
    H = cache.layers[0].keys.shape[1]
    ours = [press.layer_stats[l][1] / H for l in range(len(cache.layers))]
    theirs = [cache.layers[l].keys.shape[2] for l in range(len(cache.layers))]
    assert ours[0] > ours[-1] + 50  # a pyramid, not the uniform fallback
    assert max(abs(a - b) for a, b in zip(ours, theirs)) <= 1, (ours, theirs)
    assert sum(ours) == len(ours) * max(1, int(T * 0.6))


def test_budget_below_the_protected_window_keeps_the_newest(pipe):
    m = pipe.model
    ids = _context_ids(pipe)[:, :100]
    press = KVPolicyPress("snapkv", compression_ratio=0.9)  # 9 tokens < the 64-query window
    n_keep = max(1, int(100 * (1 - 0.9)))  # as kvpress computes it: int(9.999...) = 9
    with pytest.warns(RuntimeWarning, match="below the 64 tokens snapkv protects"):
        cache = _prefill(m, ids, press)
    full = _prefill(m, ids)
    for sets in _kept_sets(m, full, cache):
        for s in sets:
            assert s == set(range(100 - n_keep, 100))


def test_refused_specs_say_why():
    with pytest.raises(ValueError, match="merger 'semantic' needs log"):
        KVPolicyPress("snapkv | semantic", compression_ratio=0.5)
    for spec in ("int2", "snapkv | int4", "kivi"):
        with pytest.raises(ValueError, match="needs kvpolicy's packed attention"):
            KVPolicyPress(spec, compression_ratio=0.5)
    with pytest.raises(ValueError, match="compression_ratio: 1.0 is outside"):
        KVPolicyPress("snapkv", compression_ratio=1.0)
    with pytest.raises(ValueError, match="ragged: 'pad' is not"):
        KVPolicyPress("snapkv", compression_ratio=0.5, ragged="pad")
    with pytest.raises(ValueError, match="unknown scorer 'nope'"):
        KVPolicyPress("nope", compression_ratio=0.5)


def test_older_hook_spelling_still_works():
    press = KVPolicyPress("snapkv | pyramid", compression_ratio=0.5)

    class Config:
        num_hidden_layers = 7

    class Model:
        config = Config()

    press.__post_init_from_model__(Model())
    assert press.model_layers == 7
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        press.post_init_from_model(Model())
    assert press.model_layers == 7
    assert np.isclose(press.kept_fraction, 1.0)  # nothing compressed yet
