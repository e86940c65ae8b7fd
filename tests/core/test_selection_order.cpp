// Selection::validate and the library's top-k total order (topk_key).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <kvpolicy/core/selection.hpp>
#include <kvpolicy/core/topk_key.hpp>

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_core_selection_order {

using Catch::Matchers::Contains;

TEST_CASE("orderable_bits is monotone, merges -0/+0 and puts NaN lowest", "[core]") {
  const float inf = std::numeric_limits<float>::infinity();
  const float den = std::numeric_limits<float>::denorm_min();
  const std::vector<float> ascending = {-inf, -std::numeric_limits<float>::max(), -1e10f, -2.f,
                                        -1.f, -den, 0.f, den, 1e-30f, 1.f, 1.0000001f, 3e38f,
                                        std::numeric_limits<float>::max(), inf};
  for (std::size_t i = 1; i < ascending.size(); ++i) {
    INFO(ascending[i - 1] << " < " << ascending[i]);
    CHECK(kvpolicy::orderable_bits(ascending[i - 1]) < kvpolicy::orderable_bits(ascending[i]));
  }
  CHECK(kvpolicy::orderable_bits(-0.0f) == kvpolicy::orderable_bits(0.0f));
  CHECK(kvpolicy::orderable_bits(std::nanf("")) < kvpolicy::orderable_bits(-inf));
}

TEST_CASE("topk_key orders by score, then by the more recent index", "[core]") {
  using kvpolicy::topk_key;
  CHECK(topk_key(2.f, 0) > topk_key(1.f, 100));
  CHECK(topk_key(1.f, 7) > topk_key(1.f, 6));
  CHECK(topk_key(-0.f, 5) > topk_key(0.f, 4));  // -0 ties with +0; recency decides
  CHECK(topk_key(0.f, 5) > topk_key(-0.f, 4));
  CHECK(topk_key(-1.f, 1000000) < topk_key(-0.5f, 0));
  CHECK(kvpolicy::topk_key_index(topk_key(-3.5f, 123456)) == 123456);
  CHECK(kvpolicy::topk_key_index(topk_key(1e20f, 0x7fffffff)) == 0x7fffffff);
}

TEST_CASE("Selection validate rejects out-of-range and unsorted lists", "[core]") {
  kvpolicy::Selection sel(2, 3);
  CHECK(sel.layers() == 2);
  CHECK(sel.heads() == 3);
  sel.kept(1, 2) = {0, 3, 9};
  sel.kept(0, 0) = {4};
  CHECK(sel.count(1, 2) == 3);
  CHECK(sel.count(0, 1) == 0);
  CHECK(sel.total() == 4);
  CHECK_NOTHROW(sel.validate(10));
  CHECK_THROWS_WITH(sel.validate(9),
                    Contains("index 9 at layer 1, head 2 is outside [0, 9)"));
  sel.kept(0, 1) = {-1};
  CHECK_THROWS_WITH(sel.validate(10), Contains("index -1 at layer 0, head 1"));
  sel.kept(0, 1) = {2, 2};
  CHECK_THROWS_WITH(sel.validate(10),
                    Contains("layer 0, head 1 are not strictly ascending"));
  sel.kept(0, 1) = {5, 3};
  CHECK_THROWS_AS(sel.validate(10), kvpolicy::Error);
}

}  // namespace kvt_core_selection_order
