// KVView addressing (HND, NHD, strided), validate() and require_finite().
#include <catch2/catch.hpp>

#include <limits>
#include <numeric>
#include <set>
#include <vector>

#include <kvpolicy/core/kv_view.hpp>

#include "common/random.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_core_kv_view {

using kvpolicy::KVView;
using Catch::Matchers::Contains;

namespace {

// Buffer whose element at offset o holds o, so at() reveals the offset it read.
std::vector<float> iota_buffer(std::size_t n) {
  std::vector<float> b(n);
  std::iota(b.begin(), b.end(), 0.f);
  return b;
}

template <class T>
std::string validate_message(const KVView<T>& v, const char* what = "keys") {
  try {
    kvpolicy::validate(v, what);
  } catch (const kvpolicy::Error& e) {
    return e.what();
  }
  return "";
}

template <class T>
bool same_view(const KVView<T>& a, const KVView<T>& b) {
  return a.data == b.data && a.layers == b.layers && a.heads == b.heads && a.tokens == b.tokens &&
         a.dim == b.dim && a.stride_layer == b.stride_layer && a.stride_head == b.stride_head &&
         a.stride_token == b.stride_token && a.stride_dim == b.stride_dim;
}

}  // namespace

TEST_CASE("KVView HND/NHD/strided views address the right elements", "[core]") {
  const std::int64_t L = 2, H = 3, N = 5, D = 4;
  auto buf = iota_buffer(static_cast<std::size_t>(L * H * N * D));

  SECTION("HND is [layer][head][token][dim]") {
    auto v = KVView<float>::hnd(buf.data(), L, H, N, D);
    CHECK(same_view(v, KVView<float>::make(kvpolicy::Layout::HND, buf.data(), L, H, N, D)));
    for (std::int64_t l = 0; l < L; ++l)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t t = 0; t < N; ++t)
          for (std::int64_t i = 0; i < D; ++i)
            REQUIRE(v.at(l, h, t, i) == static_cast<float>(((l * H + h) * N + t) * D + i));
  }
  SECTION("NHD is [layer][token][head][dim]") {
    auto v = KVView<float>::nhd(buf.data(), L, H, N, D);
    CHECK(same_view(v, KVView<float>::make(kvpolicy::Layout::NHD, buf.data(), L, H, N, D)));
    for (std::int64_t l = 0; l < L; ++l)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t t = 0; t < N; ++t)
          for (std::int64_t i = 0; i < D; ++i)
            REQUIRE(v.at(l, h, t, i) == static_cast<float>(((l * N + t) * H + h) * D + i));
  }
  SECTION("transposed (head_dim-major, stride_dim != 1) layout") {
    // [layer][head][dim][token]: as a transposed V cache is stored.
    KVView<float> v{buf.data(), L, H, N, D, H * D * N, D * N, 1, N};
    CHECK_FALSE(v.rows_contiguous());
    for (std::int64_t l = 0; l < L; ++l)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t t = 0; t < N; ++t)
          for (std::int64_t i = 0; i < D; ++i)
            REQUIRE(v.at(l, h, t, i) == static_cast<float>(((l * H + h) * D + i) * N + t));
    CHECK_NOTHROW(kvpolicy::validate(v, "values"));
  }
  SECTION("padded token stride; layer() and prefix() sub-views") {
    const std::int64_t st = D + 3;  // rows padded to 7 elements
    std::vector<float> pb = iota_buffer(static_cast<std::size_t>(L * H * N * st));
    KVView<float> v{pb.data(), L, H, N, D, H * N * st, N * st, st, 1};
    CHECK_NOTHROW(kvpolicy::validate(v, "keys"));
    auto one = v.layer(1);
    CHECK(one.layers == 1);
    CHECK(one.heads == H);
    auto pre = v.prefix(2);
    CHECK(pre.tokens == 2);
    CHECK(pre.stride_token == st);
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t t = 0; t < N; ++t)
        for (std::int64_t i = 0; i < D; ++i) {
          REQUIRE(one.at(0, h, t, i) == static_cast<float>(((1 * H + h) * N + t) * st + i));
          REQUIRE(&one.at(0, h, t, i) == &v.at(1, h, t, i));
        }
    KVView<const float> c = v;  // implicit const conversion keeps the addressing
    CHECK(&c.at(1, 2, 4, 3) == &v.at(1, 2, 4, 3));
  }
}

