"""kvpolicy.integrations: the rectangular fill-up (numpy); the kvpress press only where torch and
kvpress are installed."""

import numpy as np
import pytest

import kvpolicy
from kvpolicy.integrations.rectangular import rectangular_indices
from conftest import cache


def test_rectangular_fills_short_rows_with_their_best_scores(rng):
    k, v = cache(rng, L=1, H=3, T=40)
    q = rng.standard_normal((1, 6, 8, 32)).astype(np.float32)
    r = kvpolicy.Policy("snapkv(window=8) | adakv(alpha=0.1)").select(k, v, q, budget_tokens=12,
                                                                      return_scores=True)
    assert len(set(r.counts[0].tolist())) > 1  # ragged
    idx = rectangular_indices(r)
    w = r.counts.max()
    assert idx.shape == (1, 3, w)
    for h in range(3):
        own = set(r.kept(0, h).tolist())
        row = idx[0, h]
        assert own <= set(row.tolist()) and (np.diff(row) > 0).all()
        extra = sorted(set(row.tolist()) - own)
        others = [t for t in range(40) if t not in own]
        best = sorted(others, key=lambda t: -r.scores[0, h, t])[: len(extra)]
        assert extra == sorted(best)


def test_rectangular_uniform_and_errors(rng):
    k, v = cache(rng, L=2, H=2, T=20)
    r = kvpolicy.Policy("knorm").select(k, v, budget_tokens=5)
    np.testing.assert_array_equal(rectangular_indices(r), r.indices)
    with pytest.raises(ValueError, match="width: 3 is below"):
        rectangular_indices(r, 3)
    with pytest.raises(ValueError, match="select with return_scores=True"):
        rectangular_indices(r, 6)


def test_kvpress_press():
    torch = pytest.importorskip("torch")
    pytest.importorskip("kvpress")
    from kvpolicy.integrations.kvpress import KVPolicyPress
    with pytest.raises(ValueError, match="merger"):
        KVPolicyPress("snapkv | nearest", compression_ratio=0.5)
    with pytest.raises(ValueError, match="repeats the context, which KVPolicyPress does not run"):
        KVPolicyPress("kvzip", compression_ratio=0.5)
    press = KVPolicyPress("knorm", compression_ratio=0.5)
    keys = torch.randn(1, 2, 10, 8)
    values = torch.randn(1, 2, 10, 8)

    class Layer:
        layer_idx = 0
        head_dim = 8

    k2, v2 = press.compress(Layer(), torch.zeros(1, 10, 16), keys, values, None, {})
    assert k2.shape == (1, 2, 5, 8)
    keep = keys.norm(dim=-1).argsort(dim=-1)[..., :5].sort(dim=-1).values
    assert torch.equal(k2, keys.gather(2, keep.unsqueeze(-1).expand(-1, -1, -1, 8)))
