// Tile codecs of the KV quantizers (include/kvpolicy/cuda/quant.hpp). One thread block per
// (row, tile of `group` tokens): the tile's rows are loaded (fp32 or fp16 -> fp32), rotated by a
// warp-level FWHT (one warp per token, shuffles for stages < 32, registers above), staged in
// shared memory; keys are divided by their norm (one thread per token sums its row in double in
// index order); then one thread per key channel (quantize_block down the column) or per value
// group (quantize_group along the row) writes its block. The per-thread functions are
// quant/tile_kernel.hpp's, shared with the CPU tests.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "check.cuh"
#include "kvpolicy/cuda/quant.hpp"
#include "kvpolicy/quant/tile_kernel.hpp"

namespace kvpolicy::cuda {
namespace {

namespace q = kvpolicy::quant;
constexpr int kThreads = 256;

__device__ __forceinline__ float load_f(const float* p) { return *p; }
__device__ __forceinline__ float load_f(const __half* p) { return __half2float(*p); }

template <class Blk, int D, class T>
__global__ void __launch_bounds__(kThreads)
encode_tiles(const T* __restrict__ src, std::int64_t tokens, std::int64_t tiles, bool keys,
             bool rotate, bool token_norm, std::size_t row_bytes, std::size_t tile_bytes,
             unsigned char* __restrict__ packed) {
  constexpr int G = Blk::group, E = D / 32;
  extern __shared__ float sm[];  // the tile (tile_index layout), then [G] norms
  float* norms = sm + q::dev::tile_floats(D, G);
  const std::int64_t row = blockIdx.x / tiles, tile = blockIdx.x % tiles, t0 = tile * G;
  const int n = static_cast<int>(tokens - t0 < G ? tokens - t0 : G);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const T* in = src + (row * tokens + t0) * D;
  for (int t = warp; t < n; t += kThreads / 32) {
    float v[E];
#pragma unroll
    for (int e = 0; e < E; ++e) v[e] = load_f(in + static_cast<std::int64_t>(t) * D + e * 32 + lane);
    if (rotate) {
#pragma unroll
      for (int half = 1; half < 32; half *= 2)
#pragma unroll
        for (int e = 0; e < E; ++e)
          v[e] = q::dev::fwht_combine(v[e], __shfl_xor_sync(0xffffffffu, v[e], half), (lane & half) != 0);
      q::dev::fwht_thread_stages<E>(v);
      const float s = q::dev::fwht_scale(D);
#pragma unroll
      for (int e = 0; e < E; ++e) v[e] = __fmul_rn(v[e], s);
    }
#pragma unroll
    for (int e = 0; e < E; ++e) sm[q::dev::tile_index(keys, t, e * 32 + lane, D, G)] = v[e];
  }
  __syncthreads();
  unsigned char* out = packed + row * row_bytes + tile * tile_bytes;
  if (keys) {
    if (token_norm) {
      constexpr int S = D + 1;  // key_stride
      for (int t = threadIdx.x; t < G; t += kThreads) norms[t] = t < n ? q::dev::key_norm(sm + t * S, D) : 0.0f;
      __syncthreads();
      for (int i = threadIdx.x; i < n * S; i += kThreads) sm[i] = q::dev::normalize_key(sm[i], norms[i / S]);
      __syncthreads();
      float* nr = reinterpret_cast<float*>(out + D * sizeof(Blk));
      for (int t = threadIdx.x; t < G; t += kThreads) nr[t] = norms[t];
    }
    Blk* blocks = reinterpret_cast<Blk*>(out);
    for (int c = threadIdx.x; c < D; c += kThreads) {
      Blk b;
      q::dev::encode_key_channel(sm, n, D, c, b);
      blocks[c] = b;
    }
  } else {
    Blk* blocks = reinterpret_cast<Blk*>(out);
    for (int i = threadIdx.x; i < G * (D / G); i += kThreads) {
      Blk b;
      q::dev::encode_value_block(sm, n, D, i, b);
      blocks[i] = b;
    }
  }
}

template <class Blk, int D>
__global__ void __launch_bounds__(kThreads)
decode_tiles(const unsigned char* __restrict__ packed, std::int64_t tokens, std::int64_t tiles,
             bool keys, bool token_norm, std::size_t row_bytes, std::size_t tile_bytes,
             float* __restrict__ out, float* __restrict__ norms) {
  constexpr int G = Blk::group;
  const std::int64_t row = blockIdx.x / tiles, tile = blockIdx.x % tiles, t0 = tile * G;
  const int n = static_cast<int>(tokens - t0 < G ? tokens - t0 : G);
  const unsigned char* in = packed + row * row_bytes + tile * tile_bytes;
  const Blk* blocks = reinterpret_cast<const Blk*>(in);
  float* o = out + (row * tokens + t0) * D;
  if (keys) {
    for (int c = threadIdx.x; c < D; c += kThreads) q::dev::decode_key_channel(blocks[c], n, D, c, o);
    if (norms) {
      const float* nr = reinterpret_cast<const float*>(in + D * sizeof(Blk));
      for (int t = threadIdx.x; t < n; t += kThreads) norms[row * tokens + t0 + t] = token_norm ? nr[t] : 1.0f;
    }
  } else {
    for (int i = threadIdx.x; i < n * (D / G); i += kThreads) q::dev::decode_value_block(blocks[i], i, o);
  }
}

template <class F>
Status with_format(const QuantFormat& f, std::int64_t dim, F&& fn) {
  auto by_dim = [&](auto blk) -> Status {
    if (dim == 64) return fn(blk, std::integral_constant<int, 64>{});
    if (dim == 128) return fn(blk, std::integral_constant<int, 128>{});
    if (dim == 256) return fn(blk, std::integral_constant<int, 256>{});
    return detail::invalid("quant: dim must be 64, 128 or 256");
  };
  if (f.group > dim) return detail::invalid("quant: group exceeds dim");
  if (f.bits == 2) {
    if (f.group == 32) return by_dim(q::Block<2, 32>{});
    if (f.group == 64) return by_dim(q::Block<2, 64>{});
    if (f.group == 128) return by_dim(q::Block<2, 128>{});
  } else if (f.bits == 4) {
    if (f.group == 32) return by_dim(q::Block<4, 32>{});
    if (f.group == 64) return by_dim(q::Block<4, 64>{});
    if (f.group == 128) return by_dim(q::Block<4, 128>{});
  }
  return detail::invalid("quant: bits must be 2 or 4 and group 32, 64 or 128");
}

}  // namespace

Status quant_encode(const cuda_backend& be, const QuantFormat& f, bool keys, const void* src,
                    QuantInput in, std::int64_t rows, std::int64_t tokens, std::int64_t dim,
                    void* packed) {
  if (rows < 0 || tokens < 0) return detail::invalid("quant_encode: negative extent");
  return with_format(f, dim, [&](auto blk, auto dc) -> Status {
    using Blk = decltype(blk);
    constexpr int D = decltype(dc)::value, G = Blk::group;
    if (rows == 0 || tokens == 0) return {};
    if (!src || !packed) return detail::invalid("quant_encode: null pointer");
    const std::int64_t tiles = (tokens + G - 1) / G;
    if (rows * tiles > 0x7fffffff) return detail::invalid("quant_encode: too many tiles");
    const std::size_t row_bytes = quant_row_bytes(f, keys, tokens, dim);
    const std::size_t tile_bytes = quant_row_bytes(f, keys, G, dim);
    const std::size_t smem = static_cast<std::size_t>(q::dev::tile_floats(D, G) + G) * sizeof(float);
    auto launch = [&](auto kernel, const auto* s) -> Status {
      KVP_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
      kernel<<<static_cast<unsigned>(rows * tiles), kThreads, smem, detail::stream_of(be.stream)>>>(
          s, tokens, tiles, keys, f.rotate, f.token_norm, row_bytes, tile_bytes,
          static_cast<unsigned char*>(packed));
      KVP_CUDA_TRY(cudaGetLastError());
      return {};
    };
    if (in == QuantInput::f16) return launch(encode_tiles<Blk, D, __half>, static_cast<const __half*>(src));
    return launch(encode_tiles<Blk, D, float>, static_cast<const float*>(src));
  });
}

Status quant_decode(const cuda_backend& be, const QuantFormat& f, bool keys, const void* packed,
                    std::int64_t rows, std::int64_t tokens, std::int64_t dim, float* out,
                    float* norms) {
  if (rows < 0 || tokens < 0) return detail::invalid("quant_decode: negative extent");
  return with_format(f, dim, [&](auto blk, auto dc) -> Status {
    using Blk = decltype(blk);
    constexpr int D = decltype(dc)::value, G = Blk::group;
    if (rows == 0 || tokens == 0) return {};
    if (!packed || !out) return detail::invalid("quant_decode: null pointer");
    const std::int64_t tiles = (tokens + G - 1) / G;
    if (rows * tiles > 0x7fffffff) return detail::invalid("quant_decode: too many tiles");
    decode_tiles<Blk, D><<<static_cast<unsigned>(rows * tiles), kThreads, 0, detail::stream_of(be.stream)>>>(
        static_cast<const unsigned char*>(packed), tokens, tiles, keys, f.token_norm,
        quant_row_bytes(f, keys, tokens, dim), quant_row_bytes(f, keys, G, dim), out, norms);
    KVP_CUDA_TRY(cudaGetLastError());
    return {};
  });
}

}  // namespace kvpolicy::cuda
