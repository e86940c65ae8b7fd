"""Policy.compress / select against hand-checkable numpy references."""

import warnings

import numpy as np
import pytest

import kvpolicy
from conftest import AllGatherGroup, cache


def knorm_reference(k, n):
    """knorm keeps the n keys with the smallest L2 norm per (layer, head), ascending indices."""
    norms = np.linalg.norm(k.astype(np.float64), axis=-1)
    keep = np.argsort(norms, axis=-1, kind="stable")[..., :n]
    return np.sort(keep, axis=-1)


def test_knorm_matches_numpy_and_compacts_in_place(rng):
    k, v = cache(rng)
    k0, v0 = k.copy(), v.copy()
    r = kvpolicy.Policy("knorm").compress(k, v, budget=0.25)
    ref = knorm_reference(k0, 10)
    assert r.indices.dtype == np.int32 and r.indices.shape == (2, 3, 10)
    np.testing.assert_array_equal(r.indices, ref)
    np.testing.assert_array_equal(r.counts, np.full((2, 3), 10))
    # In place: the input arrays now hold the kept rows at the front, and the results are views.
    assert np.shares_memory(r.keys, k) and np.shares_memory(r.values, v)
    for l in range(2):
        for h in range(3):
            np.testing.assert_array_equal(k[l, h, :10], k0[l, h, ref[l, h]])
            np.testing.assert_array_equal(v[l, h, :10], v0[l, h, ref[l, h]])
            np.testing.assert_array_equal(r.keys[l, h], k0[l, h, ref[l, h]])
            np.testing.assert_array_equal(r.kept(l, h), ref[l, h])


def test_streaming_keeps_sinks_and_recent(rng):
    k, v = cache(rng, T=50)
    r = kvpolicy.Policy("streaming(sinks=4)").select(k, v, budget_tokens=12)
    want = np.r_[0:4, 42:50]
    for l in range(2):
        for h in range(3):
            np.testing.assert_array_equal(r.kept(l, h), want)
    assert r.keys is None


def test_inplace_false_leaves_inputs(rng):
    k, v = cache(rng)
    k0 = k.copy()
    r = kvpolicy.Policy("knorm").compress(k, v, budget_tokens=7, inplace=False)
    np.testing.assert_array_equal(k, k0)
    assert not np.shares_memory(r.keys, k)
    np.testing.assert_array_equal(r.keys[1, 2], k0[1, 2, knorm_reference(k0, 7)[1, 2]])


def test_budget_forms_and_counts(rng):
    k, v = cache(rng, L=2, H=3, T=40)
    q = rng.standard_normal((2, 6, 8, 32)).astype(np.float32)
    p = kvpolicy.Policy("snapkv(window=8) | adakv")
    r = p.select(k, v, q, budget_total=2 * 3 * 13)
    assert r.counts.sum() == 2 * 3 * 13
    r = p.select(k, v, q, budget=0.5)
    assert r.counts.sum() == 2 * 3 * 20
    # Ragged rows are padded with -1 past each count.
    for l in range(2):
        for h in range(3):
            row = r.indices[l, h]
            assert (row[r.counts[l, h]:] == -1).all()
            assert (np.diff(row[: r.counts[l, h]]) > 0).all()


def test_float16_equals_float32_selection_for_streaming(rng):
    k, v = cache(rng)
    r32 = kvpolicy.Policy("streaming").select(k, v, budget=0.3)
    r16 = kvpolicy.Policy("streaming").select(k.astype(np.float16), v.astype(np.float16), budget=0.3)
    np.testing.assert_array_equal(r32.indices, r16.indices)


def test_float16_compress_in_place(rng):
    k, v = cache(rng, dtype=np.float16)
    k0 = k.copy()
    r = kvpolicy.Policy("knorm").compress(k, v, budget_tokens=5)
    ref = knorm_reference(k0, 5)
    np.testing.assert_array_equal(r.indices, ref)
    np.testing.assert_array_equal(k[0, 1, :5], k0[0, 1, ref[0, 1]])
    assert r.keys.dtype == np.float16


