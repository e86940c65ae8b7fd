"""Policy.select / compress on CUDA tensors (DLPack): the device entry's argument checks, which
run in every build, and, where a GPU and a CUDA build exist, the kept sets against the host path.

The argument checks use stand-in CUDA tensors: a DLPack capsule built with ctypes that says
"CUDA device 4095" (a device no machine has) over host memory that the checks never read. A
call that passes the checks then raises before any memory is touched: RuntimeError in a
CPU-only build (kvpolicy._core.cuda_built is False), the device guard's "cannot select it" (or
the runtime's "no device") in a CUDA build, GPU or not."""

import ctypes

import numpy as np
import pytest

import kvpolicy
from kvpolicy import _core

from conftest import AllGatherGroup, cache


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


NO_DEVICE = (2, 4095)  # kDLCUDA, an ordinal no machine has


class FakeDeviceTensor:
    """A DLPack producer that says its memory (a numpy array's) is on `device` (type, id).
    `dtype`: a (DLPack type code, bits) to report instead of the array's (e.g. (4, 16):
    bfloat16). `base`: an array that `array` views; the capsule then points at `base` with a
    byte_offset. `null_strides`: no strides (row-major). Records the stream each __dlpack__ was
    asked for."""

    def __init__(self, array, device=NO_DEVICE, dtype=None, base=None, null_strides=False):
        self.array = array
        self.device = device
        self.dtype = dtype
        self.base = base
        self.null_strides = null_strides
        self.streams = []
        self._keep = []

    @property
    def shape(self):
        return self.array.shape

    def __getitem__(self, index):
        return FakeDeviceTensor(self.array[index], self.device, self.dtype)

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, stream=None):
        self.streams.append(stream)
        a = self.array
        shape = (ctypes.c_int64 * a.ndim)(*a.shape)
        strides = (ctypes.c_int64 * a.ndim)(*(s // a.itemsize for s in a.strides))
        code, bits = self.dtype or _CODES[a.dtype]
        data, offset = a.ctypes.data, 0
        if self.base is not None:
            data, offset = self.base.ctypes.data, a.ctypes.data - self.base.ctypes.data
        m = _DLManagedTensor()
        m.dl_tensor = _DLTensor(data, _DLDevice(*self.device), a.ndim, _DLDataType(code, bits, 1),
                                shape, None if self.null_strides else strides, offset)
        self._keep += [shape, strides, m]
        return _capsule_new(ctypes.addressof(m), b"dltensor", None)


def _device(*arrays, **kw):
    return [FakeDeviceTensor(a, **kw) for a in arrays]


def _queries(rng, L=2, Hq=6, n=8, d=32, dtype=np.float32):
    return rng.standard_normal((L, Hq, n, d)).astype(dtype)


def _after_checks():
    """What a call on NO_DEVICE that passed the checks raises, before touching memory."""
    if _core.cuda_built:
        return pytest.raises(ValueError, match="cuda device 4095: cannot select it|"
                                               "DeviceGuard: CUDA error")
    return pytest.raises(RuntimeError, match="this build has no CUDA.*passed the checks")


def test_valid_call_passes_every_check_then_reports_the_build(rng):
    k, v = cache(rng)
    q = _queries(rng)
    dk, dv, dq = _device(k, v, q)
    p = kvpolicy.Policy("snapkv(window=8) | pyramid | adakv")
    with _after_checks():
        p.select(dk, dv, dq, budget=0.5)
    with _after_checks():
        p.compress(dk, dv, dq, budget_tokens=12)
    # A 3-d cache (one layer), float16 and bfloat16 pass the checks too.
    k16, v16 = k[0].astype(np.float16), v[0].astype(np.float16)
    with _after_checks():
        p.select(*_device(k16, v16, q[0].astype(np.float16)), budget=0.5)
    with _after_checks():
        p.select(*_device(k16, v16, q[0].astype(np.float16), dtype=(4, 16)), budget=0.5)
    # Row-major tensors without strides, and keys and values in one buffer (byte_offset).
    with _after_checks():
        p.compress(*_device(k, v, q, null_strides=True), budget=0.5)
    both = np.concatenate([k.ravel(), v.ravel()])
    kb, vb = both[:k.size].reshape(k.shape), both[k.size:].reshape(v.shape)
    with _after_checks():
        p.compress(FakeDeviceTensor(kb, base=both), FakeDeviceTensor(vb, base=both),
                   FakeDeviceTensor(q), budget=0.5)


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
    with pytest.raises(TypeError, match="stream: expected a CUDA stream handle"):
        p.select(dk, dv, stream=True)
    with pytest.raises(ValueError, match="stream: given, but no tensor is on a CUDA device"):
        p.select(k, v, stream=5)


def test_kvzip_takes_reconstruction_scores_on_the_cache_device_and_ams_runs_there(rng):
    k, v = cache(rng)
    dk, dv, dq = _device(k, v, _queries(rng))
    L, H, T = k.shape[:3]
    rec = rng.random((L, H, T)).astype(np.float32)
    p = kvpolicy.Policy("kvzip | adakv")
    with pytest.raises(ValueError, match="reconstruction scores are required"):
        p.select(dk, dv, dq, budget=0.5)
    with _after_checks():
        p.select(dk, dv, dq, budget=0.5, reconstruction=FakeDeviceTensor(rec))
    # Rows padded to a longer stride are taken; a one-layer cache takes [H][T] scores.
    wide = rng.random((L, H, T + 5)).astype(np.float32)
    with _after_checks():
        p.compress(dk, dv, dq, budget=0.5, reconstruction=FakeDeviceTensor(wide[:, :, :T]))
    with _after_checks():
        p.select(dk[0], dv[0], dq[0], budget=0.5, reconstruction=FakeDeviceTensor(rec[0]))
    with pytest.raises(ValueError, match="reconstruction: a host array"):
        p.select(dk, dv, dq, budget=0.5, reconstruction=rec)
    with pytest.raises(ValueError, match=r"reconstruction: shape \[2,3,9\] does not match"):
        p.select(dk, dv, dq, budget=0.5, reconstruction=FakeDeviceTensor(rec[:, :, :9]))
    with pytest.raises(TypeError, match="reconstruction: expected float32"):
        p.select(dk, dv, dq, budget=0.5,
                 reconstruction=FakeDeviceTensor(rec.astype(np.float16)))
    with pytest.raises(ValueError, match="reconstruction: rows must be contiguous"):
        p.select(dk, dv, dq, budget=0.5,
                 reconstruction=FakeDeviceTensor(np.ascontiguousarray(
                     rec.transpose(1, 0, 2)).transpose(1, 0, 2)))
    with pytest.raises(ValueError, match="reconstruction: on cuda:7"):
        p.select(dk, dv, dq, budget=0.5, reconstruction=FakeDeviceTensor(rec, device=(2, 7)))
    # ams: window attention and the credit kernels on the device (a first event).
    with _after_checks():
        kvpolicy.Policy("snapkv(window=8) | adakv | ams(window=8,min_seg_len=4)").compress(
            dk, dv, dq, budget=0.5)


def test_expected_attention_takes_the_rope_frequencies_as_a_host_array(rng):
    """Expected attention has a device kernel; its RoPE frequencies come from the spec (theta=)
    or from rope_inv_freq, a host array even when the tensors are on the device."""
    k, v = cache(rng)
    dk, dv, dq = _device(k, v, _queries(rng))
    with _after_checks():
        kvpolicy.Policy("expected(theta=10000,window=8)").select(dk, dv, dq, budget=0.5)
    freqs = 10000.0 ** (-np.arange(16, dtype=np.float64) * 2 / 32)
    with _after_checks():
        kvpolicy.Policy("expected(window=8) | adakv").compress(dk, dv, dq, budget=0.5,
                                                                rope_inv_freq=freqs)


def test_dtypes_and_devices_are_checked(rng):
    k, v = cache(rng)
    q = _queries(rng)
    p = kvpolicy.Policy("knorm")
    with pytest.raises(TypeError, match=r"keys: dtype \(code 2, 64 bits, 1 lanes\) is not supported"):
        p.select(*_device(k.astype(np.float64), v))
    with pytest.raises(TypeError, match=r"keys: dtype \(bfloat32, 1 lanes\) is not supported"):
        p.select(*_device(k, v, dtype=(4, 32)))
    with pytest.raises(TypeError, match="values: dtype float16 differs from keys. float32"):
        p.select(*_device(k, v.astype(np.float16)))
    with pytest.raises(TypeError, match="keys: tensor is on DLPack device 'rocm'"):
        p.select(*_device(k, v, device=(10, 0)))
    dk = FakeDeviceTensor(k, device=(2, 0))
    with pytest.raises(ValueError, match="values: on cuda:1 but keys are on cuda:0"):
        p.select(dk, FakeDeviceTensor(v, device=(2, 1)))
    with pytest.raises(ValueError, match="values: on cuda_managed:0 but keys are on cuda:0"):
        p.select(dk, FakeDeviceTensor(v, device=(13, 0)))
    with pytest.raises(ValueError, match="values: a host array while another tensor is on"):
        p.select(dk, v)
    with pytest.raises(ValueError, match="keys: a host array"):
        p.select(k, FakeDeviceTensor(v))
    with pytest.raises(ValueError, match="queries: 3-d while keys are 4-d"):
        kvpolicy.Policy("snapkv(window=8)").select(dk, FakeDeviceTensor(v, device=(2, 0)),
                                                   FakeDeviceTensor(q[0], device=(2, 0)))


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
    raw = np.zeros(k.size + 1, np.float32)
    shifted = raw.view(np.uint8)[2:2 + k.nbytes].view(np.float32).reshape(k.shape)
    with pytest.raises(ValueError, match=r"keys: data pointer \(with byte_offset 2\) is not "
                                         "aligned to its 4-byte elements"):
        snap.select(FakeDeviceTensor(shifted, base=raw), dv, dq, budget=0.5)


def test_arguments_the_device_path_does_not_take_are_named(rng):
    k, v = cache(rng)
    dk, dv, dq = _device(k, v, _queries(rng))
    acc = np.ones(k.shape[:3], np.float32)
    h2o = kvpolicy.Policy("h2o")
    with pytest.raises(ValueError, match="accumulated: not taken by the device path"):
        h2o.select(dk, dv, dq, accumulated=acc)
    with pytest.raises(ValueError, match="return_scores: not taken by the device path"):
        h2o.select(dk, dv, dq, return_scores=True)
    # Scorers that combine heads run sharded on the host path only.
    with pytest.raises(ValueError, match="scorer 'tova' combines KV heads across tensor-parallel"):
        kvpolicy.Policy("tova").select(dk, dv, dq, shard=kvpolicy.HeadShard(0, 2, 0, 6))
    with pytest.raises(ValueError, match="inplace: the device path compacts CUDA tensors in place"):
        h2o.compress(dk, dv, dq, inplace=False)


def _run_device_ranks(spec, k, v, q, split, bad_rank=None, **kw):
    """Ranks as threads, each calling select on its heads' stand-in device tensors; returns each
    rank's exception."""
    import threading
    group, errors = AllGatherGroup(len(split)), [None] * len(split)
    starts = np.cumsum([0] + list(split))
    g = q.shape[1] // k.shape[1]

    def rank(r):
        h0, h1 = int(starts[r]), int(starts[r + 1])
        shard = kvpolicy.HeadShard(r, len(split), h0, k.shape[1], group.member(r))
        dk, dv = _device(np.ascontiguousarray(k[:, h0:h1]), np.ascontiguousarray(v[:, h0:h1]))
        dq = None if r == bad_rank else FakeDeviceTensor(np.ascontiguousarray(q[:, h0 * g:h1 * g]))
        try:
            kvpolicy.Policy(spec).select(dk, dv, dq, shard=shard, **kw)
        except Exception as e:  # noqa: BLE001 (each rank's outcome is checked)
            errors[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(split))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_a_shard_is_agreed_on_by_every_rank_before_the_device(rng):
    """Tensor parallelism on the device path: with adakv the ranks agree on their checks first
    (in every build), so one rank's bad argument fails every rank instead of leaving the others
    waiting; valid ranks pass the checks and reach the device (here: the stand-in's error)."""
    k, v = cache(rng, L=2, H=3, T=40)
    q = _queries(rng, Hq=6)
    errors = _run_device_ranks("snapkv(window=8) | adakv", k, v, q, [1, 1, 1], bad_rank=1,
                               budget=0.3)
    assert "queries" in str(errors[1])
    for r in (0, 2):
        assert isinstance(errors[r], ValueError)
        assert "head shard: rank 1 failed its checks: queries" in str(errors[r])
    errors = _run_device_ranks("snapkv(window=8) | adakv", k, v, q, [2, 1], budget=0.3)
    for e in errors:
        with _after_checks():
            raise e
    # A chain that combines no heads needs no all_gather and exchanges nothing.
    errors = _run_device_ranks("knorm | pyramid", k, v, q, [1, 2], budget=0.3)
    for e in errors:
        with _after_checks():
            raise e


def _cudart():
    """The CUDA runtime through ctypes when this machine has a GPU, else None."""
    import ctypes.util
    for name in (ctypes.util.find_library("cudart"), "libcudart.so",
                 "/usr/local/cuda/lib64/libcudart.so"):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        count = ctypes.c_int(0)
        if lib.cudaGetDeviceCount(ctypes.byref(count)) == 0 and count.value > 0:
            return lib
    return None


class DeviceCopy(FakeDeviceTensor):
    """A real CUDA copy of a numpy array (cudaMalloc + cudaMemcpy through ctypes), as a DLPack
    producer: no torch or CuPy needed."""

    def __init__(self, cudart, array):
        self.cudart, self.host = cudart, np.ascontiguousarray(array)
        ptr = ctypes.c_void_p()
        assert cudart.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(self.host.nbytes)) == 0
        assert cudart.cudaMemcpy(ptr, self.host.ctypes.data_as(ctypes.c_void_p),
                                 ctypes.c_size_t(self.host.nbytes), 1) == 0  # host to device
        self.ptr = ptr
        super().__init__(self.host, device=(2, 0))

    def __dlpack__(self, stream=None):
        cap = super().__dlpack__(stream)
        self._keep[-1].dl_tensor.data = self.ptr.value  # the device copy, not the host array
        return cap

    def numpy(self):
        out = np.empty_like(self.host)
        assert self.cudart.cudaMemcpy(out.ctypes.data_as(ctypes.c_void_p), self.ptr,
                                      ctypes.c_size_t(out.nbytes), 2) == 0  # device to host
        return out

    def __del__(self):
        self.cudart.cudaFree(self.ptr)


_CUDART = _cudart()


@pytest.mark.skipif(not _core.cuda_built or _CUDART is None,
                    reason="needs kvpolicy built with CUDA (-C cmake.define.KVPOLICY_CUDA=ON) "
                           "and a GPU")
def test_cuda_tensors_keep_the_host_paths_sets(rng):
    k, v = cache(rng, T=64)
    q = _queries(rng)
    for spec in ("snapkv(window=8) | pyramid | adakv", "knorm", "tova", "keydiff | adakv"):
        p = kvpolicy.Policy(spec)
        want = p.compress(k.copy(), v.copy(), q, budget=0.4)
        dk, dv, dq = (DeviceCopy(_CUDART, x) for x in (k, v, q))
        got = p.compress(dk, dv, dq, budget=0.4)
        np.testing.assert_array_equal(got.indices, want.indices)
        np.testing.assert_array_equal(got.counts, want.counts)
        width = want.indices.shape[2]
        np.testing.assert_array_equal(dk.numpy()[:, :, :width], want.keys)
        np.testing.assert_array_equal(dv.numpy()[:, :, :width], want.values)
    # Expected attention: device scores equal the host's to fp32 rounding, so the kept sets may
    # differ at near-ties only: the same counts, and at most one token exchanged per row.
    p = kvpolicy.Policy("expected(theta=10000,window=8)")
    want = p.select(k, v, q, budget=0.4)
    dk, dv, dq = (DeviceCopy(_CUDART, x) for x in (k, v, q))
    got = p.select(dk, dv, dq, budget=0.4)
    np.testing.assert_array_equal(got.counts, want.counts)
    for l in range(k.shape[0]):
        for h in range(k.shape[1]):
            n = want.counts[l, h]
            assert len(set(got.indices[l, h, :n]) ^ set(want.indices[l, h, :n])) <= 2


def _torch_cuda():
    """torch when it is installed and sees a GPU, else None."""
    try:
        import torch
        return torch if torch.cuda.is_available() else None
    except Exception:  # not installed, or an install whose CUDA libraries do not load
        return None


@pytest.mark.skipif(not _core.cuda_built or _torch_cuda() is None,
                    reason="needs kvpolicy built with CUDA, torch with CUDA, and a GPU")
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_torch_cuda_tensors_on_a_stream_keep_the_host_paths_sets(rng, dtype):
    # torch's own CUDA tensors through __dlpack__, on a side stream that torch's copies are queued
    # on: the call orders its work after them, and the kept rows are compacted in place. The host
    # reference is the same values in float32 (fp16 / bf16 round exactly to float32), so the
    # kept sets must agree, and the compacted rows equal the host's kept rows.
    torch = _torch_cuda()
    k, v = cache(rng, T=64)
    q = _queries(rng)
    tdtype = getattr(torch, dtype)
    tk, tv, tq = (torch.from_numpy(x).to(tdtype) for x in (k, v, q))
    hk, hv, hq = (x.to(torch.float32).numpy() for x in (tk, tv, tq))
    side = torch.cuda.Stream()
    for spec in ("snapkv(window=8) | pyramid | adakv", "knorm", "keydiff | adakv"):
        p = kvpolicy.Policy(spec)
        want = p.compress(hk.copy(), hv.copy(), hq, budget=0.4)
        with torch.cuda.stream(side):
            dk, dv, dq = (x.to("cuda", non_blocking=False) for x in (tk, tv, tq))
            got = p.compress(dk, dv, dq, budget=0.4, stream=side.cuda_stream)
        np.testing.assert_array_equal(got.counts, want.counts)
        np.testing.assert_array_equal(got.indices, want.indices)
        width = want.indices.shape[2]
        np.testing.assert_array_equal(dk[:, :, :width].to(torch.float32).cpu().numpy(),
                                      want.keys)
        np.testing.assert_array_equal(dv[:, :, :width].to(torch.float32).cpu().numpy(),
                                      want.values)
