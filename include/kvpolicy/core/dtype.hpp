// Element types of the cache: float, Eigen::half, Eigen::bfloat16 on the host (bit-compatible with
// __half / __nv_bfloat16 on the device). All scoring math is fp32 whatever the cache type.
#pragma once
#include "kvpolicy/core/eigen.hpp"
#include "kvpolicy/core/types.hpp"
#include <concepts>
#include <cstdint>
#include <string_view>
#include <type_traits>

namespace kvpolicy {

using half = Eigen::half;
using bfloat16 = Eigen::bfloat16;

template <class T>
concept Element = std::same_as<std::remove_const_t<T>, float> ||
                  std::same_as<std::remove_const_t<T>, half> ||
                  std::same_as<std::remove_const_t<T>, bfloat16>;

template <Element T>
inline constexpr DType dtype_of = std::is_same_v<std::remove_const_t<T>, float>  ? DType::f32
                                  : std::is_same_v<std::remove_const_t<T>, half> ? DType::f16
                                                                                 : DType::bf16;

template <Element T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

template <Element T>
inline std::remove_const_t<T> from_float(float x) {
  return static_cast<std::remove_const_t<T>>(x);
}

}  // namespace kvpolicy
