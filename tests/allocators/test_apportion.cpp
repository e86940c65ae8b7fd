// The integer apportionment every allocator relies on: exact totals, bounds, rounding, and the
// water-filling that redistributes clipped budgets.
#include <cmath>
#include <vector>

#include "allocators/alloc_util.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_allocators_apportion {

using namespace kvpolicy;
using Catch::Contains;

TEST_CASE("round_to_total: exact targets come back unchanged", "[allocators][apportion]") {
  const std::vector<double> y = {936, 645.3333, 354.6667, 64};
  const std::vector<std::int64_t> lo(4, 0), hi(4, 1000);
  CHECK(alloc::round_to_total(y, 2000, lo, hi, "t") == std::vector<std::int64_t>{936, 645, 355, 64});
  // Half to even, like Python's round(): 2.5 -> 2, 3.5 -> 4.
  CHECK(alloc::round_to_total(std::vector<double>{2.5, 3.5}, 6, std::vector<std::int64_t>{0, 0},
                              std::vector<std::int64_t>{9, 9}, "t") ==
        std::vector<std::int64_t>{2, 4});
}

TEST_CASE("round_to_total: corrections go where rounding lost the most", "[allocators][apportion]") {
  const std::vector<std::int64_t> lo(3, 0), hi(3, 100);
  // 10.4 + 10.4 + 10.2 = 31: rounded 10+10+10 = 30; the unit goes to the first 10.4.
  CHECK(alloc::round_to_total(std::vector<double>{10.4, 10.4, 10.2}, 31, lo, hi, "t") ==
        std::vector<std::int64_t>{11, 10, 10});
  // 10.6 * 3 = 31.8 -> rounded 33, total 31: two units come off the ones above their targets.
  CHECK(alloc::round_to_total(std::vector<double>{10.6, 10.6, 10.6}, 31, lo, hi, "t") ==
        std::vector<std::int64_t>{10, 10, 11});
  // Bounds win over targets; the rest is spread.
  CHECK(alloc::round_to_total(std::vector<double>{50, 0, 0}, 30, std::vector<std::int64_t>{0, 5, 5},
                              std::vector<std::int64_t>{20, 100, 100}, "t") ==
        std::vector<std::int64_t>{20, 5, 5});
  REQUIRE_THROWS_WITH(alloc::round_to_total(std::vector<double>{1, 1}, 50,
                                            std::vector<std::int64_t>{0, 0},
                                            std::vector<std::int64_t>{10, 10}, "who"),
                      Contains("who: cannot split 50 tokens"));
}

TEST_CASE("round_to_total: random targets sum exactly within bounds", "[allocators][apportion]") {
  kvtest::Rng rng(5);
  for (int it = 0; it < 300; ++it) {
    const auto n = static_cast<std::size_t>(rng.integer(1, 12));
    std::vector<double> y(n);
    std::vector<std::int64_t> lo(n), hi(n);
    std::int64_t lo_sum = 0, hi_sum = 0;
    for (std::size_t i = 0; i < n; ++i) {
      lo[i] = rng.integer(0, 20);
      hi[i] = lo[i] + rng.integer(0, 50);
      y[i] = rng.uniform(-10, 80);
      lo_sum += lo[i];
      hi_sum += hi[i];
    }
    const std::int64_t total = rng.integer(lo_sum, hi_sum);
    const auto x = alloc::round_to_total(y, total, lo, hi, "t");
    REQUIRE(alloc_test::sum(x) == total);
    for (std::size_t i = 0; i < n; ++i) {
      REQUIRE(x[i] >= lo[i]);
      REQUIRE(x[i] <= hi[i]);
    }
  }
}

TEST_CASE("water_fill: clipped shares are redistributed in proportion", "[allocators][apportion]") {
  const std::vector<double> lo(4, 0.0), hi(4, 150.0);
  auto y = alloc::water_fill(std::vector<double>{1, 1, 1, 5}, 400, lo, hi);
  CHECK(y[3] == Approx(150));
  for (int i = 0; i < 3; ++i) CHECK(y[static_cast<std::size_t>(i)] == Approx(250.0 / 3));
  // All-zero weights: equal shares.
  y = alloc::water_fill(std::vector<double>{0, 0}, 10, std::vector<double>{0, 0},
                        std::vector<double>{10, 10});
  CHECK(y[0] == Approx(5));
  CHECK(y[1] == Approx(5));
  // Lower bounds lift zero-weight entries; the others share what is left.
  y = alloc::water_fill(std::vector<double>{0, 1, 1, 1}, 160, std::vector<double>(4, 10.0),
                        std::vector<double>(4, 1000.0));
  CHECK(y[0] == Approx(10));
  CHECK(y[1] == Approx(50));
}

}  // namespace kvt_allocators_apportion
