// CUDA tile codecs of the KV quantizers (int2 / int4 with Hadamard rotation and key norm, kivi):
// the device twin of quant::BasicQuantizer's encode (quantizer.hpp), giving the same packed
// bytes. Layout as BasicQuantizer: rows = layers * heads contiguous source rows [rows][tokens]
// [dim]; row r's packed part at byte r * quant_row_bytes(...), ceil(tokens / group) tiles each.
// Decoding gives the stored form (rotated, key rows divided by their norm) plus the norms, as
// quantizer.hpp's decode_key_tile / decode_value_tile. Per-thread logic: quant/tile_kernel.hpp.
// Kernels: cuda/quant.cu (head_dim 64, 128, 256 as template constants). No CUDA headers here.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kvpolicy/core/backend.hpp"
#include "kvpolicy/core/error.hpp"
#include "kvpolicy/cuda/status.hpp"

namespace kvpolicy::cuda {

struct QuantFormat {
  int bits = 2;   // 2 or 4
  int group = 32; // 32, 64 or 128 (<= dim, divides it)
  bool rotate = true;
  bool token_norm = true;  // keys only
};

enum class QuantInput : std::uint8_t { f32, f16 };  // f16: IEEE binary16 (__half / kvpolicy::half)

// Bytes of one row of `tokens` tokens (keys: blocks + norms per tile; values: blocks).
inline std::size_t quant_row_bytes(const QuantFormat& f, bool keys, std::int64_t tokens,
                                   std::int64_t dim) {
  const std::int64_t tiles = (tokens + f.group - 1) / f.group;
  const std::size_t block = static_cast<std::size_t>(8 + f.group * f.bits / 8);
  std::size_t tile = static_cast<std::size_t>(dim) * block;
  if (keys && f.token_norm) tile += static_cast<std::size_t>(f.group) * sizeof(float);
  return static_cast<std::size_t>(tiles) * tile;
}

// Encodes keys (keys = true) or values of src (device, [rows][tokens][dim] of `in`) into packed
// (device, rows * quant_row_bytes bytes). dim: 64, 128 or 256.
Status quant_encode(const cuda_backend& be, const QuantFormat& f, bool keys, const void* src,
                    QuantInput in, std::int64_t rows, std::int64_t tokens, std::int64_t dim,
                    void* packed);

// Decodes packed (device) into the stored form out [rows][tokens][dim] (device fp32); key norms
// into norms [rows][tokens] when keys and norms != nullptr (1 without token_norm).
Status quant_decode(const cuda_backend& be, const QuantFormat& f, bool keys, const void* packed,
                    std::int64_t rows, std::int64_t tokens, std::int64_t dim, float* out,
                    float* norms);

// Throwing wrappers.
inline void encode(const cuda_backend& be, const QuantFormat& f, bool keys, const void* src,
                   QuantInput in, std::int64_t rows, std::int64_t tokens, std::int64_t dim,
                   void* packed) {
  KVP_REQUIRE(rows >= 0 && tokens >= 0, "cuda::quant encode: negative extent");
  throw_if_error(quant_encode(be, f, keys, src, in, rows, tokens, dim, packed), "cuda::quant encode");
}
inline void decode(const cuda_backend& be, const QuantFormat& f, bool keys, const void* packed,
                   std::int64_t rows, std::int64_t tokens, std::int64_t dim, float* out,
                   float* norms = nullptr) {
  KVP_REQUIRE(rows >= 0 && tokens >= 0, "cuda::quant decode: negative extent");
  throw_if_error(quant_decode(be, f, keys, packed, rows, tokens, dim, out, norms), "cuda::quant decode");
}

}  // namespace kvpolicy::cuda
