// cpu::select / cpu::select_row: counts, protection, order, ties and errors.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include <kvpolicy/cpu/select.hpp>

#include "common/random.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_ops_select {

using kvpolicy::Protect;
using Catch::Matchers::Contains;

namespace {

std::vector<std::int32_t> select_row(const std::vector<float>& s, std::int64_t budget, Protect p) {
  std::vector<std::int32_t> kept;
  std::vector<std::uint64_t> scratch;
  kvpolicy::cpu::select_row(s, budget, p, kept, scratch);
  return kept;
}

// Reference: protected tokens plus the best others by (score desc, index desc), by full sort.
std::vector<std::int32_t> reference(const std::vector<float>& s, std::int64_t budget, Protect p) {
  const auto T = static_cast<std::int64_t>(s.size());
  std::vector<std::int32_t> kept;
  if (budget >= T) {
    kept.resize(s.size());
    std::iota(kept.begin(), kept.end(), 0);
    return kept;
  }
  std::vector<std::int32_t> others;
  for (std::int64_t j = 0; j < T; ++j) {
    if (j < p.sinks || j >= T - p.recent) kept.push_back(static_cast<std::int32_t>(j));
    else others.push_back(static_cast<std::int32_t>(j));
  }
  std::sort(others.begin(), others.end(), [&](std::int32_t a, std::int32_t b) {
    const float sa = s[static_cast<std::size_t>(a)], sb = s[static_cast<std::size_t>(b)];
    return sa != sb ? sa > sb : a > b;
  });
  const std::size_t m = static_cast<std::size_t>(budget) - kept.size();
  kept.insert(kept.end(), others.begin(), others.begin() + static_cast<std::ptrdiff_t>(m));
  std::sort(kept.begin(), kept.end());
  return kept;
}

}  // namespace

TEST_CASE("select_row keeps exactly the budget: protected tokens plus the best others", "[ops]") {
  kvtest::Rng rng(21);
  for (int trial = 0; trial < 400; ++trial) {
    const std::int64_t T = rng.integer(1, 120);
    const Protect p{rng.integer(0, 4), rng.integer(0, 8)};
    const std::int64_t n_prot = std::min(T, p.sinks + p.recent);
    const std::int64_t budget = rng.integer(n_prot, T + 3);
    std::vector<float> s(static_cast<std::size_t>(T));
    // Few distinct values, so ties are frequent.
    for (auto& x : s) x = trial % 2 ? rng.normal() : static_cast<float>(rng.integer(-3, 3));
    INFO("trial " << trial << " T=" << T << " budget=" << budget << " sinks=" << p.sinks
                  << " recent=" << p.recent);
    const auto kept = select_row(s, budget, p);
    REQUIRE(static_cast<std::int64_t>(kept.size()) == std::min(budget, T));
    REQUIRE(std::adjacent_find(kept.begin(), kept.end(), std::greater_equal<>()) == kept.end());
    for (std::int64_t j = 0; j < T; ++j)
      if (j < p.sinks || j >= T - p.recent)
        REQUIRE(std::binary_search(kept.begin(), kept.end(), static_cast<std::int32_t>(j)));
    REQUIRE(kept == reference(s, budget, p));
  }
}

TEST_CASE("select_row ties prefer the more recent token, and -0.0 ties with +0.0", "[ops]") {
  CHECK(select_row(std::vector<float>(8, 1.f), 3, {0, 0}) == std::vector<std::int32_t>{5, 6, 7});
  CHECK(select_row(std::vector<float>(8, 1.f), 3, {1, 1}) == std::vector<std::int32_t>{0, 6, 7});
  CHECK(select_row({0.f, -0.f, 0.f, -0.f, -0.f, 0.f}, 2, {0, 0}) ==
        std::vector<std::int32_t>{4, 5});
  CHECK(select_row({-0.f, 0.f, -0.f, 0.f, -0.f, -0.f}, 3, {0, 0}) ==
        std::vector<std::int32_t>{3, 4, 5});
  // Higher scores win over recency; negative scores and infinities order correctly.
  const float inf = std::numeric_limits<float>::infinity();
  CHECK(select_row({5.f, -1.f, -0.5f, -inf, -2.f}, 2, {0, 0}) == std::vector<std::int32_t>{0, 2});
  CHECK(select_row({-inf, inf, 0.f, -inf, 1e-45f}, 2, {0, 0}) == std::vector<std::int32_t>{1, 4});
  CHECK(select_row({-inf, -inf, -inf}, 1, {0, 0}) == std::vector<std::int32_t>{2});
}