TEST_CASE("KVView validate rejects bad extents, strides and null data with a message", "[core]") {
  std::vector<float> buf(1024);
  const auto good = KVView<float>::hnd(buf.data(), 2, 2, 8, 4);
  REQUIRE(validate_message(good).empty());
  REQUIRE(validate_message(KVView<float>::nhd(buf.data(), 2, 2, 8, 4)).empty());

  SECTION("negative extents") {
    for (int which = 0; which < 4; ++which) {
      auto v = good;
      std::int64_t* ext[4] = {&v.layers, &v.heads, &v.tokens, &v.dim};
      *ext[which] = -1;
      const std::string msg = validate_message(v, "values");
      CHECK_THAT(msg, Contains("values") && Contains("negative extent"));
      const char* names[4] = {"layers=-1", "heads=-1", "tokens=-1", "dim=-1"};
      CHECK_THAT(msg, Contains(names[which]));
    }
  }
  SECTION("negative strides") {
    auto v = good;
    v.stride_token = -4;
    CHECK_THAT(validate_message(v), Contains("keys") && Contains("negative token stride -4"));
    v = good;
    v.stride_dim = -1;
    CHECK_THAT(validate_message(v), Contains("negative dim stride -1"));
    v = good;
    v.stride_head = -32;
    CHECK_THAT(validate_message(v), Contains("negative head stride -32"));
  }
  SECTION("overlapping strides") {
    auto v = good;
    v.stride_token = 3;  // rows of 4 overlap
    CHECK_THAT(validate_message(v), Contains("token stride 3 overlaps") && Contains(">= 4"));
    v = good;
    v.stride_head = 16;  // heads of 8 tokens x 4 need 32
    CHECK_THAT(validate_message(v), Contains("head stride 16 overlaps"));
    v = good;
    v.stride_dim = 0;  // every element of a row aliases
    CHECK_THAT(validate_message(v), Contains("overlaps"));
    v = good;
    v.stride_layer = v.stride_head;  // layer 1 head 0 == layer 0 head 1
    CHECK_THAT(validate_message(v), Contains("overlaps"));
  }
  SECTION("null data") {
    auto v = good;
    v.data = nullptr;
    CHECK_THAT(validate_message(v, "queries"), Contains("queries: null data pointer"));
    // An empty view needs no memory.
    v.tokens = 0;
    CHECK(validate_message(v).empty());
  }
  SECTION("extent-1 dimensions may have any stride") {
    auto v = KVView<float>::hnd(buf.data(), 1, 1, 8, 4);
    v.stride_layer = 0;
    v.stride_head = 1;
    CHECK(validate_message(v).empty());
  }
}

TEST_CASE("KVView validate never accepts an aliasing view (brute force)", "[core]") {
  kvtest::Rng rng(7);
  std::vector<float> buf(4096);
  int accepted = 0, rejected = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    KVView<float> v{buf.data(),         rng.integer(1, 3), rng.integer(1, 3), rng.integer(1, 3),
                    rng.integer(1, 3),  rng.integer(0, 30), rng.integer(0, 12), rng.integer(0, 6),
                    rng.integer(0, 4)};
    std::set<std::int64_t> offsets;
    bool aliases = false;
    for (std::int64_t l = 0; l < v.layers; ++l)
      for (std::int64_t h = 0; h < v.heads; ++h)
        for (std::int64_t t = 0; t < v.tokens; ++t)
          for (std::int64_t i = 0; i < v.dim; ++i)
            aliases |= !offsets.insert(&v.at(l, h, t, i) - buf.data()).second;
    if (validate_message(v).empty()) {
      ++accepted;
      INFO("strides " << v.stride_layer << "," << v.stride_head << "," << v.stride_token << ","
                      << v.stride_dim << " extents " << v.layers << "," << v.heads << ","
                      << v.tokens << "," << v.dim);
      REQUIRE_FALSE(aliases);
    } else {
      ++rejected;
    }
  }
  CHECK(accepted > 100);  // the property was exercised both ways
  CHECK(rejected > 100);
}

