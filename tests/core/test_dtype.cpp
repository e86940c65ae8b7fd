// core/dtype.hpp: the 16-bit element types' conversions. float -> 16 bits must round to
// nearest, ties to even, for every input; 16 bits -> float must be exact.
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include <kvpolicy/core/dtype.hpp>

namespace kvt_core_dtype {

using kvpolicy::bfloat16;
using kvpolicy::half;

namespace {

// The value of a finite half bit pattern, from its definition.
double half_value(std::uint32_t h) {
  const std::uint32_t e = (h >> 10) & 0x1F, m = h & 0x3FF;
  const double v = e ? std::ldexp(1024.0 + m, static_cast<int>(e) - 25) : std::ldexp(m, -24);
  return (h & 0x8000) ? -v : v;
}

// Round-to-nearest-even reference over a sorted list of representable magnitudes: the pattern
// of x's nearest, the even one on a tie; inf past the largest finite value's half-ulp.
std::uint16_t half_reference(float x) {
  const double a = std::fabs(static_cast<double>(x));
  const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  if (a >= 65520.0) return sign | 0x7C00;
  std::uint32_t lo = 0, hi = 0x7BFF;  // largest pattern with value <= a
  while (lo < hi) {
    const std::uint32_t mid = (lo + hi + 1) / 2;
    if (half_value(mid) <= a) lo = mid; else hi = mid - 1;
  }
  if (lo == 0x7BFF) return static_cast<std::uint16_t>(sign | lo);  // [65504, 65520)
  const double d0 = a - half_value(lo), d1 = half_value(lo + 1) - a;
  const std::uint32_t r = d0 < d1 ? lo : d1 < d0 ? lo + 1 : (lo % 2 == 0 ? lo : lo + 1);
  return static_cast<std::uint16_t>(sign | r);
}

}  // namespace

TEST_CASE("half_bits_to_float is exact for every pattern", "[core][dtype]") {
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const float f = kvpolicy::half_bits_to_float(static_cast<std::uint16_t>(h));
    const std::uint32_t e = (h >> 10) & 0x1F, m = h & 0x3FF;
    if (e == 0x1F) {
      if (m == 0 ? !std::isinf(f) : !std::isnan(f)) FAIL("half pattern " << h);
      if (std::signbit(f) != ((h & 0x8000) != 0)) FAIL("sign of half pattern " << h);
    } else if (static_cast<double>(f) != half_value(h) || std::signbit(f) != ((h & 0x8000) != 0)) {
      FAIL("half pattern " << h << " -> " << f);
    }
  }
  CHECK(kvpolicy::half_bits_to_float(0x3C00) == 1.0f);
  CHECK(kvpolicy::half_bits_to_float(0x7BFF) == 65504.0f);
  CHECK(kvpolicy::half_bits_to_float(0x0001) == std::ldexp(1.0f, -24));
}

TEST_CASE("float_to_half_bits rounds to nearest even at every boundary", "[core][dtype]") {
  // Every finite half round-trips; then the midpoints between neighbours (the ties) and the
  // floats just either side of them, which is where a rounding rule can go wrong.
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    if (((h >> 10) & 0x1F) == 0x1F) continue;
    const float f = kvpolicy::half_bits_to_float(static_cast<std::uint16_t>(h));
    if (kvpolicy::float_to_half_bits(f) != h) FAIL("round trip of " << h);
    if ((h & 0x7FFF) == 0x7BFF) continue;
    const auto mid = static_cast<float>((half_value(h) + half_value(h + 1)) / 2);  // exact in float
    for (const float x : {mid, std::nextafter(mid, 0.f), std::nextafter(mid, 2 * mid)}) {
      if (kvpolicy::float_to_half_bits(x) != half_reference(x))
        FAIL("float " << x << " (pattern above " << h << ") -> " << kvpolicy::float_to_half_bits(x)
                      << ", expected " << half_reference(x));
    }
  }
  // Overflow: 65519.99 stays finite, 65520 (the tie above the largest half) goes to infinity.
  CHECK(kvpolicy::float_to_half_bits(std::nextafter(65520.f, 0.f)) == 0x7BFF);
  CHECK(kvpolicy::float_to_half_bits(65520.f) == 0x7C00);
  CHECK(kvpolicy::float_to_half_bits(-1e30f) == 0xFC00);
  CHECK(kvpolicy::float_to_half_bits(std::numeric_limits<float>::infinity()) == 0x7C00);
  // Underflow: 2^-25 is the tie between 0 and the smallest subnormal and goes to (even) zero.
  CHECK(kvpolicy::float_to_half_bits(std::ldexp(1.f, -25)) == 0);
  CHECK(kvpolicy::float_to_half_bits(std::nextafter(std::ldexp(1.f, -25), 1.f)) == 1);
  CHECK(kvpolicy::float_to_half_bits(-std::ldexp(1.f, -30)) == 0x8000);
  CHECK(kvpolicy::float_to_half_bits(std::numeric_limits<float>::denorm_min()) == 0);
  const std::uint16_t qnan = kvpolicy::float_to_half_bits(std::numeric_limits<float>::quiet_NaN());
  CHECK((qnan & 0x7C00) == 0x7C00);
  CHECK((qnan & 0x3FF) != 0);
}

