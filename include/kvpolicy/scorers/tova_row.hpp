// Per-thread math of TOVA shared by the CPU and the CUDA kernels: KVP_HD functions free of
// CUDA and Eigen, beside the stage's header, so that the host emulation of the kernels' grids
// (tests/agreement/) drives exactly the logic the device runs. Kernel: cuda/baselines.cu.

#pragma once
#include <cmath>
#include <cstdint>

#include "kvpolicy/core/config.hpp"

namespace kvpolicy::row_math {

// TOVA's score of token j: mean over the layer's KV heads of the GQA-mean window attention of
// the last query, summed in head order. `a` points at (l, 0, j); rows are `stride` floats apart.
KVP_HD inline float tova_at(const float* a, std::int64_t heads, std::int64_t stride) {
  float s = 0;
  for (std::int64_t h = 0; h < heads; ++h) s += a[h * stride];
  return s / static_cast<float>(heads);
}

}  // namespace kvpolicy::row_math
