// Per-thread math of KeyDiff shared by the CPU and the CUDA kernels: KVP_HD functions free of
// CUDA and Eigen, beside the stage's header, so that the host emulation of the kernels' grids
// (tests/agreement/) drives exactly the logic the device runs. Kernel: cuda/baselines.cu. The anchor
// (mean over the head's tokens of k / ||k||, double) is summed per chunk of kAnchorChunk tokens,
// then the chunks in order.

#pragma once
#include <cmath>
#include <cstdint>

#include "kvpolicy/core/config.hpp"

namespace kvpolicy::row_math {

inline constexpr std::int64_t kAnchorChunk = 256;  // KeyDiff: tokens per anchor partial

template <class Get>
KVP_HD inline double sumsq_lane(const Get& get, int lane, std::int64_t d) {
  double s = 0;
  for (std::int64_t i = lane; i < d; i += kWarpLanes) {
    const double x = get(i);
    s += x * x;
  }
  return s;
}

// Lane partial of k . anchor (double).
template <class Get>
KVP_HD inline double anchor_dot_lane(const Get& get, const double* anchor, int lane,
                                     std::int64_t d) {
  double s = 0;
  for (std::int64_t i = lane; i < d; i += kWarpLanes) s += static_cast<double>(get(i)) * anchor[i];
  return s;
}

KVP_HD inline std::int64_t anchor_chunks(std::int64_t T) {
  return (T + kAnchorChunk - 1) / kAnchorChunk;
}

// One dim's contribution of a token to the anchor sum: x / ||k|| (0 for a zero key).
KVP_HD inline double anchor_term(float x, double norm) {
  return norm > 0 ? static_cast<double>(x) / norm : 0.0;
}

// KeyDiff's score from the key's norm (as the CPU stores it: fp32), its dot with the anchor and
// the anchor's norm: -cos, 0 for a zero key or anchor.
KVP_HD inline float keydiff_score(float norm, double dot, double anchor_norm) {
  const double n = norm;
  return (n > 0 && anchor_norm > 0) ? static_cast<float>(-dot / (n * anchor_norm)) : 0.f;
}

}  // namespace kvpolicy::row_math
