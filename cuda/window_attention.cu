// Window-attention scoring on the GPU (SnapKV, H2O from queries): the device twin of
// cpu/window_attention.hpp, flash-style in two passes, fp32 throughout, no T x T buffer.
//
// Pass 1 (row statistics): a block owns kPass1Rows consecutive rows (query head m, query i) of one
// (layer, KV head) and one split of the keys. Each thread holds its scaled query row (registers
// when head_dim is a template constant, else shared memory); key tiles are staged in shared
// memory as fp32 and read by all threads (broadcast). Each thread folds its visible keys into an
// online (max, sum); partials go to workspace [row][split]. A merge kernel folds the splits of
// each row in split order.
// Pass 2 (column sums): a block owns kPass2Keys keys of one (layer, KV head); each thread owns one
// key (its fp32 row in registers / shared memory), loops over the group's heads and over the
// query tiles that can see the block's keys (staged in shared memory with their statistics), and
// adds exp(logit - max) / sum. Every column sum is owned by one thread: no atomics, one order.
// The group reduction (mean / max / sum) and the optional H2O normalisation close the thread.
// SnapKV then pools the column sums of the tokens before the window (one thread per output).
// The per-element math is in kvpolicy/cuda/score_math.hpp (window attention), scorers/snapkv_row.hpp
// (pooling) and scorers/h2o_row.hpp (normalisation): KVP_HD, tested on the host.
//
// Cost: the logits are fp32 FMAs on the CUDA cores (head_dim 64 and 128 keep the thread's row in
// registers and read the shared operand as float4 broadcasts; other head dims use shared-memory
// rows), computed twice (once per pass). At the issue's shape (Hq=32, n_q=32, T=32768, d=128)
// that is 2 x 4.3 G FMAs per layer, about 256 us at an H200's fp32 peak: the <= 100 us SnapKV
// target needs a tensor-core (MMA) variant of both passes, which this file does not have yet.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "check.cuh"
#include "elem.cuh"
#include "kvpolicy/cuda/score_launch.hpp"

