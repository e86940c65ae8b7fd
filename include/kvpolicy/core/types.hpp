// The core's plain types that host code, device code (nvcc) and the C ABI share: the cache's
// element type id, the GQA reduction, the pooling kind, and one type-erased tensor reference.
// Free of Eigen, CUDA and the standard library's heavier headers, so that cuda/ uses these
// types themselves instead of mirror copies.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace kvpolicy {

// Element type of a cache: float32, float16 (kvpolicy::half on the host, __half on the device) or
// bfloat16 (kvpolicy::bfloat16 / __nv_bfloat16); see core/dtype.hpp for the host types.
enum class DType : std::uint8_t { f32, f16, bf16 };

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float32";
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
  }
  return "?";
}

constexpr std::size_t dtype_size(DType t) { return t == DType::f32 ? 4 : 2; }

// How query-head attention is reduced to its KV head under GQA.
enum class GqaReduce : std::uint8_t { mean, max, sum };

// 1-D pooling over tokens (SnapKV's smoothing): see scorers/snapkv_row.hpp.
enum class Pool : std::uint8_t { avg, max };

// A read-only [layers][heads][tokens][dim] tensor with its element type carried at run time:
// extents and strides in elements (any non-negative strides). What an external scorer is handed
// (scorers/external.hpp) and what the CUDA kernels' type-erased entry points take (data in
// device memory there); KVView<T> is its typed form (erase()).
struct TensorRef {
  const void* data = nullptr;
  DType dtype = DType::f32;
  std::int64_t layers = 0, heads = 0, tokens = 0, dim = 0;
  std::int64_t stride_layer = 0, stride_head = 0, stride_token = 0, stride_dim = 1;
};

}  // namespace kvpolicy
