// Per-thread math of StreamingLLM shared by the CPU and the CUDA kernels: KVP_HD functions free of
// CUDA and Eigen, beside the stage's header, so that the host emulation of the kernels' grids
// (tests/agreement/) drives exactly the logic the device runs. Kernel: cuda/baselines.cu.

#pragma once
#include <cstdint>

#include "kvpolicy/core/config.hpp"

namespace kvpolicy::row_math {

KVP_HD inline float streaming_at(std::int64_t j) { return static_cast<float>(j); }

}  // namespace kvpolicy::row_math
