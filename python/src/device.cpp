// Policy on device tensors: CUDA tensors of any DLPack producer (torch, CuPy, JAX, ...) reach the
// CUDA device path (kvpolicy/cuda/policy.hpp) without a copy. The Python wrapper
// (kvpolicy/_policy.py) routes a call here when a tensor lives outside host memory and hands over
// the producers' DLPack capsules (__dlpack__(stream=...), so that the producer's pending work is
// ordered before ours). The arguments are checked here in every build, before anything touches
// the device: capsule, device type and id, dtype, rank, strides, alignment, shapes, budget, the
// policy's stages (one without a device path is named); then a CUDA build runs cuda::run_owned
// on the tensors' device and the given stream (the kernels' own shape limits, e.g. head_dim, are
// checked there), and a CPU-only build raises RuntimeError saying so.
//
// The capsules are borrowed, not consumed: the producer's capsule keeps owning the tensor, and
// the call returns only after the stream has finished with it (run_owned downloads the selection).
#include <dlpack/dlpack.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "arrays.hpp"
#include "kvpolicy/cuda/policy.hpp"
#include "kvpolicy/kvpolicy.hpp"
#include "shard.hpp"

namespace kvpy {
namespace {

using kvpolicy::Budget;
using kvpolicy::Policy;

// One borrowed DLPack tensor of device memory, 4-d ([L][H][T][d]; a 3-d one is one layer).
struct DeviceTensor {
  void* data = nullptr;
  std::int32_t device_type = 0, device_id = 0;
  kvpolicy::DType dtype = kvpolicy::DType::f32;
  std::int64_t shape[4] = {1, 0, 0, 0}, strides[4] = {0, 0, 0, 0};
  std::int64_t ndim = 0;  // as given (3 or 4)
};

const char* device_name(std::int32_t type) {
  switch (type) {
    case kDLCPU: return "cpu";
    case kDLCUDA: return "cuda";
    case kDLCUDAHost: return "cuda_host";
    case kDLCUDAManaged: return "cuda_managed";
    case kDLROCM: return "rocm";
    case kDLOpenCL: return "opencl";
    case kDLVulkan: return "vulkan";
    case kDLMetal: return "metal";
    default: return "other";
  }
}

DeviceTensor borrow(const py::handle& capsule, const char* what) {
  if (!PyCapsule_IsValid(capsule.ptr(), "dltensor"))
    type_error(what, ": expected a DLPack capsule named 'dltensor' (what __dlpack__() returns), got ",
               type_name(capsule), " (a consumed capsule cannot be used twice)");
  const auto* managed =
      static_cast<const DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  const DLTensor& t = managed->dl_tensor;
  DeviceTensor d;
  d.device_type = static_cast<std::int32_t>(t.device.device_type);
  d.device_id = t.device.device_id;
  if (t.device.device_type != kDLCUDA && t.device.device_type != kDLCUDAManaged)
    type_error(what, ": tensor is on DLPack device '", device_name(d.device_type), "' (type ",
               d.device_type, "); the device path takes CUDA tensors (host tensors go through "
               "numpy)");
  const bool floating = t.dtype.code == kDLFloat && (t.dtype.bits == 32 || t.dtype.bits == 16);
  const bool brain = t.dtype.code == kDLBfloat && t.dtype.bits == 16;
  if (t.dtype.lanes != 1 || !(floating || brain))
    type_error(what, ": dtype (",
               t.dtype.code == kDLBfloat
                   ? "bfloat" + std::to_string(t.dtype.bits)
                   : "code " + std::to_string(t.dtype.code) + ", " + std::to_string(t.dtype.bits) +
                         " bits",
               ", ", t.dtype.lanes,
               " lanes) is not supported (expected float32, float16 or bfloat16)");
  d.dtype = brain ? kvpolicy::DType::bf16
                  : t.dtype.bits == 32 ? kvpolicy::DType::f32 : kvpolicy::DType::f16;
  if (t.ndim != 3 && t.ndim != 4)
    value_error(what, ": expected a 4-d tensor [layers][heads][tokens][head_dim] (or 3-d "
                "[heads][tokens][head_dim]), got ", t.ndim, " dimensions");
  d.ndim = t.ndim;
  const int skip = 4 - t.ndim;  // a 3-d tensor is one layer
  std::int64_t row_major = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    const std::int64_t n = t.shape[i];
    if (n < 0) value_error(what, ": negative extent ", n, " on axis ", i);
    const std::int64_t s = t.strides ? t.strides[i] : row_major;  // null strides: row-major
    if (n > 1 && s < 0)
      value_error(what, ": negative stride on axis ", i,
                  " (a reversed view) is not supported; pass a contiguous copy");
    d.shape[skip + i] = n;
    d.strides[skip + i] = n > 1 ? s : 0;
    row_major *= std::max<std::int64_t>(n, 1);
  }
  d.data = static_cast<char*>(t.data) + t.byte_offset;
  const std::size_t item = kvpolicy::dtype_size(d.dtype);
  if (reinterpret_cast<std::uintptr_t>(d.data) % item != 0)
    value_error(what, ": data pointer (with byte_offset ", t.byte_offset,
                ") is not aligned to its ", item, "-byte elements");
  return d;
}

// kvzip's reconstruction scores on the device: float32 [L][Hkv][T] (or [Hkv][T] with a 3-d
// cache), shaped like the keys' first three axes, unit token stride and evenly spaced rows (what
// Inputs::reconstruction with Inputs::state_stride describes). Returns the row stride.
std::int64_t score_rows_of(const py::handle& capsule, const DeviceTensor& keys, const char* what,
                           const float** data) {
  if (!PyCapsule_IsValid(capsule.ptr(), "dltensor"))
    type_error(what, ": expected a DLPack capsule named 'dltensor' (what __dlpack__() returns), got ",
               type_name(capsule), " (a consumed capsule cannot be used twice)");
  const DLTensor& t =
      static_cast<const DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"))
          ->dl_tensor;
  if (static_cast<std::int32_t>(t.device.device_type) != keys.device_type ||
      t.device.device_id != keys.device_id)
    value_error(what, ": on ", device_name(static_cast<std::int32_t>(t.device.device_type)), ":",
                t.device.device_id, " but keys are on ", device_name(keys.device_type), ":",
                keys.device_id, " (pass every tensor on one device)");
  if (t.dtype.code != kDLFloat || t.dtype.bits != 32 || t.dtype.lanes != 1)
    type_error(what, ": expected float32 scores");
  if (t.ndim != keys.ndim - 1)
    value_error(what, ": expected ", keys.ndim - 1, " dimensions (the keys' without head_dim), got ",
                t.ndim);
  const int skip = 3 - t.ndim;
  std::int64_t shape[3] = {1, 1, 1}, strides[3] = {0, 0, 0}, row_major = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    shape[skip + i] = t.shape[i];
    strides[skip + i] = t.strides ? t.strides[i] : row_major;
    row_major *= std::max<std::int64_t>(t.shape[i], 1);
  }
  const std::int64_t L = keys.shape[0], H = keys.shape[1], T = keys.shape[2];
  if (shape[0] != L || shape[1] != H || shape[2] != T)
    value_error(what, ": shape [", shape[0], ",", shape[1], ",", shape[2],
                "] does not match the keys' [", L, ",", H, ",", T, "]");
  const std::int64_t row = H > 1 ? strides[1] : (L > 1 ? strides[0] : T);
  if ((T > 1 && strides[2] != 1) || (H > 1 && L > 1 && strides[0] != H * row) || row < T)
    value_error(what, ": rows must be contiguous and evenly spaced ([L][H] rows of T floats); "
                "pass a contiguous copy");
  *data = reinterpret_cast<const float*>(static_cast<const char*>(t.data) + t.byte_offset);
  if (reinterpret_cast<std::uintptr_t>(*data) % alignof(float) != 0)
    value_error(what, ": data pointer is not 4-byte aligned");
  return row;
}

