// Per-thread pieces of the CUDA tile codecs (cuda/quant.cu), KVP_HD and free of CUDA headers so
// the CPU tests drive exactly this logic in a host loop that emulates the grid
// (tests/agreement/test_quant_cuda.cpp). They reproduce the CPU quantizer's bytes
// (quantizer.hpp: prepare_keys / prepare_values, encode_key_tile, encode_value_tile):
//
// - Rotation: a warp-level FWHT. A row of D = 32 E values sits in a warp as v[e] = x[e * 32 +
//   lane]. Stages half = 1 .. 16 pair lanes (lane ^ half, a shuffle): fwht_combine; stages
//   half = 32 .. D / 2 pair registers e and e ^ (half / 32) in one lane: fwht_thread_stages.
//   Every butterfly is hadamard_butterfly's (a + b, a - b) on the same operands, and the host's
//   result does not depend on the order the stages are walked (hadamard.hpp), so the bits agree.
//   Then * (1 / sqrtf(D)), one rounding, as hadamard_unchecked.
// - Key norm: the sum of squares in double in index order (row_norms), then sqrt, then fp32.
//   The products float * float are exact in double, so a fused multiply-add (nvcc contracts
//   s + x * x by default) rounds once exactly as the separate add: contraction cannot change it.
// - Codes: quantize_block / quantize_group from block.hpp, unchanged. They use divisions and
//   separate adds / subtractions only (no a * b + c that nvcc could contract), and device `/` and
//   sqrtf are IEEE round-to-nearest unless built with -use_fast_math (never for this library).
#pragma once
#include <math.h>

#include <cstdint>

#include "kvpolicy/core/config.hpp"
#include "kvpolicy/quant/block.hpp"
#include "kvpolicy/quant/hadamard.hpp"

namespace kvpolicy::quant::dev {

// One lane's side of a cross-lane butterfly: the lower lane (bit `half` of lane clear) keeps
// a + b, the upper one a - b where a is the lower lane's value.
KVP_HD inline float fwht_combine(float self, float partner, bool upper) {
  return upper ? partner - self : self + partner;
}

// Stages half = 32 .. 32 (E / 2) within one lane: v[e] holds x[e * 32 + lane].
template <int E>
KVP_HD inline void fwht_thread_stages(float* v) {
  for (int h = 1; h < E; h *= 2)
    for (int e = 0; e < E; ++e)
      if ((e & h) == 0) hadamard_butterfly(v[e], v[e + h]);
}

// The orthonormal scale of hadamard_unchecked.
KVP_HD inline float fwht_scale(int d) { return 1.0f / sqrtf(static_cast<float>(d)); }

// ||row|| as row_norms computes it (d contiguous values).
KVP_HD inline float key_norm(const float* row, int d) {
  double s = 0.0;
  for (int i = 0; i < d; ++i) s += static_cast<double>(row[i]) * static_cast<double>(row[i]);
  return static_cast<float>(sqrt(s));
}

// Element i of a row divided by its token norm (prepare_keys: unchanged for a zero norm).
KVP_HD inline float normalize_key(float x, float norm) { return norm > 0.0f ? x / norm : x; }

// Where element i of token t sits in the shared-memory tile (padded against bank conflicts:
// the kernels' threads walk it 32 at a time). Keys: rows of d + 1 floats, so the norm threads
// (one per row) and the channel threads (one per column) both hit 32 different banks. Values:
// one pad float after every group of G values, so the group threads (one per group, each
// reading its group contiguously) start G + 1 floats apart.
KVP_HD inline int key_stride(int d) { return d + 1; }
KVP_HD inline int tile_index(bool keys, int t, int i, int d, int group) {
  if (keys) return t * key_stride(d) + i;
  const int j = t * d + i;
  return j + j / group;
}
// Floats of the staged tile, either part: keys group * (d + 1), values group * d + d (d pads).
KVP_HD inline int tile_floats(int d, int group) { return group * key_stride(d) + d; }

// Key tile, thread `c`: channel c's block of the n <= G stored-form rows of tile (rows
// key_stride(d) apart).
template <class Blk>
KVP_HD inline void encode_key_channel(const float* tile, int n, int d, int c, Blk& out) {
  quantize_block<Blk::bits, Blk::group>(tile + c, key_stride(d), n, out);
}

// Value tile, thread `i` (< G * d / G): block i = (token i / (d / G), channel group i % (d / G));
// zero past the n valid tokens (encode_value_tile). Group i starts at tile_index(false, ...).
template <class Blk>
KVP_HD inline void encode_value_block(const float* tile, int n, int d, int i, Blk& out) {
  const int per_row = d / Blk::group;
  if (i / per_row < n) {
    quantize_group<Blk::bits, Blk::group>(tile + static_cast<std::int64_t>(i) * (Blk::group + 1), out);
  } else {
    out.scale = 0.0f;
    out.zero = 0.0f;
    for (int k = 0; k < Blk::group * Blk::bits / 8; ++k) out.qs[k] = 0;
  }
}

// Decoding, thread `c` of a key tile: channel c of the first n stored-form rows out [n][d].
template <class Blk>
KVP_HD inline void decode_key_channel(const Blk& b, int n, int d, int c, float* out) {
  dequantize_block(b, out + c, d, n);
}

// Thread `i` of a value tile: block i into out, the tile's rows [n][d] (i < n * d / G).
template <class Blk>
KVP_HD inline void decode_value_block(const Blk& b, int i, float* out) {
  dequantize_block(b, out + static_cast<std::int64_t>(i) * Blk::group, 1, Blk::group);
}

}  // namespace kvpolicy::quant::dev
