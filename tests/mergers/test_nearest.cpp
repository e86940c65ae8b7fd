// nearest merger: the hand-computed fold into the most similar kept token, protected tokens
// untouched, exactness for identical tokens, count conservation, argument errors.
#include "mergers/merge_util.hpp"
#include "ops/naive.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_mergers_nearest {

using namespace kvpolicy;
using Catch::Contains;
using mtest::Cache;

namespace {

// One row, d = 2. Keys: k0 = (2, .5), k1 = (1, 0), k2 = (.2, 1), k3 = (0, 1), k4 = (-1, .1),
// k5 = (1, 1); values v_j = (j, 10 j); token 0 already stands for 2 tokens.
Cache<float> hand_case() {
  Cache<float> c(1, 1, 6, 2);
  const float k[6][2] = {{2, .5f}, {1, 0}, {.2f, 1}, {0, 1}, {-1, .1f}, {1, 1}};
  for (std::int64_t t = 0; t < 6; ++t) {
    c.key(0, 0, t, 0) = k[t][0], c.key(0, 0, t, 1) = k[t][1];
    c.value(0, 0, t, 0) = float(t), c.value(0, 0, t, 1) = 10.f * float(t);
  }
  c.log_count(0, 0, 0) = std::log(2.f);
  return c;
}

}  // namespace

TEST_CASE("nearest: folds each evicted value into its most cosine-similar kept token",
          "[merger][nearest]") {
  // Kept {1, 3}. Cosines with k1 = (1, 0) and k3 = (0, 1):
  //   k0: .970 vs .243 -> 1     k2: .196 vs .981 -> 3
  //   k4: -.995 vs .0995 -> 3   k5: .7071 vs .7071 (a tie) -> 3, the more recent
  // V1 = (1 v1 + 2 v0) / 3 = (1/3, 10/3), count 3; V3 = (v3 + v2 + v4 + v5) / 4 = (3.5, 35),
  // count 4. Keys are unchanged.
  Cache<float> c = hand_case();
  c.scores.row(0, 0)[1] = 1.f, c.scores.row(0, 0)[3] = 1.f;
  c.select(2);
  const auto a = c.args();
  CHECK(Nearest::nearest_targets(a, 0, 0, {0, 2, 4, 5}, {1, 3}) ==
        std::vector<std::int32_t>{1, 3, 3, 3});
  const Cache<float> before = c;
  Nearest{}.merge(cpu_backend{1}, a);
  CHECK(c.count(0, 0, 1) == Approx(3.0));
  CHECK(c.value(0, 0, 1, 0) == Approx(1.0 / 3));
  CHECK(c.value(0, 0, 1, 1) == Approx(10.0 / 3));
  CHECK(c.count(0, 0, 3) == Approx(4.0));
  CHECK(c.value(0, 0, 3, 0) == Approx(3.5));
  CHECK(c.value(0, 0, 3, 1) == Approx(35.0));
  CHECK(kvtest::bytes_of(c.k) == kvtest::bytes_of(before.k));
  c.compact();
  CHECK(c.represented(0, 0) == Approx(7.0));  // 2 + 5 other tokens

  // Token 5 protected (recent = 1) and kept: never a target, never written. 0 -> 1, 2 and 4 -> 3.
  Cache<float> p = hand_case();
  p.protect = {0, 1};
  p.scores.row(0, 0)[1] = 1.f, p.scores.row(0, 0)[3] = 1.f;
  p.select(3);
  Nearest{}.merge(cpu_backend{1}, p.args());
  CHECK(p.count(0, 0, 3) == Approx(3.0));
  CHECK(p.value(0, 0, 3, 0) == Approx(3.0));
  CHECK(p.count(0, 0, 1) == Approx(3.0));
  CHECK(p.count(0, 0, 5) == Approx(1.0));
  CHECK(p.value(0, 0, 5, 0) == 5.f);
  // Only protected tokens kept: nothing to fold into, the evicted tokens are dropped.
  Cache<float> s = hand_case();
  s.protect = {1, 1};
  s.select(2);
  const Cache<float> s0 = s;
  Nearest{}.merge(cpu_backend{1}, s.args());
  CHECK(kvtest::bytes_of(s.v) == kvtest::bytes_of(s0.v));
  CHECK(kvtest::bytes_of(s.lc) == kvtest::bytes_of(s0.lc));
}

