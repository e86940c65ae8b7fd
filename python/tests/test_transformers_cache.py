"""KVPolicyCache (kvpolicy.integrations.transformers) inside transformers' own generate(), on the
bundled model (the GGUF file of scripts/fetch_model.sh, loaded by transformers and dequantized to
fp32).

Needs torch, transformers and gguf (scripts/setup.sh --with-torch installs the pinned versions).
Without them, or without the model file, every test here is skipped.

What is checked:
- at budget 1.0 the cache computes the model's own attention: logits equal the sdpa path (a
  DynamicCache) to fp32 rounding, for a prefill and for a chunk on top of a cache, and greedy
  generate() gives the same tokens;
- against kvpolicy's own engine (kvpolicy.Model(path).engine(policy, budget), which runs the same
  Session in C++ with its own matmuls): the same kept positions in every (layer, KV head), after
  the prefill and after decoding, and the same greedy tokens, for scorers, per-head allocators,
  a merger and a quantizer;
- memory() is the README's formula: per-head lengths x 2 x head_dim x 4 bytes in fp32, packed
  tokens x bytes_per_token + residual tokens x (2 head_dim + 1) x 4 for int2;
- decode-time compression (h2o every token; snapkv every `interval` tokens) keeps every head at
  most at target + interval tokens through a long generation;
- what the cache refuses raises an error that says why.
"""

from __future__ import annotations

import copy
import os
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

from transformers import DynamicCache, LogitsProcessor  # noqa: E402

import kvpolicy  # noqa: E402
from conftest import bundled_hf_model  # noqa: E402
import kvpolicy.integrations.transformers as kvt  # noqa: E402

BUDGET = 0.3


def _context() -> str:
    """About 300 tokens of real text (base-files' GPL-3)."""
    with open("/usr/share/common-licenses/GPL-3", encoding="utf-8") as f:
        text = " ".join(f.read().split())
    return text[3000:4400]


@pytest.fixture(scope="module")
def model():
    return bundled_hf_model(kvt.ATTN_IMPLEMENTATION)


@pytest.fixture(scope="module")
def engine_model():
    return kvpolicy.Model()


@pytest.fixture(scope="module")
def prompt(engine_model):
    """Token ids (kvpolicy's tokenizer, so both sides see the same ids) of a chat prompt."""
    return engine_model.chat_prompt(_context() + "\n\nSummarize the text above in three "
                                                 "sentences.")


def _ids(tokens):
    return torch.tensor([list(tokens)])


def _generate(m, tokens, cache, n):
    x = _ids(tokens)
    with torch.no_grad():
        out = m.generate(x, attention_mask=torch.ones_like(x), past_key_values=cache,
                         max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, x.shape[1]:].tolist()


class _sdpa:
    """The same model with transformers' own sdpa attention, for the duration of a block."""

    def __init__(self, m):
        self.m = m

    def __enter__(self):
        self.m.set_attn_implementation("sdpa")
        return self.m

    def __exit__(self, *exc):
        self.m.set_attn_implementation(kvt.ATTN_IMPLEMENTATION)


# --- budget 1.0: the model's own attention ----------------------------------------------------

def test_full_budget_logits_equal_sdpa(model, prompt):
    x = _ids(prompt)
    split = len(prompt) - 17
    with torch.no_grad(), _sdpa(model):
        ref = model(x, past_key_values=DynamicCache(config=model.config)).logits
        d = DynamicCache(config=model.config)
        model(x[:, :split], past_key_values=d)
        ref_chunk = model(x[:, split:], past_key_values=d).logits
    with torch.no_grad():
        c = kvt.KVPolicyCache(model, "snapkv", budget=1.0)
        out = model(x, past_key_values=c).logits
        c2 = kvt.KVPolicyCache(model, "snapkv", budget=1.0)
        model(x[:, :split], past_key_values=c2)
        out_chunk = model(x[:, split:], past_key_values=c2).logits  # causal chunk on a cache
    scale = float(ref.abs().max())
    # fp32 rounding: the sdpa and eager paths of transformers differ by ~1e-4 here too.
    assert float((out - ref).abs().max()) <= 1e-5 * scale
    assert float((out_chunk - ref_chunk).abs().max()) <= 1e-5 * scale
    assert c.get_seq_length() == len(prompt) and c2.get_seq_length() == len(prompt)
    assert all(list(c.lengths(l)) == [len(prompt)] * c.kv_heads for l in range(c.num_layers))


@pytest.mark.parametrize("spec", ["snapkv", "h2o"])
def test_full_budget_generate_equals_dynamic_cache(model, prompt, spec):
    with _sdpa(model):
        ref = _generate(model, prompt, DynamicCache(config=model.config), 32)
    # h2o evicts back to its target at every step, and a ratio is of the prompt: a token budget
    # that covers the generation too keeps everything.
    budget = dict(budget_tokens=len(prompt) + 32) if spec == "h2o" else dict(budget=1.0)
    c = kvt.KVPolicyCache(model, spec, **budget)
    assert _generate(model, prompt, c, 32) == ref
    assert c.get_seq_length() == len(prompt) + 31  # the last token is generated, not fed


