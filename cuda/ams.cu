// AMS segments and quotas on the GPU: one thread block per (layer, KV head) row. Thread 0 runs
// the order-sensitive parts (normalize, prefix sums, cuts, split/merge, quotas: the CPU's exact
// summation order), all threads the per-segment mass sums and the final shift; see
// include/kvpolicy/allocators/ams_rows.hpp for the row logic and include/kvpolicy/cuda/ams.hpp
// for the contract. The row logic has no a * b + c pattern, so FMA contraction cannot change a
// result.
#include <cstdint>

#include "check.cuh"
#include "kvpolicy/cuda/ams.hpp"

namespace kvpolicy::cuda {
namespace {

constexpr int ams_block = 128;

__global__ void __launch_bounds__(ams_block)
    ams_rows_kernel(AmsRows a, ams::rows::Params p, unsigned char* ws) {
  const std::int64_t n = a.end - a.begin, cap = n + 1;
  __shared__ std::int64_t nseg;
  for (std::int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const std::int64_t budget = a.budgets[r];
    double* d = reinterpret_cast<double*>(ws) + r * 3 * cap;
    std::int64_t* s = reinterpret_cast<std::int64_t*>(ws + a.rows * 3 * cap * sizeof(double)) +
                      r * 2 * cap;
    const ams::rows::RowBuffers b{d,         d + cap,           d + 2 * cap,
                                  s,         a.seg_begin + r * cap, a.seg_end + r * cap,
                                  a.quota + r * cap, s + cap};
    if (threadIdx.x == 0)
      nseg = budget < 0 ? 0 : ams::rows::row_segments(a.mass + r * a.mass_stride, a.begin, a.end,
                                                        p, b);
    __syncthreads();
    const std::int64_t ns = nseg;
    for (std::int64_t i = threadIdx.x; i < ns; i += blockDim.x) ams::rows::row_segment_mass(b, i);
    __syncthreads();
    if (threadIdx.x == 0) {
      const bool ok = budget < 0 || ams::rows::row_quotas(ns, budget, p, b);
      a.segments[r] = ok ? ns : -1;
    }
    __syncthreads();
    for (std::int64_t i = threadIdx.x; i < ns; i += blockDim.x) ams::rows::row_shift(b, i, a.begin);
    __syncthreads();  // nseg is rewritten by the next row
  }
}

}  // namespace

std::size_t ams_rows_workspace_bytes(std::int64_t rows, std::int64_t begin, std::int64_t end) {
  const std::int64_t cap = (end > begin ? end - begin : 0) + 1;
  return static_cast<std::size_t>(rows * cap) * (3 * sizeof(double) + 2 * sizeof(std::int64_t));
}

Status ams_segment_quotas(const cuda_backend& be, const AmsRows& a,
                          const ams::rows::Params& p) {
  if (a.rows < 0 || a.begin < 0 || a.end < a.begin || a.end > a.tokens ||
      a.mass_stride < a.tokens)
    return detail::invalid("ams: bad rows, token range or mass stride");
  if (!(p.segment_mass > 0 && p.segment_mass <= 1) || p.min_seg_len < 1 ||
      p.max_seg_len < p.min_seg_len || p.min_keep < 0)
    return detail::invalid("ams: bad segment parameters");
  if (a.rows == 0) return {};
  if (!a.mass || !a.budgets || !a.segments || !a.seg_begin || !a.seg_end || !a.quota)
    return detail::invalid("ams: null pointer");
  const std::size_t need = ams_rows_workspace_bytes(a.rows, a.begin, a.end);
  if (be.workspace_bytes < need || !be.workspace)
    return {StatusCode::insufficient_workspace, 0, "workspace below ams_rows_workspace_bytes"};
  if (reinterpret_cast<std::uintptr_t>(be.workspace) % alignof(double) != 0)
    return detail::invalid("ams: workspace is not 8-byte aligned");
  const unsigned grid = static_cast<unsigned>(a.rows < (1 << 20) ? a.rows : (1 << 20));
  ams_rows_kernel<<<grid, ams_block, 0, detail::stream_of(be.stream)>>>(
      a, p, static_cast<unsigned char*>(be.workspace));
  KVP_CUDA_TRY(cudaGetLastError());
  return {};
}

}  // namespace kvpolicy::cuda