namespace kvpolicy::cuda {
namespace {

namespace rm = row_math;
using scoring::RowStat;

constexpr int kRows = scoring::kPass1Rows;  // pass 1: threads = rows per block
constexpr int kKeyTile = 64;              // pass 1: keys staged per tile
constexpr int kPass2Keys = 128;           // pass 2: threads = keys per block
constexpr int kQueryTile = 32;            // pass 2: queries staged per tile
constexpr std::int64_t kMaxDim = 256;

using detail::to_f32;

template <class E>
struct Src {
  const E* data;
  std::int64_t sl, sh, st, sd;
  __device__ float at(std::int64_t l, std::int64_t h, std::int64_t t, std::int64_t c) const {
    return to_f32(data[l * sl + h * sh + t * st + c * sd]);
  }
};

template <class E>
Src<E> src_of(const TensorRef& v) {
  return {static_cast<const E*>(v.data), v.stride_layer, v.stride_head, v.stride_token,
          v.stride_dim};
}

struct Shape {
  std::int64_t L, Hkv, Hq, g, T, nq, qoff, d;  // qoff: first used query token of the view
  float scale;
  int splits;
  std::int64_t split_len;
};

// The row a thread owns: registers when D is a template constant, else a shared-memory row.
template <int D>
struct OwnRow {
  float v[D];
  __device__ void load(const float* src, int) {
#pragma unroll
    for (int c = 0; c < D; ++c) v[c] = src[c];
  }
  // Same order as scoring::dot (four FMA chains over c % 4). `b` is 16-byte aligned.
  __device__ float dot(const float* b, int) const {
    static_assert(D % 4 == 0, "fixed head dims are multiples of 4");
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma unroll
    for (int c = 0; c < D; c += 4) {
      const float4 x = *reinterpret_cast<const float4*>(b + c);
      a0 = fmaf(v[c], x.x, a0);
      a1 = fmaf(v[c + 1], x.y, a1);
      a2 = fmaf(v[c + 2], x.z, a2);
      a3 = fmaf(v[c + 3], x.w, a3);
    }
    return (a0 + a1) + (a2 + a3);
  }
};
template <>
struct OwnRow<0> {
  const float* p;
  __device__ void load(const float* src, int) { p = src; }
  __device__ float dot(const float* b, int d) const { return scoring::dot(p, b, d); }
};

// Row stride (floats) of the per-thread rows staged in shared memory: odd for the runtime-d path
// so that threads reading their own rows hit different banks.
__host__ __device__ constexpr std::int64_t own_stride(int D, std::int64_t d) {
  return D == 0 ? (d | 1) : d;
}
// Broadcast rows: multiple of 4 floats (float4 reads) when D is fixed.
__host__ __device__ constexpr std::int64_t bcast_stride(int D, std::int64_t d) {
  return D == 0 ? d : (d + 3) / 4 * 4;
}

std::size_t pass1_smem(int D, std::int64_t d) {
  return sizeof(float) * static_cast<std::size_t>(kRows * own_stride(D, d) +
                                                  kKeyTile * bcast_stride(D, d));
}
std::size_t pass2_smem(int D, std::int64_t d) {
  return sizeof(float) * static_cast<std::size_t>(kPass2Keys * own_stride(D, d) +
                                                  kQueryTile * bcast_stride(D, d)) +
         sizeof(RowStat) * kQueryTile;
}

// ---- pass 1 ---------------------------------------------------------------------------------

template <class E, int D>
__global__ void __launch_bounds__(kRows)
    row_stats_kernel(Src<E> keys, Src<E> queries, Shape s, RowStat* partial) {
  extern __shared__ __align__(16) float smem[];
  const std::int64_t d = D == 0 ? s.d : D;
  const std::int64_t os = own_stride(D, d), bs = bcast_stride(D, d);
  float* qs = smem;                // [kRows][os]
  float* ks = smem + kRows * os;   // [kKeyTile][bs]
  const std::int64_t rows_per_item = s.g * s.nq;
  const int rb_per_item = scoring::pass1_row_blocks_per_item(s.g, s.nq);
  const std::int64_t item = blockIdx.x / rb_per_item;
  const std::int64_t r0 = (blockIdx.x % rb_per_item) * std::int64_t{kRows};
  const std::int64_t l = item / s.Hkv, h = item % s.Hkv;
  const std::int64_t nrows = rows_per_item - r0 < kRows ? rows_per_item - r0 : kRows;

  for (std::int64_t e = threadIdx.x; e < nrows * d; e += kRows) {
    const std::int64_t rr = e / d, c = e % d, r = r0 + rr;
    qs[rr * os + c] = queries.at(l, h * s.g + r / s.nq, s.qoff + r % s.nq, c) * s.scale;
  }
  // Keys this block needs: its split, up to what its last-positioned query sees.
  const std::int64_t rlast = r0 + nrows - 1;
  const std::int64_t imax = r0 / s.nq != rlast / s.nq ? s.nq - 1 : rlast % s.nq;
  const std::int64_t k0 = blockIdx.y * s.split_len;
  std::int64_t k1 = k0 + s.split_len < s.T ? k0 + s.split_len : s.T;
  const std::int64_t vis = scoring::query_pos(imax, s.nq, s.T) + 1;
  if (k1 > vis) k1 = vis;

  const bool valid = threadIdx.x < nrows;
  const std::int64_t r = r0 + threadIdx.x;
  const std::int64_t pos = scoring::query_pos(r % s.nq, s.nq, s.T);
  __syncthreads();
  OwnRow<D> own;
  own.load(qs + threadIdx.x * os, static_cast<int>(d));
  RowStat st = scoring::empty_stat();
  for (std::int64_t t0 = k0; t0 < k1; t0 += kKeyTile) {
    const std::int64_t nb = k1 - t0 < kKeyTile ? k1 - t0 : kKeyTile;
    __syncthreads();
    for (std::int64_t e = threadIdx.x; e < nb * d; e += kRows)
      ks[(e / d) * bs + e % d] = keys.at(l, h, t0 + e / d, e % d);
    __syncthreads();
    if (valid) {
      std::int64_t lim = pos + 1 - t0;
      if (lim > nb) lim = nb;
      for (std::int64_t jj = 0; jj < lim; ++jj)
        scoring::stat_add(st, own.dot(ks + jj * bs, static_cast<int>(d)));
    }
  }
  if (valid) partial[(item * rows_per_item + r) * s.splits + blockIdx.y] = st;
}

__global__ void merge_stats_kernel(const RowStat* partial, RowStat* stats, std::int64_t rows,
                                   int splits) {
  for (std::int64_t r = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; r < rows;
       r += std::int64_t{gridDim.x} * blockDim.x) {
    RowStat acc = partial[r * splits];
    for (int k = 1; k < splits; ++k) acc = scoring::stat_merge(acc, partial[r * splits + k]);
    stats[r] = acc;
  }
}

// ---- pass 2 ---------------------------------------------------------------------------------

template <class E, int D>
__global__ void __launch_bounds__(kPass2Keys)
    column_sums_kernel(Src<E> keys, Src<E> queries, Shape s, const RowStat* stats,
                       GqaReduce reduce, bool h2o_normalize, float* out, std::int64_t out_stride) {
  extern __shared__ __align__(16) float smem[];
  const std::int64_t d = D == 0 ? s.d : D;
  const std::int64_t os = own_stride(D, d), bs = bcast_stride(D, d);
  float* ks = smem;                                // [kPass2Keys][os]
  float* qs = smem + kPass2Keys * os;              // [kQueryTile][bs]
  RowStat* qstat = reinterpret_cast<RowStat*>(qs + kQueryTile * bs);  // [kQueryTile]
  const std::int64_t item = blockIdx.y, l = item / s.Hkv, h = item % s.Hkv;
  const std::int64_t j0 = blockIdx.x * std::int64_t{kPass2Keys};
  const std::int64_t nk = s.T - j0 < kPass2Keys ? s.T - j0 : kPass2Keys;
  for (std::int64_t e = threadIdx.x; e < nk * d; e += kPass2Keys)
    ks[(e / d) * os + e % d] = keys.at(l, h, j0 + e / d, e % d);
  __syncthreads();
  const bool valid = threadIdx.x < nk;
  const std::int64_t j = j0 + threadIdx.x;
  OwnRow<D> own;
  own.load(ks + threadIdx.x * os, static_cast<int>(d));
  const std::int64_t i_begin = scoring::first_query_seeing(j0, s.nq, s.T);
  float red = 0.f;
  for (int m = 0; m < s.g; ++m) {
    const std::int64_t hq = h * s.g + m;
    const RowStat* hstats = stats + (l * s.Hq + hq) * s.nq;
    float acc = 0.f;
    for (std::int64_t i0 = i_begin; i0 < s.nq; i0 += kQueryTile) {
      const std::int64_t ni = s.nq - i0 < kQueryTile ? s.nq - i0 : kQueryTile;
      __syncthreads();
      for (std::int64_t e = threadIdx.x; e < ni * d; e += kPass2Keys)
        qs[(e / d) * bs + e % d] = queries.at(l, hq, s.qoff + i0 + e / d, e % d) * s.scale;
      if (threadIdx.x < ni) qstat[threadIdx.x] = hstats[i0 + threadIdx.x];
      __syncthreads();
      if (valid) {
        for (std::int64_t ii = 0; ii < ni; ++ii)
          if (scoring::visible(i0 + ii, j, s.nq, s.T))
            acc += scoring::attn_prob(own.dot(qs + ii * bs, static_cast<int>(d)), qstat[ii]);
      }
    }
    red = scoring::gqa_fold(red, acc, m, reduce);
  }
  if (!valid) return;
  float v = scoring::gqa_finish(red, static_cast<int>(s.g), reduce);
  if (h2o_normalize) v /= rm::h2o_seen(j, s.nq, s.T);
  out[item * out_stride + j] = v;
}

// ---- SnapKV pooling -------------------------------------------------------------------------

__global__ void snapkv_pool_kernel(const float* colsum, std::int64_t rows, std::int64_t T,
                                   std::int64_t w, int kernel, Pool pool, float* out,
                                   std::int64_t out_stride) {
  const std::int64_t n = rows * T;
  for (std::int64_t e = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; e < n;
       e += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t r = e / T, j = e % T;
    out[r * out_stride + j] = rm::snapkv_at(colsum + r * T, T, w, j, kernel, pool);
  }
}

// ---- H2O from given state --------------------------------------------------------------------

__global__ void h2o_state_kernel(const float* acc, const float* obs, std::int64_t state_stride,
                                 bool normalize, std::int64_t rows, std::int64_t T, float* out,
                                 std::int64_t out_stride) {
  const std::int64_t n = rows * T;
  for (std::int64_t e = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; e < n;
       e += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t r = e / T, j = e % T, at = r * state_stride + j;
    out[r * out_stride + j] = rm::h2o_from_state(acc[at], obs ? obs + at : nullptr, normalize);
  }
}

// ---- host side ------------------------------------------------------------------------------

constexpr std::size_t align256(std::size_t b) { return (b + 255) / 256 * 256; }

Status check_views(const TensorRef& k, const TensorRef& q, std::int64_t nq) {
  if (!k.data || !q.data) return detail::invalid("null keys or queries pointer");
  if (k.dtype != q.dtype) return detail::invalid("keys and queries have different element types");
  if (k.layers <= 0 || k.heads <= 0 || k.tokens <= 0 || k.dim <= 0)
    return detail::invalid("keys have an empty or negative extent");
  if (q.layers != k.layers || q.dim != k.dim)
    return detail::invalid("queries differ from keys in layers or head_dim");
  if (q.heads <= 0 || q.heads % k.heads != 0)
    return detail::invalid("query heads are not a multiple of KV heads");
  if (nq < 1 || nq > q.tokens || nq > k.tokens)
    return detail::invalid("need 1..min(T, query tokens) queries");
  if (k.dim > kMaxDim) return detail::invalid("head_dim above 256 is not supported");
  if (k.layers * k.heads > 65535)
    return detail::invalid("more than 65535 (layer, KV head) rows: launch per layer group");
  const std::int64_t str[] = {k.stride_layer, k.stride_head, k.stride_token, k.stride_dim,
                              q.stride_layer, q.stride_head, q.stride_token, q.stride_dim};
  for (std::int64_t x : str)
    if (x < 0) return detail::invalid("negative stride");
  return {};
}

Shape shape_of(const TensorRef& k, const TensorRef& q, std::int64_t nq) {
  Shape s{};
  s.L = k.layers, s.Hkv = k.heads, s.Hq = q.heads, s.g = q.heads / k.heads, s.T = k.tokens;
  s.nq = nq, s.qoff = q.tokens - nq, s.d = k.dim;
  s.scale = 1.0f / sqrtf(static_cast<float>(k.dim));
  s.splits = scoring::pass1_splits(s.L * s.Hkv, s.g, s.nq, s.T);
  s.split_len = scoring::split_len(s.T, s.splits);
  return s;
}

std::size_t stats_bytes(const Shape& s) {
  const auto rows = static_cast<std::size_t>(s.L * s.Hq * s.nq);
  return align256(rows * s.splits * sizeof(RowStat)) + align256(rows * sizeof(RowStat));
}

template <class K>
Status set_smem(K kernel, std::size_t bytes) {
  int dev = 0, optin = 0;
  KVP_CUDA_TRY(cudaGetDevice(&dev));
  KVP_CUDA_TRY(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  if (bytes > static_cast<std::size_t>(optin))
    return detail::invalid("head_dim needs more shared memory than the device has per block");
  KVP_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(bytes)));
  return {};
}

template <class E, int D>
Status run_typed(const cuda_backend& be, const TensorRef& kv, const TensorRef& qv,
                 const Shape& s, GqaReduce reduce, bool h2o_normalize, float* out,
                 std::int64_t out_stride) {
  const cudaStream_t st = detail::stream_of(be.stream);
  auto* base = static_cast<unsigned char*>(be.workspace);
  const auto rows = static_cast<std::size_t>(s.L * s.Hq * s.nq);
  auto* partial = reinterpret_cast<RowStat*>(base);
  auto* stats = reinterpret_cast<RowStat*>(base + align256(rows * s.splits * sizeof(RowStat)));
  const Src<E> k = src_of<E>(kv), q = src_of<E>(qv);

  const std::size_t sm1 = pass1_smem(D, s.d), sm2 = pass2_smem(D, s.d);
  if (Status e = set_smem(row_stats_kernel<E, D>, sm1); !e.ok()) return e;
  if (Status e = set_smem(column_sums_kernel<E, D>, sm2); !e.ok()) return e;

  const std::int64_t items = s.L * s.Hkv;
  const dim3 g1(static_cast<unsigned>(items * scoring::pass1_row_blocks_per_item(s.g, s.nq)),
                static_cast<unsigned>(s.splits));
  row_stats_kernel<E, D><<<g1, kRows, sm1, st>>>(k, q, s, partial);
  KVP_CUDA_TRY(cudaGetLastError());
  merge_stats_kernel<<<detail::grid_for(static_cast<long long>(rows), 256), 256, 0, st>>>(
      partial, stats, static_cast<std::int64_t>(rows), s.splits);
  KVP_CUDA_TRY(cudaGetLastError());
  const dim3 g2(static_cast<unsigned>((s.T + kPass2Keys - 1) / kPass2Keys),
                static_cast<unsigned>(items));
  column_sums_kernel<E, D><<<g2, kPass2Keys, sm2, st>>>(k, q, s, stats, reduce, h2o_normalize,
                                                        out, out_stride);
  KVP_CUDA_TRY(cudaGetLastError());
  return {};
}

template <class E>
Status run_dim(const cuda_backend& be, const TensorRef& kv, const TensorRef& qv, const Shape& s,
               GqaReduce reduce, bool h2o_normalize, float* out, std::int64_t out_stride) {
  switch (s.d) {
    case 64: return run_typed<E, 64>(be, kv, qv, s, reduce, h2o_normalize, out, out_stride);
    case 128: return run_typed<E, 128>(be, kv, qv, s, reduce, h2o_normalize, out, out_stride);
    default: return run_typed<E, 0>(be, kv, qv, s, reduce, h2o_normalize, out, out_stride);
  }
}

Status run(const cuda_backend& be, const TensorRef& kv, const TensorRef& qv, const Shape& s,
           GqaReduce reduce, bool h2o_normalize, float* out, std::int64_t out_stride) {
  if (be.workspace_bytes < stats_bytes(s))
    return {StatusCode::insufficient_workspace, 0, "below window_attention_workspace_bytes"};
  if (!be.workspace) return detail::invalid("null workspace");
  if (reinterpret_cast<std::uintptr_t>(be.workspace) % 256 != 0)
    return detail::invalid("workspace is not 256-byte aligned");
  switch (kv.dtype) {
    case DType::f32:
      return run_dim<float>(be, kv, qv, s, reduce, h2o_normalize, out, out_stride);
    case DType::f16:
      return run_dim<__half>(be, kv, qv, s, reduce, h2o_normalize, out, out_stride);
    case DType::bf16:
      return run_dim<__nv_bfloat16>(be, kv, qv, s, reduce, h2o_normalize, out, out_stride);
  }
  return detail::invalid("unknown element type");
}

Status check_out(const MutableScoreView& out, const TensorRef& k) {
  if (!out.data) return detail::invalid("null output pointer");
  if (out.layers != k.layers || out.heads != k.heads || out.tokens != k.tokens)
    return detail::invalid("output shape differs from the keys' [layers][heads][tokens]");
  if (out.row_stride < out.tokens) return detail::invalid("output row stride below tokens");
  return {};
}

}  // namespace

