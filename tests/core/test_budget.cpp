// Budget resolution (ratio / tokens / total) and rejection of bad budgets.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include <kvpolicy/core/budget.hpp>

#include "common/random.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_core_budget {

using kvpolicy::Budget;
using Catch::Matchers::Contains;

namespace {
std::int64_t sum(const std::vector<std::int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), std::int64_t{0});
}
}  // namespace

TEST_CASE("Budget resolves to exact integers that sum to the global budget", "[core]") {
  kvtest::Rng rng(11);
  for (int trial = 0; trial < 600; ++trial) {
    const std::int64_t L = rng.integer(1, 6), H = rng.integer(1, 8), T = rng.integer(0, 300);
    const std::int64_t rows = L * H;
    INFO("L=" << L << " H=" << H << " T=" << T);

    const double r = trial % 10 == 0 ? (trial % 20 == 0 ? 0.0 : 1.0) : rng.uniform(0.0, 1.0);
    const auto br = Budget::ratio(r).resolve(L, H, T);
    REQUIRE(static_cast<std::int64_t>(br.size()) == rows);
    const std::int64_t per = std::llround(r * static_cast<double>(T));
    for (auto b : br) REQUIRE(b == per);
    REQUIRE(sum(br) == Budget::ratio(r).global(L, H, T));

    const std::int64_t n = rng.integer(0, 2 * T + 1);
    const auto bt = Budget::tokens(n).resolve(L, H, T);
    REQUIRE(static_cast<std::int64_t>(bt.size()) == rows);
    for (auto b : bt) REQUIRE(b == std::min(n, T));
    REQUIRE(sum(bt) == rows * std::min(n, T));
    REQUIRE(Budget::tokens(n).global(L, H, T) == rows * std::min(n, T));

    const std::int64_t total = rng.integer(0, rows * T + rows * T / 4 + 2);
    const auto bg = Budget::total(total).resolve(L, H, T);
    REQUIRE(static_cast<std::int64_t>(bg.size()) == rows);
    REQUIRE(sum(bg) == std::min(total, rows * T));
    REQUIRE(Budget::total(total).global(L, H, T) == std::min(total, rows * T));
    const auto [lo, hi] = std::minmax_element(bg.begin(), bg.end());
    REQUIRE(*hi - *lo <= 1);
    REQUIRE(*lo >= 0);
    REQUIRE(*hi <= T);
    REQUIRE(std::is_sorted(bg.rbegin(), bg.rend()));  // the remainder goes to the first rows
  }
}

TEST_CASE("Budget resolve: hand-checked values", "[core]") {
  using V = std::vector<std::int64_t>;
  CHECK(Budget::total(10).resolve(1, 3, 100) == V{4, 3, 3});
  CHECK(Budget::total(11).resolve(2, 2, 100) == V{3, 3, 3, 2});
  CHECK(Budget::total(1000).resolve(1, 2, 7) == V{7, 7});  // capped at every token
  CHECK(Budget::ratio(0.25).resolve(1, 2, 10) == V{3, 3});  // llround(2.5) == 3
  CHECK(Budget::ratio(0.5).resolve(2, 1, 9) == V{5, 5});
  CHECK(Budget::tokens(5).resolve(1, 2, 3) == V{3, 3});
  CHECK(Budget::tokens(0).resolve(1, 2, 3) == V{0, 0});
  CHECK(Budget::ratio(1.0).resolve(1, 1, 0) == V{0});
}

TEST_CASE("Budget: token counts up to INT64_MAX come back as integers (fuzz_spec regression)",
          "[core]") {
  // A double holds INT64_MAX as 2^63: converting that back to int64 overflowed.
  using V = std::vector<std::int64_t>;
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  CHECK(Budget::tokens(kMax).count() == kMax);
  CHECK(Budget::total(kMax).count() == kMax);
  CHECK(Budget::tokens(std::int64_t{1} << 62).count() == std::int64_t{1} << 62);
  CHECK(Budget::tokens(kMax).resolve(2, 2, 10) == V{10, 10, 10, 10});
  CHECK(Budget::total(kMax).resolve(1, 3, 7) == V{7, 7, 7});
}

TEST_CASE("Budget rejects negative, NaN, infinite and >1-ratio budgets with messages", "[core]") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  CHECK_THROWS_WITH(Budget::ratio(-0.1).validate(), Contains("budget is negative (-0.1)"));
  CHECK_THROWS_WITH(Budget::ratio(1.5).resolve(1, 1, 10), Contains("budget ratio 1.5 is above 1"));
  CHECK_THROWS_WITH(Budget::ratio(nan).resolve(1, 1, 10), Contains("not a finite number"));
  CHECK_THROWS_WITH(Budget::ratio(inf).global(1, 1, 10), Contains("not a finite number"));
  CHECK_THROWS_WITH(Budget::tokens(-3).resolve(2, 2, 10), Contains("budget is negative (-3)"));
  CHECK_THROWS_WITH(Budget::total(-1).global(2, 2, 10), Contains("budget is negative (-1)"));
  CHECK_THROWS_AS(Budget::ratio(nan).validate(), kvpolicy::Error);
  // Messages carry the library prefix.
  CHECK_THROWS_WITH(Budget::tokens(-3).validate(), Contains("kvpolicy: "));
  // Boundary values are valid.
  CHECK_NOTHROW(Budget::ratio(0.0).validate());
  CHECK_NOTHROW(Budget::ratio(1.0).validate());
  CHECK_NOTHROW(Budget::tokens(0).validate());
  CHECK_NOTHROW(Budget::tokens(std::int64_t{1} << 40).validate());
}

}  // namespace kvt_core_budget
