// Baseline scorers (KNorm, KeyDiff, TOVA, StreamingLLM) and Ada-KV head budgets on the GPU: the
// device twins of scorers/{knorm,keydiff,tova,streaming}.hpp and allocators/adakv.hpp.
//
// KNorm: one warp per (row, token); lanes stride the dims, fp32 FMAs, xor-butterfly sum.
// KeyDiff: (1) one warp per token: ||k|| in double; (2) anchor partials, one block per (row,
//   chunk of kAnchorChunk tokens), one thread per dim; (3) one block per row adds the chunks in
//   order, divides by T, and thread 0 sums the squares of the anchor in dim order; (4) one warp
//   per token: k . anchor in double -> -cos. Same double math as the CPU scorer.
// TOVA: cuda::window_attention (last query, GQA mean) into the workspace, then the mean over the
//   layer's KV heads, written to every head's row.
// StreamingLLM: out[l][h][j] = j.
// Ada-KV: keys topk_key(score, j) of every row's non-protected tokens, a CUB segmented radix
//   sort per row (descending), then one block per layer: the safeguards, a radix select (8 x
//   8-bit digits) of the key of the layer's free-th best pool entry, counts per head.
// Per-element math: scorers/{knorm,keydiff,tova,streaming}_row.hpp, allocators/adakv_row.hpp and
// the warp helpers of kvpolicy/cuda/baseline_math.hpp (KVP_HD, tested on the host).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cstdint>
#include <cub/device/device_segmented_radix_sort.cuh>

#include "check.cuh"
#include "elem.cuh"
#include "kvpolicy/core/topk_key.hpp"
#include "kvpolicy/cuda/baseline_launch.hpp"

