// Per-thread math of KNorm shared by the CPU and the CUDA kernels: KVP_HD functions free of
// CUDA and Eigen, beside the stage's header, so that the host emulation of the kernels' grids
// (tests/agreement/) drives exactly the logic the device runs. Kernel: cuda/baselines.cu (one warp
// per token; lanes fold the dims lane, lane + 32, ...).

#pragma once
#include <cmath>
#include <cstdint>

#include "kvpolicy/core/config.hpp"

namespace kvpolicy::row_math {

// Lane partial of ||k||^2 in fp32: fmaf over the dims lane, lane + 32, ... in order.
// `get(i)` returns element i of the token's key as float.
template <class Get>
KVP_HD inline float knorm_lane(const Get& get, int lane, std::int64_t d) {
  float s = 0.f;
  for (std::int64_t i = lane; i < d; i += kWarpLanes) {
    const float x = get(i);
    s = fmaf(x, x, s);
  }
  return s;
}
KVP_HD inline float knorm_finish(float sum_sq) { return -sqrtf(sum_sq); }

}  // namespace kvpolicy::row_math
