// The device Session's bookkeeping kernels (include/kvpolicy/cuda/session_launch.hpp): one
// grid-stride launch appends a block of tokens to every head of a layer (K and V rows, original
// positions, zeroed per-token state, the new lengths), one pushes new queries into the layer's
// query window. Elements are moved as raw 2- or 4-byte words: no conversion. The index
// arithmetic is session_math.hpp's, which the CPU tests check.
#include <cuda_runtime.h>

#include <cstdint>

#include "check.cuh"
#include "kvpolicy/cuda/session_launch.hpp"
#include "kvpolicy/cuda/session_math.hpp"

namespace kvpolicy::cuda {
namespace {

namespace sm = session_math;
constexpr int kBlock = 256;

template <class W>
__global__ void append_kernel(SessionAppendArgs a, std::int64_t heads, std::int64_t n,
                              std::int64_t dim) {
  const auto* ks = static_cast<const W*>(a.keys.data);
  const auto* vs = static_cast<const W*>(a.values.data);
  auto* kd = static_cast<W*>(a.key_store);
  auto* vd = static_cast<W*>(a.value_store);
  const std::int64_t total = heads * n * dim;
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       e < total; e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t h = e / (dim * n);
    const sm::AppendSlot s = sm::append_slot(e, n, dim, a.capacity, a.lengths[h]);
    kd[s.row * dim + s.dim] = ks[s.head * a.keys.stride_head + s.token * a.keys.stride_token +
                                 s.dim * a.keys.stride_dim];
    vd[s.row * dim + s.dim] = vs[s.head * a.values.stride_head +
                                 s.token * a.values.stride_token + s.dim * a.values.stride_dim];
    if (s.dim != 0) continue;
    a.positions[s.row] = a.first_position + static_cast<std::int32_t>(s.token);
    for (float* z : a.zeroed)
      if (z) z[s.row] = 0.0f;
    if (s.token == 0) a.lengths_out[s.head] = a.lengths[s.head] + n;
  }
}

template <class W>
__global__ void push_kernel(WindowPushArgs a, std::int64_t heads, std::int64_t n,
                            std::int64_t dim) {
  const auto* q = static_cast<const W*>(a.queries.data);
  const auto* in = static_cast<const W*>(a.window_in);
  auto* out = static_cast<W*>(a.window_out);
  const std::int64_t total = heads * a.window * dim;
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       e < total; e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t i = e % dim, slot = (e / dim) % a.window, h = e / (dim * a.window);
    const sm::WindowSource s = sm::window_source(slot, a.window, n);
    out[e] = s.fresh ? q[h * a.queries.stride_head + s.fresh_index * a.queries.stride_token +
                         i * a.queries.stride_dim]
                     : in[(h * a.window + s.old_slot) * dim + i];
  }
}

bool strides_ok(const TensorRef& t) {
  return t.data && t.layers == 1 && t.stride_head >= 0 && t.stride_token >= 0 && t.stride_dim >= 0;
}

}  // namespace

Status session_append(const cuda_backend& be, const SessionAppendArgs& a) {
  const TensorRef& k = a.keys;
  if (!strides_ok(k) || !strides_ok(a.values))
    return detail::invalid("session_append: null or non-single-layer source, or negative strides");
  if (a.values.dtype != k.dtype || a.values.heads != k.heads || a.values.tokens != k.tokens ||
      a.values.dim != k.dim)
    return detail::invalid("session_append: keys and values differ in dtype or shape");
  if (!a.key_store || !a.value_store || !a.lengths || !a.lengths_out || !a.positions)
    return detail::invalid("session_append: null storage, lengths or positions");
  if (a.lengths == a.lengths_out)
    return detail::invalid("session_append: lengths_out aliases lengths");
  if (k.heads <= 0 || k.dim <= 0 || k.tokens <= 0 || a.capacity < k.tokens)
    return detail::invalid("session_append: empty block or capacity below its tokens");
  const std::int64_t total = k.heads * k.tokens * k.dim;
  const unsigned grid = detail::grid_for(total, kBlock);
  auto s = detail::stream_of(be.stream);
  if (dtype_size(k.dtype) == 4)
    append_kernel<std::uint32_t><<<grid, kBlock, 0, s>>>(a, k.heads, k.tokens, k.dim);
  else
    append_kernel<std::uint16_t><<<grid, kBlock, 0, s>>>(a, k.heads, k.tokens, k.dim);
  KVP_CUDA_TRY(cudaGetLastError());
  return {};
}

Status session_push_window(const cuda_backend& be, const WindowPushArgs& a) {
  const TensorRef& q = a.queries;
  if (!strides_ok(q)) return detail::invalid("session_push_window: null or non-single-layer queries");
  if (!a.window_in || !a.window_out || a.window_in == a.window_out)
    return detail::invalid("session_push_window: null or aliasing window buffers");
  if (q.heads <= 0 || q.dim <= 0 || q.tokens <= 0 || a.window <= 0)
    return detail::invalid("session_push_window: empty queries or window");
  const std::int64_t total = q.heads * a.window * q.dim;
  const unsigned grid = detail::grid_for(total, kBlock);
  auto s = detail::stream_of(be.stream);
  if (dtype_size(q.dtype) == 4)
    push_kernel<std::uint32_t><<<grid, kBlock, 0, s>>>(a, q.heads, q.tokens, q.dim);
  else
    push_kernel<std::uint16_t><<<grid, kBlock, 0, s>>>(a, q.heads, q.tokens, q.dim);
  KVP_CUDA_TRY(cudaGetLastError());
  return {};
}

Status copy_rows_on_device(const cuda_backend& be, void* dst, std::size_t dst_pitch,
                           const void* src, std::size_t src_pitch, std::size_t width,
                           std::size_t height) {
  if (width == 0 || height == 0) return {};
  if (!dst || !src || width > dst_pitch || width > src_pitch)
    return detail::invalid("copy_rows_on_device: null pointer or a row wider than its pitch");
  KVP_CUDA_TRY(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height,
                                 cudaMemcpyDeviceToDevice, detail::stream_of(be.stream)));
  return {};
}

}  // namespace kvpolicy::cuda
