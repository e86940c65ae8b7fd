// Loading cache rows into fp32 row-major Eigen matrices (any element type, any strides).
#pragma once
#include "kvpolicy/cpu/eigen.hpp"
#include <cstdint>

#include "kvpolicy/core/kv_view.hpp"

namespace kvpolicy::cpu {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// out(r, :) = view(l, h, t0 + r, :) as fp32, for r in [0, n).
template <class T>
void load_rows(const KVView<T>& v, std::int64_t l, std::int64_t h, std::int64_t t0,
               std::int64_t n, RowMatrix& out) {
  out.resize(n, v.dim);
  for (std::int64_t r = 0; r < n; ++r) {
    const auto* src = v.row(l, h, t0 + r);
    float* dst = out.data() + r * v.dim;
    if (v.stride_dim == 1) {
      for (std::int64_t i = 0; i < v.dim; ++i) dst[i] = static_cast<float>(src[i]);
    } else {
      for (std::int64_t i = 0; i < v.dim; ++i) dst[i] = static_cast<float>(src[i * v.stride_dim]);
    }
  }
}

// Row-major fp32 view of rows [t0, t0+n) without copying when the cache is float with unit
// head_dim stride; otherwise converts into `buf`.
using RowMap = Eigen::Map<const RowMatrix, 0, Eigen::OuterStride<>>;

template <class T>
RowMap rows_f32(const KVView<T>& v, std::int64_t l, std::int64_t h, std::int64_t t0,
                std::int64_t n, RowMatrix& buf) {
  if constexpr (std::is_same_v<std::remove_const_t<T>, float>) {
    if (v.stride_dim == 1 && (n <= 1 || v.stride_token >= v.dim))
      return RowMap(v.row(l, h, t0), n, v.dim, Eigen::OuterStride<>(n <= 1 ? v.dim : v.stride_token));
  }
  load_rows(v, l, h, t0, n, buf);
  return RowMap(buf.data(), n, v.dim, Eigen::OuterStride<>(v.dim));
}

}  // namespace kvpolicy::cpu
