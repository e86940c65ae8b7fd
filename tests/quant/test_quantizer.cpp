// int2 / int4 / kivi codecs: per-element half-step error bound, exact constant and zero groups,
// packed sizes, the Quantizer concept and argument errors.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include <kvpolicy/concepts.hpp>
#include <kvpolicy/quant/quantizer.hpp>

#include "common/random.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_quant_quantizer {

using Catch::Matchers::Contains;
using kvpolicy::KVView;
namespace q = kvpolicy::quant;

static_assert(kvpolicy::Quantizer<q::Int2> && kvpolicy::Quantizer<q::Int4> &&
              kvpolicy::Quantizer<q::Kivi>);

namespace {

// fp32 slack of the codec: x / scale and (code - zero) * scale each round once.
double slack(double x, double scale) { return 4e-7 * (std::abs(x) + scale) + 1e-30; }

// Group with the given shape: uniform, normal, all positive (zero point < 0), outlier.
std::vector<float> make_group(kvtest::Rng& rng, int n, int shape) {
  std::vector<float> x(static_cast<std::size_t>(n));
  for (auto& v : x) {
    switch (shape) {
      case 0: v = static_cast<float>(rng.uniform(-3, 3)); break;
      case 1: v = rng.normal(0.01f); break;
      case 2: v = static_cast<float>(rng.uniform(5, 6)); break;
      default: v = rng.normal();
    }
  }
  if (shape == 3) x[static_cast<std::size_t>(n / 3)] = 40.0f;
  return x;
}

template <class Blk>
void check_block_round_trip(kvtest::Rng& rng) {
  for (int shape = 0; shape < 4; ++shape)
    for (int n : {Blk::group, Blk::group - 7, 1}) {
      auto x = make_group(rng, n, shape);
      Blk b;
      q::quantize_block(x.data(), 1, n, b);
      std::vector<float> y(static_cast<std::size_t>(n));
      q::dequantize_block(b, y.data(), 1, n);
      const float lo = *std::min_element(x.begin(), x.end()), hi = *std::max_element(x.begin(), x.end());
      INFO("bits " << Blk::bits << " group " << Blk::group << " shape " << shape << " n " << n);
      if (lo != hi) CHECK(b.scale == Approx((hi - lo) / Blk::max_code).epsilon(1e-6));
      CHECK(b.zero == std::round(b.zero));
      for (int i = 0; i < n; ++i) {
        const double err = std::abs(double(y[static_cast<std::size_t>(i)]) - x[static_cast<std::size_t>(i)]);
        CHECK(err <= 0.5 * b.scale + slack(x[static_cast<std::size_t>(i)], b.scale));
      }
    }
}

// Stored-form (rotated, normalized) rows of one (layer, head) of a view, as the quantizer sees them.
std::vector<float> stored_rows(const q::QuantConfig& c, q::Part part, const KVView<const float>& v,
                               std::int64_t l, std::int64_t h) {
  std::vector<float> rows(static_cast<std::size_t>(v.tokens * v.dim));
  for (std::int64_t t = 0; t < v.tokens; ++t) {
    float* r = rows.data() + t * v.dim;
    for (std::int64_t i = 0; i < v.dim; ++i) r[i] = v.at(l, h, t, i);
    if (part == q::Part::keys) q::prepare_key(c, r, v.dim);
    else q::prepare_value(c, r, v.dim);
  }
  return rows;
}

// Checks every stored-form element against half the step of its group (K: a channel over a tile's
// tokens; V: a token over `group` channels), decoding the packed tiles directly.
template <class Q>
void check_packed_bound(const Q& quant, const KVView<const float>& src, const std::vector<std::byte>& packed) {
  const auto& c = quant.config;
  const std::int64_t d = src.dim, T = src.tokens, G = c.group;
  const std::size_t row_bytes = quant.packed_bytes(T, d), tb = q::tile_bytes(c, quant.part, d);
  q::with_block(c.bits, G, [&](auto blk) {
    using Blk = decltype(blk);
    for (std::int64_t l = 0; l < src.layers; ++l)
      for (std::int64_t h = 0; h < src.heads; ++h) {
        auto x = stored_rows(c, quant.part, src, l, h);
        for (std::int64_t t0 = 0; t0 < T; t0 += G) {
          const int n = static_cast<int>(std::min(G, T - t0));
          const std::byte* tile = packed.data() + (l * src.heads + h) * row_bytes + (t0 / G) * tb;
          const auto* blocks = reinterpret_cast<const Blk*>(tile);
          std::vector<float> y(static_cast<std::size_t>(n * d));
          if (quant.part == q::Part::keys) q::decode_key_tile<Blk>(c, tile, n, d, y.data(), nullptr);
          else q::decode_value_tile<Blk>(tile, n, d, y.data());
          for (int t = 0; t < n; ++t)
            for (std::int64_t i = 0; i < d; ++i) {
              const Blk& b = quant.part == q::Part::keys ? blocks[i] : blocks[t * (d / G) + i / G];
              const double xv = x[static_cast<std::size_t>((t0 + t) * d + i)];
              const double err = std::abs(y[static_cast<std::size_t>(t * d + i)] - xv);
              if (err > 0.5 * b.scale + slack(xv, b.scale)) {
                FAIL_CHECK("element (" << l << ", " << h << ", " << t0 + t << ", " << i << ") error " << err
                                       << " > half step " << 0.5 * b.scale);
                return;
              }
            }
        }
      }
  });
}

template <class Q>
std::vector<float> round_trip(const Q& quant, const KVView<const float>& src) {
  std::vector<std::byte> packed(static_cast<std::size_t>(src.layers * src.heads) * quant.packed_bytes(src.tokens, src.dim));
  quant.encode(src, packed);
  std::vector<float> out(static_cast<std::size_t>(src.layers * src.heads * src.tokens * src.dim));
  quant.decode(packed, KVView<float>::hnd(out.data(), src.layers, src.heads, src.tokens, src.dim));
  return out;
}

}  // namespace

