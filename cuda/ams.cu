// AMS on the GPU: one thread block per (layer, KV head) row in each of three kernels; see
// include/kvpolicy/allocators/ams_rows.hpp for the row logic and include/kvpolicy/cuda/ams.hpp
// for the contracts.
//  - mass: one thread per sum lane (256); block reductions of the lane sums in the CPU's order.
//  - segments and quotas: thread 0 runs the order-sensitive parts (normalize, prefix sums, cuts,
//    split/merge, quotas: the CPU's exact summation order), all threads the per-segment mass sums
//    and the final shift.
//  - mark: per segment, 64 block-wide counts find the quota-th largest key, then one masking pass.
// Where the row logic multiplies and adds it calls fma itself, so FMA contraction cannot change a
// result. Untuned: the mass kernel reads each row five times, the mark kernel a segment 65 times
// (with 192 block barriers per segment: rows cut into thousands of short segments are slow).
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

__device__ double block_total(double part, double* lanes) {
  __shared__ double total;
  lanes[threadIdx.x] = part;
  __syncthreads();
  if (threadIdx.x == 0) total = ams::rows::lanes_total(lanes);
  __syncthreads();
  const double t = total;
  __syncthreads();  // total and lanes are rewritten by the next call
  return t;
}

constexpr int mass_block = ams::rows::kMassLanes;

__global__ void __launch_bounds__(mass_block) ams_mass_kernel(AmsMass a, AmsMassParams p) {
  namespace rows = ams::rows;
  __shared__ double lanes[mass_block];
  __shared__ float maxes[mass_block];
  const int t = static_cast<int>(threadIdx.x);
  const std::int64_t T = a.tokens, pooled = T - (a.window < T ? a.window : T);
  for (std::int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const float* attn = a.attn + r * a.attn_stride;
    double* mc = a.m_cur + r * T;
    double* out = a.mass + r * T;
    float* credit = a.state ? a.state + r * a.state_stride : nullptr;
    // A: the window's tokens take the pooled maximum (any order: max is exact).
    float mx = -INFINITY;
    for (std::int64_t j = t; j < pooled; j += mass_block) {
      const float v = rows::mass_pooled(attn, pooled, j, p.kernel);
      mc[j] = v;  // read back by this thread in phase B
      mx = fmaxf(mx, v);
    }
    maxes[t] = mx;
    __syncthreads();
    for (int s = mass_block / 2; s > 0; s /= 2) {
      if (t < s) maxes[t] = fmaxf(maxes[t], maxes[t + s]);
      __syncthreads();
    }
    mx = maxes[0];
    // B: m_cur before normalizing.
    double part = 0.0;
    for (std::int64_t j = t; j < T; j += mass_block) {
      const double v =
          rows::mass_current(j < pooled ? static_cast<float>(mc[j]) : 0.f, pooled, j, mx);
      mc[j] = v;
      part += v;
    }
    const double s1 = block_total(part, lanes);
    // C: m_cur normalized; the credit moves on.
    part = 0.0;
    for (std::int64_t j = t; j < T; j += mass_block) {
      const double m = mc[j] / s1;
      mc[j] = m;
      const float c = rows::credit_next(credit ? credit[j] : 0.f, m, p.lambda);
      if (credit) credit[j] = c;
      const double v = rows::relu_eps(c);
      out[j] = v;
      part += v;
    }
    const double s2 = block_total(part, lanes);
    // D: the mix.
    part = 0.0;
    for (std::int64_t j = t; j < T; j += mass_block) {
      const double v = rows::mass_mix(mc[j], out[j], s2, p.beta);
      out[j] = v;
      part += v;
    }
    const double s3 = block_total(part, lanes);
    // E: normalized.
    for (std::int64_t j = t; j < T; j += mass_block) out[j] /= s3;
    if (t == 0) {
      const std::int64_t b = a.budgets[r];
      a.unprotected_budgets[r] = b >= T ? -1 : b - a.n_protected;
    }
    __syncthreads();  // maxes is rewritten by the next row
  }
}

constexpr int mark_block = 256;

__global__ void __launch_bounds__(mark_block) ams_mark_kernel(AmsMark a) {
  __shared__ unsigned long long count;
  for (std::int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    float* s = a.scores + r * a.row_stride;
    const std::int64_t ns = a.segments[r], at = r * a.seg_stride;
    for (std::int64_t i = 0; i < ns; ++i) {
      const std::int64_t b = a.seg_begin[at + i], e = a.seg_end[at + i], q = a.quota[at + i];
      const bool all = q >= e - b, none = q <= 0;  // the same in every thread
      std::uint64_t kth = 0;
      if (!all && !none)
        kth = ams::rows::kth_key(q, [&](std::uint64_t trial) {
          unsigned long long c = 0;
          for (std::int64_t j = b + threadIdx.x; j < e; j += mark_block)
            c += topk_key(s[j], static_cast<std::int32_t>(j)) >= trial ? 1 : 0;
          if (threadIdx.x == 0) count = 0;
          __syncthreads();
          atomicAdd(&count, c);
          __syncthreads();
          const auto n = static_cast<std::int64_t>(count);
          __syncthreads();  // count is reset by the next call
          return n;
        });
      for (std::int64_t j = b + threadIdx.x; j < e; j += mark_block)
        s[j] = ams::rows::mask_score(
            s[j], all || (!none && topk_key(s[j], static_cast<std::int32_t>(j)) >= kth));
    }
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

Status ams_mass(const cuda_backend& be, const AmsMass& a, const AmsMassParams& p) {
  if (a.rows < 0 || a.tokens < 0 || a.attn_stride < a.tokens || a.window < 1 ||
      a.n_protected < 0 || (a.state && a.state_stride < a.tokens))
    return detail::invalid("ams: bad rows, tokens, strides, window or protected count");
  if (p.kernel < 1 || p.kernel % 2 == 0 || !(p.lambda >= 0 && p.lambda < 1) ||
      !(p.beta >= 0 && p.beta <= 1))
    return detail::invalid("ams: bad kernel, lambda or beta");
  if (a.rows == 0 || a.tokens == 0) return {};
  if (!a.attn || !a.budgets || !a.m_cur || !a.mass || !a.unprotected_budgets)
    return detail::invalid("ams: null pointer");
  const unsigned grid = static_cast<unsigned>(a.rows < (1 << 20) ? a.rows : (1 << 20));
  ams_mass_kernel<<<grid, mass_block, 0, detail::stream_of(be.stream)>>>(a, p);
  KVP_CUDA_TRY(cudaGetLastError());
  return {};
}

Status ams_mark(const cuda_backend& be, const AmsMark& a) {
  if (a.rows < 0 || a.tokens < 0 || a.row_stride < a.tokens || a.seg_stride < 1)
    return detail::invalid("ams: bad rows, tokens or strides");
  if (a.tokens > (std::int64_t{1} << 31) - 1)
    return detail::invalid("ams: tokens exceed the int32 index range");
  if (a.rows == 0) return {};
  if (!a.scores || !a.segments || !a.seg_begin || !a.seg_end || !a.quota)
    return detail::invalid("ams: null pointer");
  const unsigned grid = static_cast<unsigned>(a.rows < (1 << 20) ? a.rows : (1 << 20));
  ams_mark_kernel<<<grid, mark_block, 0, detail::stream_of(be.stream)>>>(a);
  KVP_CUDA_TRY(cudaGetLastError());
  return {};
}

}  // namespace kvpolicy::cuda