Status window_attention_workspace_bytes(const TensorRef& keys, const TensorRef& queries,
                                        std::int64_t nq, std::size_t& bytes) {
  if (Status e = check_views(keys, queries, nq); !e.ok()) return e;
  bytes = stats_bytes(shape_of(keys, queries, nq));
  return {};
}

Status window_attention(const cuda_backend& be, const TensorRef& keys, const TensorRef& queries,
                        GqaReduce reduce, std::int64_t nq, const MutableScoreView& out) {
  if (Status e = check_views(keys, queries, nq); !e.ok()) return e;
  if (Status e = check_out(out, keys); !e.ok()) return e;
  return run(be, keys, queries, shape_of(keys, queries, nq), reduce, false, out.data,
             out.row_stride);
}

namespace {
std::int64_t snap_w(const TensorRef& k, const SnapKV& p) {
  return p.window < k.tokens ? p.window : k.tokens;
}
Status check_snap(const TensorRef& k, const TensorRef& q, const SnapKV& p) {
  if (p.window < 1) return detail::invalid("snapkv window must be >= 1");
  if (p.kernel < 1 || p.kernel % 2 == 0) return detail::invalid("pooling kernel must be odd");
  return check_views(k, q, snap_w(k, p));
}
std::size_t colsum_bytes(const TensorRef& k) {
  return align256(static_cast<std::size_t>(k.layers * k.heads * k.tokens) * sizeof(float));
}
}  // namespace