TEST_CASE("block codec: every element within half a step of its group", "[quant]") {
  kvtest::Rng rng(5);
  check_block_round_trip<q::Block<2, 32>>(rng);
  check_block_round_trip<q::Block<4, 32>>(rng);
  check_block_round_trip<q::Block<2, 64>>(rng);
  check_block_round_trip<q::Block<4, 64>>(rng);
  check_block_round_trip<q::Block<2, 128>>(rng);
  check_block_round_trip<q::Block<4, 128>>(rng);
}

// The vectorized encoders and unpackers against the scalar reference, byte for byte: groups with
// rounding ties (x / scale = k + 1/2), signed zeros at the minimum, constant and near-constant
// (huge zero point) groups, tiny and huge magnitudes.
template <class Blk>
void check_fast_codec(kvtest::Rng& rng) {
  constexpr int G = Blk::group;
  const std::int64_t d = 2 * G + 64;  // key tiles: chunks of 64 channels and a partial one
  for (int shape = 0; shape < 8; ++shape) {
    std::vector<float> x(static_cast<std::size_t>(G * d));
    for (std::size_t i = 0; i < x.size(); ++i) {
      const float r = static_cast<float>(rng.normal());
      switch (shape) {
        case 0: x[i] = r; break;
        case 1: x[i] = 0.5f * static_cast<float>(rng.integer(-6, 6)); break;  // ties
        case 2: x[i] = static_cast<float>(rng.integer(0, 3)) * (rng.integer(0, 1) ? 1.0f : -0.0f); break;
        case 3: x[i] = i % 3 ? 0.0f : -0.0f; break;
        case 4: x[i] = 1000.0f + r * 1e-4f; break;  // near-constant: quotients in the millions
        case 5: x[i] = r * 1e-38f; break;
        case 6: x[i] = r * 1e37f; break;
        default: x[i] = i % 7 ? 2.5f : r; break;
      }
    }
    INFO("bits " << Blk::bits << " group " << G << " shape " << shape);
    // Values: each contiguous group.
    for (std::int64_t g = 0; g < G * d / G; ++g) {
      Blk fast, ref;
      q::quantize_group(x.data() + g * G, fast);
      q::quantize_block(x.data() + g * G, 1, G, ref);
      REQUIRE(std::memcmp(&fast, &ref, sizeof(Blk)) == 0);
      float off[static_cast<std::size_t>(G)], y[static_cast<std::size_t>(G)];
      q::block_offsets(ref, off);
      q::dequantize_block(ref, y, 1, G);
      for (int i = 0; i < G; ++i) {
        REQUIRE(off[i] == static_cast<float>(q::block_code(ref, i)) - ref.zero);
        REQUIRE(y[i] == q::dequantize_value(q::block_code(ref, i), ref.scale, ref.zero));
      }
    }
    // Values: the tile encoder (batches of 16 and 8 groups where vectorized, then single groups)
    // on rows [n][dv], dv = the multiple of G below d: n dv / G groups, 128 / 108 / 4 at G = 32.
    const std::int64_t dv = d / G * G;
    for (int n : {G, G - 5, 1}) {
      std::vector<Blk> fast(static_cast<std::size_t>(dv)), ref(fast.size());  // a tile: G rows
      q::encode_value_tile<Blk>(x.data(), n, dv, reinterpret_cast<std::byte*>(fast.data()));
      const std::int64_t groups = n * dv / G;
      for (std::int64_t g = 0; g < groups; ++g) q::quantize_block(x.data() + g * G, 1, G, ref[static_cast<std::size_t>(g)]);
      REQUIRE(std::memcmp(fast.data(), ref.data(), static_cast<std::size_t>(groups) * sizeof(Blk)) == 0);
    }
    // Keys: channels of a tile of n tokens (rows [n][d]).
    for (int n : {G, G - 5, 1}) {
      std::vector<Blk> fast(static_cast<std::size_t>(d)), ref(fast.size());
      q::encode_key_blocks(x.data(), n, d, fast.data());
      for (std::int64_t c = 0; c < d; ++c) q::quantize_block(x.data() + c, d, n, ref[static_cast<std::size_t>(c)]);
      REQUIRE(std::memcmp(fast.data(), ref.data(), fast.size() * sizeof(Blk)) == 0);
    }
  }
}