TEST_CASE("select_row: budget >= T keeps everything, budget 0 keeps nothing", "[ops]") {
  const std::vector<float> s = {3, 1, 2};
  CHECK(select_row(s, 3, {0, 0}) == std::vector<std::int32_t>{0, 1, 2});
  CHECK(select_row(s, 100, {5, 5}) == std::vector<std::int32_t>{0, 1, 2});
  // NaN scores do not matter when nothing is evicted.
  CHECK(select_row({std::nanf(""), 1.f}, 2, {0, 0}) == std::vector<std::int32_t>{0, 1});
  CHECK(select_row(s, 0, {0, 0}).empty());
  // Output vectors are reused across rows: each call replaces the previous contents.
  std::vector<std::int32_t> kept;
  std::vector<std::uint64_t> scratch;
  kvpolicy::cpu::select_row(s, 2, {0, 0}, kept, scratch);
  CHECK(kept == std::vector<std::int32_t>{0, 2});
  kvpolicy::cpu::select_row(s, 3, {0, 0}, kept, scratch);
  CHECK(kept == std::vector<std::int32_t>{0, 1, 2});
  kvpolicy::cpu::select_row(s, 1, {0, 0}, kept, scratch);
  CHECK(kept == std::vector<std::int32_t>{0});
  CHECK(select_row({}, 0, {0, 0}).empty());
  // The recent tokens alone fill the budget.
  CHECK(select_row({1, 2, 3, 4}, 3, {0, 3}) == std::vector<std::int32_t>{1, 2, 3});
}

TEST_CASE("select_row errors: budget below the protected count, NaN scores", "[ops]") {
  const std::vector<float> s(20, 1.f);
  CHECK_THROWS_WITH(select_row(s, 4, {2, 3}),
                    Contains("budget of 4 tokens is below the 5 protected tokens (2 sinks + 3 recent)"));
  CHECK_THROWS_AS(select_row(s, -1, {0, 0}), kvpolicy::Error);
  std::vector<float> n(20, 1.f);
  n[7] = std::nanf("");
  CHECK_THROWS_WITH(select_row(n, 10, {2, 2}), Contains("score of token 7 is NaN"));
  // A NaN inside the protected region is never compared, so it is not an error.
  n[7] = 1.f;
  n[0] = std::nanf("");
  CHECK(select_row(n, 5, {1, 1}).size() == 5);
}

TEST_CASE("select over a ScoreMap: per-row budgets and validation", "[ops]") {
  kvtest::Rng rng(4);
  const std::int64_t L = 2, H = 3, T = 50;
  kvpolicy::ScoreMap scores(L, H, T);
  for (std::int64_t i = 0; i < L * H * T; ++i) scores.data()[i] = rng.normal();
  const std::vector<std::int64_t> budgets = {0, 5, 17, 49, 50, 60};
  const Protect p{0, 0};
  kvpolicy::Selection sel;
  kvpolicy::cpu::select(kvpolicy::cpu_backend{2}, scores, budgets, p, sel);
  REQUIRE(sel.layers() == L);
  REQUIRE(sel.heads() == H);
  for (std::int64_t r = 0; r < L * H; ++r) {
    auto row = scores.row(r / H, r % H);
    const std::vector<float> s(row.begin(), row.end());
    const auto k = sel.kept(r / H, r % H);
    CHECK(std::vector<std::int32_t>(k.begin(), k.end()) == reference(s, budgets[static_cast<std::size_t>(r)], p));
  }
  const std::vector<std::int64_t> short_budgets = {1, 2, 3};
  CHECK_THROWS_WITH(kvpolicy::cpu::select(kvpolicy::cpu_backend{1}, scores, short_budgets, p, sel),
                    Contains("select: 3 budgets for 6 (layer, head) rows"));
  const std::vector<std::int64_t> negative = {1, 2, 3, -4, 5, 6};
  CHECK_THROWS_WITH(kvpolicy::cpu::select(kvpolicy::cpu_backend{1}, scores, negative, p, sel),
                    Contains("select: negative budget -4"));
  // An error in one row's worker (protected count) reaches the caller.
  const std::vector<std::int64_t> low = {10, 10, 10, 10, 2, 10};
  CHECK_THROWS_WITH(kvpolicy::cpu::select(kvpolicy::cpu_backend{2}, scores, low, {1, 2}, sel),
                    Contains("budget of 2 tokens is below the 3 protected tokens"));
}

}  // namespace kvt_ops_select
