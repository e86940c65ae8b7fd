// KV quantizers: `int2` / `int4` (OScaR-style: Hadamard rotation + omni-token norm scaling of K,
// then asymmetric min-max codes) and `kivi` (the same codes without rotation or norm scaling).
// Source: shared/algorithms.md (OScaR, Su et al. 2026; KIVI, Liu et al. 2024).
//
// Stored form of one KV head (everything fp32 before packing):
//   K~_t = H k_t / n_t  with n_t = ||k_t||_2   (H: orthonormal Walsh-Hadamard, hadamard.hpp)
//   V~_t = H v_t
// so q.k_t = (H q).K~_t * n_t exactly, and sum_t p_t v_t = H (sum_t p_t V~_t) (H is its own
// inverse). rotate=false drops H, token_norm=false sets n_t = 1.
// [ours] n_t is the norm of the token's key in its own KV head, not over all KV heads as in
// OScaR: this library evicts per KV head (ragged), so row t of two heads is generally not the
// same token after eviction. Per head it is still exact and no coarser.
//
// Quantization (block.hpp): K per channel over groups of `group` consecutive tokens (KIVI: key
// outliers live in channels); V per token over groups of `group` channels. The unit of storage is
// a tile of `group` tokens of one KV head:
//   key tile   = Block[d]          (block c: channel c of the tile's tokens, in token order)
//                + float norm[group]                         (only when token_norm)
//   value tile = Block[group][d / group]  (token-major; block b: channels [b*group, (b+1)*group))
// Both tiles are arrays of 4-byte-aligned structs; their sizes are key_tile_bytes() and
// value_tile_bytes(). A partial last tile (encode() of a token count that is not a multiple of
// group) has zero blocks / zero norms past the valid tokens.
//
// Bytes per token and KV head, packed part (bytes_per_token()):
//   2 * d * sizeof(Block) / group + (token_norm ? 4 : 0)
//   int2, group 32: d=64: 68, d=128: 132 (fp16 K+V: 256 / 512 -> 3.9x smaller)
//   int4, group 32: d=64: 100, d=128: 196          kivi (2 bit, group 32): d=128: 128
// The fp32 scale + zero point of a 32-value group cost 2 bits per value, as much as the codes:
// group=128 brings int2 down to 2 * 128 * 40 / 128 + 4 = 84 bytes at d=128.
// The residual window (packed_cache.hpp) holds up to `residual` more tokens at 2 * d * 4 + 4
// bytes each.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/kv_view.hpp"
#include "kvpolicy/core/params.hpp"
#include "kvpolicy/quant/block.hpp"
#include "kvpolicy/quant/hadamard.hpp"
#include "kvpolicy/quant/vector_codec.hpp"

