// Internal to cuda/: the cache's element types (float, __half, __nv_bfloat16) read as float, and
// one token's strided row as the row math (*_row.hpp) reads it: get(i) is element i.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace kvpolicy::cuda::detail {

__host__ __device__ __forceinline__ float to_f32(float x) { return x; }
__host__ __device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__host__ __device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class E>
struct ElemRow {
  const E* p;
  std::int64_t stride;
  __host__ __device__ float operator()(std::int64_t i) const { return to_f32(p[i * stride]); }
};

}  // namespace kvpolicy::cuda::detail