template <class T>
kvpolicy::KVView<T> view_of(const DeviceTensor& d) {
  return {static_cast<T*>(d.data), d.shape[0],   d.shape[1],   d.shape[2],  d.shape[3],
          d.strides[0],            d.strides[1], d.strides[2], d.strides[3]};
}

// [first, last) bytes a view can touch (for the keys/values overlap check).
template <class T>
std::pair<std::uintptr_t, std::uintptr_t> extent(const kvpolicy::KVView<T>& v) {
  const auto first = reinterpret_cast<std::uintptr_t>(v.data);
  if (v.layers == 0 || v.heads == 0 || v.tokens == 0 || v.dim == 0) return {first, first};
  const std::int64_t last = (v.layers - 1) * v.stride_layer + (v.heads - 1) * v.stride_head +
                            (v.tokens - 1) * v.stride_token + (v.dim - 1) * v.stride_dim;
  return {first, first + static_cast<std::uintptr_t>(last + 1) * sizeof(T)};
}

template <class T>
py::tuple run(const Policy& p, const DeviceTensor& kd, const DeviceTensor* vd,
              const DeviceTensor* qd, const Budget& budget, const kvpolicy::EventInfo& ev,
              bool compact, std::uintptr_t stream, std::span<const float> rope_inv_freq,
              const float* reconstruction, std::int64_t reconstruction_stride,
              const PyGather& gather) {
  kvpolicy::KVView<T> k = view_of<T>(kd), v;
  kvpolicy::Inputs<T> in;
  in.keys = k;
  in.reconstruction = reconstruction;  // device memory (kvzip)
  in.state_stride = reconstruction ? reconstruction_stride : 0;
  if (vd) {
    v = view_of<T>(*vd);
    in.values = v;
  }
  if (qd) in.queries = view_of<const T>(*qd);
  in.rope_inv_freq = rope_inv_freq;  // host memory, as on the host path
  // The event's host checks, as cuda::plan makes them: stages without a device path, shapes
  // (values against keys too), budget, protection, the shard. Under tensor parallelism with a
  // policy that exchanges (adakv), every rank takes part in the ranks' agreement on them here
  // (also without CUDA), so that one rank's error is raised on all (the GIL released: the
  // all-gather is Python code, maybe another thread's).
  {
    py::gil_scoped_release nogil;
    with_gather_errors(gather, [&] {
      (void)kvpolicy::cuda::detail::setup_event(p, in, budget, ev, /*agree_ranks=*/true);
    });
  }
  if (compact) {
    const auto a = extent(k), b = extent(v);
    if (a.first < b.second && b.first < a.second)
      value_error("values: shares memory with keys; compacting both in place would corrupt them");
  }
#if defined(KVPOLICY_WITH_CUDA)
  kvpolicy::cuda::OwnedEvent r;
  {
    py::gil_scoped_release nogil;
    r = with_gather_errors(gather, [&] {
      return kvpolicy::cuda::run_owned(kd.device_id, reinterpret_cast<void*>(stream), p, k, v,
                                       in, budget, compact, ev);
    });
  }
  py::tuple out = selection_arrays(r.selection);
  return py::make_tuple(out[0], out[1], py::none(), r.event.warning);
#else
  (void)stream;
  throw std::runtime_error(
      "kvpolicy: this build has no CUDA, so CUDA tensors cannot be compressed where they are "
      "(reinstall with CUDA: pip install . -C cmake.define.KVPOLICY_CUDA=ON, or pass host "
      "tensors); the arguments passed the checks made without a device");
#endif
}

