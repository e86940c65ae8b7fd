// Packed block format of the KV quantizers (int2, int4, kivi) and its scalar reference codec.
// Asymmetric min-max quantization of one group of `Group` fp32 values to `Bits`-bit codes, as in
// OScaR and KIVI (shared/algorithms.md): scale = (max - min) / (2^b - 1), zero = round(-min /
// scale), code = clamp(round(x / scale) + zero, 0, 2^b - 1), x' = (code - zero) * scale.
// Every element is reconstructed within half a step (scale / 2) of its value, up to fp32 rounding
// of x / scale (negligible unless a group's range is below ~1e-5 of its magnitude, where the
// integer zero point of the source formula exceeds fp32's exact-integer precision).
//
// Block layout (like ggml's block_q4_0, but fp32 scale and zero point, as the sources use):
//
//   struct Block<Bits, Group> {            // one group of Group values
//     float scale;                         // step between consecutive codes; > 0
//     float zero;                          // integer-valued: the code that decodes to 0.0
//     uint8_t qs[Group * Bits / 8];        // value i: byte i / (8 / Bits), bits starting at
//   };                                     //   (i % (8 / Bits)) * Bits, low bits first
//
//   Block<2, 32>: 16 bytes (4.0 bits per value)   Block<4, 32>: 24 bytes (6.0 bits per value)
//   Block<2, 64>: 24 bytes (3.0)                  Block<4, 64>: 40 bytes (5.0)
//   Block<2, 128>: 40 bytes (2.5)                 Block<4, 128>: 72 bytes (4.5)
//
// Degenerate groups [ours, so they decode exactly]: all values equal to c != 0 -> scale = |c|,
// zero = (c < 0 ? 1 : 0) (codes 1 or 0); all zero -> the source's range [-1, 1]. A range so small
// that the scale underflows is treated as constant (its error is then at most max - min).
//
// Everything that touches one value or one block is KVP_HD so a CUDA kernel can share it. Next
// to the scalar reference codec (quantize_block, dequantize_block) are the pieces the host's
// vectorized tile codecs (quantizer.hpp) and packed attention (attention.hpp) are built from;
// the tests check that they give the reference's bytes and values.
#pragma once
#include <math.h>    // truncf, copysignf, fabsf, isfinite: also in device code
#include <string.h>  // memcpy, also in device code

#include <bit>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvpolicy/core/config.hpp"
#include "kvpolicy/core/error.hpp"

namespace kvpolicy::quant {

template <int Bits, int Group>
struct Block {
  static_assert(Bits == 2 || Bits == 4, "codes are 2 or 4 bits");
  static_assert(Group % 32 == 0, "groups are multiples of 32 values");
  static constexpr int bits = Bits;
  static constexpr int group = Group;
  static constexpr int per_byte = 8 / Bits;
  static constexpr int max_code = (1 << Bits) - 1;

