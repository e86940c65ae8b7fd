// Per-thread math of H2O shared by the CPU and the CUDA kernels: KVP_HD functions free of
// CUDA and Eigen, beside the stage's header, so that the host emulation of the kernels' grids
// (tests/agreement/) drives exactly the logic the device runs. Kernels: cuda/window_attention.cu.

#pragma once
#include <cstdint>

#include "kvpolicy/core/config.hpp"

namespace kvpolicy::row_math {

// Number of the last n_q queries that see key j (H2O normalize=true divides by it).
KVP_HD inline float h2o_seen(std::int64_t j, std::int64_t nq, std::int64_t T) {
  const std::int64_t first = T - nq;
  return static_cast<float>(T - (j > first ? j : first));
}

// H2O's score of one key from given state: the accumulator, or with normalize (and counts
// given) the accumulator over the number of queries that saw the key (0 where none did).
KVP_HD inline float h2o_from_state(float acc, const float* observed, bool normalize) {
  if (!normalize || !observed) return acc;
  return *observed > 0 ? acc / *observed : 0.f;
}

}  // namespace kvpolicy::row_math
