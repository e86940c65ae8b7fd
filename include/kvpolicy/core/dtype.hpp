// Element types of the cache on the host: float, kvpolicy::half (IEEE binary16) and
// kvpolicy::bfloat16, the last two 16-bit storage types bit-compatible with CUDA's __half and
// __nv_bfloat16 (a device tensor's bytes are read as either). All scoring math is fp32 whatever
// the cache type: the 16-bit types only convert to and from float, with no arithmetic of their
// own. Free of Eigen and CUDA, so that every core header is shared by host code and nvcc.
//
// Conversions: float -> 16 bits rounds to nearest, ties to even (overflow to infinity,
// underflow through the subnormals to signed zero); a NaN becomes a quiet NaN with its sign and
// the top of its payload. 16 bits -> float is exact, NaNs included (payload and sign kept).
// Other arithmetic types convert through float. One portable body on every target: no F16C
// variant, whose definition would differ between translation units built with and without
// -mf16c (an ODR violation that could leave F16C instructions in a portable program).
#pragma once
#include <bit>
#include <concepts>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include "kvpolicy/core/types.hpp"

namespace kvpolicy {

// ---- bit conversions ------------------------------------------------------------------------

// The normal range is tested first (the branch is predictable on real data). The subnormal
// halves go through the FPU: 0.5f + m * 2^-24 is exact (the ulp of [0.5, 1) is 2^-24), so subtracting 0.5f recovers
// m * 2^-24, and adding 0.5f to |x| < 2^-14 rounds it to a multiple of 2^-24 to nearest even,
// which is the half's subnormal mantissa. Only the default rounding mode is assumed.
inline float half_bits_to_float(std::uint16_t h) {
  const std::uint32_t em = h & 0x7FFFu;  // exponent and mantissa
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  if (em - 0x400u < 0x7C00u - 0x400u)  // normal: rebias the exponent 15 -> 127
    return std::bit_cast<float>(sign | ((em << 13) + (112u << 23)));
  if (em < 0x400u)  // zero and subnormals: m * 2^-24
    return std::bit_cast<float>(
        sign | std::bit_cast<std::uint32_t>(std::bit_cast<float>(0x3F000000u | em) - 0.5f));
  return std::bit_cast<float>(sign | 0x7F800000u | (em << 13));  // inf / NaN (payload kept)
}

inline std::uint16_t float_to_half_bits(float f) {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t ax = x & 0x7FFFFFFFu;
  // Normal half: round the 13 dropped mantissa bits to nearest even, then rebias; a carry may
  // reach the next exponent, and from 65520 on, infinity.
  const auto sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  if (ax - 0x38800000u < 0x47800000u - 0x38800000u)  // [2^-14, 2^16): the common case
    return static_cast<std::uint16_t>(
        sign | (((ax + 0x0FFFu + ((ax >> 13) & 1u)) >> 13) - (112u << 10)));
  if (ax < 0x38800000u)  // the subnormal (or zero)
    return static_cast<std::uint16_t>(
        sign | (std::bit_cast<std::uint32_t>(std::bit_cast<float>(ax) + 0.5f) - 0x3F000000u));
  return static_cast<std::uint16_t>(sign | (ax > 0x7F800000u ? 0x7E00u | ((ax >> 13) & 0x1FFu)
                                                              : 0x7C00u));
}

constexpr float bfloat16_bits_to_float(std::uint16_t b) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

constexpr std::uint16_t float_to_bfloat16_bits(float f) {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);
  return static_cast<std::uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

// ---- the 16-bit element types ---------------------------------------------------------------

// Storage only: explicit conversions from and to arithmetic types (through float), equality of
// values (so +0 == -0 and NaN != NaN), and the raw bits in `bits`. Codec: encode / decode.
template <class Codec>
struct basic_float16 {
  std::uint16_t bits = 0;
  constexpr basic_float16() = default;
  template <class A>
    requires std::is_arithmetic_v<A>
  constexpr explicit basic_float16(A v) : bits(Codec::encode(static_cast<float>(v))) {}
  static constexpr basic_float16 from_bits(std::uint16_t b) {
    basic_float16 x;
    x.bits = b;
    return x;
  }
  template <class A>
    requires std::is_arithmetic_v<A>
  constexpr explicit operator A() const {
    return static_cast<A>(Codec::decode(bits));
  }
  friend constexpr bool operator==(basic_float16 a, basic_float16 b) {
    return Codec::decode(a.bits) == Codec::decode(b.bits);
  }
};

struct HalfCodec {
  static float decode(std::uint16_t b) { return half_bits_to_float(b); }
  static std::uint16_t encode(float f) { return float_to_half_bits(f); }
};
struct BFloat16Codec {
  static constexpr float decode(std::uint16_t b) { return bfloat16_bits_to_float(b); }
  static constexpr std::uint16_t encode(float f) { return float_to_bfloat16_bits(f); }
};

using half = basic_float16<HalfCodec>;          // IEEE binary16, CUDA's __half
using bfloat16 = basic_float16<BFloat16Codec>;  // CUDA's __nv_bfloat16

static_assert(sizeof(half) == 2 && std::is_trivially_copyable_v<half>);
static_assert(sizeof(bfloat16) == 2 && std::is_trivially_copyable_v<bfloat16>);

template <class T>
concept Element = std::same_as<std::remove_const_t<T>, float> ||
                  std::same_as<std::remove_const_t<T>, half> ||
                  std::same_as<std::remove_const_t<T>, bfloat16>;

template <Element T>
inline constexpr DType dtype_of = std::is_same_v<std::remove_const_t<T>, float>  ? DType::f32
                                  : std::is_same_v<std::remove_const_t<T>, half> ? DType::f16
                                                                                 : DType::bf16;

template <Element T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

template <Element T>
inline std::remove_const_t<T> from_float(float x) {
  return static_cast<std::remove_const_t<T>>(x);
}

}  // namespace kvpolicy
