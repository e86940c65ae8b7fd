// PyramidKV: kvpress's layer schedule by hand, exact conservation (kvpress checks the mean to
// 1e-3; here the sum is exact), fallbacks, protected floors, one-layer events (Session) and the
// spec parameters.
#include <cmath>
#include <vector>

#include "allocators/alloc_util.hpp"
#include "scorers/naive.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_allocators_pyramid {

using namespace kvpolicy;
using alloc_test::context;
using Catch::Contains;

namespace {

// Runs Pyramid on an event of L layers x H heads whose rows all have budget b.
std::vector<std::int64_t> run(const Pyramid& p, std::int64_t L, std::int64_t H, std::int64_t T,
                              std::int64_t b, Protect prot) {
  ScoreMap s(L, H, T);
  std::vector<std::int64_t> budgets(static_cast<std::size_t>(L * H), b);
  p.allocate(context(s, prot), budgets);
  return budgets;
}

std::vector<std::int64_t> layer_column(const std::vector<std::int64_t>& b, std::int64_t H,
                                       std::int64_t h) {
  std::vector<std::int64_t> out;
  for (std::size_t r = static_cast<std::size_t>(h); r < b.size(); r += static_cast<std::size_t>(H))
    out.push_back(b[r]);
  return out;
}

}  // namespace

TEST_CASE("pyramid: kvpress's schedule by hand", "[allocators][pyramid]") {
  const Pyramid p;  // beta 20, window = protected tokens
  // T = 1000, compression 0.5 -> B = 500, W = 64, 4 layers: min = 25, max = 975 >= T - W = 936,
  // so max = 936, min = 1000 - 936 = 64; step (936 - 64) / 3 = 290.67:
  // 936, 645.33 -> 645, 354.67 -> 355, 64 (kvpress's numbers), sum 2000 = 4 * 500.
  auto b = run(p, 4, 2, 1000, 500, {0, 64});
  for (std::int64_t h = 0; h < 2; ++h)
    CHECK(layer_column(b, 2, h) == std::vector<std::int64_t>{936, 645, 355, 64});
  // T = 10000, B = 2000, W = 64, 5 layers: min = 100, max = 3900 (below T - W): step 950.
  b = run(p, 5, 1, 10000, 2000, {0, 64});
  CHECK(b == std::vector<std::int64_t>{3900, 2950, 2000, 1050, 100});
  CHECK(alloc_test::sum(b) == 5 * 2000);
  // The real-valued schedule itself (kvpress before rounding).
  const auto y = p.schedule(500, 4, 1000, 64);
  CHECK(y[1] == Approx(645.3333).epsilon(1e-6));
  CHECK(y[2] == Approx(354.6667).epsilon(1e-6));
}

TEST_CASE("pyramid: kvpress's fallbacks keep the uniform budget", "[allocators][pyramid]") {
  const Pyramid p;
  // B / beta = 200 / 20 = 10 < W = 32: kvpress falls back to SnapKV's uniform budget.
  CHECK(run(p, 6, 2, 2000, 200, {0, 32}) == std::vector<std::int64_t>(12, 200));
  // One layer: nothing to split (kvpress would divide by L - 1 = 0).
  CHECK(run(p, 1, 3, 500, 100, {0, 4}) == std::vector<std::int64_t>(3, 100));
  // Nothing to evict: B = T.
  CHECK(run(p, 4, 1, 100, 100, {0, 4}) == std::vector<std::int64_t>(4, 100));
}

TEST_CASE("pyramid: a fractional mean is rounded to an exact sum", "[allocators][pyramid]") {
  // Column budgets 500, 500, 501, 500 (an uneven total budget): mean 500.25.
  Pyramid p;
  p.beta = 4;
  ScoreMap s(4, 1, 1000);
  std::vector<std::int64_t> b = {500, 500, 501, 500};
  p.allocate(context(s, {0, 16}), b);
  CHECK(alloc_test::sum(b) == 2001);
  CHECK(std::is_sorted(b.rbegin(), b.rend()));
  const auto y = p.schedule(500.25, 4, 1000, 16);
  for (std::size_t l = 0; l < 4; ++l) CHECK(std::abs(static_cast<double>(b[l]) - y[l]) < 1.0);
}

TEST_CASE("pyramid: no layer below the protected tokens or above T", "[allocators][pyramid]") {
  // window=0 makes kvpress's min fall below the 12 protected tokens: the floor holds, and the
  // sum is still exact.
  Pyramid p;
  p.beta = 50;
  p.window = 0;
  const auto b = run(p, 8, 2, 400, 100, {4, 8});
  CHECK(alloc_test::sum(b) == 8 * 2 * 100);
  for (auto x : b) {
    CHECK(x >= 12);
    CHECK(x <= 400);
  }
  CHECK(b.front() > b.back());
}

