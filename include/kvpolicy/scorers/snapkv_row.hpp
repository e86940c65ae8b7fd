// Per-thread math of SnapKV shared by the CPU and the CUDA kernels: KVP_HD functions free of
// CUDA and Eigen, beside the stage's header, so that the host emulation of the kernels' grids
// (tests/agreement/) drives exactly the logic the device runs. Kernels: cuda/window_attention.cu.

// 1-D pooling over tokens, stride 1, padding kernel/2 (SnapKV's smoothing). Average pooling
// divides by the kernel size including padded positions (PyTorch avg_pool1d's default
// count_include_pad=True, which kvpress and the SnapKV code use); max pooling ignores padding.
#pragma once
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kvpolicy/core/config.hpp"
#include "kvpolicy/core/error.hpp"
#include "kvpolicy/core/types.hpp"

namespace kvpolicy::row_math {

// Output j of a stride-1 pooling with padding kernel/2 over in[0..n): average counts the padded
// positions (count_include_pad), max ignores them; the same values as pool1d below (whose running
// sum is double; here each window is summed directly in double).
KVP_HD inline float pool_at(const float* in, std::int64_t n, std::int64_t j, int kernel,
                            Pool p) {
  const std::int64_t r = kernel / 2;
  const std::int64_t lo = j - r < 0 ? 0 : j - r, hi = j + r > n - 1 ? n - 1 : j + r;
  if (p == Pool::max) {
    float m = -INFINITY;
    for (std::int64_t t = lo; t <= hi; ++t) m = in[t] > m ? in[t] : m;
    return m;
  }
  double s = 0;
  for (std::int64_t t = lo; t <= hi; ++t) s += in[t];
  return static_cast<float>(s / kernel);
}

// SnapKV's score of token j from the pooled column sums: window tokens (the last w) are always
// kept, as FLT_MAX.
KVP_HD inline float snapkv_at(const float* colsum, std::int64_t T, std::int64_t w,
                              std::int64_t j, int kernel, Pool p) {
  return j >= T - w ? FLT_MAX : pool_at(colsum, T - w, j, kernel, p);
}

// The whole-row form of the pooling (CPU): a running window sum in double, O(n) per row. The
// same values as pool_at at every j up to the rounding of the running sum.
inline void pool1d(const float* in, float* out, std::int64_t n, int kernel, Pool pool) {
  KVP_REQUIRE(kernel >= 1 && kernel % 2 == 1, "pooling kernel ", kernel,
              " must be odd and positive");
  KVP_REQUIRE(in != out, "pool1d: input and output must not alias");
  const std::int64_t r = kernel / 2;
  if (pool == Pool::max) {
    for (std::int64_t j = 0; j < n; ++j) {
      float m = -std::numeric_limits<float>::infinity();
      for (std::int64_t t = std::max<std::int64_t>(0, j - r); t <= std::min(n - 1, j + r); ++t)
        m = std::max(m, in[t]);
      out[j] = m;
    }
    return;
  }
  // Running window sum in double to avoid drift over long rows.
  double s = 0;
  for (std::int64_t t = 0; t <= std::min(n - 1, r); ++t) s += in[t];
  for (std::int64_t j = 0; j < n; ++j) {
    out[j] = static_cast<float>(s / kernel);
    if (j + r + 1 < n) s += in[j + r + 1];
    if (j - r >= 0) s -= in[j - r];
  }
}

}  // namespace kvpolicy::row_math
