// Warp-level helpers of the CUDA baseline scorers and of the device Ada-KV allocator
// (cuda/baselines.cu), as KVP_HD functions free of CUDA and Eigen, so the CPU tests drive exactly
// this logic in a host emulation of the kernels' grids (tests/agreement/test_baselines_cuda.cpp).
// The per-token math of each stage sits beside the stage: scorers/knorm_row.hpp,
// scorers/keydiff_row.hpp, scorers/tova_row.hpp, scorers/streaming_row.hpp and
// allocators/adakv_row.hpp.
//
// KNorm / KeyDiff: one warp per token. Lane `lane` folds the dims lane, lane + 32, ... of the
// token's key into a partial; the 32 partials are combined by the butterfly (xor 16, 8, 4, 2, 1)
// the kernels do with shuffles, so every lane ends with the same value (warp_tree_sum emulates
// it on the host, in the same pairing).
#pragma once
#include <cmath>
#include <cstdint>

#include "kvpolicy/core/config.hpp"

namespace kvpolicy::cuda::baseline {

inline constexpr int kWarp = kWarpLanes;

// ---- warp reductions -------------------------------------------------------------------------

// Host emulation of the kernels' xor butterfly: p[i] <- p[i] + p[i ^ off] for off = 16 .. 1.
// Returns lane 0's value (all lanes end equal: fp addition is commutative).
template <class V>
KVP_HD inline V warp_tree_sum(V* p) {
  for (int off = kWarp / 2; off >= 1; off /= 2) {
    V n[kWarp];
    for (int i = 0; i < kWarp; ++i) n[i] = p[i] + p[i ^ off];
    for (int i = 0; i < kWarp; ++i) p[i] = n[i];
  }
  return p[0];
}

}  // namespace kvpolicy::cuda::baseline
