// AMS on the GPU, three launches per event, each one thread block per (layer, KV head) row running
// the KVP_HD row logic of allocators/ams_rows.hpp that the CPU allocator runs too:
//  - ams_mass (steps 1-2): the row's mixed mass m from its window attention and credit state (the
//    credit updated in place), 256 lanes whose sums are added in the CPU's lane order, so m equals
//    AMS::mass bit for bit for the same window attention (cuda::window_attention itself equals
//    the CPU's to fp32 rounding); and each row's budget for the unprotected tokens;
//  - ams_segment_quotas (steps 3-4): the segments (cumulative-mass cuts, split/merge) and the
//    per-segment quotas of the row's unprotected tokens (sequential where the CPU order of
//    summation must be kept, the per-segment sums in parallel), so the integers equal
//    AMS::candidates' (ams::segments, ams::quotas) exactly;
//  - ams_mark (step 5): per segment, the quota-th largest library order key by a bitwise search
//    over block-wide counts; every unprotected non-candidate score becomes -inf (candidates at
//    -inf the lowest finite float), the scores AMS::allocate hands to the top-k.
// The typed chain step (window attention, then the three) is cuda::allocate(be, const AMS&, ...)
// in cuda/baselines.hpp. Type-erased, no CUDA or Eigen headers; kernels in cuda/ams.cu.
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

// Steps 1-2. attn: the GQA-mean window attention of the last `window` queries, [rows][attn_stride]
// (device). state: the credit [rows][state_stride] floats (device), read and updated; null for a
// first event (every credit 0, nothing written). budgets[r]: the chain's budget of row r (device).
// Outputs: mass [rows][tokens] doubles and unprotected_budgets[r] = budgets[r] - n_protected, or
// -1 when budgets[r] >= tokens (nothing to evict; the credit still moves on). m_cur is scratch
// [rows][tokens] doubles. `budgets` below n_protected cannot be checked here: the caller does.
struct AmsMass {
  const float* attn = nullptr;
  std::int64_t rows = 0, tokens = 0, attn_stride = 0, window = 0;
  float* state = nullptr;
  std::int64_t state_stride = 0;
  const std::int64_t* budgets = nullptr;
  std::int64_t n_protected = 0;
  double* m_cur = nullptr;
  double* mass = nullptr;
  std::int64_t* unprotected_budgets = nullptr;
};

struct AmsMassParams {
  int kernel = 5;
  double lambda = 0.8, beta = 0.7;
};

Status ams_mass(const cuda_backend& be, const AmsMass& a, const AmsMassParams& p);

// Step 5 over ams_segment_quotas' outputs (each row at r * seg_stride): scores [rows][row_stride]
// (device), masked in place inside the rows' segments; rows with segments[r] <= 0 untouched.
struct AmsMark {
  float* scores = nullptr;
  std::int64_t rows = 0, tokens = 0, row_stride = 0;
  const std::int64_t* segments = nullptr;
  const std::int64_t* seg_begin = nullptr;
  const std::int64_t* seg_end = nullptr;
  const std::int64_t* quota = nullptr;
  std::int64_t seg_stride = 0;
};

Status ams_mark(const cuda_backend& be, const AmsMark& a);

}  // namespace kvpolicy::cuda
