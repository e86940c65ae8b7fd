// 1-D pooling over tokens, stride 1, padding kernel/2 (SnapKV's smoothing). Average pooling
// divides by the kernel size including padded positions (PyTorch avg_pool1d's default
// count_include_pad=True, which kvpress and the SnapKV code use); max pooling ignores padding.
#pragma once
#include <algorithm>
#include <cstdint>
#include <limits>

#include "kvpolicy/core/error.hpp"
#include "kvpolicy/core/types.hpp"

namespace kvpolicy::cpu {

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

}  // namespace kvpolicy::cpu