def test_dynamic_cache_through_kvpolicy_attention_is_sdpa(model, prompt):
    """Without a KVPolicyCache, attn_implementation='kvpolicy' is transformers' sdpa."""
    with _sdpa(model):
        ref = _generate(model, prompt[:60], DynamicCache(config=model.config), 8)
    assert _generate(model, prompt[:60], DynamicCache(config=model.config), 8) == ref


# --- against kvpolicy's own engine ---------------------------------------------------------------

SPECS = ["snapkv", "snapkv | adakv", "h2o", "tova", "keydiff", "snapkv | ams", "snapkv | pyramid",
         "snapkv | nearest", "snapkv | int2"]


def _positions(get, layers, heads):
    return [[np.asarray(get(l, h), dtype=np.int64) for h in range(heads)] for l in range(layers)]


def _differing(a, b):
    return [(l, h) for l in range(len(a)) for h in range(len(a[l]))
            if not np.array_equal(a[l][h], b[l][h])]


@pytest.mark.parametrize("spec", SPECS)
def test_same_kept_sets_and_tokens_as_engine(model, engine_model, prompt, spec):
    n = 16
    e = engine_model.engine(spec, budget=BUDGET)
    e.prefill(prompt)
    c = kvt.KVPolicyCache(model, spec, budget=BUDGET)
    with torch.no_grad():
        model(_ids(prompt), past_key_values=c)
    L, H = c.num_layers, c.kv_heads
    assert all(c.compressions[l] == 1 for l in range(L))
    diff = _differing(_positions(c.positions, L, H), _positions(e.positions, L, H))
    assert not diff, f"{spec}: kept sets differ from the engine's in (layer, head) {diff}"
    for l in range(L):
        assert list(c.lengths(l)) == list(e.lengths(l))

    # Decoding: generate() feeds n - 1 tokens for n outputs; the engine's nth token is the
    # argmax of its last logits.
    e2 = engine_model.engine(spec, budget=BUDGET)
    e2.prefill(prompt)
    ref = e2.generate(n - 1, stop=[]) + [int(np.argmax(e2.last_logits))]
    c2 = kvt.KVPolicyCache(model, spec, budget=BUDGET)
    assert _generate(model, prompt, c2, n) == ref
    diff = _differing(_positions(c2.positions, L, H), _positions(e2.positions, L, H))
    assert not diff, f"{spec}: after decoding, kept sets differ in (layer, head) {diff}"
    assert c2.memory() == e2.kv_bytes


# --- memory -------------------------------------------------------------------------------------

def test_memory_fp32_ragged_heads(model, prompt):
    c = kvt.KVPolicyCache(model, "snapkv | adakv", budget=BUDGET)
    with torch.no_grad():
        model(_ids(prompt), past_key_values=c)
    lengths = np.array([c.lengths(l) for l in range(c.num_layers)])
    assert len({tuple(r) for r in lengths}) > 1 and (lengths.min(1) != lengths.max(1)).any(), \
        "adakv should give heads different lengths"
    assert c.memory() == int(lengths.sum()) * 2 * c.head_dim * 4
    # Storage: one buffer per layer at its longest head (fitted after the prefill compression;
    # nothing compresses while decoding here).
    caps = [c.session.capacity(l) for l in range(c.num_layers)]
    assert caps == [int(r.max()) for r in lengths]
    assert c.storage_bytes() == sum(2 * c.kv_heads * cap * c.head_dim * 4 for cap in caps)
    assert c.storage_bytes() < 2 * c.kv_heads * len(prompt) * c.head_dim * 4 * c.num_layers


def test_memory_int2_packed(model, prompt):
    spec = "snapkv | int2"
    c = kvt.KVPolicyCache(model, spec, budget=0.9)
    with torch.no_grad():
        model(_ids(prompt), past_key_values=c)
    q = kvpolicy.Quantizer("int2")
    d = c.head_dim
    total = packed = 0
    for l in range(c.num_layers):
        assert c.session.quantized(l)
        for h in range(c.kv_heads):
            p = c.session.packed(l, h)
            assert p.size == c.lengths(l)[h]
            total += p.packed_tokens * q.bytes_per_token(d) + p.residual_tokens * (2 * d + 1) * 4
            packed += p.packed_tokens
    assert packed > 0
    assert c.memory() == pytest.approx(total, abs=0.5)
    fp32 = sum(int(c.lengths(l).sum()) for l in range(c.num_layers)) * 2 * d * 4
    assert c.memory() < fp32


# --- decode-time compression ------------------------------------------------------------------