TEST_CASE("pyramid: random shapes conserve the budget exactly", "[allocators][pyramid]") {
  kvtest::Rng rng(41);
  for (int it = 0; it < 400; ++it) {
    Pyramid p;
    p.beta = rng.uniform(1.0, 30.0);
    p.window = rng.integer(-1, 20);
    const std::int64_t L = rng.integer(1, 40), H = rng.integer(1, 4), T = rng.integer(1, 3000);
    const Protect prot{rng.integer(0, 8), rng.integer(0, 64)};
    const std::int64_t lo = prot.total(T);
    ScoreMap s(L, H, T);
    std::vector<std::int64_t> b(static_cast<std::size_t>(L * H));
    for (auto& x : b) x = rng.integer(lo, T);  // uneven rows too
    auto columns = [&](const std::vector<std::int64_t>& v) {
      std::vector<std::int64_t> c(static_cast<std::size_t>(H), 0);
      for (std::size_t r = 0; r < v.size(); ++r) c[r % static_cast<std::size_t>(H)] += v[r];
      return c;
    };
    const auto before = columns(b);
    INFO("L=" << L << " H=" << H << " T=" << T << " beta=" << p.beta << " window=" << p.window);
    p.allocate(context(s, prot), b);
    REQUIRE(columns(b) == before);  // every KV head's budget over the layers is kept exactly
    for (std::int64_t x : b) {
      REQUIRE(x >= lo);
      REQUIRE(x <= T);
    }
  }
}

TEST_CASE("pyramid: one-layer events add up to the whole model's schedule", "[allocators][pyramid]") {
  // The Session compresses layer by layer: EventInfo{l, L} must give layer l the same budget the
  // all-layers event gives it, and the layers must sum to L * B.
  kvtest::Rng rng(3);
  const std::int64_t L = 6, H = 2, T = 300, B = 120;
  const auto c = naive::random_case<float>(rng, L, H, 2, T, 8, 8, Layout::HND);
  const Policy pol("snapkv(window=8) | pyramid(beta=5)");
  const Selection all = pol.select(cpu_backend{1}, c.inputs(), Budget::tokens(B));
  std::int64_t total = 0;
  for (std::int64_t l = 0; l < L; ++l) {
    const Selection sel = pol.select(cpu_backend{1}, alloc_test::layer_of(c.inputs(), l),
                                     Budget::tokens(B), EventInfo{l, L});
    for (std::int64_t h = 0; h < H; ++h) {
      CHECK(alloc_test::kept(sel, 0, h) == alloc_test::kept(all, l, h));
      total += sel.count(0, h);
    }
  }
  CHECK(total == L * H * B);
  CHECK(all.count(0, 0) > all.count(L - 1, 0));
  alloc_test::require_valid(all, T, {0, 8});
  REQUIRE_THROWS_WITH(pol.select(cpu_backend{1}, c.inputs(), Budget::tokens(B), EventInfo{1, L}),
                      Contains("do not fit a model of 6 layers"));
}

TEST_CASE("pyramid: a Session gives each layer its share", "[allocators][pyramid][session]") {
  const std::int64_t L = 4, H = 2, g = 2, d = 8, T = 200;
  SessionConfig cfg;
  cfg.layers = L;
  cfg.kv_heads = H;
  cfg.q_heads = H * g;
  cfg.head_dim = d;
  cfg.budget = Budget::ratio(0.5);
  cfg.backend = cpu_backend{1};
  Session<float> s(Policy("snapkv(window=8) | pyramid(beta=5)"), cfg);
  kvtest::Rng rng(9);
  for (std::int64_t l = 0; l < L; ++l) {
    const auto k = rng.normals(H * T * d), v = rng.normals(H * T * d),
               q = rng.normals(H * g * T * d);
    s.append(l, KVView<const float>::hnd(k.data(), 1, H, T, d),
             KVView<const float>::hnd(v.data(), 1, H, T, d),
             KVView<const float>::hnd(q.data(), 1, H * g, T, d));
    REQUIRE(s.compress_if_due(l));
  }
  // B = 100, W = 8: min 20, max 180; step 53.33: 180, 126.67, 73.33, 20.
  const std::vector<std::int64_t> want = {180, 127, 73, 20};
  std::int64_t total = 0;
  for (std::int64_t l = 0; l < L; ++l)
    for (std::int64_t h = 0; h < H; ++h) {
      CHECK(s.length(l, h) == want[static_cast<std::size_t>(l)]);
      total += s.length(l, h);
    }
  CHECK(total == L * H * 100);
}

TEST_CASE("pyramid: spec parameters", "[allocators][pyramid][spec]") {
  const Policy p("snapkv | pyramid(beta=8, window=16)");
  const auto& py = std::get<Pyramid>(p.allocators().at(0));
  CHECK(py.beta == 8);
  CHECK(py.window == 16);
  REQUIRE_THROWS_WITH(Policy("snapkv | pyramid(beta=0.5)"), Contains("pyramid: beta must be >= 1"));
  REQUIRE_THROWS_WITH(Policy("snapkv | pyramid(beta=x)"), Contains("'beta' expects a number"));
  REQUIRE_THROWS_WITH(Policy("snapkv | pyramid(window=-2)"), Contains("pyramid: window must be >= 0"));
  REQUIRE_THROWS_WITH(Policy("snapkv | pyramid(steep=2)"),
                      Contains("unknown parameter 'steep'") && Contains("beta"));
}

}  // namespace kvt_allocators_pyramid
