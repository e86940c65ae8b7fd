// Split-KV decode attention over packed caches on the device: the twin of
// quant::packed_attention (quant/attention.hpp) for one layer of Hkv PackedCaches. Same three-pass
// structure as cuda/decode.hpp (the statistics pass excepted): per (KV head, split) block the
// query rows are pre-scaled and rotated (FWHT in shared memory), each tile of `group` tokens is
// dequantized into shared memory with quant/tile_kernel.hpp's decode_key_channel /
// decode_value_block (stored form: rotated keys divided by their norm, rotated values), the
// residual's fp32 rows are read in chunks of `group`; logit = (q . k~) n + bias; the splits are
// merged per row and the output is rotated back. Kernels: cuda/decode_packed.cu.
//
// Device layout (PackedHeadsView): the heads' key tiles back to back (head h's from tile
// tile_offset[h], each key_tile_bytes as PackedCache stores it: d blocks, then `group` fp32 norms
// with token_norm), the value tiles likewise, the residual rows of all heads concatenated
// (head h's from row res_offset[h]); flatten() builds that image on the host.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kvpolicy/core/backend.hpp"
#include "kvpolicy/cuda/score_launch.hpp"  // TensorRef, DType
#include "kvpolicy/cuda/status.hpp"

namespace kvpolicy::cuda {

struct PackedHeadsView {
  int bits = 2, group = 32;  // 2 or 4; 32, 64 or 128 (<= dim)
  bool rotate = true, token_norm = true;
  std::int64_t heads = 0, dim = 0;
  std::int64_t max_tokens = 0;  // max size() over the heads (sizes the grid and the bias)
  std::size_t key_tile_bytes = 0, value_tile_bytes = 0;
  const unsigned char* key_tiles = nullptr;
  const unsigned char* value_tiles = nullptr;
  const std::int64_t* tile_offset = nullptr;  // [heads + 1], device
  const float* res_keys = nullptr;            // [rows][dim]
  const float* res_values = nullptr;          // [rows][dim]
  const float* res_norms = nullptr;           // [rows]
  const std::int64_t* res_offset = nullptr;   // [heads + 1], device
};

struct PackedDecodeArgs {
  const float* bias = nullptr;  // optional [Hkv][bias_stride], cache order (packed, residual)
  std::int64_t bias_stride = 0;
  bool causal = false;
  std::int64_t split = 0;  // tokens per split, a multiple of group; 0: chosen from the shape
};

// queries: [1][Hq][n_q][dim] (device), any element type; out: device fp32 [Hq][n_q][dim].
Status packed_decode_workspace_bytes(const PackedHeadsView& cache, const TensorRef& queries,
                                     const PackedDecodeArgs& args, std::size_t& bytes);
Status packed_decode_attention(const cuda_backend& be, const PackedHeadsView& cache,
                               const TensorRef& queries, const PackedDecodeArgs& args,
                               float* out);

}  // namespace kvpolicy::cuda

#if !defined(__CUDACC__)
#include <algorithm>
#include <cstring>
#include <span>
#include <vector>

#include "kvpolicy/quant/packed_cache.hpp"

namespace kvpolicy::cuda {

// Host image of Hkv packed caches in the device layout above (upload each vector as bytes, then
// fill the PackedHeadsView pointers with view()).
struct PackedImage {
  quant::QuantConfig config;
  std::int64_t heads = 0, dim = 0, max_tokens = 0;
  std::size_t key_tile_bytes = 0, value_tile_bytes = 0;
  std::vector<unsigned char> key_tiles, value_tiles;
  std::vector<std::int64_t> tile_offset, res_offset;
  std::vector<float> res_keys, res_values, res_norms;

  PackedHeadsView view(const void* kt, const void* vt, const void* toff, const void* rk,
                       const void* rv, const void* rn, const void* roff) const {
    PackedHeadsView v;
    v.bits = config.bits;
    v.group = config.group;
    v.rotate = config.rotate;
    v.token_norm = config.token_norm;
    v.heads = heads;
    v.dim = dim;
    v.max_tokens = max_tokens;
    v.key_tile_bytes = key_tile_bytes;
    v.value_tile_bytes = value_tile_bytes;
    v.key_tiles = static_cast<const unsigned char*>(kt);
    v.value_tiles = static_cast<const unsigned char*>(vt);
    v.tile_offset = static_cast<const std::int64_t*>(toff);
    v.res_keys = static_cast<const float*>(rk);
    v.res_values = static_cast<const float*>(rv);
    v.res_norms = static_cast<const float*>(rn);
    v.res_offset = static_cast<const std::int64_t*>(roff);
    return v;
  }
};

inline PackedImage flatten(std::span<const quant::PackedCache> heads) {
  KVP_REQUIRE(!heads.empty(), "cuda::flatten: no KV heads");
  PackedImage im;
  im.config = heads[0].config();
  im.heads = static_cast<std::int64_t>(heads.size());
  im.dim = heads[0].head_dim();
  im.key_tile_bytes = heads[0].key_tile_size();
  im.value_tile_bytes = heads[0].value_tile_size();
  im.tile_offset.push_back(0);
  im.res_offset.push_back(0);
  for (const quant::PackedCache& c : heads) {
    KVP_REQUIRE(c.config() == im.config && c.head_dim() == im.dim,
                "cuda::flatten: KV heads with different configurations");
    im.max_tokens = std::max(im.max_tokens, c.size());
    const std::size_t kb = static_cast<std::size_t>(c.tiles()) * im.key_tile_bytes;
    const std::size_t vb = static_cast<std::size_t>(c.tiles()) * im.value_tile_bytes;
    const std::size_t k0 = im.key_tiles.size(), v0 = im.value_tiles.size();
    im.key_tiles.resize(k0 + kb);
    im.value_tiles.resize(v0 + vb);
    if (kb) std::memcpy(im.key_tiles.data() + k0, c.key_tile(0), kb);
    if (vb) std::memcpy(im.value_tiles.data() + v0, c.value_tile(0), vb);
    im.tile_offset.push_back(im.tile_offset.back() + c.tiles());
    const std::int64_t r = c.residual_tokens();
    im.res_keys.insert(im.res_keys.end(), c.residual_keys(), c.residual_keys() + r * im.dim);
    im.res_values.insert(im.res_values.end(), c.residual_values(),
                         c.residual_values() + r * im.dim);
    im.res_norms.insert(im.res_norms.end(), c.residual_norms(), c.residual_norms() + r);
    im.res_offset.push_back(im.res_offset.back() + r);
  }
  return im;
}

}  // namespace kvpolicy::cuda
#endif
