// Split-KV decode attention over packed caches (include/kvpolicy/cuda/decode_packed.hpp).
// Pass 1: one block of D threads per (KV head, split of a multiple of `group` tokens); pass 2:
// one block of D threads per query row (merge of the splits, then the inverse rotation). The
// per-thread math is kvpolicy/cuda/decode_math.hpp's and quant/tile_kernel.hpp's, driven on the
// host by tests/agreement/test_decode_cuda.cpp.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "check.cuh"
#include "kvpolicy/cuda/decode_math.hpp"
#include "kvpolicy/cuda/decode_packed.hpp"
#include "kvpolicy/quant/tile_kernel.hpp"

namespace kvpolicy::cuda {
namespace {

namespace dm = kvpolicy::cuda::decode_math;
namespace q = kvpolicy::quant;

__device__ __forceinline__ float query_at(const TensorRef& v, std::int64_t h, std::int64_t t,
                                          std::int64_t c) {
  const std::int64_t o = h * v.stride_head + t * v.stride_token + c * v.stride_dim;
  switch (v.dtype) {
    case DType::f16: return __half2float(static_cast<const __half*>(v.data)[o]);
    case DType::bf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(v.data)[o]);
    default: return static_cast<const float*>(v.data)[o];
  }
}

template <int D, class Blk>
__global__ void __launch_bounds__(D)
packed_partial(PackedHeadsView c, TensorRef queries, PackedDecodeArgs a, float scale,
               std::int64_t g, std::int64_t split, std::int64_t splits, dm::Workspace w) {
  constexpr int G = Blk::group;
  extern __shared__ float smem[];
  const std::int64_t nq = queries.tokens;
  const int R = static_cast<int>(g * nq), tid = threadIdx.x;
  const std::int64_t h = blockIdx.x / splits, s = blockIdx.x % splits;
  const std::int64_t tile0 = c.tile_offset[h], res0 = c.res_offset[h];
  const std::int64_t packed = (c.tile_offset[h + 1] - tile0) * G;
  const std::int64_t len = packed + c.res_offset[h + 1] - res0, s0 = s * split;
  const std::int64_t s1 = s0 + split < len ? s0 + split : len;
  const dm::BlockSmem sm = dm::carve(smem, R, D, G);
  for (int x = tid; x < R * D; x += D)
    sm.qs[x] = query_at(queries, h * g + x / D / nq, (x / D) % nq, x % D) * scale;
  dm::phase_init(sm, R, D, tid, D);
  __syncthreads();
  if (c.rotate) {
    for (int half = 1; half < D; half *= 2) {
      for (int p = tid; p < R * (D / 2); p += D) dm::fwht_pair(sm.qs + (p / (D / 2)) * D, half, p % (D / 2));
      __syncthreads();
    }
    const float n = dm::fwht_norm(D);
    for (int x = tid; x < R * D; x += D) sm.qs[x] *= n;
  }
  const float* bias = a.bias ? a.bias + h * a.bias_stride : nullptr;
  const std::int64_t row0 = h * g * nq;
  __syncthreads();
  for (std::int64_t t0 = s0; t0 < s1; t0 += G) {
    const int n = static_cast<int>(s1 - t0 < G ? s1 - t0 : G);
    if (t0 < packed) {  // a whole tile (splits are multiples of G, packed too)
      const std::int64_t tile = tile0 + t0 / G;
      const unsigned char* kt = c.key_tiles + tile * c.key_tile_bytes;
      const Blk* kb = reinterpret_cast<const Blk*>(kt);
      const Blk* vb = reinterpret_cast<const Blk*>(c.value_tiles + tile * c.value_tile_bytes);
      for (int ch = tid; ch < D; ch += D) {
        const Blk kblk = kb[ch], vblk = vb[ch];
        q::dev::decode_key_channel(kblk, G, dm::kt_stride(D), ch, sm.kt);  // d: the row stride
        q::dev::decode_value_block(vblk, ch, sm.vt);
      }
      const float* nr = reinterpret_cast<const float*>(kt + D * sizeof(Blk));
      for (int t = tid; t < G; t += D) sm.norms[t] = c.token_norm ? nr[t] : 1.0f;
    } else {
      const std::int64_t r = res0 + (t0 - packed);
      for (int x = tid; x < n * D; x += D) {
        sm.kt[(x / D) * dm::kt_stride(D) + x % D] = c.res_keys[r * D + x];
        sm.vt[x] = c.res_values[r * D + x];
      }
      for (int t = tid; t < n; t += D) sm.norms[t] = c.res_norms[r + t];
    }
    __syncthreads();
    for (int x = tid; x < R * G; x += D) {
      const int r = x / G, j = x % G;
      const std::int64_t vis = dm::visible_keys(len, nq, r % nq, a.causal);
      sm.lg[x] = dm::tile_logit(sm, D, r, j, n, t0, vis, bias, sm.norms);
    }
    __syncthreads();
    for (int r = tid; r < R; r += D) sm.tp[r] = dm::tile_part(sm.lg + r * G, G);
    __syncthreads();
    dm::fold_channel(sm, R, D, G, n, tid);
    __syncthreads();
    for (int r = tid; r < R; r += D) dm::fold_state(sm, r);
    __syncthreads();
  }
  for (int r = tid; r < R; r += D) w.part_stat[(row0 + r) * splits + s] = sm.state[r];
  for (int x = tid; x < R * D; x += D)
    w.part_acc[((row0 + x / D) * splits + s) * D + x % D] = sm.acc[x];
}

template <int D>
__global__ void __launch_bounds__(D)
packed_merge(dm::Workspace w, std::int64_t splits, bool rotate, float* out) {
  __shared__ float row[D];
  const std::int64_t r = blockIdx.x;
  dm::merge_channel(w, r, splits, D, threadIdx.x, row);
  __syncthreads();
  if (rotate) {
    for (int half = 1; half < D; half *= 2) {
      if (threadIdx.x < D / 2) dm::fwht_pair(row, half, threadIdx.x);
      __syncthreads();
    }
    out[r * D + threadIdx.x] = row[threadIdx.x] * dm::fwht_norm(D);
  } else {
    out[r * D + threadIdx.x] = row[threadIdx.x];
  }
}

std::int64_t split_of(const PackedHeadsView& c, const PackedDecodeArgs& a) {
  if (a.split > 0) return a.split;
  const std::int64_t want_blocks = 4 * 132;
  const std::int64_t per_head = (want_blocks + c.heads - 1) / c.heads;
  std::int64_t split = (c.max_tokens + per_head - 1) / per_head;
  split = (split + c.group - 1) / c.group * c.group;
  return split < 4 * c.group ? 4 * c.group : split;
}

template <int D, class Blk>
Status launch(const cuda_backend& be, const PackedHeadsView& c, const TensorRef& queries,
              const PackedDecodeArgs& a, float* out) {
  cudaStream_t st = detail::stream_of(be.stream);
  const std::int64_t g = queries.heads / c.heads, nq = queries.tokens, rows = queries.heads * nq;
  const std::int64_t split = split_of(c, a), splits = dm::split_count(c.max_tokens, split);
  const dm::Workspace w = dm::carve_workspace(static_cast<float*>(be.workspace), rows, splits, D, false);
  const std::size_t smem =
      static_cast<std::size_t>(dm::smem_floats(static_cast<int>(g * nq), D, Blk::group)) * sizeof(float);
  int dev = 0, optin = 0;
  KVP_CUDA_TRY(cudaGetDevice(&dev));
  KVP_CUDA_TRY(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  if (smem > static_cast<std::size_t>(optin))
    return detail::invalid("packed decode attention: group size * n_q too large for shared memory");
  auto* k1 = packed_partial<D, Blk>;
  KVP_CUDA_TRY(cudaFuncSetAttribute(k1, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  k1<<<static_cast<unsigned>(c.heads * splits), D, smem, st>>>(
      c, queries, a, 1.0f / sqrtf(static_cast<float>(D)), g, split, splits, w);
  KVP_CUDA_TRY(cudaGetLastError());
  packed_merge<D><<<static_cast<unsigned>(rows), D, 0, st>>>(w, splits, c.rotate, out);
  KVP_CUDA_TRY(cudaGetLastError());
  return {};
}

template <int D, int Bits>
Status by_group(const cuda_backend& be, const PackedHeadsView& c, const TensorRef& q,
                const PackedDecodeArgs& a, float* out) {
  switch (c.group) {
    case 32: return launch<D, quant::Block<Bits, 32>>(be, c, q, a, out);
    case 64: return launch<D, quant::Block<Bits, 64>>(be, c, q, a, out);
    default:
      if constexpr (D >= 128) return launch<D, quant::Block<Bits, 128>>(be, c, q, a, out);
      return detail::invalid("packed decode attention: group above head_dim");
  }
}

template <int D>
Status by_bits(const cuda_backend& be, const PackedHeadsView& c, const TensorRef& q,
               const PackedDecodeArgs& a, float* out) {
  return c.bits == 2 ? by_group<D, 2>(be, c, q, a, out) : by_group<D, 4>(be, c, q, a, out);
}

Status check(const PackedHeadsView& c, const TensorRef& queries, const PackedDecodeArgs& a) {
  if (c.heads <= 0 || queries.heads % c.heads != 0 || queries.tokens < 1 || queries.dim != c.dim)
    return detail::invalid("packed decode attention: bad shapes");
  if (c.dim != 64 && c.dim != 128 && c.dim != 256)
    return detail::invalid("packed decode attention: head_dim must be 64, 128 or 256");
  if ((c.bits != 2 && c.bits != 4) || (c.group != 32 && c.group != 64 && c.group != 128) ||
      c.group > c.dim)
    return detail::invalid("packed decode attention: unsupported bits / group");
  if (a.split < 0 || a.split % c.group != 0)
    return detail::invalid("packed decode attention: split must be a multiple of group");
  return {};
}

}  // namespace

Status packed_decode_workspace_bytes(const PackedHeadsView& c, const TensorRef& queries,
                                     const PackedDecodeArgs& a, std::size_t& bytes) {
  if (Status s = check(c, queries, a); !s.ok()) return s;
  const std::int64_t splits = dm::split_count(c.max_tokens, split_of(c, a));
  bytes = static_cast<std::size_t>(
              dm::workspace_floats(queries.heads * queries.tokens, splits, c.dim, 0, false)) *
          sizeof(float);
  return {};
}

Status packed_decode_attention(const cuda_backend& be, const PackedHeadsView& c,
                               const TensorRef& queries, const PackedDecodeArgs& a, float* out) {
  std::size_t need = 0;
  if (Status s = packed_decode_workspace_bytes(c, queries, a, need); !s.ok()) return s;
  if (!queries.data || !out || !c.tile_offset || !c.res_offset)
    return detail::invalid("packed decode attention: null pointer");
  if (be.workspace_bytes < need || !be.workspace)
    return {StatusCode::insufficient_workspace, 0, "packed decode attention: workspace too small"};
  switch (c.dim) {
    case 64: return by_bits<64>(be, c, queries, a, out);
    case 128: return by_bits<128>(be, c, queries, a, out);
    default: return by_bits<256>(be, c, queries, a, out);
  }
}

}  // namespace kvpolicy::cuda