Status snapkv_workspace_bytes(const TensorRef& keys, const TensorRef& queries,
                              const SnapKV& p, std::size_t& bytes) {
  if (Status e = check_snap(keys, queries, p); !e.ok()) return e;
  bytes = colsum_bytes(keys) + stats_bytes(shape_of(keys, queries, snap_w(keys, p)));
  return {};
}

Status snapkv_score(const cuda_backend& be, const TensorRef& keys, const TensorRef& queries,
                    const SnapKV& p, const MutableScoreView& out) {
  if (Status e = check_snap(keys, queries, p); !e.ok()) return e;
  if (Status e = check_out(out, keys); !e.ok()) return e;
  const std::int64_t w = snap_w(keys, p);
  const Shape s = shape_of(keys, queries, w);
  const std::size_t cb = colsum_bytes(keys);
  if (be.workspace_bytes < cb + stats_bytes(s))
    return {StatusCode::insufficient_workspace, 0, "below snapkv_workspace_bytes"};
  if (!be.workspace) return detail::invalid("null workspace");
  auto* colsum = static_cast<float*>(be.workspace);
  cuda_backend inner = be;
  inner.workspace = static_cast<unsigned char*>(be.workspace) + cb;
  inner.workspace_bytes = be.workspace_bytes - cb;
  if (Status e = run(inner, keys, queries, s, p.reduce, false, colsum, keys.tokens); !e.ok())
    return e;
  const std::int64_t rows = keys.layers * keys.heads;
  snapkv_pool_kernel<<<detail::grid_for(rows * keys.tokens, 256), 256, 0,
                       detail::stream_of(be.stream)>>>(colsum, rows, keys.tokens, w, p.kernel,
                                                       p.pool, out.data, out.row_stride);
  KVP_CUDA_TRY(cudaGetLastError());
  return {};
}

