"""Quantizers: round trips within half a quantization step; packed attention."""

import numpy as np
import pytest

import kvpolicy
from test_session import attention


def half_steps(x, axis_group, group, bits):
    """Half the quantization step of each value's group: (max - min) / (2^bits - 1) / 2."""
    L, H, T, d = x.shape
    if axis_group == "tokens":  # keys: per channel over groups of `group` tokens
        g = x.reshape(L, H, T // group, group, d)
        step = (g.max(3, keepdims=True) - g.min(3, keepdims=True)) / (2 ** bits - 1)
        return np.broadcast_to(step / 2, g.shape).reshape(x.shape)
    g = x.reshape(L, H, T, d // group, group)  # values: per token over groups of channels
    step = (g.max(4, keepdims=True) - g.min(4, keepdims=True)) / (2 ** bits - 1)
    return np.broadcast_to(step / 2, g.shape).reshape(x.shape)


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_round_trip_within_half_a_step(rng, bits):
    q = kvpolicy.Quantizer(f"kivi(bits={bits})")
    assert q.bits == bits and q.group == 32 and not q.rotate
    x = rng.standard_normal((2, 3, 64, 64)).astype(np.float32)
    for part, axis in (("keys", "tokens"), ("values", "channels")):
        packed = q.encode(x, part)
        assert packed.dtype == np.uint8
        assert packed.shape == (2, 3, q.packed_bytes(64, 64, part))
        y = q.decode(packed, 64, 64, part)
        err = np.abs(y - x)
        assert (err <= half_steps(x, axis, 32, bits) * (1 + 1e-5) + 1e-6).all(), part


def test_int2_int4_round_trip(rng):
    x = rng.standard_normal((1, 2, 64, 64)).astype(np.float32)
    errs = {}
    for spec in ("int2", "int4"):
        q = kvpolicy.Quantizer(spec)
        y = q.decode(q.encode(x[0], "keys"), 64, 64, "keys")  # 3-d in, 3-d out
        assert y.shape == x[0].shape
        errs[spec] = float(np.mean((y - x[0]) ** 2) / np.mean(x ** 2))
    assert errs["int4"] < errs["int2"] < 0.25
    assert kvpolicy.Quantizer("int2").bytes_per_token(64) == 68


def test_packed_cache_and_attention(rng):
    q = kvpolicy.Quantizer("int4(residual=16)")
    d, T, H, Hq = 64, 100, 2, 4
    k = rng.standard_normal((H, T, d)).astype(np.float32)
    v = rng.standard_normal((H, T, d)).astype(np.float32)
    heads = []
    for h in range(H):
        c = kvpolicy.PackedCache(q, d)
        c.append(k[h, :60], v[h, :60])
        c.append(k[h, 60:], v[h, 60:])
        assert c.size == T and c.packed_tokens == 96 and c.residual_tokens == 4
        kd, vd = c.decode()
        np.testing.assert_allclose(kd[96:], k[h, 96:], rtol=1e-5, atol=1e-5)  # residual: fp32
        heads.append(c)
    qs = rng.standard_normal((Hq, 3, d)).astype(np.float32)
    out = kvpolicy.packed_attention(heads, qs, causal=True)
    for h in range(H):
        kd, vd = heads[h].decode()
        np.testing.assert_allclose(out[2 * h:2 * h + 2], attention(qs[2 * h:2 * h + 2], kd, vd, True),
                                   rtol=1e-3, atol=1e-4)


def test_quant_errors(rng):
    with pytest.raises(ValueError, match="unknown quantizer 'snapkv'"):
        kvpolicy.Quantizer("snapkv")
    with pytest.raises(ValueError, match="group must be 32, 64 or 128"):
        kvpolicy.Quantizer("int2(group=16)")
    q = kvpolicy.Quantizer("int2")
    with pytest.raises(TypeError, match="x: dtype float64"):
        q.encode(np.zeros((1, 1, 32, 64)))
    with pytest.raises(ValueError, match="part: expected 'keys' or 'values'"):
        q.encode(np.zeros((1, 1, 32, 64), np.float32), "both")
    with pytest.raises(ValueError, match="packed: rows of"):
        q.decode(np.zeros((1, 1, 10), np.uint8), 32, 64)
