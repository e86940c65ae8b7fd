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
// Everything that touches one value or one block is KVP_HD so a CUDA kernel can share it.
#pragma once
#include <math.h>  // roundf, fabsf, isfinite: also in device code

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
  std::uint8_t qs[Group * Bits / 8];
};

static_assert(sizeof(Block<2, 32>) == 16 && sizeof(Block<4, 32>) == 24);
static_assert(sizeof(Block<2, 64>) == 24 && sizeof(Block<4, 64>) == 40);
static_assert(sizeof(Block<2, 128>) == 40 && sizeof(Block<4, 128>) == 72);
static_assert(std::is_trivially_copyable_v<Block<2, 32>> && alignof(Block<2, 32>) == 4);

struct QuantRange {
  float scale, zero;
};

// Scale and zero point of a group with minimum lo and maximum hi (lo <= hi, both finite).
KVP_HD inline QuantRange quant_range(float lo, float hi, int max_code) {
  const float m = static_cast<float>(max_code);
  if (lo == 0.0f && hi == 0.0f) return {2.0f / m, roundf(m / 2.0f)};  // range [-1, 1]
  if (lo != hi) {
    const float scale = hi / m - lo / m;  // no overflow for |lo|, |hi| near FLT_MAX
    const float zero = roundf(-lo / scale);
    if (scale > 0.0f && isfinite(zero)) return {scale, zero};
  }
  const float c = lo != 0.0f ? lo : hi;  // constant (or numerically constant) group
  return {fabsf(c), c < 0.0f ? 1.0f : 0.0f};
}

// The code of x (clamped to [0, max_code]).
KVP_HD inline int quantize_value(float x, QuantRange r, int max_code) {
  const float c = roundf(x / r.scale) + r.zero;
  return c <= 0.0f ? 0 : (c >= static_cast<float>(max_code) ? max_code : static_cast<int>(c));
}

KVP_HD inline float dequantize_value(int code, float scale, float zero) {
  return (static_cast<float>(code) - zero) * scale;
}

template <int Bits, int Group>
KVP_HD inline int block_code(const Block<Bits, Group>& b, int i) {
  constexpr int per = Block<Bits, Group>::per_byte;
  return (b.qs[i / per] >> ((i % per) * Bits)) & Block<Bits, Group>::max_code;
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
  for (int i = 0; i < n; ++i) y[i * stride] = dequantize_value(block_code(b, i), b.scale, b.zero);
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