  float scale;
  float zero;
  std::uint8_t qs[static_cast<std::size_t>(Group * Bits / 8)];
};

static_assert(sizeof(Block<2, 32>) == 16 && sizeof(Block<4, 32>) == 24);
static_assert(sizeof(Block<2, 64>) == 24 && sizeof(Block<4, 64>) == 40);
static_assert(sizeof(Block<2, 128>) == 40 && sizeof(Block<4, 128>) == 72);
static_assert(std::is_trivially_copyable_v<Block<2, 32>> && alignof(Block<2, 32>) == 4);

struct QuantRange {
  float scale, zero;
};

// roundf(x): the nearest integer, halves away from zero, without the library call. Exact:
// x - truncf(x) is exact in fp32 (no bits below x's last place), t +- 1 is exact wherever a
// fraction can remain (|x| < 2^23), and infinities pass through (inf - inf is NaN, not >= 0.5).
KVP_HD inline float round_half_away(float x) {
  const float t = truncf(x);
  const float up = fabsf(x - t) >= 0.5f ? 1.0f : 0.0f;
  return t + copysignf(up, x);  // t + -0 = t keeps a -0 of truncf(-0.3)
}

// Scale and zero point of a group with minimum lo and maximum hi (lo <= hi, both finite).
KVP_HD inline QuantRange quant_range(float lo, float hi, int max_code) {
  const float m = static_cast<float>(max_code);
  if (lo == 0.0f && hi == 0.0f) return {2.0f / m, round_half_away(m / 2.0f)};  // range [-1, 1]
  if (lo != hi) {
    const float scale = hi / m - lo / m;  // no overflow for |lo|, |hi| near FLT_MAX
    const float zero = round_half_away(-lo / scale);
    if (scale > 0.0f && isfinite(zero)) return {scale, zero};
  }
  const float c = lo != 0.0f ? lo : hi;  // constant (or numerically constant) group
  return {fabsf(c), c < 0.0f ? 1.0f : 0.0f};
}

// The code of x (clamped to [0, max_code]).
KVP_HD inline int quantize_value(float x, QuantRange r, int max_code) {
  const float c = round_half_away(x / r.scale) + r.zero;
  return c <= 0.0f ? 0 : (c >= static_cast<float>(max_code) ? max_code : static_cast<int>(c));
}

// quantize_value(x, r, max_code) when |x / r.scale| < 2^22, in operations that GCC and Clang
// vectorize under the default fp flags (-ftrapping-math): truncf through an int32 conversion
// (exact in that range; it gives +0 for -0.3, which only changes the sign of a zero c, and c is
// converted to an int), and every select between a computed value and a constant (a select of
// two computed values, or an operation inside one branch, gets turned back into a branch).
// c is integer-valued, so clamping it as a float and converting afterwards changes nothing.
KVP_HD inline int quantize_value_small(float x, QuantRange r, int max_code) {
  const float v = x / r.scale;
  const float t = static_cast<float>(static_cast<std::int32_t>(v));
  const float up = fabsf(v - t) >= 0.5f ? 1.0f : 0.0f;
  const float c = t + copysignf(up, v) + r.zero;
  const float m = static_cast<float>(max_code);
  const float above0 = c <= 0.0f ? 0.0f : c;
  return static_cast<int>(c >= m ? m : above0);
}

// Whether quantize_value_small is exact for every value of a group with minimum lo and maximum
// hi: |x| <= max(|lo|, |hi|) < 2^21 scale (the product is exact, or overflows only where every
// fp32 quotient is below 2^22 anyway) bounds |x / scale| by 2^21 < 2^22. Fails only for groups
// whose range is below ~1e-6 of their magnitude.
KVP_HD inline bool small_quotients(float lo, float hi, QuantRange r) {
  const float bound = 2097152.0f * r.scale;  // 2^21
  return fabsf(lo) < bound && fabsf(hi) < bound;
}

KVP_HD inline float dequantize_value(int code, float scale, float zero) {
  return (static_cast<float>(code) - zero) * scale;
}

template <int Bits, int Group>
KVP_HD inline int block_code(const Block<Bits, Group>& b, int i) {
  constexpr int per = Block<Bits, Group>::per_byte;
  return (b.qs[i / per] >> ((i % per) * Bits)) & Block<Bits, Group>::max_code;
}

// --- Whole-block pieces for the vectorized codecs --------------------------------------------
//
// Bytes 8w .. 8w + 7 of qs read as one little-endian 64-bit word hold values
// i = w * 64 / Bits + j, j < 64 / Bits, at bits [j * Bits, (j + 1) * Bits): value i sits in byte
// i / per_byte at bit (i % per_byte) * Bits, and byte k of the word at bit 8 * k. So a word
// unpacks with one shift per value by a constant (j * Bits), which vectorizes, where block_code
// needs a byte gather. (qs is a multiple of 8 bytes in every format.)
static_assert(std::endian::native == std::endian::little, "the packed words are read as little-endian");

// y[i] = code_i - zero for all Group values (exact: small integers), so that
// dequantize_value(code_i, scale, zero) == y[i] * scale bit for bit. Attention multiplies y by
// the query (keys) or the probability (values) folded with the scale instead.
template <int Bits, int Group>
KVP_HD inline void block_offsets(const Block<Bits, Group>& b, float* y) {
  constexpr int per_word = 64 / Bits;
  constexpr std::uint32_t mask = Block<Bits, Group>::max_code;
  for (int w = 0; w < Group / per_word; ++w) {
    std::uint64_t word;
    memcpy(&word, b.qs + 8 * w, 8);
    for (int j = 0; j < per_word; ++j)
      y[w * per_word + j] = static_cast<float>(static_cast<std::uint32_t>(word >> (Bits * j)) & mask) - b.zero;
  }
}

// The inverse: packs Group codes (one per byte, each <= max_code) into b.qs. The `per` codes
// of output byte k, read as one little-endian word w, sit at bits 8 u; w >> (u * (8 - Bits))
// moves code u to bit u * Bits, and every other code of the word out of the low byte.
template <int Bits, int Group>
KVP_HD inline void pack_codes(const std::uint8_t* codes, Block<Bits, Group>& b) {
  constexpr int per = Block<Bits, Group>::per_byte;
  for (int k = 0; k < Group / per; ++k) {
    std::uint32_t w = 0;
    memcpy(&w, codes + k * per, per);
    std::uint32_t v = 0;
    for (int u = 0; u < per; ++u) v |= w >> (u * (8 - Bits));
    b.qs[k] = static_cast<std::uint8_t>(v);
  }
}

// Minimum and maximum of Group contiguous values, as quantize_block's sequential scan finds them.
// Eight running lanes vectorize; the scan's tie rule (the first of equal values wins) only shows
// for zeros, where -0 and +0 compare equal but give zero points of opposite sign
// (round(-lo / scale) is -0 for lo = +0), so a zero result takes the sign of the first zero.
template <int Group>
KVP_HD inline void group_min_max(const float* x, float& lo, float& hi) {
  constexpr int L = 8;
  float l[L], h[L];
  for (int j = 0; j < L; ++j) l[j] = h[j] = x[j];
  for (int i = L; i < Group; i += L)
    for (int j = 0; j < L; ++j) {
      const float v = x[i + j];
      l[j] = v < l[j] ? v : l[j];
      h[j] = v > h[j] ? v : h[j];
    }
  lo = l[0], hi = h[0];
  for (int j = 1; j < L; ++j) {
    lo = l[j] < lo ? l[j] : lo;
    hi = h[j] > hi ? h[j] : hi;
  }
  if (lo == 0.0f || hi == 0.0f)
    for (int i = 0; i < Group; ++i)
      if (x[i] == 0.0f) {
        if (lo == 0.0f) lo = x[i];
        if (hi == 0.0f) hi = x[i];
        break;
      }
}

// The codes of quantize_block(x, 1, Group, b) for a group whose range r came from its minimum
// lo and maximum hi (b.scale and b.zero are left to the caller).
template <int Bits, int Group>
KVP_HD inline void quantize_group_codes(const float* x, QuantRange r, float lo, float hi,
                                        Block<Bits, Group>& b) {
  using B = Block<Bits, Group>;
  std::uint8_t codes[static_cast<std::size_t>(Group)];
  if (small_quotients(lo, hi, r))
    for (int i = 0; i < Group; ++i) codes[i] = static_cast<std::uint8_t>(quantize_value_small(x[i], r, B::max_code));
  else
    for (int i = 0; i < Group; ++i) codes[i] = static_cast<std::uint8_t>(quantize_value(x[i], r, B::max_code));
  pack_codes(codes, b);
}

// quantize_block(x, 1, Group, b): the same bytes, vectorized.
template <int Bits, int Group>
KVP_HD inline void quantize_group(const float* x, Block<Bits, Group>& b) {
  float lo, hi;
  group_min_max<Group>(x, lo, hi);
  const QuantRange r = quant_range(lo, hi, Block<Bits, Group>::max_code);
  b.scale = r.scale;
  b.zero = r.zero;
  quantize_group_codes(x, r, lo, hi, b);
}

// Encodes the n <= Group values x[0], x[stride], ..., x[(n-1) * stride] (finite) into b. Codes
// past n are 0; the range is taken over the n values only.
template <int Bits, int Group>
KVP_HD inline void quantize_block(const float* x, std::int64_t stride, int n,
                                  Block<Bits, Group>& b) {
  using B = Block<Bits, Group>;
  float lo = n > 0 ? x[0] : 0.0f, hi = lo;
  for (int i = 1; i < n; ++i) {
    const float v = x[i * stride];
    lo = v < lo ? v : lo;
    hi = v > hi ? v : hi;
  }
  const QuantRange r = quant_range(lo, hi, B::max_code);
  b.scale = r.scale;
  b.zero = r.zero;
  for (int k = 0; k < Group * Bits / 8; ++k) b.qs[k] = 0;
  for (int i = 0; i < n; ++i) {
    const int c = quantize_value(x[i * stride], r, B::max_code);
    b.qs[i / B::per_byte] = static_cast<std::uint8_t>(b.qs[i / B::per_byte] |
                                                      (c << ((i % B::per_byte) * Bits)));
  }
}

// Decodes the first n values of b into y[0], y[stride], ...
template <int Bits, int Group>
KVP_HD inline void dequantize_block(const Block<Bits, Group>& b, float* y, std::int64_t stride,
                                    int n) {
  float off[static_cast<std::size_t>(Group)];
  block_offsets(b, off);
  for (int i = 0; i < n; ++i) y[i * stride] = off[i] * b.scale;  // == dequantize_value
}

// --- Runtime (bits, group) -> compile-time format --------------------------------------------

inline void require_format(int bits, std::int64_t group, std::string_view who) {
  KVP_REQUIRE(bits == 2 || bits == 4, who, ": bits must be 2 or 4, got ", bits);
  KVP_REQUIRE(group == 32 || group == 64 || group == 128, who, ": group must be 32, 64 or 128, got ",
              group);
}

inline std::size_t block_bytes(int bits, std::int64_t group) {
  return static_cast<std::size_t>(8 + group * bits / 8);
}

// Calls f(Block<Bits, Group>{}) for the runtime format (checked by require_format first).
template <class F>
decltype(auto) with_block(int bits, std::int64_t group, F&& f) {
  require_format(bits, group, "quantizer");
  if (bits == 2) {
    if (group == 32) return f(Block<2, 32>{});
    if (group == 64) return f(Block<2, 64>{});
    return f(Block<2, 128>{});
  }
  if (group == 32) return f(Block<4, 32>{});
  if (group == 64) return f(Block<4, 64>{});
  return f(Block<4, 128>{});
}

}  // namespace kvpolicy::quant
