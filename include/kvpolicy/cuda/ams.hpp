// AMS steps 3-4 on the GPU: per (layer, KV head) row, the segments (cumulative-mass cuts,
// split/merge) and the per-segment quotas of the row's unprotected tokens, from the row's mixed
// mass m (steps 1-2, computed by the caller). One thread block per row runs the KVP_HD row logic
// of allocators/ams_rows.hpp (sequential where the CPU order of summation must be kept, the
// per-segment sums in parallel), so the integers equal AMS::candidates' (ams::segments,
// ams::quotas) exactly. Type-erased, no CUDA or Eigen headers; kernel in cuda/ams.cu.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kvpolicy/allocators/ams_rows.hpp"
#include "kvpolicy/core/backend.hpp"
#include "kvpolicy/cuda/status.hpp"

namespace kvpolicy::cuda {

// Device arrays. Row r's mass is mass[r * mass_stride .. + tokens); its unprotected tokens are
// [begin, end) (the same for every row: sinks and recent tokens are per call). budgets[r]: the
// tokens to keep among the unprotected ones (B - protected), or < 0 to skip the row (nothing to
// evict: segments = 0). Outputs, each row at r * (end - begin + 1): seg_begin / seg_end (row
// positions) and quota for the first segments[r] entries; segments[r] = -1 if budgets[r] exceeds
// end - begin.
struct AmsRows {
  const double* mass = nullptr;
  std::int64_t rows = 0, tokens = 0, mass_stride = 0, begin = 0, end = 0;
  const std::int64_t* budgets = nullptr;
  std::int64_t* segments = nullptr;  // [rows]
  std::int64_t* seg_begin = nullptr;
  std::int64_t* seg_end = nullptr;
  std::int64_t* quota = nullptr;
};

// Scratch per row: 3 doubles and 2 integers per unprotected token (+1).
std::size_t ams_rows_workspace_bytes(std::int64_t rows, std::int64_t begin, std::int64_t end);

Status ams_segment_quotas(const cuda_backend& be, const AmsRows& a,
                          const ams::rows::Params& params);

}  // namespace kvpolicy::cuda
