// Ada-KV: heads with concentrated scores give budget to heads with flat ones, the alpha
// safeguard holds, the layer's budget is conserved exactly, ties are deterministic, and the kept
// sets through a full Policy are the per-head prefixes of the cross-head top-k.
#include <algorithm>
#include <tuple>
#include <vector>

#include "allocators/alloc_util.hpp"
#include "scorers/naive.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_allocators_adakv {

using namespace kvpolicy;
using alloc_test::context;
using Catch::Contains;

namespace {

ScoreMap rows(const std::vector<std::vector<float>>& r) {  // one layer, a head per entry
  ScoreMap s(1, static_cast<std::int64_t>(r.size()), static_cast<std::int64_t>(r[0].size()));
  for (std::size_t h = 0; h < r.size(); ++h)
    std::copy(r[h].begin(), r[h].end(), s.row(0, static_cast<std::int64_t>(h)).begin());
  return s;
}

std::vector<std::int64_t> run(double alpha, ScoreMap s, std::vector<std::int64_t> b,
                              Protect p = {}) {
  AdaKV a;
  a.alpha = alpha;
  a.allocate(context(s, p), b);
  return b;
}

// Straight from the description: per layer, each head's safeguard, then a sort of everything
// left across heads by (score desc, index desc, head desc).
std::vector<std::int64_t> naive_adakv(const ScoreMap& s, std::vector<std::int64_t> b, Protect p,
                                      double alpha) {
  const std::int64_t L = s.layers(), H = s.heads(), T = s.tokens();
  const std::int64_t sinks = std::min(p.sinks, T), rb = std::max(sinks, T - p.recent);
  const std::int64_t P = sinks + T - rb;
  for (std::int64_t l = 0; l < L; ++l) {
    std::vector<std::tuple<float, std::int64_t, std::int64_t>> pool;  // score, index, head
    std::int64_t free = 0;
    for (std::int64_t h = 0; h < H; ++h) {
      auto& bh = b[static_cast<std::size_t>(l * H + h)];
      const std::int64_t keep =
          std::min(bh, std::max(P, static_cast<std::int64_t>(std::floor(alpha * bh))));
      free += bh - keep;
      std::vector<std::pair<float, std::int64_t>> own;
      for (std::int64_t j = sinks; j < rb; ++j) own.emplace_back(s.row(l, h)[j], j);
      std::sort(own.begin(), own.end(), std::greater<>());
      for (std::size_t i = static_cast<std::size_t>(keep - P); i < own.size(); ++i)
        pool.emplace_back(own[i].first, own[i].second, h);
      bh = keep;
    }
    std::sort(pool.begin(), pool.end(), std::greater<>());
    for (std::int64_t i = 0; i < free; ++i)
      ++b[static_cast<std::size_t>(l * H + std::get<2>(pool[static_cast<std::size_t>(i)]))];
  }
  return b;
}

}  // namespace

TEST_CASE("adakv: concentrated heads give budget to flat heads, by hand", "[allocators][adakv]") {
  std::vector<float> peaked(10, 0.1f), flat(10, 0.5f);
  peaked[3] = 0.9f;
  // B = 5 per head, alpha 0.2: each head keeps its best floor(0.2 * 5) = 1; the other 8 go to
  // the best remaining scores of the layer, all in the flat head (0.5 > 0.1).
  CHECK(run(0.2, rows({peaked, flat}), {5, 5}) == std::vector<std::int64_t>{1, 9});
  CHECK(run(0.2, rows({flat, peaked}), {5, 5}) == std::vector<std::int64_t>{9, 1});
  // alpha = 1: every head keeps its own budget.
  CHECK(run(1.0, rows({peaked, flat}), {5, 5}) == std::vector<std::int64_t>{5, 5});
  // alpha = 0: a pure top-10 across both heads: 0.9 of head 0, then nine 0.5 of head 1.
  CHECK(run(0.0, rows({peaked, flat}), {5, 5}) == std::vector<std::int64_t>{1, 9});
  // Ties across heads: the more recent token first, then the higher head.
  CHECK(run(0.0, rows({std::vector<float>(4, 1.f), std::vector<float>(4, 1.f)}), {1, 2}) ==
        std::vector<std::int64_t>{1, 2});  // keys (1.0, 3, head 1) > (1.0, 3, head 0) > (1.0, 2, h1)
}

TEST_CASE("adakv: the alpha safeguard holds", "[allocators][adakv]") {
  // Head 0 scores lowest everywhere, yet keeps floor(0.2 * 10) = 2.
  CHECK(run(0.2, rows({std::vector<float>(20, 0.f), std::vector<float>(20, 1.f)}), {10, 10}) ==
        std::vector<std::int64_t>{2, 18});
  CHECK(run(0.35, rows({std::vector<float>(20, 0.f), std::vector<float>(20, 1.f)}), {10, 10}) ==
        std::vector<std::int64_t>{3, 17});
  // Protected tokens (1 sink + 2 recent) count toward the safeguard and are never given away:
  // max(3, floor(0.2 * 6)) = 3 for head 0; the 6 free tokens go to head 1's 7 middle tokens.
  CHECK(run(0.2, rows({std::vector<float>(10, 0.f), std::vector<float>(10, 1.f)}), {6, 6},
            {1, 2}) == std::vector<std::int64_t>{3, 9});
}