TEST_CASE("block codec: vectorized encoders give the reference bytes", "[quant]") {
  kvtest::Rng rng(23);
  check_fast_codec<q::Block<2, 32>>(rng);
  check_fast_codec<q::Block<4, 32>>(rng);
  check_fast_codec<q::Block<2, 64>>(rng);
  check_fast_codec<q::Block<4, 128>>(rng);
  // round_half_away is roundf; quantize_value_small is quantize_value where it applies.
  for (float v : {0.5f, -0.5f, 1.5f, -2.5f, 0.49999997f, -0.49999997f, -0.3f, 8388607.5f, 4194303.5f,
                  1e30f, -1e-30f, 0.0f, -0.0f, INFINITY, -INFINITY}) {
    INFO("v = " << v);
    const float a = q::round_half_away(v), b = std::round(v);
    CHECK(std::memcmp(&a, &b, sizeof a) == 0);
  }
  for (int i = 0; i < 100000; ++i) {
    const float v = static_cast<float>(rng.uniform(-8, 8)) * (i % 2 ? 1.0f : 0.25f);
    const float a = q::round_half_away(v), b = std::round(v);
    REQUIRE(std::memcmp(&a, &b, sizeof a) == 0);
    const q::QuantRange r{static_cast<float>(rng.uniform(0.01, 2)), static_cast<float>(rng.integer(-20, 20))};
    if (std::abs(v / r.scale) < 4194304.0f)
      REQUIRE(q::quantize_value_small(v, r, 3) == q::quantize_value(v, r, 3));
  }
}

TEST_CASE("block codec: constant and all-zero groups decode exactly", "[quant]") {
  for (float c : {0.0f, 3.7f, -2.5f, 1e-30f, -1e30f, 1e-45f}) {
    std::vector<float> x(32, c), y(32, 99.f);
    q::Block<2, 32> b2;
    q::quantize_block(x.data(), 1, 32, b2);
    q::dequantize_block(b2, y.data(), 1, 32);
    for (float v : y) CHECK(v == c);
    q::Block<4, 128> b4;
    std::vector<float> x4(128, c), y4(128, 99.f);
    q::quantize_block(x4.data(), 1, 128, b4);
    q::dequantize_block(b4, y4.data(), 1, 128);
    for (float v : y4) CHECK(v == c);
  }
  // The source's convention for an all-zero group: range [-1, 1].
  std::vector<float> z(32, 0.0f);
  q::Block<2, 32> b;
  q::quantize_block(z.data(), 1, 32, b);
  CHECK(b.scale == Approx(2.0 / 3));
  CHECK(b.zero == 2.0f);
}