namespace kvpolicy::quant {

enum class Part : std::uint8_t { keys, values };

struct QuantConfig {
  int bits = 2;
  int group = 32;      // tokens per K group = channels per V group = tokens per tile
  int residual = 128;  // newest tokens kept in fp32 (packed_cache.hpp)
  bool rotate = true;
  bool token_norm = true;
  friend bool operator==(const QuantConfig&, const QuantConfig&) = default;
};

// Checks what does not depend on the head dimension.
inline void validate_format(const QuantConfig& c, std::string_view who) {
  require_format(c.bits, c.group, who);
  KVP_REQUIRE(c.residual >= 0, who, ": residual must be >= 0 tokens, got ", c.residual);
}

// Full check against a head dimension.
inline void validate(const QuantConfig& c, std::int64_t head_dim, std::string_view who) {
  validate_format(c, who);
  KVP_REQUIRE(head_dim > 0, who, ": head_dim must be positive, got ", head_dim);
  KVP_REQUIRE(head_dim % c.group == 0, who, ": group ", c.group, " does not divide head_dim ",
              head_dim, " (values are quantized in groups of channels)");
  if (c.rotate) require_hadamard_size(head_dim, std::string(who) + ": head_dim");
}

inline std::size_t key_tile_bytes(const QuantConfig& c, std::int64_t d) {
  return static_cast<std::size_t>(d) * block_bytes(c.bits, c.group) +
         (c.token_norm ? static_cast<std::size_t>(c.group) * sizeof(float) : 0);
}
inline std::size_t value_tile_bytes(const QuantConfig& c, std::int64_t d) {
  return static_cast<std::size_t>(d) * block_bytes(c.bits, c.group);
}
inline std::size_t tile_bytes(const QuantConfig& c, Part p, std::int64_t d) {
  return p == Part::keys ? key_tile_bytes(c, d) : value_tile_bytes(c, d);
}

// Packed bytes per token and KV head (K + V + token norm), excluding the residual window.
inline double bytes_per_token(const QuantConfig& c, std::int64_t head_dim) {
  return static_cast<double>(key_tile_bytes(c, head_dim) + value_tile_bytes(c, head_dim)) /
         static_cast<double>(c.group);
}

// --- Stored form of one row (host; d already validated) -------------------------------------

// ||k|| of rows k [n][d]: each a sum of squares in index order in double (the products are
// exact there; the order of the additions fixes the bits), rounded to fp32. Each row's sum is
// one chain of d dependent additions, so rows go together: 16 at a time as four vectors of four
// rows (lanes) where vector extensions exist (element i of four rows is a 4 x 4 transpose away),
// four scalar sums otherwise and for the rest (past n, the last row is summed again and dropped).
inline void row_norms(const float* k, std::int64_t n, std::int64_t d, float* norms) {
  std::int64_t t = 0;
#if defined(KVP_QUANT_VECTOR) && defined(__AVX512F__)
  // With AVX-512: vectors of 8 rows (8 doubles), two of them (16 rows) as independent chains.
  // Elements i .. i + 15 of 8 rows (8 vectors of 16 floats) become 16 vectors of element j
  // across the rows in three rounds of 2-source permutes (interleave row pairs, then pairs of
  // pairs, then the two quads): 24 permutes and 16 conversions per 128 values where the 4 x 4
  // form below takes 64 shuffles and 32 conversions (18% less time per row at d = 128, rows in
  // L1). The additions stay in index order per row, so the bits are the same.
  if (d % 16 == 0) {
    typedef float f16 __attribute__((vector_size(64)));
    typedef float f8 __attribute__((vector_size(32)));
    typedef double d8 __attribute__((vector_size(64)));
    for (; t + 16 <= n; t += 16) {
      d8 s[2] = {};
      for (std::int64_t i = 0; i < d; i += 16)
        for (int h = 0; h < 2; ++h) {
          f16 a[8], b[8], c[8];
          for (int r = 0; r < 8; ++r) __builtin_memcpy(&a[r], k + (t + 8 * h + r) * d + i, sizeof a[r]);
          // b[2p + e], rows 2p and 2p + 1: lane 2j + r holds element 8e + j of row 2p + r.
          for (int p = 0; p < 4; ++p) {
            b[2 * p] = __builtin_shufflevector(a[2 * p], a[2 * p + 1], 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
            b[2 * p + 1] = __builtin_shufflevector(a[2 * p], a[2 * p + 1], 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
          }
          // c[4q + m], rows 4q .. 4q + 3: lane 4j + r holds element 4m + j of row 4q + r.
          for (int q = 0; q < 2; ++q)
            for (int e = 0; e < 2; ++e) {
              const f16 x = b[4 * q + e], y = b[4 * q + 2 + e];
              c[4 * q + 2 * e] = __builtin_shufflevector(x, y, 0, 1, 16, 17, 2, 3, 18, 19, 4, 5, 20, 21, 6, 7, 22, 23);
              c[4 * q + 2 * e + 1] = __builtin_shufflevector(x, y, 8, 9, 24, 25, 10, 11, 26, 27, 12, 13, 28, 29, 14, 15, 30, 31);
            }
          // w0: elements 4m, 4m + 1 of rows 0 .. 7 (lanes 0-7, 8-15); w1: 4m + 2, 4m + 3.
          for (int m = 0; m < 4; ++m) {
            const f16 w0 = __builtin_shufflevector(c[m], c[4 + m], 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
            const f16 w1 = __builtin_shufflevector(c[m], c[4 + m], 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
            const f8 e[4] = {__builtin_shufflevector(w0, w0, 0, 1, 2, 3, 4, 5, 6, 7), __builtin_shufflevector(w0, w0, 8, 9, 10, 11, 12, 13, 14, 15),
                             __builtin_shufflevector(w1, w1, 0, 1, 2, 3, 4, 5, 6, 7), __builtin_shufflevector(w1, w1, 8, 9, 10, 11, 12, 13, 14, 15)};
            for (int j = 0; j < 4; ++j) {
              const d8 x = __builtin_convertvector(e[j], d8);
              s[h] += x * x;
            }
          }
        }
      for (int h = 0; h < 2; ++h)
        for (int r = 0; r < 8; ++r) norms[t + 8 * h + r] = static_cast<float>(std::sqrt(s[h][r]));
    }
  }
#endif
#if defined(KVP_QUANT_VECTOR)
  if (d % 4 == 0) {
    typedef float f4 __attribute__((vector_size(16)));
    typedef double d4 __attribute__((vector_size(32)));
    constexpr int R = 4;  // vectors of 4 rows: independent chains
    for (; t + 4 * R <= n; t += 4 * R) {
      d4 s[R] = {};
      for (std::int64_t i = 0; i < d; i += 4)
        for (int r = 0; r < R; ++r) {
          const float* p = k + (t + 4 * r) * d + i;
          f4 a0, a1, a2, a3;  // elements i .. i + 3 of rows 0 .. 3 of the vector
          __builtin_memcpy(&a0, p, sizeof a0);
          __builtin_memcpy(&a1, p + d, sizeof a1);
          __builtin_memcpy(&a2, p + 2 * d, sizeof a2);
          __builtin_memcpy(&a3, p + 3 * d, sizeof a3);
          const f4 l01 = __builtin_shufflevector(a0, a1, 0, 4, 1, 5), h01 = __builtin_shufflevector(a0, a1, 2, 6, 3, 7);
          const f4 l23 = __builtin_shufflevector(a2, a3, 0, 4, 1, 5), h23 = __builtin_shufflevector(a2, a3, 2, 6, 3, 7);
          const f4 e[4] = {__builtin_shufflevector(l01, l23, 0, 1, 4, 5), __builtin_shufflevector(l01, l23, 2, 3, 6, 7),
                           __builtin_shufflevector(h01, h23, 0, 1, 4, 5), __builtin_shufflevector(h01, h23, 2, 3, 6, 7)};
          for (int j = 0; j < 4; ++j) {
            const d4 x = __builtin_convertvector(e[j], d4);
            s[r] += x * x;
          }
        }
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) norms[t + 4 * r + j] = static_cast<float>(std::sqrt(s[r][j]));
    }
  }
#endif
  for (; t < n; t += 4) {
    const float* r[4];
    for (std::int64_t j = 0; j < 4; ++j) r[j] = k + std::min(t + j, n - 1) * d;
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (std::int64_t i = 0; i < d; ++i) {
      s0 += static_cast<double>(r[0][i]) * r[0][i];
      s1 += static_cast<double>(r[1][i]) * r[1][i];
      s2 += static_cast<double>(r[2][i]) * r[2][i];
      s3 += static_cast<double>(r[3][i]) * r[3][i];
    }
    const double s[4] = {s0, s1, s2, s3};
    for (std::int64_t j = 0; j < 4 && t + j < n; ++j) norms[t + j] = static_cast<float>(std::sqrt(s[j]));
  }
}

// Rows k [n][d] <- H src / ||H src|| (src [n][d]: k itself, or rows that do not overlap it);
// norms [n] <- the token norms (1 without token_norm, 0 for a zero key, which then stays zero).
inline void prepare_keys(const QuantConfig& c, const float* src, float* k, std::int64_t n,
                         std::int64_t d, float* norms) {
  if (c.rotate)
    for (std::int64_t t = 0; t < n; ++t) hadamard_unchecked_to(src + t * d, k + t * d, d);
  else if (src != k)
    std::copy(src, src + n * d, k);
  if (!c.token_norm) {
    std::fill(norms, norms + n, 1.0f);
    return;
  }
  row_norms(k, n, d, norms);
  for (std::int64_t t = 0; t < n; ++t) {
    const float nt = norms[t];
    float* r = k + t * d;
    if (nt > 0.0f)
      for (std::int64_t i = 0; i < d; ++i) r[i] /= nt;  // a division, not * (1 / nt): same bits
  }
}

// Rows k [n][d] <- H k / ||k|| in place.
inline void prepare_keys(const QuantConfig& c, float* k, std::int64_t n, std::int64_t d,
                         float* norms) {
  prepare_keys(c, k, k, n, d, norms);
}

// One row: k <- H k / ||k||; returns the token norm.
inline float prepare_key(const QuantConfig& c, float* k, std::int64_t d) {
  float n = 1.0f;
  prepare_keys(c, k, 1, d, &n);
  return n;
}
inline void prepare_value(const QuantConfig& c, float* v, std::int64_t d) {
  if (c.rotate) hadamard_unchecked(v, d);
}
// Rows v [n][d] <- H src (src: v itself, or rows that do not overlap it).
inline void prepare_values(const QuantConfig& c, const float* src, float* v, std::int64_t n,
                           std::int64_t d) {
  if (c.rotate)
    for (std::int64_t t = 0; t < n; ++t) hadamard_unchecked_to(src + t * d, v + t * d, d);
  else if (src != v)
    std::copy(src, src + n * d, v);
}
inline void prepare_values(const QuantConfig& c, float* v, std::int64_t n, std::int64_t d) {
  prepare_values(c, v, v, n, d);
}
// Inverses: back to the original space.
inline void restore_key(const QuantConfig& c, float* k, std::int64_t d, float norm) {
  if (c.token_norm)
    for (std::int64_t i = 0; i < d; ++i) k[i] *= norm;
  if (c.rotate) hadamard_unchecked(k, d);
}
inline void restore_value(const QuantConfig& c, float* v, std::int64_t d) {
  if (c.rotate) hadamard_unchecked(v, d);
}

// --- Tiles; Blk = Block<bits, group> ---------------------------------------------------------
//
// The encoders give quantize_block's bytes (tests/quant compare them), vectorized: keys across
// channels (the rows are token-major, each channel's block runs down a column), values along the
// row (each block is 32+ contiguous channels).

// quantize_block(k + c0 + j, d, n, blocks[c0 + j]) for the nc <= kKeyChunk channels j of one
// chunk: the running min / max per channel scans the tokens in order as the reference does (so
// its tie rule holds), then every token's codes are computed across the channels and packed per
// channel. Divides per element; the exact path under detail::encode_key_channels.
constexpr int kKeyChunk = 64;
template <class Blk>
void encode_key_chunk(const float* k, int n, std::int64_t d, std::int64_t c0, int nc, Blk* blocks) {
  constexpr int kChannels = kKeyChunk, G = Blk::group, per = Blk::per_byte;
  float lo[kChannels], hi[kChannels];
  float scale[kChannels], zero[kChannels];
  std::uint8_t codes[static_cast<std::size_t>(G)][kChannels];  // [token][channel]; 0 past n, as the reference leaves them
  const float* x = k + c0;
  for (int j = 0; j < nc; ++j) lo[j] = hi[j] = n > 0 ? x[j] : 0.0f;
  for (int t = 1; t < n; ++t)
    for (int j = 0; j < nc; ++j) {
      const float v = x[t * d + j];
      lo[j] = v < lo[j] ? v : lo[j];
      hi[j] = v > hi[j] ? v : hi[j];
    }
  for (int j = 0; j < nc; ++j) {
    const QuantRange r = quant_range(lo[j], hi[j], Blk::max_code);
    scale[j] = r.scale;
    zero[j] = r.zero;
    blocks[c0 + j].scale = scale[j];
    blocks[c0 + j].zero = zero[j];
  }
  bool small = true;  // quantize_value_small is exact for every channel of the chunk
  for (int j = 0; j < nc; ++j) small &= small_quotients(lo[j], hi[j], {scale[j], zero[j]});
  for (int t = 0; t < G; ++t) {
    if (t >= n) {
      std::fill(codes[t], codes[t] + nc, std::uint8_t{0});
      continue;
    }
    const float* xt = x + t * d;
    if (small)
      for (int j = 0; j < nc; ++j) codes[t][j] = static_cast<std::uint8_t>(quantize_value_small(xt[j], {scale[j], zero[j]}, Blk::max_code));
    else
      for (int j = 0; j < nc; ++j) codes[t][j] = static_cast<std::uint8_t>(quantize_value(xt[j], {scale[j], zero[j]}, Blk::max_code));
  }
  // Byte b of channel j's block: tokens b * per .. b * per + per - 1 (block.hpp's layout).
  for (int b = 0; b < G / per; ++b) {
    std::uint8_t packed[kChannels];
    for (int j = 0; j < nc; ++j) {
      unsigned v = 0;
      for (int u = 0; u < per; ++u) v |= static_cast<unsigned>(codes[b * per + u][j]) << (u * Blk::bits);
      packed[j] = static_cast<std::uint8_t>(v);
    }
    for (int j = 0; j < nc; ++j) blocks[c0 + j].qs[b] = packed[j];
  }
}

// quantize_block(k + ch, d, n, blocks[ch]) for every channel ch, kKeyChunk channels at a time.
template <class Blk>
void encode_key_blocks(const float* k, int n, std::int64_t d, Blk* blocks) {
  for (std::int64_t c0 = 0; c0 < d; c0 += kKeyChunk) {
    const int nc = static_cast<int>(std::min<std::int64_t>(kKeyChunk, d - c0));
#if defined(KVP_QUANT_VECTOR)
    // nc is a multiple of 16: d is one of group (>= 32).
#if defined(__AVX512F__)
    if (n > 0 && nc % 16 == 0 && detail::encode_key_channels<Blk, detail::qv16f>(k + c0, n, d, nc / 16, blocks + c0)) continue;
#else
    if (n > 0 && nc % 8 == 0 && detail::encode_key_channels(k + c0, n, d, nc / 8, blocks + c0)) continue;
#endif
#endif
    encode_key_chunk(k, n, d, c0, nc, blocks);
  }
}

// k: n <= group stored-form rows [n][d]; norms: [n] (read only with token_norm).
template <class Blk>
void encode_key_tile(const QuantConfig& c, const float* k, const float* norms, int n,
                     std::int64_t d, std::byte* out) {
  auto* blocks = reinterpret_cast<Blk*>(out);
  encode_key_blocks(k, n, d, blocks);
  if (c.token_norm) {
    auto* nr = reinterpret_cast<float*>(out + d * static_cast<std::int64_t>(sizeof(Blk)));
    for (int t = 0; t < Blk::group; ++t) nr[t] = t < n ? norms[t] : 0.0f;
  }
}

// v: n <= group stored-form rows [n][d].
template <class Blk>
void encode_value_tile(const float* v, int n, std::int64_t d, std::byte* out) {
  auto* blocks = reinterpret_cast<Blk*>(out);
  const std::int64_t per_row = d / Blk::group;
  std::memset(out + n * per_row * static_cast<std::int64_t>(sizeof(Blk)), 0,
              static_cast<std::size_t>((Blk::group - n) * per_row) * sizeof(Blk));
  const std::int64_t count = n * per_row;  // block i: values [i G, (i + 1) G) of the rows [n][d]
  std::int64_t i0 = 0;
#if defined(KVP_QUANT_VECTOR)
#if defined(__AVX512F__)
  if constexpr (Blk::group == 32)
    for (; i0 + 16 <= count; i0 += 16)
      if (!detail::encode_value_groups16(v + i0 * Blk::group, blocks + i0))
        for (int i = 0; i < 16; ++i) quantize_group(v + (i0 + i) * Blk::group, blocks[i0 + i]);
#endif
  for (; i0 + 8 <= count; i0 += 8)
    if (!detail::encode_value_groups8(v + i0 * Blk::group, blocks + i0))
      for (int i = 0; i < 8; ++i) quantize_group(v + (i0 + i) * Blk::group, blocks[i0 + i]);
#endif
  // quantize_group per block, in chunks of kBlocks: all ranges of a chunk first, so that the
  // dependent divisions of quant_range can overlap across blocks.
  constexpr std::int64_t kBlocks = 16;
  for (; i0 < count; i0 += kBlocks) {
    const std::int64_t m = std::min(kBlocks, count - i0);
    float lo[kBlocks], hi[kBlocks];
    QuantRange r[kBlocks];
    for (std::int64_t i = 0; i < m; ++i) {
      group_min_max<Blk::group>(v + (i0 + i) * Blk::group, lo[i], hi[i]);
      r[i] = quant_range(lo[i], hi[i], Blk::max_code);
      blocks[i0 + i].scale = r[i].scale;
      blocks[i0 + i].zero = r[i].zero;
    }
    for (std::int64_t i = 0; i < m; ++i)
      quantize_group_codes(v + (i0 + i) * Blk::group, r[i], lo[i], hi[i], blocks[i0 + i]);
  }
}

// Stored-form rows [n][d] and norms [n] (norms may be null; 1 without token_norm).
template <class Blk>
void decode_key_tile(const QuantConfig& c, const std::byte* in, int n, std::int64_t d, float* k,
                     float* norms) {
  const auto* blocks = reinterpret_cast<const Blk*>(in);
  for (std::int64_t ch = 0; ch < d; ++ch) dequantize_block(blocks[ch], k + ch, d, n);
  if (!norms) return;
  const auto* nr = reinterpret_cast<const float*>(in + d * static_cast<std::int64_t>(sizeof(Blk)));
  for (int t = 0; t < n; ++t) norms[t] = c.token_norm ? nr[t] : 1.0f;
}

template <class Blk>
void decode_value_tile(const std::byte* in, int n, std::int64_t d, float* v) {
  const auto* blocks = reinterpret_cast<const Blk*>(in);
  const std::int64_t per_row = d / Blk::group;
  for (int t = 0; t < n; ++t)
    for (std::int64_t b = 0; b < per_row; ++b)
      dequantize_block(blocks[t * per_row + b], v + t * d + b * Blk::group, 1, Blk::group);
}

// --- The policy stage ------------------------------------------------------------------------

class PackedCache;  // packed_cache.hpp

// One value type for int2 / int4 / kivi (Tag gives the spec name and defaults). Models
// kvpolicy::Quantizer (packed_cache.hpp) through pack(): what a Session calls to turn one KV
// head's survivors into a PackedCache (packed tiles plus the fp32 residual window, read by
// packed_attention in attention.hpp). encode()/decode() apply the same codes to one part (keys
// or values: `part`) of a whole view [layer][head][token][dim], row (l, h) at byte offset
// (l * heads + h) * packed_bytes(tokens, dim), as ceil(tokens / group) tiles, without a residual
// window; decoding returns the original space (norm multiplied back, rotated back). They are the
// whole-view codec the CUDA encode/decode kernels reproduce byte for byte.
template <class Tag>
struct BasicQuantizer {
  static constexpr std::string_view name = Tag::name;
  QuantConfig config = Tag::defaults;
  Part part = Part::keys;

  int bits() const { return config.bits; }
  BasicQuantizer keys() const { return {config, Part::keys}; }
  BasicQuantizer values() const { return {config, Part::values}; }
  void validate(std::int64_t head_dim) const { quant::validate(config, head_dim, name); }
  double bytes_per_token(std::int64_t head_dim) const {
    return quant::bytes_per_token(config, head_dim);
  }

  // Bytes of one (layer, head) row of `tokens` tokens.
  std::size_t packed_bytes(std::int64_t tokens, std::int64_t head_dim) const {
    validate(head_dim);
    KVP_REQUIRE(tokens >= 0, name, ": negative token count ", tokens);
    const std::int64_t tiles = (tokens + config.group - 1) / config.group;
    return static_cast<std::size_t>(tiles) * tile_bytes(config, part, head_dim);
  }

  void encode(const KVView<const float>& src, std::span<std::byte> packed) const {
    validate_view(src, packed.size(), "encode");
    require_finite(src, std::string(name) + ": encode input");
    const std::int64_t d = src.dim;
    std::vector<float> rows(static_cast<std::size_t>(config.group * d)), norms(static_cast<std::size_t>(config.group));
    for_each_tile(src, [&](auto blk, std::int64_t l, std::int64_t h, std::int64_t t0, int n, std::size_t off) {
      using Blk = decltype(blk);
      for (int t = 0; t < n; ++t) {
        float* r = rows.data() + t * d;
        for (std::int64_t i = 0; i < d; ++i) r[i] = src.at(l, h, t0 + t, i);
        if (part == Part::keys) norms[static_cast<std::size_t>(t)] = prepare_key(config, r, d);
        else prepare_value(config, r, d);
      }
      if (part == Part::keys) encode_key_tile<Blk>(config, rows.data(), norms.data(), n, d, packed.data() + off);
      else encode_value_tile<Blk>(rows.data(), n, d, packed.data() + off);
    });
  }

  void decode(std::span<const std::byte> packed, const KVView<float>& dst) const {
    validate_view(dst, packed.size(), "decode");
    const std::int64_t d = dst.dim;
    std::vector<float> rows(static_cast<std::size_t>(config.group * d)), norms(static_cast<std::size_t>(config.group));
    for_each_tile(dst, [&](auto blk, std::int64_t l, std::int64_t h, std::int64_t t0, int n, std::size_t off) {
      using Blk = decltype(blk);
      if (part == Part::keys) decode_key_tile<Blk>(config, packed.data() + off, n, d, rows.data(), norms.data());
      else decode_value_tile<Blk>(packed.data() + off, n, d, rows.data());
      for (int t = 0; t < n; ++t) {
        float* r = rows.data() + t * d;
        if (part == Part::keys) restore_key(config, r, d, norms[static_cast<std::size_t>(t)]);
        else restore_value(config, r, d);
        for (std::int64_t i = 0; i < d; ++i) dst.at(l, h, t0 + t, i) = r[i];
      }
    });
  }

  // Tokens [0, tokens) of (layer, head) of two views (a head's survivors after eviction) as a
  // packed cache whose residual window is fitted to them (quant::fit_residual: never more bytes
  // than the full-precision rows it replaces). Defined in packed_cache.hpp.
  template <class T>
  PackedCache pack(const KVView<const T>& keys, const KVView<const T>& values, std::int64_t layer,
                   std::int64_t head, std::int64_t tokens) const;

  // Spec parameters: int2/int4 take group, residual, rotate, token_norm; kivi takes bits, group,
  // residual. The caller (registry) rejects unread names with Params::finish().
  static BasicQuantizer from_params(Params& p) {
    BasicQuantizer q;
    if constexpr (Tag::configurable_bits) q.config.bits = static_cast<int>(p.get_int("bits", q.config.bits));
    q.config.group = static_cast<int>(p.get_int("group", q.config.group));
    q.config.residual = static_cast<int>(p.get_int("residual", q.config.residual));
    if constexpr (Tag::configurable_transform) {
      q.config.rotate = p.get_bool("rotate", q.config.rotate);
      q.config.token_norm = p.get_bool("token_norm", q.config.token_norm);
    }
    validate_format(q.config, name);
    return q;
  }

 private:
  // f(Block{}, layer, head, first token, tokens, byte offset) for every tile of a view.
  template <class T, class F>
  void for_each_tile(const KVView<T>& v, F&& f) const {
    const std::int64_t G = config.group, tokens = v.tokens;
    const std::size_t row_bytes = packed_bytes(tokens, v.dim), tb = tile_bytes(config, part, v.dim);
    with_block(config.bits, G, [&](auto blk) {
      for (std::int64_t l = 0; l < v.layers; ++l)
        for (std::int64_t h = 0; h < v.heads; ++h)
          for (std::int64_t t0 = 0; t0 < tokens; t0 += G)
            f(blk, l, h, t0, static_cast<int>(std::min(G, tokens - t0)),
              static_cast<std::size_t>(l * v.heads + h) * row_bytes + static_cast<std::size_t>(t0 / G) * tb);
    });
  }

  template <class T>
  void validate_view(const KVView<T>& v, std::size_t have, std::string_view op) const {
    kvpolicy::validate(v, std::string(name) + ": " + std::string(op) + " view");
    validate(v.dim);
    const std::size_t need = static_cast<std::size_t>(v.layers * v.heads) * packed_bytes(v.tokens, v.dim);
    KVP_REQUIRE(have >= need, name, ": ", op, " needs ", need, " packed bytes for ", v.layers,
                " layers x ", v.heads, " heads x ", v.tokens, " tokens, got ", have);
  }
};

struct Int2Tag {
  static constexpr std::string_view name = "int2";
  static constexpr QuantConfig defaults{2, 32, 128, true, true};
  static constexpr bool configurable_bits = false, configurable_transform = true;
};
struct Int4Tag {
  static constexpr std::string_view name = "int4";
  static constexpr QuantConfig defaults{4, 32, 128, true, true};
  static constexpr bool configurable_bits = false, configurable_transform = true;
};
struct KiviTag {
  static constexpr std::string_view name = "kivi";
  static constexpr QuantConfig defaults{2, 32, 128, false, false};
  static constexpr bool configurable_bits = true, configurable_transform = false;
};

using Int2 = BasicQuantizer<Int2Tag>;
using Int4 = BasicQuantizer<Int4Tag>;
using Kivi = BasicQuantizer<KiviTag>;

}  // namespace kvpolicy::quant

// BasicQuantizer::pack and the Quantizer concept need PackedCache.
#include "kvpolicy/quant/packed_cache.hpp"