TEST_CASE("adakv: random layers match the naive reference exactly", "[allocators][adakv]") {
  kvtest::Rng rng(23);
  for (int it = 0; it < 300; ++it) {
    const std::int64_t L = rng.integer(1, 4), H = rng.integer(1, 6), T = rng.integer(1, 200);
    const Protect p{rng.integer(0, 4), rng.integer(0, 16)};
    const double alpha = rng.integer(0, 5) * 0.1;
    const ScoreMap s = alloc_test::random_scores(rng, L, H, T, rng.integer(0, 1) ? 4 : 0);
    std::vector<std::int64_t> b(static_cast<std::size_t>(L * H));
    for (auto& x : b) x = rng.integer(p.total(T), T);
    INFO("L=" << L << " H=" << H << " T=" << T << " alpha=" << alpha);
    const auto got = run(alpha, s, b, p);
    REQUIRE(got == naive_adakv(s, b, p, alpha));
    for (std::int64_t l = 0; l < L; ++l) {
      std::int64_t before = 0, after = 0;
      for (std::int64_t h = 0; h < H; ++h) {
        const auto r = static_cast<std::size_t>(l * H + h);
        before += b[r];
        after += got[r];
        REQUIRE(got[r] >= std::max(p.total(T),
                                   std::min(b[r], static_cast<std::int64_t>(alpha * b[r]))));
        REQUIRE(got[r] <= T);
      }
      REQUIRE(after == before);  // conserved per layer
    }
  }
}

TEST_CASE("adakv: long rows (the histogram's edge bucket, ties across heads) match the naive "
          "reference", "[allocators][adakv]") {
  // adakv finds the pool's best entries by histograms of the keys' top bits (12 at a time): scores in
  // [1, 2) share sign and exponent, so thousands of entries land in each bucket and the edge
  // bucket is partly sorted; a few score levels make equal keys in several heads (same token,
  // same score), which the head order breaks; negative and zero scores, other buckets.
  kvtest::Rng rng(29);
  for (int it = 0; it < 12; ++it) {
    const std::int64_t L = 2, H = rng.integer(2, 6), T = rng.integer(1000, 3000);
    const Protect p{rng.integer(0, 4), rng.integer(0, 64)};
    const double alpha = rng.integer(0, 3) * 0.1;
    ScoreMap s = alloc_test::random_scores(rng, L, H, T, it % 3 == 0 ? 5 : 0);
    for (std::int64_t i = 0; i < L * H * T; ++i) {
      float& x = s.data()[i];
      if (it % 3 == 1) x += 1.0f;           // one exponent
      if (it % 3 == 2) x = 4.0f * x - 2.0f;  // both signs
    }
    std::vector<std::int64_t> b(static_cast<std::size_t>(L * H));
    for (auto& x : b) x = rng.integer(p.total(T), T / 3);
    INFO("it=" << it << " H=" << H << " T=" << T << " alpha=" << alpha);
    REQUIRE(run(alpha, s, b, p) == naive_adakv(s, b, p, alpha));
  }
}

TEST_CASE("adakv: the radix select matches the naive reference on narrow ranges and special "
          "values, with any thread count", "[allocators][adakv]") {
  // adakv selects the pool's best entries 12 bits of the score at a time (two histogram levels,
  // then the entries sharing the 24-bit edge prefix): scores that differ only in their low
  // mantissa bits put the whole pool in one level-1 (and level-2) bucket; -0 / +0, the smallest
  // subnormals and huge values sit at the ends of the order. The per-head passes run on the
  // context's backend: the budgets may not depend on its thread count (null: no backend).
  // The calls run one after another on this thread with H going up and down, so the
  // allocator's per-thread buffers are reused at other sizes (a stale head row must not count).
  kvtest::Rng rng(41);
  for (int it = 0; it < 12; ++it) {
    const std::int64_t L = 2, H = rng.integer(1, 7), T = rng.integer(700, 2500);
    const Protect p{rng.integer(0, 3), rng.integer(0, 40)};
    const double alpha = rng.integer(0, 4) * 0.1;  // > 0: some heads' safeguards exceed P
    ScoreMap s = alloc_test::random_scores(rng, L, H, T, it % 4 == 3 ? 7 : 0);
    const float specials[] = {0.0f, -0.0f, 1e-45f, -1e-45f, 3e38f, -3e38f, 1.17549435e-38f};
    for (std::int64_t i = 0; i < L * H * T; ++i) {
      float& x = s.data()[i];
      if (it % 4 == 0) x = 1.5f + std::ldexp(x, -16);             // 7 low mantissa bits differ
      if (it % 4 == 1) x = std::nextafter(1.0f, 2.0f) * (x < 0.5f ? 1.0f : 1.0f + 0x1p-22f);  // 2 values
      if (it % 4 == 2 && rng.integer(0, 9) == 0) x = specials[rng.integer(0, 6)];
    }
    std::vector<std::int64_t> b(static_cast<std::size_t>(L * H));
    for (auto& x : b) x = rng.integer(p.total(T), T - 1);
    INFO("it=" << it << " H=" << H << " T=" << T << " alpha=" << alpha);
    const std::vector<std::int64_t> want = naive_adakv(s, b, p, alpha);
    AdaKV a;
    a.alpha = alpha;
    for (int threads : {0, 1, 2, 3}) {
      const cpu_backend be{threads};
      AllocContext ctx = context(s, p);
      if (threads > 0) ctx.backend = &be;
      std::vector<std::int64_t> got = b;
      a.allocate(ctx, got);
      INFO("threads=" << threads);
      REQUIRE(got == want);
    }
  }
}