TEST_CASE("bfloat16 conversions: exact widening, nearest-even narrowing", "[core][dtype]") {
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    const float f = kvpolicy::bfloat16_bits_to_float(static_cast<std::uint16_t>(b));
    if (std::bit_cast<std::uint32_t>(f) != b << 16) FAIL("bfloat16 pattern " << b);
    if (std::isnan(f)) continue;
    if (kvpolicy::float_to_bfloat16_bits(f) != b) FAIL("round trip of " << b);
  }
  // 1 + 2^-8 is the tie between 1 and 1 + 2^-7: to even (1); a hair above goes up.
  CHECK(kvpolicy::float_to_bfloat16_bits(1.f + std::ldexp(1.f, -8)) == 0x3F80);
  CHECK(kvpolicy::float_to_bfloat16_bits(std::nextafter(1.f + std::ldexp(1.f, -8), 2.f)) == 0x3F81);
  // 1 + 3 * 2^-8 is the tie between 1 + 2^-7 (odd) and 1 + 2^-6: to even (up).
  CHECK(kvpolicy::float_to_bfloat16_bits(1.f + 3 * std::ldexp(1.f, -8)) == 0x3F82);
  CHECK(kvpolicy::float_to_bfloat16_bits(std::numeric_limits<float>::max()) == 0x7F80);  // inf
  CHECK(std::isnan(kvpolicy::bfloat16_bits_to_float(
      kvpolicy::float_to_bfloat16_bits(std::numeric_limits<float>::quiet_NaN()))));
  // A signalling NaN whose payload sits in the low bits must not become infinity.
  const float snan = std::bit_cast<float>(0x7F800001u);
  CHECK(std::isnan(kvpolicy::bfloat16_bits_to_float(kvpolicy::float_to_bfloat16_bits(snan))));
  CHECK(std::isnan(kvpolicy::half_bits_to_float(kvpolicy::float_to_half_bits(snan))));
  // NaN signs and payloads: narrowing quiets and keeps the sign; widening keeps both exactly.
  const std::uint16_t neg = kvpolicy::float_to_half_bits(-std::numeric_limits<float>::quiet_NaN());
  CHECK((neg & 0x8000) != 0);
  CHECK((neg & 0x7E00) == 0x7E00);
  CHECK(kvpolicy::float_to_half_bits(snan) == 0x7E00);  // payload below the kept bits: quiet only
  CHECK(std::bit_cast<std::uint32_t>(kvpolicy::half_bits_to_float(0x7C01)) == 0x7F802000u);
  CHECK(std::bit_cast<std::uint32_t>(kvpolicy::half_bits_to_float(0xFE00)) == 0xFFC00000u);
  CHECK((kvpolicy::float_to_bfloat16_bits(-std::numeric_limits<float>::quiet_NaN()) & 0x8040) ==
        0x8040);
}

TEST_CASE("half and bfloat16: explicit conversions and value equality", "[core][dtype]") {
  CHECK(static_cast<float>(half(1.5)) == 1.5f);
  CHECK(static_cast<float>(bfloat16(-2)) == -2.f);
  CHECK(static_cast<int>(half(3.f)) == 3);
  CHECK(half(0.f) == half(-0.f));
  CHECK_FALSE(half(std::numeric_limits<float>::quiet_NaN()) ==
              half(std::numeric_limits<float>::quiet_NaN()));
  CHECK(half::from_bits(0x3C00) == half(1.f));
  CHECK(bfloat16::from_bits(0x3F80) == bfloat16(1.f));
  CHECK(half().bits == 0);
  CHECK(kvpolicy::dtype_of<half> == kvpolicy::DType::f16);
  CHECK(kvpolicy::dtype_of<const bfloat16> == kvpolicy::DType::bf16);
}

}  // namespace kvt_core_dtype