Status h2o_workspace_bytes(const TensorRef& keys, const TensorRef& queries, std::size_t& bytes) {
  return window_attention_workspace_bytes(keys, queries, queries.tokens, bytes);
}

Status h2o_score(const cuda_backend& be, const TensorRef& keys, const TensorRef& queries,
                 const H2O& p, const MutableScoreView& out) {
  if (Status e = check_views(keys, queries, queries.tokens); !e.ok()) return e;
  if (Status e = check_out(out, keys); !e.ok()) return e;
  return run(be, keys, queries, shape_of(keys, queries, queries.tokens), p.reduce, p.normalize,
             out.data, out.row_stride);
}

Status h2o_score_from_state(const cuda_backend& be, const float* accumulated,
                            const float* observed, std::int64_t state_stride, const H2O& p,
                            const MutableScoreView& out) {
  const bool normalize = p.normalize;
  if (out.layers < 0 || out.heads < 0 || out.tokens < 0)
    return detail::invalid("negative output extent");
  const std::int64_t rows = out.layers * out.heads;
  if (rows == 0 || out.tokens == 0) return {};
  if (!accumulated || !out.data) return detail::invalid("null accumulator or output pointer");
  if (normalize && !observed) return detail::invalid("normalize needs the observed counts");
  if (state_stride < out.tokens) return detail::invalid("state stride below tokens");
  if (out.row_stride < out.tokens) return detail::invalid("output row stride below tokens");
  h2o_state_kernel<<<detail::grid_for(rows * out.tokens, 256), 256, 0,
                     detail::stream_of(be.stream)>>>(accumulated, observed, state_stride,
                                                     normalize, rows, out.tokens, out.data,
                                                     out.row_stride);
  KVP_CUDA_TRY(cudaGetLastError());
  return {};
}

}  // namespace kvpolicy::cuda