TEST_CASE("quantizers: stored-form elements within half a step, K per channel and V per token", "[quant]") {
  const int bits = GENERATE(2, 4);
  const int group = GENERATE(32, 64);
  const bool rotate = GENERATE(false, true);
  const std::int64_t T = GENERATE(96, 45);  // 45: a partial last tile
  const std::int64_t d = 128;
  q::Int2 quant;
  quant.config = {bits, group, 128, rotate, rotate};
  kvtest::Rng rng(static_cast<std::uint64_t>(bits * 1000 + group + rotate + T));
  auto x = rng.normals(2 * 2 * T * d);
  for (std::int64_t t = 0; t < T; ++t) x[static_cast<std::size_t>(t * d + 3)] += 12.f;  // outlier channel
  const auto src = KVView<const float>::hnd(x.data(), 2, 2, T, d);
  INFO("bits " << bits << " group " << group << " rotate+norm " << rotate << " T " << T);
  for (auto part : {q::Part::keys, q::Part::values}) {
    const auto qp = part == q::Part::keys ? quant.keys() : quant.values();
    std::vector<std::byte> packed(4 * qp.packed_bytes(T, d));
    qp.encode(src, packed);
    check_packed_bound(qp, src, packed);
    // Original space: rotation is orthonormal, so each token's L2 error is at most
    // norm * sqrt(d) * (half the largest step) in stored units; check a looser but meaningful
    // relative bound.
    auto y = round_trip(qp, src);
    double err = 0, ref = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      err += (double(y[i]) - x[i]) * (double(y[i]) - x[i]);
      ref += double(x[i]) * x[i];
    }
    CHECK(std::sqrt(err / ref) < (bits == 2 ? 0.6 : 0.12));
  }
}

TEST_CASE("quantizers: constant channels, zero values and zero keys round-trip exactly", "[quant]") {
  const std::int64_t T = 64, d = 64;
  std::vector<float> k(static_cast<std::size_t>(T * d)), v(k.size(), 0.0f);
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t i = 0; i < d; ++i) k[static_cast<std::size_t>(t * d + i)] = 0.25f * static_cast<float>(i % 7) - 0.5f;
  const auto K = KVView<const float>::hnd(k.data(), 1, 1, T, d);
  const auto V = KVView<const float>::hnd(v.data(), 1, 1, T, d);
  // kivi: every K channel is constant over the tokens, every V token all zero: exact.
  CHECK(round_trip(q::Kivi{}.keys(), K) == k);
  CHECK(round_trip(q::Kivi{}.values(), V) == v);
  // int2: zero values and zero keys (norm 0) stay exactly zero.
  CHECK(round_trip(q::Int2{}.values(), V) == v);
  CHECK(round_trip(q::Int2{}.keys(), V) == v);
}

TEST_CASE("quantizers: packed sizes and bytes per token", "[quant]") {
  CHECK(q::Int2{}.bytes_per_token(128) == 132.0);  // 2 * 128 * 16 / 32 + 4
  CHECK(q::Int2{}.bytes_per_token(64) == 68.0);
  CHECK(q::Int4{}.bytes_per_token(128) == 196.0);
  CHECK(q::Kivi{}.bytes_per_token(128) == 128.0);
  q::Int2 g128;
  g128.config.group = 128;
  CHECK(g128.bytes_per_token(128) == 84.0);
  CHECK(q::Int2{}.keys().packed_bytes(64, 128) == 2 * (128 * 16 + 32 * 4));
  CHECK(q::Int2{}.values().packed_bytes(65, 128) == 3 * 128 * 16);
  CHECK(q::Int2{}.packed_bytes(0, 128) == 0);
  CHECK(q::Int2::name == "int2");
  CHECK(q::Int4{}.bits() == 4);
  CHECK(q::Kivi::name == "kivi");
  CHECK_FALSE(q::Kivi{}.config.rotate);
  CHECK_FALSE(q::Kivi{}.config.token_norm);
}

