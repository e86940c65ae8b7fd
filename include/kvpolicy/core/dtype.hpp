// Element types of the cache on the host: float, kvpolicy::half (IEEE binary16) and
// kvpolicy::bfloat16, the last two 16-bit storage types bit-compatible with CUDA's __half and
// __nv_bfloat16 (a device tensor's bytes are read as either). All scoring math is fp32 whatever
// the cache type: the 16-bit types only convert to and from float, with no arithmetic of their
// own. Free of Eigen and CUDA, so that every core header is shared by host code and nvcc.
//
// Conversions: float -> 16 bits rounds to nearest, ties to even (overflow to infinity,
// underflow through the subnormals to signed zero); 16 bits -> float is exact. A NaN stays a
// NaN (quiet, sign kept). With F16C enabled (-march=native on x86-64) half uses the
// instructions, which round the same way.
#pragma once
#include <bit>
#include <concepts>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include "kvpolicy/core/types.hpp"
#if defined(__F16C__) && !defined(__CUDACC__)
#include <immintrin.h>
#endif

namespace kvpolicy {

// ---- bit conversions ------------------------------------------------------------------------

inline float half_bits_to_float(std::uint16_t h) {
#if defined(__F16C__) && !defined(__CUDACC__)
  return _cvtsh_ss(h);
#else
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  std::uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);  // inf / NaN (payload kept)
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal half: value = man * 2^-24, normal in fp32
    const int lz = std::countl_zero(static_cast<std::uint32_t>(man)) - 21;  // zeros within 10 bits
    const std::uint32_t m = (man << lz) & 0x3FFu;
    bits = sign | (static_cast<std::uint32_t>(113 - lz) << 23) | (m << 13);
  }
  return std::bit_cast<float>(bits);
#endif
}

inline std::uint16_t float_to_half_bits(float f) {
#if defined(__F16C__) && !defined(__CUDACC__)
  return static_cast<std::uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
#else
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const auto sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  const std::uint32_t ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u)  // NaN: quiet, the payload's top bits kept
    return static_cast<std::uint16_t>(sign | 0x7E00u | ((ax >> 13) & 0x1FFu));
  if (ax >= 0x47800000u) return static_cast<std::uint16_t>(sign | 0x7C00u);  // >= 2^16 (and inf)
  std::uint32_t h, rem, tie;
  if (ax >= 0x38800000u) {  // normal half: rebias the exponent, keep 10 of 23 mantissa bits
    h = (ax >> 13) - (112u << 10);
    rem = ax & 0x1FFFu;
    tie = 0x1000u;
  } else {  // subnormal half (or zero): value = m * 2^(e - 150), unit 2^-24
    if (ax <= 0x33000000u) return sign;  // at most 2^-25: rounds to zero (the tie to even)
    const std::uint32_t e = ax >> 23, m = (ax & 0x7FFFFFu) | 0x800000u;
    const std::uint32_t shift = 126 - e;  // 14 .. 24
    h = m >> shift;
    rem = m & ((1u << shift) - 1);
    tie = 1u << (shift - 1);
  }
  if (rem > tie || (rem == tie && (h & 1u))) ++h;  // a carry may reach the next exponent / inf
  return static_cast<std::uint16_t>(sign | h);
#endif
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