TEST_CASE("nearest: identical evicted tokens keep the attention output exact",
          "[merger][nearest]") {
  // Tokens 4, 9 and 15 of each head are copies of token 12 (kept); only the copies are evicted,
  // so each folds into token 12 (cosine 1) and log(4) restores them.
  const std::int64_t H = 3, T = 20, d = 8, g = 2, nq = 4;
  kvtest::Rng rng(21);
  Cache<float> c(1, H, T, d);
  c.randomize(rng);
  for (std::int64_t h = 0; h < H; ++h) {
    for (std::int64_t t = 0; t < T; ++t) c.scores.row(0, h)[static_cast<std::size_t>(t)] = 1.f;
    for (std::int64_t t : {4, 9, 15}) {
      c.scores.row(0, h)[static_cast<std::size_t>(t)] = 0.f;
      for (std::int64_t i = 0; i < d; ++i)
        c.key(0, h, t, i) = c.key(0, h, 12, i), c.value(0, h, t, i) = c.value(0, h, 12, i);
    }
  }
  const auto q = rng.normals(H * g * nq * d);
  const auto full = mtest::attend(c, q, g, nq, std::vector<std::int64_t>(H, T), false);
  c.select(T - 3);
  Nearest{}.merge(cpu_backend{2}, c.args());
  c.compact();
  CHECK(kvtest::max_rel_err(mtest::attend(c, q, g, nq, std::vector<std::int64_t>(H, T - 3), true),
                            full) < 1e-6);
  for (std::int64_t h = 0; h < H; ++h) {
    CHECK(c.count(0, h, 12 - 2) == Approx(4.0));  // token 12 sits after the evicted 4 and 9
    CHECK(c.represented(0, h) == Approx(double(T)));
  }
}

TEST_CASE("nearest: counts are conserved on random caches and arguments are checked",
          "[merger][nearest]") {
  const std::int64_t L = 2, H = 2, T = 50, d = 8;
  kvtest::Rng rng(3);
  Cache<float> c(L, H, T, d);
  c.randomize(rng);
  c.protect = {2, 5};
  c.randomize_scores(rng, 3);
  double total[4] = {};
  for (std::int64_t r = 0; r < L * H; ++r)
    for (std::int64_t t = 2; t < T - 5; ++t) total[r] += std::round(c.count(r / H, r % H, t));
  c.select(15);
  Nearest{}.merge(cpu_backend{2}, c.args());
  c.compact();
  for (std::int64_t r = 0; r < L * H; ++r) {
    double kept = 0;  // non-protected rows: 2 .. 9 after compaction (7 protected of 15)
    for (std::int64_t t = 2; t < 10; ++t) kept += c.count(r / H, r % H, t);
    CHECK(kept == Approx(total[r]));
  }

  Cache<float> e(1, 1, 4, 2);
  e.select(2);
  auto a = e.args();
  a.log_count = nullptr;
  CHECK_THROWS_WITH(Nearest{}.merge(cpu_backend{1}, a), Contains("nearest: log_count is required"));
  a = e.args();
  a.scores = nullptr;  // nearest reads no scores
  CHECK_NOTHROW(Nearest{}.merge(cpu_backend{1}, a));
  a = e.args();
  Selection wrong(1, 2);
  a.selection = &wrong;
  CHECK_THROWS_WITH(Nearest{}.merge(cpu_backend{1}, a),
                    Contains("nearest: selection is [1,2] but the cache has [1,1]"));
  a = e.args();
  a.values.tokens = 3;
  CHECK_THROWS_WITH(Nearest{}.merge(cpu_backend{1}, a), Contains("nearest: values [1,1,3,2]"));
}

}  // namespace kvt_mergers_nearest