TEST_CASE("quantizers: NHD and HND views encode to the same bytes", "[quant]") {
  kvtest::Rng rng(3);
  auto t = kvtest::random_tensor<float>(rng, 2, 3, 40, 64, 2.0, kvpolicy::Layout::NHD);
  const auto h = kvtest::make_tensor<float>(2, 3, 40, 64, t.ref.v, kvpolicy::Layout::HND);
  const auto quant = q::Int4{}.values();
  std::vector<std::byte> a(6 * quant.packed_bytes(40, 64)), b(a.size());
  quant.encode(t.view(), a);
  quant.encode(h.view(), b);
  CHECK(a == b);
}

TEST_CASE("quantizers: spec parameters", "[quant]") {
  kvpolicy::Params p("int2");
  p.set("group", "64");
  p.set("residual", "256");
  p.set("rotate", "false");
  const auto i2 = q::Int2::from_params(p);
  CHECK(i2.config == q::QuantConfig{2, 64, 256, false, true});
  CHECK_NOTHROW(p.finish());
  kvpolicy::Params k("kivi");
  k.set("bits", "4");
  CHECK(q::Kivi::from_params(k).config == q::QuantConfig{4, 32, 128, false, false});
  kvpolicy::Params bad_bits("kivi");
  bad_bits.set("bits", "3");
  CHECK_THROWS_WITH(q::Kivi::from_params(bad_bits), Contains("kivi: bits must be 2 or 4, got 3"));
  kvpolicy::Params no_bits("int2");
  no_bits.set("bits", "4");
  q::Int2::from_params(no_bits);
  CHECK_THROWS_WITH(no_bits.finish(), Contains("unknown parameter 'bits'"));
  kvpolicy::Params bad_group("int4");
  bad_group.set("group", "48");
  CHECK_THROWS_WITH(q::Int4::from_params(bad_group), Contains("int4: group must be 32, 64 or 128, got 48"));
  kvpolicy::Params bad_res("int2");
  bad_res.set("residual", "-1");
  CHECK_THROWS_WITH(q::Int2::from_params(bad_res), Contains("residual must be >= 0 tokens, got -1"));
}

TEST_CASE("quantizers reject bad arguments with messages", "[quant]") {
  std::vector<float> x(2 * 40 * 96, 1.0f);
  const auto V96 = KVView<const float>::hnd(x.data(), 1, 2, 40, 96);
  std::vector<std::byte> big(1 << 20);
  // head_dim 96: not a power of two (rotation) ...
  CHECK_THROWS_WITH(q::Int2{}.encode(V96, big), Contains("int2: head_dim 96 is not a power of two"));
  // ... fine for kivi with group 32, but group 64 does not divide it.
  CHECK_NOTHROW(q::Kivi{}.encode(V96, big));
  q::Kivi k64;
  k64.config.group = 64;
  CHECK_THROWS_WITH(k64.encode(V96, big), Contains("kivi: group 64 does not divide head_dim 96"));
  q::Int4 b3;
  b3.config.bits = 3;
  CHECK_THROWS_WITH(b3.packed_bytes(10, 64), Contains("int4: bits must be 2 or 4, got 3"));
  const auto V64 = KVView<const float>::hnd(x.data(), 1, 2, 40, 64);
  std::vector<std::byte> small(q::Int2{}.packed_bytes(40, 64));  // one row, two are needed
  CHECK_THROWS_WITH(q::Int2{}.encode(V64, small), Contains("encode needs "));
  std::vector<float> out(x.size());
  CHECK_THROWS_WITH(q::Int2{}.decode(small, KVView<float>::hnd(out.data(), 1, 2, 40, 64)),
                    Contains("decode needs "));
  x[7] = NAN;
  CHECK_THROWS_WITH(q::Int2{}.encode(V64, big), Contains("non-finite"));
}

}  // namespace kvt_quant_quantizer