py::tuple run_device(const Policy& p, const py::handle& keys, const py::handle& values,
                     const py::handle& queries, char kind, double value, std::int64_t first_layer,
                     std::int64_t model_layers, bool compact, std::uintptr_t stream,
                     const std::vector<float>& rope_inv_freq, const py::handle& reconstruction,
                     const py::object& shard) {
  const DeviceTensor k = borrow(keys, "keys");
  const float* rec = nullptr;
  const std::int64_t rec_stride =
      reconstruction.is_none() ? 0 : score_rows_of(reconstruction, k, "reconstruction", &rec);
  std::optional<DeviceTensor> v, q;
  if (!values.is_none()) v = borrow(values, "values");
  if (!queries.is_none()) q = borrow(queries, "queries");
  if (compact && !v) value_error("values: compress needs the values to compact");
  for (const auto& [t, what] : {std::pair{&v, "values"}, std::pair{&q, "queries"}}) {
    if (!*t) continue;
    const DeviceTensor& d = **t;
    if (d.device_id != k.device_id || d.device_type != k.device_type)
      value_error(what, ": on ", device_name(d.device_type), ":", d.device_id, " but keys are on ",
                  device_name(k.device_type), ":", k.device_id, " (pass every tensor on one device)");
    if (d.dtype != k.dtype)
      type_error(what, ": dtype ", kvpolicy::dtype_name(d.dtype), " differs from keys' ",
                 kvpolicy::dtype_name(k.dtype), " (keys, values and queries share one element type)");
    if (d.ndim != k.ndim)
      value_error(what, ": ", d.ndim, "-d while keys are ", k.ndim, "-d");
  }
  const Budget budget = make_budget(kind, value);
  kvpolicy::EventInfo ev;
  ev.first_layer = first_layer;
  ev.model_layers = model_layers;
  kvpolicy::HeadShard hs;
  PyGather gather;
  ev.shard = shard_of(shard, hs, gather);
  const DeviceTensor* vp = v ? &*v : nullptr;
  const DeviceTensor* qp = q ? &*q : nullptr;
  switch (k.dtype) {
    case kvpolicy::DType::f32:
      return run<float>(p, k, vp, qp, budget, ev, compact, stream, rope_inv_freq, rec,
                        rec_stride, gather);
    case kvpolicy::DType::f16:
      return run<kvpolicy::half>(p, k, vp, qp, budget, ev, compact, stream, rope_inv_freq, rec,
                                 rec_stride, gather);
    case kvpolicy::DType::bf16:
      return run<kvpolicy::bfloat16>(p, k, vp, qp, budget, ev, compact, stream, rope_inv_freq,
                                     rec, rec_stride, gather);
  }
  value_error("keys: unknown dtype");
}

}  // namespace

void bind_policy_device(py::class_<Policy>& cls) {
  cls.def("_run_device", &run_device, py::arg("keys"), py::arg("values"), py::arg("queries"),
          py::arg("kind"), py::arg("value"), py::arg("first_layer"), py::arg("model_layers"),
          py::arg("compact"), py::arg("stream"), py::arg("rope_inv_freq"),
          py::arg("reconstruction") = py::none(), py::arg("shard") = py::none());
}

bool cuda_built() {
#if defined(KVPOLICY_WITH_CUDA)
  return true;
#else
  return false;
#endif
}

}  // namespace kvpy
