// Type-erased entry points of the device Session's bookkeeping kernels (cuda/session.cu): the
// append of new tokens into a layer's storage and the push of new queries into its window.
// Plain structs in, a Status out, never a throw; the typed host side is cuda/session.hpp. The
// per-thread arithmetic is session_math.hpp's. No CUDA or Eigen headers.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kvpolicy/core/backend.hpp"
#include "kvpolicy/core/types.hpp"
#include "kvpolicy/cuda/status.hpp"

namespace kvpolicy::cuda {

// Appends n = keys.tokens tokens to every head of one layer's storage ([heads][capacity][dim],
// the dtype of keys, contiguous), after the rows each head already holds, in one launch.
struct SessionAppendArgs {
  TensorRef keys, values;  // [1][heads][n][dim], device memory, any non-negative strides
  void* key_store = nullptr;
  void* value_store = nullptr;
  std::int64_t capacity = 0;              // rows per head of the storage
  const std::int64_t* lengths = nullptr;  // device [heads]: rows held before the append
  std::int64_t* lengths_out = nullptr;    // device [heads]: lengths + n (must not alias lengths)
  std::int32_t* positions = nullptr;      // device [heads][capacity]: new row t gets first_position + t
  std::int32_t first_position = 0;
  float* zeroed[4] = {nullptr, nullptr, nullptr, nullptr};  // per-token state [heads][capacity]: new rows = 0
};
Status session_append(const cuda_backend& be, const SessionAppendArgs& a);

// Pushes n = queries.tokens queries into a right-aligned window of `window` slots per query
// head (session_math.hpp): window_out[h][i] = the newest min(n, window) queries in the last
// slots, the older ones shifted towards slot 0.
struct WindowPushArgs {
  TensorRef queries;  // [1][q_heads][n][dim], device memory
  const void* window_in = nullptr;  // [q_heads][window][dim], queries' dtype, contiguous
  void* window_out = nullptr;       // same shape; must not alias window_in
  std::int64_t window = 0;
};
Status session_push_window(const cuda_backend& be, const WindowPushArgs& a);

// `height` rows of `width` bytes from src (row pitch src_pitch) to dst (dst_pitch), device to
// device, asynchronous on be.stream (cudaMemcpy2DAsync).
Status copy_rows_on_device(const cuda_backend& be, void* dst, std::size_t dst_pitch,
                           const void* src, std::size_t src_pitch, std::size_t width,
                           std::size_t height);

}  // namespace kvpolicy::cuda