def test_strided_nhd_view_equals_contiguous(rng):
    # NHD storage [L][T][H][d] viewed as [L][H][T][d]: non-contiguous, supported by KVView.
    k, v = cache(rng)
    q = rng.standard_normal((2, 6, 8, 32)).astype(np.float32)
    kn = np.ascontiguousarray(k.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    vn = np.ascontiguousarray(v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    assert not kn.flags.c_contiguous
    p = kvpolicy.Policy("snapkv(window=8)")
    want = p.compress(k.copy(), v.copy(), q, budget=0.25)
    got = p.compress(kn, vn, q, budget=0.25)
    np.testing.assert_array_equal(got.indices, want.indices)
    np.testing.assert_array_equal(got.keys, want.keys)
    np.testing.assert_array_equal(got.values, want.values)
    # A slice with a step is fine too (token stride 2).
    big = np.repeat(k, 2, axis=2)[:, :, ::2]
    np.testing.assert_array_equal(p.select(big, v, q, budget=0.25).indices, want.indices)


def test_three_d_input_is_one_layer(rng):
    k, v = cache(rng, L=1)
    r4 = kvpolicy.Policy("knorm").select(k, v, budget_tokens=6)
    r3 = kvpolicy.Policy("knorm").select(k[0], v[0], budget_tokens=6)
    np.testing.assert_array_equal(r3.indices, r4.indices[0])
    np.testing.assert_array_equal(r3.kept(1), r4.kept(0, 1))


def test_scores_and_h2o_accumulated(rng):
    k, v = cache(rng, T=30)
    acc = rng.random((2, 3, 30)).astype(np.float32)
    r = kvpolicy.Policy("h2o(recent_tokens=0)").select(k, v, budget_tokens=5, accumulated=acc,
                                                       return_scores=True)
    assert r.scores.shape == (2, 3, 30)
    np.testing.assert_array_equal(r.indices, np.sort(np.argsort(-acc, axis=-1)[..., :5], axis=-1))


def test_policy_properties():
    p = kvpolicy.Policy("snapkv(window=16) | adakv")
    assert p.spec == "snapkv(window=16) | adakv"
    assert p.scorer == "snapkv" and p.query_window == 16
    assert "queries" in p.needs
    assert repr(p) == "Policy('snapkv(window=16) | adakv')"


# --- bad inputs: ValueError / TypeError naming the argument ------------------------------------

@pytest.mark.parametrize("dtype", [np.int32, np.float64])
def test_bad_dtype(rng, dtype):
    k, v = cache(rng)
    with pytest.raises(TypeError, match="keys: dtype"):
        kvpolicy.Policy("knorm").compress(k.astype(dtype), v, budget=0.5)
    with pytest.raises(TypeError, match="values: dtype"):
        kvpolicy.Policy("knorm").compress(k, v.astype(dtype), budget=0.5)


def test_mixed_dtypes(rng):
    k, v = cache(rng)
    with pytest.raises(TypeError, match="values: dtype float16 differs"):
        kvpolicy.Policy("knorm").compress(k, v.astype(np.float16), budget=0.5)


def test_not_an_array(rng):
    with pytest.raises(TypeError, match="keys: expected a numpy array"):
        kvpolicy.Policy("knorm").select([[1.0]], budget=0.5)


def test_wrong_rank(rng):
    k, v = cache(rng)
    with pytest.raises(ValueError, match="keys: expected a 4-d array"):
        kvpolicy.Policy("knorm").compress(k[0, 0], v[0, 0], budget=0.5)
    with pytest.raises(ValueError, match="values: 3-d while keys are 4-d"):
        kvpolicy.Policy("knorm").compress(k, v[0], budget=0.5)


def test_mismatched_shapes(rng):
    k, v = cache(rng)
    with pytest.raises(ValueError, match="values shape"):
        kvpolicy.Policy("knorm").compress(k, v[:, :, :20], budget=0.5)
    q = rng.standard_normal((2, 4, 8, 32)).astype(np.float32)  # 4 query heads for 3 KV heads
    with pytest.raises(ValueError, match="queries"):
        kvpolicy.Policy("snapkv(window=8)").select(k, v, q, budget=0.5)


def test_missing_queries(rng):
    k, v = cache(rng)
    with pytest.raises(ValueError, match="queries"):
        kvpolicy.Policy("snapkv").select(k, v, budget=0.5)


def test_negative_strides(rng):
    k, v = cache(rng)
    with pytest.raises(ValueError, match="keys: negative stride on axis 2"):
        kvpolicy.Policy("knorm").select(k[:, :, ::-1], v, budget=0.5)


def test_unaligned_strides(rng):
    k, _ = cache(rng)
    raw = np.zeros(k.size * 4 + 2, dtype=np.uint8)[2:].view(np.float32)  # offset 2 bytes
    bad = np.lib.stride_tricks.as_strided(raw, shape=(1, 1, 4, 2), strides=(64, 64, 10, 4))
    with pytest.raises(ValueError, match="keys: stride 10 bytes"):
        kvpolicy.Policy("knorm").select(bad, budget=0.5)


def test_overlapping_strides(rng):
    k, v = cache(rng)
    b = np.broadcast_to(k[:, :, :1], k.shape)  # token stride 0
    with pytest.raises(ValueError, match="keys: token stride 0 overlaps"):
        kvpolicy.Policy("knorm").select(b, v, budget=0.5)


def test_read_only_in_place(rng):
    k, v = cache(rng)
    k.flags.writeable = False
    with pytest.raises(ValueError, match="keys: array is read-only"):
        kvpolicy.Policy("knorm").compress(k, v, budget=0.5)
    kvpolicy.Policy("knorm").compress(k, v, budget=0.5, inplace=False)  # a copy is fine
    kvpolicy.Policy("knorm").select(k, v, budget=0.5)


def test_shared_memory_in_place(rng):
    k, _ = cache(rng)
    with pytest.raises(ValueError, match="values: shares memory with keys"):
        kvpolicy.Policy("knorm").compress(k, k, budget=0.5)


def test_nan_rejected_before_writing(rng):
    k, v = cache(rng)
    k[1, 2, 7, 3] = np.nan
    k0 = k.copy()
    with pytest.raises(ValueError, match="keys contains a non-finite value .* layer 1, head 2, token 7"):
        kvpolicy.Policy("knorm").compress(k, v, budget=0.5)
    np.testing.assert_array_equal(k, k0)
    v[0, 0, 0, 0] = np.inf
    with pytest.raises(ValueError, match="non-finite"):
        kvpolicy.Policy("streaming").select(k, v, budget=0.5)


def test_unknown_spec():
    with pytest.raises(ValueError, match="unknown scorer 'nosuch' \\(valid scorers: h2o"):
        kvpolicy.Policy("nosuch")
    with pytest.raises(ValueError, match="snapkv.*window"):
        kvpolicy.Policy("snapkv(windw=3)")


@pytest.mark.parametrize("kw,exc,msg", [
    (dict(budget=1.5), ValueError, "budget: ratio 1.5"),
    (dict(budget="x"), TypeError, "budget: expected a ratio"),
    (dict(budget_tokens=-1), ValueError, "budget_tokens: must be >= 0"),
    (dict(budget_tokens=2.5), TypeError, "budget_tokens: expected an int"),
    (dict(budget_tokens=3, budget_total=4), ValueError, "at most one"),
])
def test_bad_budgets(rng, kw, exc, msg):
    k, v = cache(rng)
    with pytest.raises(exc, match=msg):
        kvpolicy.Policy("knorm").select(k, v, **kw)


def test_budget_below_protected_keeps_what_fits_with_a_warning(rng):
    k, v = cache(rng)  # T = 40
    with pytest.warns(RuntimeWarning, match="budget of 2 tokens per head is below the 4 tokens "
                      r"streaming protects \(4 sinks \+ 0 recent\): kept the first 2 instead"):
        r = kvpolicy.Policy("streaming(sinks=4)").select(k, v, budget_tokens=2)
    assert (r.counts == 2).all() and (r.indices == [0, 1]).all()
    assert "kept the first 2" in r.warning
    q = np.random.default_rng(1).standard_normal((2, 6, 8, 32)).astype(np.float32)
    with pytest.warns(RuntimeWarning, match="kept the newest 5 instead"):
        r = kvpolicy.Policy("snapkv(window=8)").select(k, v, q, budget_tokens=5)
    assert (r.indices == np.arange(35, 40)).all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # at the window: no warning
        r = kvpolicy.Policy("snapkv(window=8)").select(k, v, q, budget_tokens=8)
    assert r.warning == ""


def test_quantizer_alone_keeps_every_token(rng):
    k, v = cache(rng)
    p = kvpolicy.Policy("int2(residual=16)")
    assert p.spec == "int2(residual=16)" and p.quantizer == "int2" and p.scorer == ""
    assert p.needs == frozenset() and p.query_window == 0
    r = p.select(k, v, budget=1.0)
    assert (r.counts == 40).all() and (r.indices == np.arange(40)).all()
    with pytest.raises(ValueError, match="has no scorer and keeps every token; the budget keeps "
                       "60 of 240"):
        p.select(k, v, budget=0.25)
    s = kvpolicy.Session("int4", layers=1, kv_heads=2, q_heads=2, head_dim=32)
    s.append(0, k[0, :2], v[0, :2])
    assert s.compress_if_due(0)
    assert s.lengths(0).tolist() == [40, 40]


class DLPackOnly:
    """A tensor that only speaks DLPack (as torch tensors do)."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kw):
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def test_dlpack_input_is_zero_copy(rng):
    k, v = cache(rng)
    k0 = k.copy()
    r = kvpolicy.Policy("knorm").compress(DLPackOnly(k), DLPackOnly(v), budget_tokens=4)
    ref = knorm_reference(k0, 4)
    np.testing.assert_array_equal(r.indices, ref)
    np.testing.assert_array_equal(k[1, 1, :4], k0[1, 1, ref[1, 1]])  # written through


def test_h2o_normalized_by_observed_counts(rng):
    k, v = cache(rng, L=1, H=2, T=30)
    acc = rng.random((1, 2, 30)).astype(np.float32)
    obs = np.broadcast_to(np.arange(30, 0, -1, dtype=np.float32), (1, 2, 30)).copy()
    p = kvpolicy.Policy("h2o(recent_tokens=0,normalize=true)")
    r = p.select(k, v, budget_tokens=6, accumulated=acc, observed=obs)
    want = np.sort(np.argsort(-(acc / obs), axis=-1, kind="stable")[..., :6], axis=-1)
    np.testing.assert_array_equal(r.indices, want)
    with pytest.raises(ValueError, match="observed-query counts"):
        p.select(k, v, budget_tokens=6, accumulated=acc)
    with pytest.raises(ValueError, match="observed: shape"):
        p.select(k, v, budget_tokens=6, accumulated=acc, observed=obs[:, :, :5])


def test_kvzip_with_given_reconstruction_scores(rng):
    """kvzip on scores an engine computed itself: the first 4 tokens, then the best scores."""
    L, H, T, d = 2, 2, 30, 8
    k = rng.standard_normal((L, H, T, d)).astype(np.float32)
    rec = rng.random((L, H, T)).astype(np.float32)
    p = kvpolicy.Policy("kvzip")
    with pytest.raises(ValueError, match="context-reconstruction scores are required"):
        p.select(k, budget_tokens=10)
    r = p.select(k, budget_tokens=10, reconstruction=rec)
    for l in range(L):
        for h in range(H):
            best = 4 + np.argsort(-rec[l, h, 4:], kind="stable")[:6]
            np.testing.assert_array_equal(r.indices[l, h, :r.counts[l, h]],
                                          np.sort(np.r_[0:4, best]))
    with pytest.raises(ValueError, match="reconstruction: shape"):
        p.select(k, budget_tokens=10, reconstruction=rec[:, :, :5])


def _run_ranks(spec, k, v, q, split, **kw):
    import threading
    group, results, errors = AllGatherGroup(len(split)), [None] * len(split), [None] * len(split)
    starts = np.cumsum([0] + list(split))
    g = q.shape[1] // k.shape[1]

    def rank(r):
        h0, h1 = starts[r], starts[r + 1]
        shard = kvpolicy.HeadShard(r, len(split), int(h0), k.shape[1], group.member(r))
        try:
            results[r] = kvpolicy.Policy(spec).select(k[:, h0:h1], v[:, h0:h1], q[:, h0 * g:h1 * g],
                                                      shard=shard, return_scores=True, **kw)
        except ValueError as e:
            errors[r] = str(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(split))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors


@pytest.mark.parametrize("spec", ["snapkv(window=8) | adakv", "tova | pyramid(beta=2) | adakv(alpha=0)",
                                  "expected(window=8,theta=10000) | adakv", "knorm | ams(window=8,min_seg_len=4)"])
def test_head_shard_ranks_keep_what_one_call_keeps(rng, spec):
    k, v = cache(rng, L=2, H=3, T=160)
    q = rng.standard_normal((2, 9, 8, k.shape[-1])).astype(np.float32)
    one = kvpolicy.Policy(spec).select(k, v, q, budget=0.3, return_scores=True)
    assert kvpolicy.Policy(spec).spans_heads == ("adakv" in spec or "tova" in spec or "expected" in spec)
    for split in ([2, 1], [1, 1, 1]):
        res, err = _run_ranks(spec, k, v, q, split, budget=0.3)
        assert err == [None] * len(split)
        h0 = 0
        for r, n in enumerate(split):
            for l in range(2):
                for h in range(n):
                    np.testing.assert_array_equal(res[r].kept(l, h), one.kept(l, h0 + h))
                    np.testing.assert_array_equal(res[r].scores[l, h], one.scores[l, h0 + h])
            h0 += n


def test_head_shard_errors_reach_every_rank(rng):
    k, v = cache(rng, L=2, H=3, T=40)
    q = rng.standard_normal((2, 9, 4, k.shape[-1])).astype(np.float32)
    # Rank 1 holds heads [1, 3) but claims to start at 2: every rank reports the gap.
    import threading
    group, errors = AllGatherGroup(2), [None, None]

    def rank(r):
        shard = kvpolicy.HeadShard(r, 2, 0 if r == 0 else 2, 3, group.member(r))
        h0, h1 = (0, 1) if r == 0 else (1, 3)
        try:
            kvpolicy.Policy("knorm | adakv").select(k[:, h0:h1], v[:, h0:h1], shard=shard, budget=0.3)
        except ValueError as e:
            errors[r] = str(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in errors:
        assert e is not None and "heads [2, 4) of rank 1 do not fit the model's 3 KV heads" in e
    assert "rank 1 failed its checks" in errors[0]
    # A Python all_gather that raises: its message is part of the error.
    def broken(data):
        raise RuntimeError("communicator down")
    with pytest.raises(ValueError, match="communicator down"):
        kvpolicy.Policy("knorm | adakv").select(k[:, :1], v[:, :1], budget=0.3,
                                                shard=kvpolicy.HeadShard(0, 2, 0, 3, broken))
    # A policy that combines no heads needs no all_gather.
    r = kvpolicy.Policy("knorm").select(k[:, 1:], v[:, 1:], budget=0.3,
                                        shard=kvpolicy.HeadShard(1, 2, 1, 3))
    one = kvpolicy.Policy("knorm").select(k, v, budget=0.3)
    np.testing.assert_array_equal(r.kept(0, 0), one.kept(0, 1))