TEST_CASE("adakv: kept sets through a Policy are physically ragged", "[allocators][adakv]") {
  kvtest::Rng rng(8);
  const std::int64_t L = 2, H = 4, T = 96, B = 30;
  const auto c = naive::random_case<float>(rng, L, H, 2, T, 16, 8, Layout::HND);
  ScoreMap scores;
  const Selection sel =
      Policy("snapkv(window=8,sinks=2) | adakv").select(cpu_backend{2}, c.inputs(),
                                                        Budget::tokens(B), &scores);
  alloc_test::require_valid(sel, T, {2, 8});
  bool ragged = false;
  for (std::int64_t l = 0; l < L; ++l) {
    std::int64_t total = 0;
    for (std::int64_t h = 0; h < H; ++h) {
      total += sel.count(l, h);
      ragged = ragged || sel.count(l, h) != B;
      CHECK(sel.count(l, h) >= std::max<std::int64_t>(10, static_cast<std::int64_t>(0.2 * B)));
      // Each head keeps its own best: every kept unprotected token outscores every dropped one.
      auto k = sel.kept(l, h);
      std::vector<char> in(T, 0);
      for (auto j : k) in[static_cast<std::size_t>(j)] = 1;
      float worst_kept = 1e30f, best_dropped = -1e30f;
      for (std::int64_t j = 2; j < T - 8; ++j) {
        const float x = scores.row(l, h)[j];
        if (in[static_cast<std::size_t>(j)])
          worst_kept = std::min(worst_kept, x);
        else
          best_dropped = std::max(best_dropped, x);
      }
      CHECK(worst_kept >= best_dropped);
    }
    CHECK(total == H * B);
  }
  CHECK(ragged);
  // The same through the compile-time pipeline.
  SnapKV snap;
  snap.window = 8;
  snap.sinks = 2;
  const Selection sel2 =
      Pipeline<SnapKV, AdaKV>(snap, AdaKV{}).select(cpu_backend{1}, c.inputs(), Budget::tokens(B));
  for (std::int64_t l = 0; l < L; ++l)
    for (std::int64_t h = 0; h < H; ++h) CHECK(alloc_test::kept(sel, l, h) == alloc_test::kept(sel2, l, h));
}

TEST_CASE("adakv: spec parameters and chain order", "[allocators][adakv][spec]") {
  CHECK(std::get<AdaKV>(Policy("knorm | adakv(alpha=0.5)").allocators().at(0)).alpha == 0.5);
  CHECK(std::get<AdaKV>(Policy("knorm | adakv").allocators().at(0)).alpha == 0.2);
  REQUIRE_THROWS_WITH(Policy("knorm | adakv(alpha=1.5)"), Contains("adakv: alpha must be in [0, 1]"));
  REQUIRE_THROWS_WITH(Policy("knorm | adakv(alpha=-0.1)"), Contains("adakv: alpha must be in [0, 1]"));
  REQUIRE_THROWS_WITH(Policy("knorm | adakv(beta=1)"), Contains("unknown parameter 'beta'"));
  REQUIRE_THROWS_WITH(Policy("knorm | adakv | pyramid"),
                      Contains("allocator 'pyramid' cannot follow 'adakv'") &&
                          Contains("layers -> heads -> segments"));
  REQUIRE_THROWS_WITH(Policy("snapkv | ams | adakv"), Contains("'adakv' cannot follow 'ams'"));
  REQUIRE_THROWS_WITH(Policy("snapkv | ams | ams"), Contains("'ams' cannot follow 'ams'"));
  CHECK_NOTHROW(Policy("knorm | pyramid | depthkv(weights=1) | uniform | adakv | ams | uniform"));
  kvtest::Rng rng(1);
  const auto c = naive::random_case<float>(rng, 1, 2, 1, 32, 4, 8, Layout::HND);
  REQUIRE_THROWS_WITH((Pipeline<KNorm, AdaKV, Pyramid>(KNorm{}, AdaKV{}, Pyramid{})
                           .select(cpu_backend{1}, c.inputs(), Budget::tokens(8))),
                      Contains("allocator 'pyramid' cannot follow 'adakv'"));
}

}  // namespace kvt_allocators_adakv
