"""Session: prefill + decode loop against a numpy attention over what the session holds."""

import numpy as np
import pytest

import kvpolicy


def attention(q, k, v, causal_last):
    """q [g][n][d] of one KV head's query group, k/v [T][d]; the n queries are the last n
    tokens when causal_last."""
    d = q.shape[-1]
    s = q.astype(np.float64) @ k.T.astype(np.float64) / np.sqrt(d)
    if causal_last:
        n, T = q.shape[1], k.shape[0]
        mask = np.arange(T)[None, :] > (T - n + np.arange(n))[:, None]
        s = np.where(mask[None], -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return p @ v.astype(np.float64)


def test_decode_loop_streaming(rng):
    L, H, Hq, d, T0 = 2, 2, 4, 16, 32
    s = kvpolicy.Session("streaming(sinks=4)", layers=L, kv_heads=H, q_heads=Hq, head_dim=d,
                         budget_tokens=16, decode_interval=4)
    assert s.decode_interval == 4
    kv = lambda n: rng.standard_normal((H, n, d)).astype(np.float32)
    for l in range(L):
        s.append(l, kv(T0), kv(T0))
        assert s.compress_if_due(l)
        np.testing.assert_array_equal(s.lengths(l), [16, 16])
        np.testing.assert_array_equal(s.positions(l, 1), np.r_[0:4, 20:32])
    pos = T0
    for step in range(10):
        for l in range(L):
            s.append(l, kv(1), kv(1))
            q = rng.standard_normal((Hq, 1, d)).astype(np.float32)
            out = s.attend(l, q)
            assert out.shape == (Hq, 1, d) and out.dtype == np.float32
            for h in range(H):
                ref = attention(q[2 * h:2 * h + 2], s.keys(l, h), s.values(l, h), True)
                np.testing.assert_allclose(out[2 * h:2 * h + 2], ref, rtol=1e-4, atol=1e-5)
            s.compress_if_due(l)
            n = s.lengths(l)[0]
            assert 16 <= n < 16 + 4
            # sinks, then the newest tokens, in order
            np.testing.assert_array_equal(s.positions(l, 0), np.r_[0:4, pos + 1 - (n - 4):pos + 1])
        pos += 1
    assert s.kv_bytes > 0


def test_full_cache_attention_matches_numpy(rng):
    H, Hq, d, T = 2, 6, 8, 20
    s = kvpolicy.Session("streaming", layers=1, kv_heads=H, q_heads=Hq, head_dim=d)
    k = rng.standard_normal((H, T, d)).astype(np.float32)
    v = rng.standard_normal((H, T, d)).astype(np.float32)
    q = rng.standard_normal((Hq, T, d)).astype(np.float32)
    # NHD-strided input works as well as contiguous.
    kn = np.ascontiguousarray(k.transpose(1, 0, 2)).transpose(1, 0, 2)
    s.append(0, kn, v)
    out = s.attend(0, q)
    for h in range(H):
        np.testing.assert_allclose(out[3 * h:3 * h + 3], attention(q[3 * h:3 * h + 3], k[h], v[h], True),
                                   rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(s.keys(0, 1), k[1])


def test_snapkv_session_needs_queries(rng):
    s = kvpolicy.Session("snapkv(window=4)", layers=1, kv_heads=1, q_heads=2, head_dim=8, budget=0.5)
    k = rng.standard_normal((1, 16, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="needs the queries; pass q"):
        s.append(0, k, k)
    q = rng.standard_normal((2, 16, 8)).astype(np.float32)
    s.append(0, k, k, q)
    idx, counts = s.compress(0)
    assert counts.tolist() == [[8]] and (idx[0, 0, -4:] == np.arange(12, 16)).all()


def test_session_budget_below_the_window_warns(rng):
    s = kvpolicy.Session("snapkv(window=8)", layers=1, kv_heads=1, q_heads=2, head_dim=8,
                         budget_tokens=3)
    k = rng.standard_normal((1, 16, 8)).astype(np.float32)
    s.append(0, k, k, rng.standard_normal((2, 16, 8)).astype(np.float32))
    with pytest.warns(RuntimeWarning, match="session: layer 0: budget of 3 tokens per head is "
                      "below the 8 tokens snapkv protects"):
        assert s.compress_if_due(0)
    assert s.positions(0, 0).tolist() == [13, 14, 15]


def test_session_errors(rng):
    with pytest.raises(ValueError, match="q_heads 3 is not a positive multiple of kv_heads 2"):
        kvpolicy.Session("streaming", layers=1, kv_heads=2, q_heads=3, head_dim=8)
    s = kvpolicy.Session("streaming", layers=1, kv_heads=2, q_heads=2, head_dim=8)
    k = np.zeros((2, 3, 8), np.float32)
    with pytest.raises(TypeError, match="k: dtype float16 is not supported \\(expected float32\\)"):
        s.append(0, k.astype(np.float16), k)
    with pytest.raises(ValueError, match="v must be \\[1\\]\\[2\\]\\[n\\]\\[8\\]"):
        s.append(0, k, np.zeros((2, 3, 4), np.float32))
    with pytest.raises(ValueError, match="k: expected a 3-d array"):
        s.append(0, k[None], k)
    bad = k.copy()
    bad[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="k contains a non-finite value"):
        s.append(0, bad, k)
    with pytest.raises(ValueError, match="layer"):
        s.append(5, k, k)


def test_storage_reserve_and_shrink(rng):
    H, d = 2, 8
    s = kvpolicy.Session("knorm", layers=2, kv_heads=H, q_heads=H, head_dim=d, budget_tokens=5,
                         initial_capacity=4)
    kv = lambda n: rng.standard_normal((H, n, d)).astype(np.float32)
    for l in range(2):
        s.append(l, kv(12), kv(12))
    assert s.capacity(0) == 12  # grown to fit the append
    assert s.compress_if_due(0)
    keys, pos = s.keys(0, 1), s.positions(0, 1)
    s.reserve(0, 40)  # grows; the cache is unchanged
    assert s.capacity(0) == 40 and s.capacity(1) == 12
    np.testing.assert_array_equal(s.keys(0, 1), keys)
    np.testing.assert_array_equal(s.positions(0, 1), pos)
    s.reserve(0, 1)  # never below the longest head
    assert s.capacity(0) == 5
    np.testing.assert_array_equal(s.keys(0, 1), keys)
    s.shrink_to_fit()  # every layer to its longest head
    assert s.capacity(1) == 12 and s.capacity(0) == 5
    with pytest.raises(ValueError, match="tokens must be positive"):
        s.reserve(0, 0)
    with pytest.raises(ValueError, match="address space"):
        s.reserve(0, 2 ** 62)


def test_reconstruct_kvzip(rng):
    """Session.reconstruct: the attention of a chunk placed after the cache, and per cached
    token the largest softmax probability over the chunk's queries and the KV head's group;
    kvzip then keeps the sinks and the best of those scores."""
    L, H, Hq, d, T, n = 1, 2, 4, 16, 40, 6
    g = Hq // H
    s = kvpolicy.Session("kvzip", layers=L, kv_heads=H, q_heads=Hq, head_dim=d, budget=0.5)
    assert s.policy.needs == {"keys", "reconstruction"}
    k, v = (rng.standard_normal((H, T, d)).astype(np.float32) for _ in range(2))
    s.append(0, k, v)
    with pytest.raises(ValueError, match="context-reconstruction scores"):
        s.compress_if_due(0)
    best = np.zeros((H, T))
    for _ in range(2):
        ck, cv = (rng.standard_normal((H, n, d)).astype(np.float32) for _ in range(2))
        q = rng.standard_normal((Hq, n, d)).astype(np.float32)
        out = s.reconstruct(0, ck, cv, q)
        assert out.shape == (Hq, n, d)
        for h in range(H):
            kk, vv = np.concatenate([k[h], ck[h]]), np.concatenate([v[h], cv[h]])
            qs = q[h * g:(h + 1) * g].astype(np.float64)
            np.testing.assert_allclose(out[h * g:(h + 1) * g], attention(qs, kk, vv, True),
                                       atol=1e-5)
            sc = qs @ kk.T.astype(np.float64) / np.sqrt(d)
            sc = np.where(np.arange(T + n)[None, None, :] > (T + np.arange(n))[None, :, None],
                          -np.inf, sc)
            p = np.exp(sc - sc.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            best[h] = np.maximum(best[h], p[..., :T].max(axis=(0, 1)))
            np.testing.assert_allclose(s.reconstruction(0, h), best[h], atol=1e-6)
    np.testing.assert_array_equal(s.lengths(0), [T, T])
    assert s.reconstructed(0)
    assert s.compress_if_due(0)
    for h in range(H):
        rest = 4 + np.argsort(-best[h, 4:], kind="stable")[:T // 2 - 4]
        np.testing.assert_array_equal(s.positions(0, h), np.sort(np.r_[0:4, rest]))
    s.clear_reconstruction()
    assert not s.reconstructed(0)
