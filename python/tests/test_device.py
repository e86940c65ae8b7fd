"""Policy.select / compress on CUDA tensors (DLPack): the device entry's argument checks, which
run in every build, and, where a GPU and a CUDA build exist, the kept sets against the host path.

The argument checks use stand-in CUDA tensors: a DLPack capsule built with ctypes that says
"CUDA device 0" (or another device) over host memory that is never read by the checks. A
CPU-only build (kvpolicy._core.cuda_built is False) then raises RuntimeError after every check;
a CUDA build on a machine without a GPU raises the CUDA error of its first allocation. Neither
touches the (fake) device memory."""

import ctypes

import numpy as np
import pytest

import kvpolicy
from kvpolicy import _core

from conftest import cache


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

_CODES = {np.dtype(np.float32): (2, 32), np.dtype(np.float16): (2, 16),
          np.dtype(np.float64): (2, 64), np.dtype(np.int32): (0, 32)}


class FakeDeviceTensor:
    """A DLPack producer that says its memory (a numpy array's) is on `device` (type, id).
    `bfloat16=True` reports dtype bfloat16. Records the stream each __dlpack__ was asked for."""

    def __init__(self, array, device=(2, 0), bfloat16=False):
        self.array = array
        self.device = device
        self.bfloat16 = bfloat16
        self.streams = []
        self._keep = []

    @property
    def shape(self):
        return self.array.shape

    def __getitem__(self, index):
        return FakeDeviceTensor(self.array[index], self.device, self.bfloat16)

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, stream=None):
        self.streams.append(stream)
        a = self.array
        shape = (ctypes.c_int64 * a.ndim)(*a.shape)
        strides = (ctypes.c_int64 * a.ndim)(*(s // a.itemsize for s in a.strides))
        code, bits = (4, 16) if self.bfloat16 else _CODES[a.dtype]
        m = _DLManagedTensor()
        m.dl_tensor = _DLTensor(a.ctypes.data, _DLDevice(*self.device), a.ndim,
                                _DLDataType(code, bits, 1), shape, strides, 0)
        self._keep += [shape, strides, m]
        return _capsule_new(ctypes.addressof(m), b"dltensor", None)


def _device(*arrays, **kw):
    return [FakeDeviceTensor(a, **kw) for a in arrays]


def _queries(rng, L=2, Hq=6, n=8, d=32, dtype=np.float32):
    return rng.standard_normal((L, Hq, n, d)).astype(dtype)


def _after_checks():
    """What a call that passed every check raises on this machine (no GPU)."""
    if _core.cuda_built:
        return pytest.raises(Exception, match="CUDA|cuda")
    return pytest.raises(RuntimeError, match="this build has no CUDA.*every argument was checked")


def test_valid_call_passes_every_check_then_reports_the_build(rng):
    k, v = cache(rng)
    q = _queries(rng)
    dk, dv, dq = _device(k, v, q)
    p = kvpolicy.Policy("snapkv(window=8) | pyramid | adakv")
    with _after_checks():
        p.select(dk, dv, dq, budget=0.5)
    with _after_checks():
        p.compress(dk, dv, dq, budget_tokens=12)
    # A 3-d cache (one layer) and float16 pass the checks too.
    k16, v16 = k[0].astype(np.float16), v[0].astype(np.float16)
    with _after_checks():
        p.select(*_device(k16, v16, q[0].astype(np.float16)), budget=0.5)


def test_the_producers_are_asked_for_the_callers_stream(rng):
    k, v = cache(rng)
    dk, dv = _device(k, v)
    p = kvpolicy.Policy("knorm")
    with _after_checks():
        p.select(dk, dv)
    assert dk.streams == [1] and dv.streams == [1]  # DLPack's legacy default stream
    with _after_checks():
        p.select(dk, dv, stream=0x1234)
    assert dk.streams[-1] == 0x1234 and dv.streams[-1] == 0x1234
    with pytest.raises(TypeError, match="stream: expected a CUDA stream handle"):
        p.select(dk, dv, stream=-1)
    with pytest.raises(ValueError, match="stream: given, but no tensor is on a CUDA device"):
        p.select(k, v, stream=5)


def test_stages_without_a_device_path_are_named(rng):
    k, v = cache(rng)
    dk, dv, dq = _device(k, v, _queries(rng))
    with pytest.raises(ValueError, match="scorer 'expected' has no CUDA kernel.*snapkv"):
        kvpolicy.Policy("expected").select(dk, dv, dq, budget=0.5)
    with pytest.raises(ValueError, match="allocator 'ams' has no device path"):
        kvpolicy.Policy("snapkv(window=8) | ams").select(dk, dv, dq, budget=0.5)


def test_dtypes_and_devices_are_checked(rng):
    k, v = cache(rng)
    q = _queries(rng)
    p = kvpolicy.Policy("knorm")
    with pytest.raises(TypeError, match=r"keys: dtype \(code 2, 64 bits, 1 lanes\) is not supported"):
        p.select(*_device(k.astype(np.float64), v))
    with pytest.raises(TypeError, match=r"keys: dtype \(bfloat16, 1 lanes\)"):
        p.select(*_device(k, v, bfloat16=True))
    with pytest.raises(TypeError, match="values: dtype float16 differs from keys. float32"):
        p.select(*_device(k, v.astype(np.float16)))
    with pytest.raises(TypeError, match="keys: tensor is on DLPack device 'rocm'"):
        p.select(*_device(k, v, device=(10, 0)))
    dk = FakeDeviceTensor(k)
    with pytest.raises(ValueError, match="values: on cuda:1 but keys are on cuda:0"):
        p.select(dk, FakeDeviceTensor(v, device=(2, 1)))
    with pytest.raises(ValueError, match="values: a host array while another tensor is on"):
        p.select(dk, v)
    with pytest.raises(ValueError, match="keys: a host array"):
        p.select(k, FakeDeviceTensor(v))
    with pytest.raises(ValueError, match="queries: 3-d while keys are 4-d"):
        kvpolicy.Policy("snapkv(window=8)").select(dk, FakeDeviceTensor(v),
                                                   FakeDeviceTensor(q[0]))


def test_shapes_and_budgets_are_checked(rng):
    k, v = cache(rng)
    q = _queries(rng)
    dk, dv, dq = _device(k, v, q)
    snap = kvpolicy.Policy("snapkv(window=8)")
    with pytest.raises(ValueError, match="values shape .* does not match keys"):
        snap.compress(dk, FakeDeviceTensor(v[:, :, :30]), dq, budget=0.5)
    with pytest.raises(ValueError, match="queries: 5 query heads are not a multiple of 3"):
        snap.select(dk, dv, FakeDeviceTensor(q[:, :5]), budget=0.5)
    with pytest.raises(ValueError, match="queries: this policy needs the last 8 queries"):
        snap.select(dk, dv, budget=0.5)
    with pytest.raises(ValueError, match="expected a 4-d tensor"):
        snap.select(FakeDeviceTensor(k[0, 0]), budget=0.5)
    with pytest.raises(ValueError, match="negative stride"):
        kvpolicy.Policy("knorm").select(FakeDeviceTensor(k[:, :, ::-1]), budget=0.5)
    with pytest.raises(ValueError, match="keeps every token"):
        kvpolicy.Policy("int2").select(dk, dv, budget=0.5)
    with pytest.raises(ValueError, match="values: compress needs the values"):
        snap.compress(dk, None, dq, budget=0.5)
    with pytest.raises(ValueError, match="values: shares memory with keys"):
        snap.compress(dk, FakeDeviceTensor(k), dq, budget=0.5)


def test_arguments_the_device_path_does_not_take_are_named(rng):
    k, v = cache(rng)
    dk, dv, dq = _device(k, v, _queries(rng))
    acc = np.ones(k.shape[:3], np.float32)
    h2o = kvpolicy.Policy("h2o")
    with pytest.raises(ValueError, match="accumulated: not taken by the device path"):
        h2o.select(dk, dv, dq, accumulated=acc)
    with pytest.raises(ValueError, match="return_scores: not taken by the device path"):
        h2o.select(dk, dv, dq, return_scores=True)
    with pytest.raises(ValueError, match="shard: not taken by the device path"):
        h2o.select(dk, dv, dq, shard=kvpolicy.HeadShard(0, 1, 0, 3))
    with pytest.raises(ValueError, match="inplace: the device path compacts CUDA tensors in place"):
        h2o.compress(dk, dv, dq, inplace=False)


def _torch_cuda():
    try:
        import torch as t
    except ImportError:
        return None
    return t if t.cuda.is_available() else None


@pytest.mark.skipif(not _core.cuda_built or _torch_cuda() is None,
                    reason="needs kvpolicy built with CUDA and a GPU (torch.cuda)")
def test_cuda_tensors_keep_the_host_paths_sets(rng):
    t = _torch_cuda()
    k, v = cache(rng, T=64)
    q = _queries(rng)
    for spec in ("snapkv(window=8) | pyramid | adakv", "knorm", "tova", "keydiff | adakv"):
        p = kvpolicy.Policy(spec)
        want = p.compress(k.copy(), v.copy(), q, budget=0.4)
        dk, dv, dq = (t.from_numpy(x.copy()).cuda() for x in (k, v, q))
        stream = t.cuda.current_stream().cuda_stream
        got = p.compress(dk, dv, dq, budget=0.4, stream=stream)
        np.testing.assert_array_equal(got.indices, want.indices)
        np.testing.assert_array_equal(got.counts, want.counts)
        np.testing.assert_array_equal(got.keys.cpu().numpy(), want.keys)
        np.testing.assert_array_equal(got.values.cpu().numpy(), want.values)