TEMPLATE_TEST_CASE("require_finite names the non-finite element", "[core]", float,
                   kvpolicy::half, kvpolicy::bfloat16) {
  kvtest::Rng rng(3);
  auto data = rng.normals<TestType>(2 * 3 * 4 * 5);
  auto v = KVView<TestType>::nhd(data.data(), 2, 3, 4, 5);
  CHECK_NOTHROW(kvpolicy::require_finite(v, "keys"));
  v.at(1, 2, 3, 4) = kvpolicy::from_float<TestType>(std::numeric_limits<float>::quiet_NaN());
  CHECK_THROWS_WITH(kvpolicy::require_finite(v, "keys"),
                    Contains("keys contains a non-finite value") &&
                        Contains("layer 1, head 2, token 3, dim 4"));
  v.at(1, 2, 3, 4) = kvpolicy::from_float<TestType>(0.5f);
  v.at(0, 1, 0, 2) = kvpolicy::from_float<TestType>(-std::numeric_limits<float>::infinity());
  CHECK_THROWS_WITH(kvpolicy::require_finite(v, "values"),
                    Contains("values contains a non-finite value (-inf)") &&
                        Contains("layer 0, head 1, token 0, dim 2"));
}

TEST_CASE("KVView validate rejects extents and strides beyond the address space (fuzz_c_api "
          "regression)", "[core]") {
  // Found by fuzz_c_api: an empty view ([2^62][4][0][1]) passed validate() and its L * H rows
  // then overflowed sizes computed from it; a stride times its extent overflowed inside the
  // aliasing check.
  std::vector<float> buf(64);
  const std::int64_t big = std::int64_t{1} << 62;
  CHECK_THAT(validate_message(KVView<float>{buf.data(), big, 4, 0, 1, 0, 0, 0, 1}),
             Contains("keys: extents span more elements than the address space holds"));
  CHECK_THAT(validate_message(KVView<float>{nullptr, 1, big, 0, 2, 0, 0, 0, 1}),
             Contains("address space"));
  CHECK(validate_message(KVView<float>{nullptr, big / 8, 1, 0, 1, 0, 0, 0, 1}).empty());
  KVView<float> v = KVView<float>::hnd(buf.data(), 1, 2, 3, 4);
  v.stride_token = big;  // token 2 sits at 2^63
  CHECK_THAT(validate_message(v), Contains("token stride 4611686018427387904 x 2 reaches past"));
  v.stride_token = 4;
  v.stride_head = std::numeric_limits<std::int64_t>::max();
  CHECK_THAT(validate_message(v), Contains("head stride") && Contains("reaches past"));
}

TEST_CASE("require_finite returns at once for an empty view (fuzz_c_api regression)", "[core]") {
  // Found by fuzz_c_api: queries [1][2^40][0][4] (valid: empty) made require_finite walk 2^40
  // heads of nothing, a hang of hours.
  std::vector<float> one(1);
  const KVView<float> v{one.data(), 1, std::int64_t{1} << 40, 0, 4, 0, 0, 4, 1};
  REQUIRE(validate_message(v).empty());
  CHECK_NOTHROW(kvpolicy::require_finite(v, "queries"));
}

}  // namespace kvt_core_kv_view