class _Lengths(LogitsProcessor):
    """Records the longest head and the storage after each forward of generate()."""

    def __init__(self, cache):
        self.cache = cache
        self.longest = []
        self.storage = []

    def __call__(self, input_ids, scores):
        c = self.cache
        self.longest.append(max(int(c.lengths(l).max()) for l in range(c.num_layers)))
        self.storage.append(c.storage_bytes())
        return scores


@pytest.mark.parametrize("spec,interval,target", [("h2o", 0, 48), ("snapkv", 16, 64)])
def test_decode_time_compression_bounded(model, prompt, spec, interval, target):
    steps = 200
    c = kvt.KVPolicyCache(model, spec, budget_tokens=target, interval=interval)
    rec = _Lengths(c)
    x = _ids(prompt)
    with torch.no_grad():
        model.generate(x, attention_mask=torch.ones_like(x), past_key_values=c,
                       max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                       pad_token_id=0, logits_processor=[rec])
    every = interval or 1  # h2o: every token
    assert len(rec.longest) == steps
    assert max(rec.longest) <= target + every
    assert rec.longest[0] == target  # the prefill compression
    for l in range(c.num_layers):
        assert list(c.budgets(l)) == [target] * c.kv_heads
        assert target <= c.lengths(l).min() and c.lengths(l).max() < target + every
        assert c.compressions[l] == 1 + (steps - 1) // every
        pos = c.positions(l, 0)
        assert pos[-1] == len(prompt) + steps - 2  # the newest fed token is held
    assert c.memory() < (target + every) * 2 * c.head_dim * 4 * c.kv_heads * c.num_layers
    # Storage: target + interval rows per head, reserved after the prefill, never regrown.
    assert [c.session.capacity(l) for l in range(c.num_layers)] == [target + every] * c.num_layers
    assert set(rec.storage) == {(target + every) * 2 * c.head_dim * 4 * c.kv_heads * c.num_layers}


# --- what the cache refuses ----------------------------------------------------------------------

def test_refuses_batches_padding_and_other_attention(model, prompt):
    c = kvt.KVPolicyCache(model, "snapkv", budget=0.5)
    with pytest.raises(ValueError, match="batch size 2"), torch.no_grad():
        model(_ids(prompt[:20]).repeat(2, 1), past_key_values=c)
    c = kvt.KVPolicyCache(model, "snapkv", budget=0.5)
    mask = torch.ones(1, 20, dtype=torch.long)
    mask[0, :3] = 0
    with pytest.raises(ValueError, match="not the plain causal mask"), torch.no_grad():
        model(_ids(prompt[:20]), attention_mask=mask, past_key_values=c)
    c = kvt.KVPolicyCache(model, "snapkv", budget=0.5)
    with _sdpa(model), pytest.raises(RuntimeError, match="did not run through kvpolicy"), \
            torch.no_grad():
        model(_ids(prompt[:20]), past_key_values=c)
    with pytest.raises(ValueError, match="model.generate\\(\\) does not run"):
        kvt.KVPolicyCache(model, "kvzip", budget=0.5)
    c = kvt.KVPolicyCache(model, "snapkv", budget=0.5)
    with pytest.raises(ValueError, match="num_beams"):
        _generate_beams(model, prompt[:20], c)
    with pytest.raises(TypeError, match="float32"):
        c.update(torch.zeros(1, c.kv_heads, 1, c.head_dim, dtype=torch.float16),
                 torch.zeros(1, c.kv_heads, 1, c.head_dim, dtype=torch.float16), 0)


def _generate_beams(m, tokens, cache):
    x = _ids(tokens)
    with torch.no_grad():
        m.generate(x, attention_mask=torch.ones_like(x), past_key_values=cache, max_new_tokens=4,
                   num_beams=2, do_sample=False, pad_token_id=0)


def test_refuses_unsupported_models_and_specs(model):
    def stub(**changes):
        cfg = copy.deepcopy(model.config)
        for k, v in changes.items():
            setattr(cfg, k, v)
        return types.SimpleNamespace(config=cfg)

    with pytest.raises(ValueError, match="attention implementation is 'sdpa'"):
        kvt.KVPolicyCache(stub(_attn_implementation="sdpa"), "snapkv")
    with pytest.raises(ValueError, match="sliding-window"):
        kvt.KVPolicyCache(stub(sliding_window=256), "snapkv")
    with pytest.raises(ValueError, match="layers of type"):
        kvt.KVPolicyCache(stub(layer_types=["sliding_attention"] * 30), "snapkv")
    with pytest.raises(ValueError, match="soft"):
        kvt.KVPolicyCache(stub(attn_logit_softcapping=50.0), "snapkv")
    with pytest.raises(TypeError, match="expected a transformers model"):
        kvt.KVPolicyCache(object(), "snapkv")
    with pytest.raises(ValueError, match="quantizer|packed"):  # no decode-time eviction of tiles
        kvt.KVPolicyCache(model, "snapkv | int2", budget=0.5, interval=16)
    with pytest.raises(ValueError, match="interval"):
        kvt.KVPolicyCache(model, "snapkv", interval=-1)
