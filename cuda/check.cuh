// Internal to cuda/: CUDA error -> Status, and the checks every launch goes through.
#pragma once
#include <cuda_runtime.h>

#include "kvpolicy/cuda/status.hpp"

namespace kvpolicy::cuda::detail {

inline Status cuda_status(cudaError_t e) {
  if (e == cudaSuccess) return {};
  return {StatusCode::cuda_error, static_cast<int>(e), cudaGetErrorString(e)};
}

inline Status invalid(const char* message) { return {StatusCode::invalid_argument, 0, message}; }

inline cudaStream_t stream_of(void* s) { return static_cast<cudaStream_t>(s); }

// Grid for a grid-stride loop over n items.
inline unsigned grid_for(long long n, int block, unsigned max_blocks = 1u << 16) {
  const long long g = (n + block - 1) / block;
  return static_cast<unsigned>(g < 1 ? 1 : (g > max_blocks ? max_blocks : g));
}

}  // namespace kvpolicy::cuda::detail

// Return the Status of a failing CUDA call (or of a failed launch: `KVP_CUDA_TRY(cudaGetLastError())`).
#define KVP_CUDA_TRY(expr)                                                     \
  do {                                                                         \
    const cudaError_t kvp_err_ = (expr);                                       \
    if (kvp_err_ != cudaSuccess) return ::kvpolicy::cuda::detail::cuda_status(kvp_err_); \
  } while (0)
