// Split-KV decode attention (include/kvpolicy/cuda/decode.hpp). Pass 1: one block of D threads
// per (KV head, split); pass 2: one block of D threads per query row; pass 3 (H2O statistics):
// one thread per (KV head, key). The per-thread math is kvpolicy/cuda/decode_math.hpp's, which
// the CPU tests drive in a host emulation of these grids. Deterministic: fixed reduction orders,
// no atomics.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "check.cuh"
#include "kvpolicy/cuda/decode.hpp"
#include "kvpolicy/cuda/decode_math.hpp"

namespace kvpolicy::cuda {
namespace {

namespace dm = kvpolicy::cuda::decode_math;

__device__ __forceinline__ float ld(const float* p) { return *p; }
__device__ __forceinline__ float ld(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ float ld(const __nv_bfloat16* p) { return __bfloat162float(*p); }

// Element (head h, token t, channel c) of a one-layer view.
template <class T>
__device__ __forceinline__ float at(const TensorRef& v, std::int64_t h, std::int64_t t,
                                    std::int64_t c) {
  return ld(static_cast<const T*>(v.data) + h * v.stride_head + t * v.stride_token +
            c * v.stride_dim);
}

template <int D, class T, class Q>
__global__ void __launch_bounds__(D)
decode_partial(TensorRef keys, TensorRef values, TensorRef queries, DecodeArgs a, float scale,
               std::int64_t g, std::int64_t split, std::int64_t splits, dm::Workspace w) {
  constexpr int TK = dm::key_tile(D);
  extern __shared__ float smem[];
  const std::int64_t nq = queries.tokens, tokens = keys.tokens;
  const int R = static_cast<int>(g * nq), tid = threadIdx.x;
  const std::int64_t h = blockIdx.x / splits, s = blockIdx.x % splits;
  const std::int64_t len = a.lengths[h], s0 = s * split;
  const std::int64_t s1 = s0 + split < len ? s0 + split : len;
  const dm::BlockSmem sm = dm::carve(smem, R, D, TK);
  for (int x = tid; x < R * D; x += D) {
    const int r = x / D, c = x % D;
    sm.qs[x] = at<Q>(queries, h * g + r / nq, r % nq, c) * scale;
  }
  dm::phase_init(sm, R, D, tid, D);
  const float* bias = a.bias ? a.bias + h * a.bias_stride : nullptr;
  const std::int64_t row0 = h * g * nq;  // global row of local row 0
  __syncthreads();
  for (std::int64_t t0 = s0; t0 < s1; t0 += TK) {
    const int n = static_cast<int>(s1 - t0 < TK ? s1 - t0 : TK);
    for (int x = tid; x < n * D; x += D) {
      const int j = x / D, c = x % D;
      sm.kt[j * dm::kt_stride(D) + c] = at<T>(keys, h, t0 + j, c);
      sm.vt[x] = at<T>(values, h, t0 + j, c);
    }
    __syncthreads();
    for (int x = tid; x < R * TK; x += D) {
      const int r = x / TK, j = x % TK;
      const std::int64_t vis = dm::visible_keys(len, nq, r % nq, a.causal);
      const float l = dm::tile_logit(sm, D, r, j, n, t0, vis, bias);
      sm.lg[x] = l;
      if (w.logits && j < n) w.logits[(row0 + r) * tokens + t0 + j] = l;
    }
    __syncthreads();
    for (int r = tid; r < R; r += D) sm.tp[r] = dm::tile_part(sm.lg + r * TK, TK);
    __syncthreads();
    dm::fold_channel(sm, R, D, TK, n, tid);
    __syncthreads();
    for (int r = tid; r < R; r += D) dm::fold_state(sm, r);
    __syncthreads();
  }
  for (int r = tid; r < R; r += D) w.part_stat[(row0 + r) * splits + s] = sm.state[r];
  for (int x = tid; x < R * D; x += D) {
    const int r = x / D, c = x % D;
    w.part_acc[((row0 + r) * splits + s) * D + c] = sm.acc[x];
  }
}

template <int D>
__global__ void __launch_bounds__(D)
decode_merge(dm::Workspace w, std::int64_t splits, float* out) {
  const std::int64_t row = blockIdx.x;
  const dm::SoftmaxPart f = dm::merge_channel(w, row, splits, D, threadIdx.x, out + row * D);
  if (threadIdx.x == 0) w.final_stat[row] = f;
}

__global__ void decode_stats(dm::Workspace w, const std::int64_t* lengths, std::int64_t g,
                             std::int64_t nq, std::int64_t tokens, bool causal, float acc_scale,
                             float* accumulate, float* observed, std::int64_t state_stride,
                             std::int64_t kv_heads) {
  const std::int64_t n = kv_heads * tokens;
  for (std::int64_t x = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; x < n;
       x += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t h = x / tokens, j = x % tokens;
    dm::key_stats(w, h, j, lengths[h], g, nq, tokens, causal, acc_scale,
                  accumulate ? accumulate + h * state_stride : nullptr,
                  observed ? observed + h * state_stride : nullptr);
  }
}

std::int64_t split_of(const TensorRef& keys, const DecodeArgs& a) {
  return a.split > 0 ? a.split : decode_default_split(keys.heads, keys.tokens, keys.dim);
}

bool stats_wanted(const DecodeArgs& a) { return a.accumulate || a.observed; }

template <int D, class T, class Q>
Status launch(const cuda_backend& be, const TensorRef& keys, const TensorRef& values,
              const TensorRef& queries, const DecodeArgs& a, float* out) {
  cudaStream_t st = detail::stream_of(be.stream);
  const std::int64_t g = queries.heads / keys.heads, nq = queries.tokens;
  const std::int64_t rows = queries.heads * nq, split = split_of(keys, a);
  const std::int64_t splits = dm::split_count(keys.tokens, split);
  const dm::Workspace w =
      dm::carve_workspace(static_cast<float*>(be.workspace), rows, splits, D, stats_wanted(a));
  const std::size_t smem =
      static_cast<std::size_t>(dm::smem_floats(static_cast<int>(g * nq), D, dm::key_tile(D))) * sizeof(float);
  int dev = 0, optin = 0;
  KVP_CUDA_TRY(cudaGetDevice(&dev));
  KVP_CUDA_TRY(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  if (smem > static_cast<std::size_t>(optin))
    return detail::invalid("decode attention: group size * n_q too large for shared memory");
  auto* k1 = decode_partial<D, T, Q>;
  KVP_CUDA_TRY(cudaFuncSetAttribute(k1, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem)));
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  k1<<<static_cast<unsigned>(keys.heads * splits), D, smem, st>>>(keys, values, queries, a,
                                                                   scale, g, split, splits, w);
  KVP_CUDA_TRY(cudaGetLastError());
  decode_merge<D><<<static_cast<unsigned>(rows), D, 0, st>>>(w, splits, out);
  KVP_CUDA_TRY(cudaGetLastError());
  if (stats_wanted(a)) {
    const std::int64_t n = keys.heads * keys.tokens;
    decode_stats<<<detail::grid_for(n, 256), 256, 0, st>>>(w, a.lengths, g, nq, keys.tokens,
                                                          a.causal, a.acc_scale, a.accumulate,
                                                          a.observed, a.state_stride,
                                                          keys.heads);
    KVP_CUDA_TRY(cudaGetLastError());
  }
  return {};
}

template <int D, class T>
Status by_query(const cuda_backend& be, const TensorRef& k, const TensorRef& v,
                const TensorRef& q, const DecodeArgs& a, float* out) {
  switch (q.dtype) {
    case DType::f32: return launch<D, T, float>(be, k, v, q, a, out);
    case DType::f16: return launch<D, T, __half>(be, k, v, q, a, out);
    case DType::bf16: return launch<D, T, __nv_bfloat16>(be, k, v, q, a, out);
  }
  return detail::invalid("decode attention: unknown query element type");
}

template <int D>
Status by_cache(const cuda_backend& be, const TensorRef& k, const TensorRef& v,
                const TensorRef& q, const DecodeArgs& a, float* out) {
  switch (k.dtype) {
    case DType::f32: return by_query<D, float>(be, k, v, q, a, out);
    case DType::f16: return by_query<D, __half>(be, k, v, q, a, out);
    case DType::bf16: return by_query<D, __nv_bfloat16>(be, k, v, q, a, out);
  }
  return detail::invalid("decode attention: unknown cache element type");
}

Status check_shapes(const TensorRef& keys, const TensorRef& queries, const DecodeArgs& a) {
  if (keys.heads <= 0 || queries.heads % keys.heads != 0 || queries.tokens < 1 ||
      queries.dim != keys.dim || keys.tokens < 0)
    return detail::invalid("decode attention: bad shapes");
  if (keys.dim != 64 && keys.dim != 128 && keys.dim != 256)
    return detail::invalid("decode attention: head_dim must be 64, 128 or 256");
  if (a.split < 0 || (a.split > 0 && a.split % dm::key_tile(static_cast<int>(keys.dim)) != 0))
    return detail::invalid("decode attention: split must be a multiple of 4096 / head_dim");
  return {};
}

}  // namespace

std::int64_t decode_default_split(std::int64_t kv_heads, std::int64_t tokens, std::int64_t dim) {
  const std::int64_t tk = dm::key_tile(static_cast<int>(dim));
  const std::int64_t want_blocks = 4 * 132;  // about four blocks per SM of an H100 / H200
  std::int64_t per_head = (want_blocks + kv_heads - 1) / (kv_heads > 0 ? kv_heads : 1);
  std::int64_t split = (tokens + per_head - 1) / (per_head > 0 ? per_head : 1);
  split = (split + tk - 1) / tk * tk;
  const std::int64_t min_split = 4 * tk;  // fewer keys per block than this is all overhead
  return split < min_split ? min_split : split;
}

Status decode_workspace_bytes(const TensorRef& keys, const TensorRef& queries,
                              const DecodeArgs& args, std::size_t& bytes) {
  if (Status s = check_shapes(keys, queries, args); !s.ok()) return s;
  const std::int64_t rows = queries.heads * queries.tokens;
  const std::int64_t splits = dm::split_count(keys.tokens, split_of(keys, args));
  bytes = static_cast<std::size_t>(
              dm::workspace_floats(rows, splits, keys.dim, keys.tokens, stats_wanted(args))) *
          sizeof(float);
  return {};
}

Status decode_attention(const cuda_backend& be, const TensorRef& keys, const TensorRef& values,
                        const TensorRef& queries, const DecodeArgs& args, float* out) {
  std::size_t need = 0;
  if (Status s = decode_workspace_bytes(keys, queries, args, need); !s.ok()) return s;
  if (!keys.data || !values.data || !queries.data || !args.lengths || !out)
    return detail::invalid("decode attention: null pointer");
  if (be.workspace_bytes < need || (need && !be.workspace))
    return {StatusCode::insufficient_workspace, 0, "decode attention: workspace too small"};
  switch (keys.dim) {
    case 64: return by_cache<64>(be, keys, values, queries, args, out);
    case 128: return by_cache<128>(be, keys, values, queries, args, out);
    default: return by_cache<256>(be, keys, values, queries, args, out);
  }
}

}  // namespace kvpolicy::cuda