namespace kvpolicy::cuda {
namespace {

namespace bm = baseline;
namespace rm = row_math;

constexpr int kBlock = 256;
constexpr int kWarpsPerBlock = kBlock / bm::kWarp;
constexpr int kAdaThreads = 1024;
constexpr std::size_t align256(std::size_t x) { return (x + 255) & ~std::size_t{255}; }

using detail::to_f32;

// Element i of one token's key, as float.
template <class E>
using KeyRow = detail::ElemRow<E>;

template <class E>
struct Keys {
  const E* data;
  std::int64_t H, T, d, sl, sh, st, sd;
  __device__ KeyRow<E> row(std::int64_t r, std::int64_t j) const {
    return {data + (r / H) * sl + (r % H) * sh + j * st, sd};
  }
};

template <class E>
Keys<E> keys_of(const TensorRef& v) {
  return {static_cast<const E*>(v.data), v.heads, v.tokens, v.dim, v.stride_layer,
          v.stride_head, v.stride_token, v.stride_dim};
}

template <class V>
__device__ __forceinline__ V warp_sum(V v) {
#pragma unroll
  for (int off = bm::kWarp / 2; off >= 1; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

Status check_keys(const TensorRef& k) {
  if (!k.data) return detail::invalid("null keys pointer");
  if (k.layers <= 0 || k.heads <= 0 || k.tokens <= 0 || k.dim <= 0)
    return detail::invalid("empty keys");
  if (k.stride_layer < 0 || k.stride_head < 0 || k.stride_token < 0 || k.stride_dim < 0)
    return detail::invalid("negative key strides");
  return {};
}
Status check_out(const MutableScoreView& out, std::int64_t L, std::int64_t H, std::int64_t T) {
  if (!out.data) return detail::invalid("null output pointer");
  if (out.layers != L || out.heads != H || out.tokens != T)
    return detail::invalid("output shape differs from the keys' [layers][heads][tokens]");
  if (out.row_stride < out.tokens) return detail::invalid("output row stride below tokens");
  return {};
}

// ---- KNorm ----------------------------------------------------------------------------------

template <class E>
__global__ void __launch_bounds__(kBlock)
    knorm_kernel(Keys<E> k, std::int64_t items, float* out, std::int64_t out_stride) {
  const int lane = threadIdx.x % bm::kWarp;
  const std::int64_t warps = std::int64_t{gridDim.x} * kWarpsPerBlock;
  for (std::int64_t w = blockIdx.x * std::int64_t{kWarpsPerBlock} + threadIdx.x / bm::kWarp;
       w < items; w += warps) {
    const std::int64_t r = w / k.T, j = w % k.T;
    const float s = warp_sum(rm::knorm_lane(k.row(r, j), lane, k.d));
    if (lane == 0) out[r * out_stride + j] = rm::knorm_finish(s);
  }
}

unsigned warp_grid(std::int64_t items) {
  return detail::grid_for(items, kWarpsPerBlock, 1u << 20);
}

// ---- KeyDiff --------------------------------------------------------------------------------

struct KdLayout {
  std::size_t norms = 0, partial = 0, anchor = 0, anorm = 0, total = 0;
};
KdLayout kd_layout(const TensorRef& k) {
  const auto R = static_cast<std::size_t>(k.layers * k.heads);
  const auto T = static_cast<std::size_t>(k.tokens), d = static_cast<std::size_t>(k.dim);
  const auto C = static_cast<std::size_t>(rm::anchor_chunks(k.tokens));
  KdLayout l;
  std::size_t at = 0;
  l.norms = at, at += align256(R * T * sizeof(double));
  l.partial = at, at += align256(R * C * d * sizeof(double));
  l.anchor = at, at += align256(R * d * sizeof(double));
  l.anorm = at, at += align256(R * sizeof(double));
  l.total = at;
  return l;
}

template <class E>
__global__ void __launch_bounds__(kBlock)
    kd_norms_kernel(Keys<E> k, std::int64_t items, double* norms) {
  const int lane = threadIdx.x % bm::kWarp;
  const std::int64_t warps = std::int64_t{gridDim.x} * kWarpsPerBlock;
  for (std::int64_t w = blockIdx.x * std::int64_t{kWarpsPerBlock} + threadIdx.x / bm::kWarp;
       w < items; w += warps) {
    const double s = warp_sum(rm::sumsq_lane(k.row(w / k.T, w % k.T), lane, k.d));
    if (lane == 0) norms[w] = sqrt(s);
  }
}

// grid (chunks, rows); thread i < d sums x_i / ||k|| over the chunk's tokens in order.
template <class E>
__global__ void kd_anchor_partial_kernel(Keys<E> k, const double* norms, double* partial) {
  const std::int64_t c = blockIdx.x, r = blockIdx.y, C = gridDim.x;
  const std::int64_t i = threadIdx.x;
  if (i >= k.d) return;
  const std::int64_t j0 = c * rm::kAnchorChunk;
  const std::int64_t j1 = j0 + rm::kAnchorChunk < k.T ? j0 + rm::kAnchorChunk : k.T;
  double acc = 0;
  for (std::int64_t j = j0; j < j1; ++j) acc += rm::anchor_term(k.row(r, j)(i), norms[r * k.T + j]);
  partial[(r * C + c) * k.d + i] = acc;
}

__global__ void kd_anchor_finish_kernel(const double* partial, std::int64_t C, std::int64_t T,
                                        std::int64_t d, double* anchor, double* anorm) {
  const std::int64_t r = blockIdx.x;
  for (std::int64_t i = threadIdx.x; i < d; i += blockDim.x) {
    double a = 0;
    for (std::int64_t c = 0; c < C; ++c) a += partial[(r * C + c) * d + i];
    anchor[r * d + i] = a / static_cast<double>(T);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double s = 0;
    for (std::int64_t i = 0; i < d; ++i) s += anchor[r * d + i] * anchor[r * d + i];
    anorm[r] = sqrt(s);
  }
}

template <class E>
__global__ void __launch_bounds__(kBlock)
    kd_score_kernel(Keys<E> k, std::int64_t items, const double* norms, const double* anchor,
                    const double* anorm, float* out, std::int64_t out_stride) {
  const int lane = threadIdx.x % bm::kWarp;
  const std::int64_t warps = std::int64_t{gridDim.x} * kWarpsPerBlock;
  for (std::int64_t w = blockIdx.x * std::int64_t{kWarpsPerBlock} + threadIdx.x / bm::kWarp;
       w < items; w += warps) {
    const std::int64_t r = w / k.T, j = w % k.T;
    const double dot = warp_sum(rm::anchor_dot_lane(k.row(r, j), anchor + r * k.d, lane, k.d));
    if (lane == 0)
      out[r * out_stride + j] =
          rm::keydiff_score(static_cast<float>(norms[w]), dot, anorm[r]);
  }
}

// ---- TOVA / StreamingLLM --------------------------------------------------------------------

__global__ void tova_kernel(const float* attn, std::int64_t L, std::int64_t H, std::int64_t T,
                            float* out, std::int64_t out_stride) {
  const std::int64_t n = L * T;
  for (std::int64_t e = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; e < n;
       e += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t l = e / T, j = e % T;
    const float v = rm::tova_at(attn + l * H * T + j, H, T);
    for (std::int64_t h = 0; h < H; ++h) out[(l * H + h) * out_stride + j] = v;
  }
}

__global__ void streaming_kernel(std::int64_t rows, std::int64_t T, float* out,
                                 std::int64_t out_stride) {
  const std::int64_t n = rows * T;
  for (std::int64_t e = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; e < n;
       e += std::int64_t{gridDim.x} * blockDim.x)
    out[(e / T) * out_stride + e % T] = rm::streaming_at(e % T);
}

// ---- Ada-KV ---------------------------------------------------------------------------------

struct AdaLayout {
  std::int64_t N = 0;  // scored tokens per row
  std::size_t budgets = 0, segments = 0, keys_a = 0, keys_b = 0, cub = 0;
  std::size_t cub_bytes = 0, total = 0;
};

Status ada_plan(std::int64_t L, std::int64_t H, std::int64_t T, std::int64_t sinks,
                std::int64_t recent, AdaLayout& lay) {
  if (L < 0 || H < 0 || T < 0) return detail::invalid("negative score shape");
  if (H > adakv_max_heads) return detail::invalid("more heads per layer than adakv_max_heads");
  if (T > INT_MAX) return detail::invalid("tokens exceed the int32 index range");
  const std::int64_t R = L * H, N = rm::ada_span(sinks, recent, T).scored();
  if (N > 0 && R > std::int64_t{INT_MAX} / N)
    return detail::invalid("rows * scored tokens exceeds the int range of CUB's item count");
  const int items = static_cast<int>(R * N);
  std::size_t sort_bytes = 0;
  if (items > 0) {
    cub::DoubleBuffer<std::uint64_t> keys(nullptr, nullptr);
    KVP_CUDA_TRY(cub::DeviceSegmentedRadixSort::SortKeysDescending(
        nullptr, sort_bytes, keys, items, static_cast<int>(R),
        static_cast<const std::int64_t*>(nullptr), static_cast<const std::int64_t*>(nullptr)));
  }
  const auto Rs = static_cast<std::size_t>(R), Ns = static_cast<std::size_t>(items);
  std::size_t at = 0;
  lay.N = N;
  lay.budgets = at, at += align256(Rs * sizeof(std::int64_t));
  lay.segments = at, at += align256((Rs + 1) * sizeof(std::int64_t));
  lay.keys_a = at, at += align256(Ns * sizeof(std::uint64_t));
  lay.keys_b = at, at += align256(Ns * sizeof(std::uint64_t));
  lay.cub_bytes = sort_bytes;
  lay.cub = at, at += align256(sort_bytes);
  lay.total = at;
  return {};
}

__global__ void ada_keys_kernel(const float* scores, std::int64_t stride, std::int64_t R,
                                std::int64_t N, std::int64_t sinks, std::uint64_t* keys,
                                std::int64_t* segments) {
  const std::int64_t n = R * N;
  for (std::int64_t e = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; e < n;
       e += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t r = e / N, j = sinks + e % N;
    keys[e] = topk_key(scores[r * stride + j], static_cast<std::int32_t>(j));
  }
  for (std::int64_t r = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; r <= R;
       r += std::int64_t{gridDim.x} * blockDim.x)
    segments[r] = r * N;
}

// One block per layer (kAdaThreads threads; dynamic shared memory: 3 * H int64).
__global__ void __launch_bounds__(kAdaThreads)
    ada_budget_kernel(const std::uint64_t* sorted, std::int64_t N, std::int64_t H,
                      std::int64_t P, std::int64_t T, double alpha, const std::int64_t* budgets,
                      std::int64_t* out) {
  extern __shared__ std::int64_t ada_sh[];
  std::int64_t* keep = ada_sh;        // [H]
  std::int64_t* gt = ada_sh + H;      // [H]: first B_h, then pool entries > t*
  std::int64_t* eq = ada_sh + 2 * H;  // [H]: pool entries == t*
  __shared__ unsigned long long count[rm::kDigits];
  __shared__ std::int64_t free_s;
  __shared__ std::uint64_t prefix_s;
  const std::int64_t l = blockIdx.x;
  const std::uint64_t* rows = sorted + l * H * N;
  for (std::int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    const std::int64_t b = rm::ada_clamp(budgets[l * H + h], P, T);
    keep[h] = rm::ada_keep(b, P, alpha);
    gt[h] = b;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    std::int64_t f = 0;
    for (std::int64_t h = 0; h < H; ++h) f += gt[h] - keep[h];
    free_s = f;
    prefix_s = 0;
  }
  __syncthreads();
  const std::int64_t free = free_s;
  if (free > 0) {
    const int d = threadIdx.x % rm::kDigits;
    const int group = threadIdx.x / rm::kDigits, groups = blockDim.x / rm::kDigits;
    for (int r = 0; r < rm::kRounds; ++r) {
      if (threadIdx.x < rm::kDigits) count[threadIdx.x] = 0;
      __syncthreads();
      const std::uint64_t t = rm::candidate(prefix_s, r, d);
      std::int64_t c = 0;
      for (std::int64_t h = group; h < H; h += groups)
        c += rm::pool_ge(rows + h * N, N, keep[h] - P, t);
      atomicAdd(&count[d], static_cast<unsigned long long>(c));
      __syncthreads();
      if (threadIdx.x < rm::kDigits && rm::digit_wins(count, d, free))
        prefix_s = rm::candidate(prefix_s, r, d);
      __syncthreads();
    }
    const std::uint64_t ts = prefix_s;
    for (std::int64_t h = threadIdx.x; h < H; h += blockDim.x) {
      const std::int64_t g = keep[h] - P;
      const std::int64_t above = rm::pool_ge(rows + h * N, N, g, ts + 1);
      eq[h] = rm::pool_ge(rows + h * N, N, g, ts) - above;
      gt[h] = above;
    }
  } else {
    for (std::int64_t h = threadIdx.x; h < H; h += blockDim.x) gt[h] = eq[h] = 0;
  }
  __syncthreads();
  if (threadIdx.x == 0) rm::ada_assign(keep, gt, eq, H, free, out + l * H);
}

}  // namespace

// ---- entry points ---------------------------------------------------------------------------

Status knorm_score(const cuda_backend& be, const TensorRef& keys, const MutableScoreView& out) {
  if (Status e = check_keys(keys); !e.ok()) return e;
  if (Status e = check_out(out, keys.layers, keys.heads, keys.tokens); !e.ok()) return e;
  const std::int64_t items = keys.layers * keys.heads * keys.tokens;
  const cudaStream_t st = detail::stream_of(be.stream);
  const unsigned g = warp_grid(items);
  switch (keys.dtype) {
    case DType::f32:
      knorm_kernel<<<g, kBlock, 0, st>>>(keys_of<float>(keys), items, out.data, out.row_stride);
      break;
    case DType::f16:
      knorm_kernel<<<g, kBlock, 0, st>>>(keys_of<__half>(keys), items, out.data, out.row_stride);
      break;
    case DType::bf16:
      knorm_kernel<<<g, kBlock, 0, st>>>(keys_of<__nv_bfloat16>(keys), items, out.data,
                                         out.row_stride);
      break;
    default: return detail::invalid("unknown element type");
  }
  KVP_CUDA_TRY(cudaGetLastError());
  return {};
}

Status keydiff_workspace_bytes(const TensorRef& keys, std::size_t& bytes) {
  bytes = 0;
  if (Status e = check_keys(keys); !e.ok()) return e;
  if (keys.dim > 1024) return detail::invalid("head_dim above 1024 is not supported");
  bytes = kd_layout(keys).total;
  return {};
}

namespace {
template <class E>
Status keydiff_typed(cudaStream_t st, const TensorRef& kv, unsigned char* ws,
                     const KdLayout& lay, const MutableScoreView& out) {
  const Keys<E> k = keys_of<E>(kv);
  const std::int64_t R = kv.layers * kv.heads, items = R * kv.tokens;
  const std::int64_t C = rm::anchor_chunks(kv.tokens);
  auto* norms = reinterpret_cast<double*>(ws + lay.norms);
  auto* partial = reinterpret_cast<double*>(ws + lay.partial);
  auto* anchor = reinterpret_cast<double*>(ws + lay.anchor);
  auto* anorm = reinterpret_cast<double*>(ws + lay.anorm);
  kd_norms_kernel<E><<<warp_grid(items), kBlock, 0, st>>>(k, items, norms);
  KVP_CUDA_TRY(cudaGetLastError());
  const unsigned dim_threads = static_cast<unsigned>((kv.dim + 31) / 32 * 32);
  kd_anchor_partial_kernel<E><<<dim3(static_cast<unsigned>(C), static_cast<unsigned>(R)),
                                dim_threads, 0, st>>>(k, norms, partial);
  KVP_CUDA_TRY(cudaGetLastError());
  kd_anchor_finish_kernel<<<static_cast<unsigned>(R), kBlock, 0, st>>>(partial, C, kv.tokens,
                                                                       kv.dim, anchor, anorm);
  KVP_CUDA_TRY(cudaGetLastError());
  kd_score_kernel<E><<<warp_grid(items), kBlock, 0, st>>>(k, items, norms, anchor, anorm,
                                                          out.data, out.row_stride);
  KVP_CUDA_TRY(cudaGetLastError());
  return {};
}
}  // namespace

Status keydiff_score(const cuda_backend& be, const TensorRef& keys, const MutableScoreView& out) {
  std::size_t need = 0;
  if (Status e = keydiff_workspace_bytes(keys, need); !e.ok()) return e;
  if (Status e = check_out(out, keys.layers, keys.heads, keys.tokens); !e.ok()) return e;
  if (keys.layers * keys.heads > 65535)
    return detail::invalid("more (layer, head) rows than a grid's y extent");
  if (be.workspace_bytes < need)
    return {StatusCode::insufficient_workspace, 0, "below keydiff_workspace_bytes"};
  if (!be.workspace) return detail::invalid("null workspace");
  if (reinterpret_cast<std::uintptr_t>(be.workspace) % 256 != 0)
    return detail::invalid("workspace is not 256-byte aligned");
  auto* ws = static_cast<unsigned char*>(be.workspace);
  const KdLayout lay = kd_layout(keys);
  const cudaStream_t st = detail::stream_of(be.stream);
  switch (keys.dtype) {
    case DType::f32: return keydiff_typed<float>(st, keys, ws, lay, out);
    case DType::f16: return keydiff_typed<__half>(st, keys, ws, lay, out);
    case DType::bf16: return keydiff_typed<__nv_bfloat16>(st, keys, ws, lay, out);
  }
  return detail::invalid("unknown element type");
}

Status tova_workspace_bytes(const TensorRef& keys, const TensorRef& queries,
                            std::size_t& bytes) {
  bytes = 0;
  if (Status e = check_keys(keys); !e.ok()) return e;
  std::size_t wa = 0;
  if (Status e = window_attention_workspace_bytes(keys, queries, 1, wa); !e.ok()) return e;
  bytes = align256(static_cast<std::size_t>(keys.layers * keys.heads * keys.tokens) *
                   sizeof(float)) +
          wa;
  return {};
}

Status tova_score(const cuda_backend& be, const TensorRef& keys, const TensorRef& queries,
                  const MutableScoreView& out) {
  std::size_t need = 0;
  if (Status e = tova_workspace_bytes(keys, queries, need); !e.ok()) return e;
  if (Status e = check_out(out, keys.layers, keys.heads, keys.tokens); !e.ok()) return e;
  if (be.workspace_bytes < need)
    return {StatusCode::insufficient_workspace, 0, "below tova_workspace_bytes"};
  if (!be.workspace) return detail::invalid("null workspace");
  if (reinterpret_cast<std::uintptr_t>(be.workspace) % 256 != 0)
    return detail::invalid("workspace is not 256-byte aligned");
  const std::int64_t L = keys.layers, H = keys.heads, T = keys.tokens;
  const std::size_t ab = align256(static_cast<std::size_t>(L * H * T) * sizeof(float));
  auto* attn = static_cast<float*>(be.workspace);
  cuda_backend inner = be;
  inner.workspace = static_cast<unsigned char*>(be.workspace) + ab;
  inner.workspace_bytes = be.workspace_bytes - ab;
  if (Status e = window_attention(inner, keys, queries, GqaReduce::mean, 1,
                                  MutableScoreView{attn, L, H, T, T});
      !e.ok())
    return e;
  tova_kernel<<<detail::grid_for(L * T, kBlock), kBlock, 0, detail::stream_of(be.stream)>>>(
      attn, L, H, T, out.data, out.row_stride);
  KVP_CUDA_TRY(cudaGetLastError());
  return {};
}

Status copy_score_rows(const cuda_backend& be, const float* src, std::int64_t src_stride,
                       const MutableScoreView& out) {
  if (out.layers < 0 || out.heads < 0 || out.tokens < 0)
    return detail::invalid("negative output shape");
  if (out.row_stride < out.tokens || src_stride < out.tokens)
    return detail::invalid("source or output row stride below tokens");
  const std::int64_t rows = out.layers * out.heads;
  if (rows * out.tokens == 0) return {};
  if (!out.data || !src) return detail::invalid("null source or output pointer");
  KVP_CUDA_TRY(cudaMemcpy2DAsync(out.data, static_cast<std::size_t>(out.row_stride) * sizeof(float),
                                 src, static_cast<std::size_t>(src_stride) * sizeof(float),
                                 static_cast<std::size_t>(out.tokens) * sizeof(float),
                                 static_cast<std::size_t>(rows), cudaMemcpyDeviceToDevice,
                                 detail::stream_of(be.stream)));
  return {};
}

Status streaming_score(const cuda_backend& be, const MutableScoreView& out) {
  if (out.layers < 0 || out.heads < 0 || out.tokens < 0)
    return detail::invalid("negative output shape");
  if (out.row_stride < out.tokens) return detail::invalid("output row stride below tokens");
  const std::int64_t rows = out.layers * out.heads;
  if (rows * out.tokens == 0) return {};
  if (!out.data) return detail::invalid("null output pointer");
  streaming_kernel<<<detail::grid_for(rows * out.tokens, kBlock), kBlock, 0,
                     detail::stream_of(be.stream)>>>(rows, out.tokens, out.data, out.row_stride);
  KVP_CUDA_TRY(cudaGetLastError());
  return {};
}

Status adakv_workspace_bytes(std::int64_t layers, std::int64_t heads, std::int64_t tokens,
                             std::int64_t sinks, std::int64_t recent, std::size_t& bytes) {
  AdaLayout lay;
  const Status s = ada_plan(layers, heads, tokens, sinks, recent, lay);
  bytes = s.ok() ? lay.total : 0;
  return s;
}

Status adakv_budgets(const cuda_backend& be, const ScoreView& scores, const std::int64_t* budgets,
                     BudgetsAt where, std::int64_t sinks, std::int64_t recent, double alpha,
                     std::int64_t* out_budgets) {
  if (!(alpha >= 0.0 && alpha <= 1.0)) return detail::invalid("alpha must be in [0, 1]");
  AdaLayout lay;
  if (Status s = ada_plan(scores.layers, scores.heads, scores.tokens, sinks, recent, lay); !s.ok())
    return s;
  const std::int64_t L = scores.layers, H = scores.heads, T = scores.tokens, R = L * H;
  if (R == 0) return {};
  if (!budgets || !out_budgets) return detail::invalid("null budgets pointer");
  if (scores.row_stride < T) return detail::invalid("score row stride below tokens");
  if (lay.N > 0 && !scores.data) return detail::invalid("null score pointer");
  if (L > INT_MAX) return detail::invalid("too many layers for a grid");
  if (be.workspace_bytes < lay.total || !be.workspace)
    return {StatusCode::insufficient_workspace, 0, "below adakv_workspace_bytes"};
  if (reinterpret_cast<std::uintptr_t>(be.workspace) % 256 != 0)
    return detail::invalid("workspace must be 256-byte aligned (as cudaMalloc returns it)");
  const cudaStream_t st = detail::stream_of(be.stream);
  auto* ws = static_cast<unsigned char*>(be.workspace);
  auto* ws_budgets = reinterpret_cast<std::int64_t*>(ws + lay.budgets);
  auto* segments = reinterpret_cast<std::int64_t*>(ws + lay.segments);
  auto* keys_a = reinterpret_cast<std::uint64_t*>(ws + lay.keys_a);
  auto* keys_b = reinterpret_cast<std::uint64_t*>(ws + lay.keys_b);
  if (where == BudgetsAt::host) {
    KVP_CUDA_TRY(cudaMemcpyAsync(ws_budgets, budgets, static_cast<std::size_t>(R) * sizeof(std::int64_t),
                                 cudaMemcpyHostToDevice, st));
    budgets = ws_budgets;
  }
  const rm::AdaSpan span = rm::ada_span(sinks, recent, T);
  const std::uint64_t* sorted = keys_a;
  if (lay.N > 0) {
    const std::int64_t items = R * lay.N;
    ada_keys_kernel<<<detail::grid_for(items + 1, kBlock), kBlock, 0, st>>>(
        scores.data, scores.row_stride, R, lay.N, span.sinks, keys_a, segments);
    KVP_CUDA_TRY(cudaGetLastError());
    cub::DoubleBuffer<std::uint64_t> keys(keys_a, keys_b);
    std::size_t temp = lay.cub_bytes;
    KVP_CUDA_TRY(cub::DeviceSegmentedRadixSort::SortKeysDescending(
        ws + lay.cub, temp, keys, static_cast<int>(items), static_cast<int>(R), segments,
        segments + 1, 0, 64, st));
    sorted = keys.Current();
  }
  const std::size_t smem = 3 * static_cast<std::size_t>(H) * sizeof(std::int64_t);
  ada_budget_kernel<<<static_cast<unsigned>(L), kAdaThreads, smem, st>>>(
      sorted, lay.N, H, span.protected_count(T), T, alpha, budgets, out_budgets);
  KVP_CUDA_TRY(cudaGetLastError());
  return {};
}

}  // namespace kvpolicy::cuda
