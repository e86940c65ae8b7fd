// semantic merger: exactness of proportional attention for identical tokens, chunk boundaries,
// count conservation across events, per-head cores, the tau extremes, the naive GSC reference,
// thread-count determinism and parameter errors.
#include <cstring>

#include <kvpolicy/core/params.hpp>

#include "mergers/merge_util.hpp"
#include "ops/naive.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_mergers_semantic {

using namespace kvpolicy;
using Catch::Contains;
using mtest::Cache;

namespace {

struct Group {
  std::vector<std::int64_t> at;  // positions of the identical tokens
  std::size_t pick;              // the one the selection keeps
};
Group group(std::vector<std::int64_t> at, std::size_t pick) { return {std::move(at), pick}; }

}  // namespace

TEST_CASE("semantic: n identical tokens merged into one core attend like the full cache",
          "[merger][semantic]") {
  // Each KV head holds a group of n tokens with one key and one value (at positions that vary
  // with the case); the selection keeps one of them (`pick`) and every other token. tau = 1
  // merges exactly the group: one core of count n whose log(n) bias restores the n copies.
  const auto weight = GENERATE(MergeWeight::mean, MergeWeight::importance);
  const Group grp = GENERATE(group({5, 6}, 0), group({3, 9, 17}, 1), group({4, 5, 6, 7, 8}, 4),
                             group({2, 10, 11, 15, 18, 19, 20}, 2), group({12, 21}, 1));
  const auto& at = grp.at;
  const std::size_t pick = grp.pick;
  const std::int64_t H = 2, T = 24, d = 16, g = 2, nq = 3, n = static_cast<std::int64_t>(at.size());
  kvtest::Rng rng(7 + static_cast<std::uint64_t>(n));
  Cache<float> c(1, H, T, d);
  c.randomize(rng);
  c.protect = {1, 2};  // token 0 and 22, 23
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t t = 0; t < T; ++t) c.scores.row(0, h)[static_cast<std::size_t>(t)] = 1.f + float(t % 3);
  for (std::int64_t h = 0; h < H; ++h)
    for (std::size_t m = 0; m < at.size(); ++m) {
      for (std::int64_t i = 0; i < d; ++i) {
        c.key(0, h, at[m], i) = c.key(0, h, at[0], i);
        c.value(0, h, at[m], i) = c.value(0, h, at[0], i);
      }
      c.scores.row(0, h)[static_cast<std::size_t>(at[m])] = m == pick ? 0.5f : 0.1f;
    }
  const auto q = rng.normals(H * g * nq * d);
  const auto full = mtest::attend(c, q, g, nq, std::vector<std::int64_t>(H, T), false);
  c.select(T - (n - 1));
  mtest::semantic(1.f, T, weight).merge(cpu_backend{2}, c.args());
  c.compact();
  std::vector<std::int64_t> lengths(H, T - (n - 1));
  const auto merged = mtest::attend(c, q, g, nq, lengths, true);
  INFO("n=" << n << " pick=" << pick);
  CHECK(kvtest::max_rel_err(merged, full) < 1e-6);
  for (std::int64_t h = 0; h < H; ++h) {
    // After compaction the core sits at at[pick] minus the `pick` evicted copies before it.
    CHECK(c.count(0, h, at[pick] - std::int64_t(pick)) == Approx(double(n)).epsilon(1e-6));
    CHECK(c.represented(0, h) == Approx(double(T)).epsilon(1e-6));
  }
  // Dropping the group's copies instead (no merge) changes the output.
  Cache<float> dropped = c;
  std::fill(dropped.lc.begin(), dropped.lc.end(), 0.f);
  CHECK(kvtest::max_rel_err(mtest::attend(dropped, q, g, nq, lengths, true), full) > 1e-4);
}

TEST_CASE("semantic: chunks end at delimiters and never cross them", "[merger][semantic]") {
  // One row of 12 tokens with one key direction (tau = -1 or 1 would merge anything) and
  // values v_j = j; delimiters end chunks at 3 and 8: [0..3] [4..8] [9..11].
  const float tau = GENERATE(-1.f, 1.f);
  Cache<float> c(1, 1, 12, 2);
  for (std::int64_t t = 0; t < 12; ++t) {
    c.key(0, 0, t, 0) = 1.f, c.key(0, 0, t, 1) = 0.f;
    c.value(0, 0, t, 0) = float(t), c.value(0, 0, t, 1) = -float(t);
  }
  c.delimiter = mtest::mask(12, {3, 8});
  auto chunk_counts = [&](Cache<float> x, std::vector<std::int64_t> kept, std::int64_t chunk) {
    for (std::int64_t t : kept) x.scores.row(0, 0)[static_cast<std::size_t>(t)] = 1.f + float(t);
    x.select(static_cast<std::int64_t>(kept.size()));
    REQUIRE(std::vector<std::int32_t>(x.sel.kept(0, 0).begin(), x.sel.kept(0, 0).end()) ==
            std::vector<std::int32_t>(kept.begin(), kept.end()));
    mtest::semantic(tau, chunk).merge(cpu_backend{1}, x.args());
    std::vector<std::pair<double, float>> out;  // (count, value) of each kept row
    for (std::int64_t t : kept) out.push_back({std::round(x.count(0, 0, t)), x.value(0, 0, t, 0)});
    return out;
  };
  using P = std::vector<std::pair<double, float>>;
  // One kept token per chunk: each core is its chunk (counts 4, 5, 3; means 1.5, 6, 10).
  CHECK(chunk_counts(c, {1, 6, 10}, 0) == P{{4, 1.5f}, {5, 6.f}, {3, 10.f}});
  // The chunk [4..8] keeps nothing: its tokens are evicted, neither neighbour takes them.
  CHECK(chunk_counts(c, {1, 10}, 0) == P{{4, 1.5f}, {3, 10.f}});
  // With a mask, chunk > 0 caps chunk lengths: chunk=3 cuts [0..2] [3] [4..6] [7..8] [9..11];
  // the lone delimiter 3 keeps nothing and is evicted.
  CHECK(chunk_counts(c, {1, 5, 8, 10}, 3) == P{{3, 1.f}, {3, 5.f}, {2, 7.5f}, {3, 10.f}});
  // Without a mask: fixed chunks of 4, [0..3] [4..7] [8..11].
  c.delimiter.clear();
  CHECK(chunk_counts(c, {1, 6, 10}, 4) == P{{4, 1.5f}, {4, 5.5f}, {4, 9.5f}});
}

TEST_CASE("semantic: chunk_end keeps boundaries across events when a delimiter is evicted",
          "[merger][semantic]") {
  // Event 1: 12 tokens of one direction, v_j = j, per-row mask with delimiters at 3 and 8,
  // tau = -1. Kept: 1, 2 (chunk [0..3]; 2 scores higher and seeds: it absorbs 0 and the
  // delimiter 3), 6, 10. chunk_end aliases the mask: 1 at the last kept row of each chunk.
  Cache<float> c(1, 1, 12, 1);
  for (std::int64_t t = 0; t < 12; ++t) c.key(0, 0, t, 0) = 1.f, c.value(0, 0, t, 0) = float(t);
  c.delimiter = mtest::mask(12, {3, 8});
  c.delimiter_stride = 12;
  for (std::int64_t t : {1, 2, 6, 10}) c.scores.row(0, 0)[static_cast<std::size_t>(t)] = float(t);
  c.select(4);
  auto a = c.args();
  a.chunk_end = c.delimiter.data();
  a.chunk_end_stride = 12;
  mtest::semantic(-1.f, 0).merge(cpu_backend{1}, a);
  CHECK(c.delimiter[1] == 0);
  CHECK(c.delimiter[2] == 1);
  CHECK(c.delimiter[6] == 1);
  CHECK(c.delimiter[10] == 1);
  c.compact();
  Cache<float> e = c.shrink();  // rows: tokens 1, 2 (count 3), 6 (count 5), 10 (count 3)
  REQUIRE(e.delimiter == std::vector<std::uint8_t>{0, 1, 1, 1});
  // Event 2: keep rows 0 (token 1) and 3 (token 10). Row 1 ends the first chunk, so row 0
  // absorbs row 1 only; row 2 (token 6, count 5) is alone in its chunk and is evicted.
  e.scores.row(0, 0)[0] = 2.f, e.scores.row(0, 0)[3] = 1.f;
  e.select(2);
  mtest::semantic(-1.f, 0).merge(cpu_backend{1}, e.args());
  CHECK(e.count(0, 0, 0) == Approx(4.0));
  CHECK(e.value(0, 0, 0, 0) == Approx(1.5));  // mean of tokens 0..3
  CHECK(e.count(0, 0, 3) == Approx(3.0));
  e.compact();
  CHECK(e.represented(0, 0) == Approx(7.0));
}

TEST_CASE("semantic: counts are conserved across two events and a core never mixes heads",
          "[merger][semantic]") {
  // tau = -1 and one bonus-scored token in every chunk (so every chunk has a kept seed): every
  // token of every row is represented after each event, and with weight=mean the count-weighted
  // sum of values of each row is invariant.
  const std::int64_t L = 2, H = 3, T = 64, d = 8;
  kvtest::Rng rng(99);
  Cache<float> c(L, H, T, d);
  c.randomize(rng);
  c.protect = {2, 4};
  auto bonus = [&](Cache<float>& x, std::int64_t chunk) {
    x.randomize_scores(rng);
    for (std::int64_t r = 0; r < L * H; ++r)
      for (std::int64_t b = 0; b < x.T; b += chunk) {
        const std::int64_t lo = std::max(b, x.protect.sinks);
        const std::int64_t hi = std::min(b + chunk, x.T - x.protect.recent);
        if (lo < hi) x.scores.row(r / H, r % H)[static_cast<std::size_t>(rng.integer(lo, hi - 1))] += 10.f;
      }
  };
  auto value_sums = [&](Cache<float>& x, std::int64_t rows) {
    std::vector<double> s(static_cast<std::size_t>(L * H * d), 0.0);
    for (std::int64_t r = 0; r < L * H; ++r)
      for (std::int64_t t = 0; t < rows; ++t)
        for (std::int64_t i = 0; i < d; ++i)
          s[static_cast<std::size_t>(r * d + i)] += x.count(r / H, r % H, t) * x.value(r / H, r % H, t, i);
    return s;
  };
  const auto sums0 = value_sums(c, T);
  bonus(c, 8);
  c.select(20);  // 6 protected + 8 chunk seeds + 6 more
  // Head-local cores: every value of a core must come from its own head. Give each head values
  // offset by 100 * (l * H + h): the mean of a core stays within its head's offset band.
  Cache<float> banded = c;
  for (std::int64_t r = 0; r < L * H; ++r)
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t i = 0; i < d; ++i) banded.value(r / H, r % H, t, i) = float(100 * r) + float(rng.uniform(0, 1));
  mtest::semantic(-1.f, 8).merge(cpu_backend{2}, banded.args());
  for (std::int64_t r = 0; r < L * H; ++r)
    for (std::int32_t t : banded.sel.kept(r / H, r % H))
      for (std::int64_t i = 0; i < d; ++i) {
        CHECK(banded.value(r / H, r % H, t, i) >= float(100 * r));
        CHECK(banded.value(r / H, r % H, t, i) < float(100 * r + 1));
      }
  mtest::semantic(-1.f, 8).merge(cpu_backend{2}, c.args());
  c.compact();
  for (std::int64_t r = 0; r < L * H; ++r) CHECK(c.represented(r / H, r % H) == Approx(double(T)));
  const auto sums1 = value_sums(c, 20);
  CHECK(kvtest::max_rel_err(sums1, sums0) < 1e-5);

  Cache<float> e = c.shrink();  // 20 rows each, counts carried in log_count
  bonus(e, 4);
  e.select(10);  // 6 protected + 4 chunk seeds ([16..19] is all recent)
  mtest::semantic(-1.f, 4).merge(cpu_backend{2}, e.args());
  e.compact();
  for (std::int64_t r = 0; r < L * H; ++r) CHECK(e.represented(r / H, r % H) == Approx(double(T)));
  CHECK(kvtest::max_rel_err(value_sums(e, 10), sums0) < 1e-5);
}

TEST_CASE("semantic: tau = 1 merges only identical directions, tau = -1 each chunk into one core",
          "[merger][semantic]") {
  // One row, d = 3. Token 1 (kept) has key u; tokens 2 and 3 are 2u and 0.5u (same direction);
  // token 4 is u tilted by 1e-3; token 5 is -u. Token 0 (kept) is another direction.
  Cache<float> c(1, 1, 6, 3);
  const float u[3] = {0.3f, -0.7f, 0.2f};
  const float scale[6] = {0, 1, 2, 0.5f, 1, -1};
  for (std::int64_t t = 1; t < 6; ++t)
    for (std::int64_t i = 0; i < 3; ++i) c.key(0, 0, t, i) = scale[t] * u[i];
  c.key(0, 0, 4, 2) += 1e-3f;
  c.key(0, 0, 0, 0) = 1.f;
  for (std::int64_t t = 0; t < 6; ++t) c.value(0, 0, t, 0) = float(t);
  c.scores.row(0, 0)[0] = 3.f, c.scores.row(0, 0)[1] = 2.f;
  c.select(2);
  Cache<float> one = c;
  mtest::semantic(1.f, 6).merge(cpu_backend{1}, one.args());
  CHECK(one.count(0, 0, 1) == Approx(3.0));  // 1, 2, 3
  CHECK(one.value(0, 0, 1, 0) == Approx(2.0));
  CHECK(one.count(0, 0, 0) == Approx(1.0));
  // tau = -1 with the same kept tokens: token 0 seeds first and takes every evicted token;
  // token 1 stays a singleton (kept tokens never join another core).
  Cache<float> all = c;
  mtest::semantic(-1.f, 6).merge(cpu_backend{1}, all.args());
  CHECK(all.count(0, 0, 0) == Approx(5.0));
  CHECK(all.value(0, 0, 0, 0) == Approx((0 + 2 + 3 + 4 + 5) / 5.0));
  CHECK(all.count(0, 0, 1) == Approx(1.0));

  // tau = -1, random keys, one kept token per chunk of 4: each chunk becomes one core whose
  // value is the chunk's mean (weight=mean) and whose count is 4.
  kvtest::Rng rng(5);
  Cache<float> r(1, 2, 16, 4);
  r.randomize(rng);
  for (std::int64_t h = 0; h < 2; ++h)
    for (std::int64_t b = 0; b < 16; b += 4)
      r.scores.row(0, h)[static_cast<std::size_t>(b + rng.integer(0, 3))] = 1.f;
  r.select(4);
  Cache<float> before = r;
  mtest::semantic(-1.f, 4).merge(cpu_backend{1}, r.args());
  for (std::int64_t h = 0; h < 2; ++h)
    for (std::int32_t t : r.sel.kept(0, h)) {
      CHECK(r.count(0, h, t) == Approx(4.0));
      for (std::int64_t i = 0; i < 4; ++i) {
        double mk = 0, mv = 0;
        for (std::int64_t j = t / 4 * 4; j < t / 4 * 4 + 4; ++j)
          mk += before.key(0, h, j, i) / 4.0, mv += before.value(0, h, j, i) / 4.0;
        CHECK(r.key(0, h, t, i) == Approx(mk).margin(1e-6));
        CHECK(r.value(0, h, t, i) == Approx(mv).margin(1e-6));
      }
    }
}

TEST_CASE("semantic: matches the naive GSC reference on random caches", "[merger][semantic]") {
  // Importance weights (non-negative scores), carried counts, a shared delimiter mask plus a
  // chunk cap, several layers and heads.
  const float tau = GENERATE(0.f, 0.3f, 0.6f);
  const std::int64_t L = 2, H = 2, T = 40, d = 4, chunk = 7;
  kvtest::Rng rng(1234 + static_cast<std::uint64_t>(tau * 10));
  Cache<float> c(L, H, T, d);
  c.randomize(rng);
  c.protect = {1, 3};
  c.randomize_scores(rng, 4);
  c.delimiter = mtest::mask(T, {5, 6, 17, 30});
  c.select(14);
  Cache<float> ref = c;
  mtest::semantic(tau, chunk, MergeWeight::importance).merge(cpu_backend{2}, c.args());
  for (std::int64_t l = 0; l < L; ++l)
    for (std::int64_t h = 0; h < H; ++h) {
      const auto owner = mtest::naive_gsc(ref, l, h, tau, chunk);
      for (std::int32_t t : ref.sel.kept(l, h)) {
        double w = 0, n = 0;
        std::vector<double> k(d, 0.0), v(d, 0.0);
        bool core = false;
        for (std::int64_t j = 0; j < T; ++j) {
          if (owner[static_cast<std::size_t>(j)] != t) continue;
          core = core || j != t;
          const double cj = ref.count(l, h, j), wj = cj * ref.scores.row(l, h)[static_cast<std::size_t>(j)];
          n += cj, w += wj;
          for (std::int64_t i = 0; i < d; ++i)
            k[static_cast<std::size_t>(i)] += wj * ref.key(l, h, j, i), v[static_cast<std::size_t>(i)] += wj * ref.value(l, h, j, i);
        }
        INFO("layer " << l << " head " << h << " token " << t);
        if (!core) {
          CHECK(c.log_count(l, h, t) == ref.log_count(l, h, t));
          CHECK(c.key(l, h, t, 0) == ref.key(l, h, t, 0));
          continue;
        }
        CHECK(c.count(l, h, t) == Approx(n).epsilon(1e-6));
        for (std::int64_t i = 0; i < d; ++i) {
          CHECK(c.key(l, h, t, i) == Approx(k[static_cast<std::size_t>(i)] / w).margin(1e-6));
          CHECK(c.value(l, h, t, i) == Approx(v[static_cast<std::size_t>(i)] / w).margin(1e-6));
        }
      }
      // Protected rows never change.
      for (std::int64_t t : {std::int64_t{0}, T - 3, T - 2, T - 1}) {
        CHECK(c.log_count(l, h, t) == ref.log_count(l, h, t));
        CHECK(c.value(l, h, t, 1) == ref.value(l, h, t, 1));
      }
    }
}

TEST_CASE("semantic and nearest are bit-identical for 1 and 2 threads", "[merger]") {
  const std::int64_t L = 2, H = 3, T = 200, d = 16;
  kvtest::Rng rng(77);
  Cache<bfloat16> c(L, H, T, d);
  c.randomize(rng);
  c.protect = {4, 16};
  c.randomize_scores(rng);
  c.delimiter.resize(static_cast<std::size_t>(T));
  for (auto& m : c.delimiter) m = rng.integer(0, 9) == 0;
  c.select(60);
  auto run = [&](auto merger, int threads) {
    Cache<bfloat16> x = c;
    merger.merge(cpu_backend{threads}, x.args());
    return x;
  };
  auto same = [](const Cache<bfloat16>& a, const Cache<bfloat16>& b) {
    return kvtest::bytes_of(a.k) == kvtest::bytes_of(b.k) &&
           kvtest::bytes_of(a.v) == kvtest::bytes_of(b.v) &&
           kvtest::bytes_of(a.lc) == kvtest::bytes_of(b.lc);
  };
  const Semantic sem = mtest::semantic(0.2f, 16, MergeWeight::importance);
  const auto s1 = run(sem, 1), s2 = run(sem, 2);
  CHECK(same(s1, s2));
  CHECK(!same(s1, c));  // it did merge something
  const auto n1 = run(Nearest{}, 1), n2 = run(Nearest{}, 2);
  CHECK(same(n1, n2));
  CHECK(!same(n1, c));
}

TEST_CASE("semantic: bad parameters and arguments are rejected with clear errors",
          "[merger][semantic]") {
  auto parse = [](std::initializer_list<std::pair<const char*, const char*>> kv) {
    Params p("semantic");
    for (auto& [k, v] : kv) p.set(k, v);
    Semantic s = Semantic::from_params(p);
    p.finish();
    return s;
  };
  const Semantic def = parse({});
  CHECK(def.tau == 0.9f);
  CHECK(def.chunk == 32);
  CHECK(def.weight == MergeWeight::importance);
  CHECK(def.is_delimiter("Hello."));
  CHECK(def.is_delimiter("\n"));
  CHECK(!def.is_delimiter(" world"));
  const Semantic s = parse({{"tau", "-1"}, {"chunk", "0"}, {"weight", "mean"}, {"delimiters", ".\\s\\c\\n"}});
  CHECK(s.tau == -1.f);
  CHECK(s.weight == MergeWeight::mean);
  CHECK(s.is_delimiter("a b"));
  CHECK(s.is_delimiter(","));
  CHECK(!s.is_delimiter(";"));

  CHECK_THROWS_WITH(parse({{"tau", "1.5"}}), Contains("semantic: tau must be in [-1, 1], got 1.5"));
  CHECK_THROWS_WITH(parse({{"tau", "-1.01"}}), Contains("tau must be in [-1, 1]"));
  CHECK_THROWS_WITH(parse({{"tau", "1.00000001"}}), Contains("tau must be in [-1, 1]"));
  CHECK_THROWS_WITH(parse({{"tau", "nan"}}), Contains("'tau' expects a number"));
  CHECK_THROWS_WITH(parse({{"chunk", "-3"}}), Contains("semantic: chunk must be >= 0"));
  CHECK_THROWS_WITH(parse({{"chunk", "0"}, {"delimiters", "none"}}),
                    Contains("no delimiters and chunk=0"));
  CHECK_THROWS_WITH(parse({{"weight", "max"}}), Contains("must be one of {importance, mean}"));
  CHECK_THROWS_WITH(parse({{"delimiters", "\\q"}}), Contains("unknown escape"));
  CHECK_THROWS_WITH(parse({{"delimiters", "abcdefghijklmnop"}}), Contains("at most 15"));
  CHECK_THROWS_WITH(parse({{"taus", "0.5"}}), Contains("unknown parameter 'taus'"));
  Semantic nan_tau;
  nan_tau.tau = std::nanf("");
  CHECK_THROWS_WITH(nan_tau.validate(), Contains("tau must be in [-1, 1]"));

  // chunk = 0 is valid with a delimiter mask, rejected without one.
  Cache<float> c(1, 2, 8, 2);
  c.scores.row(0, 0)[3] = 1.f;
  c.select(4);
  const Semantic by_delim = parse({{"chunk", "0"}});
  CHECK_THROWS_WITH(by_delim.merge(cpu_backend{1}, c.args()),
                    Contains("semantic: chunk must be > 0 when no delimiter mask is given"));
  c.delimiter = mtest::mask(8, {3});
  CHECK_NOTHROW(by_delim.merge(cpu_backend{1}, c.args()));
  auto a = c.args();
  a.log_count = nullptr;
  CHECK_THROWS_WITH(def.merge(cpu_backend{1}, a), Contains("semantic: log_count is required"));
  a = c.args();
  a.scores = nullptr;
  CHECK_THROWS_WITH(def.merge(cpu_backend{1}, a), Contains("semantic: scores are required"));
  a = c.args();
  a.selection = nullptr;
  CHECK_THROWS_WITH(def.merge(cpu_backend{1}, a), Contains("semantic: a selection is required"));
  a = c.args();
  a.delimiter_stride = 5;
  CHECK_THROWS_WITH(def.merge(cpu_backend{1}, a), Contains("delimiter_stride 5 is below the 8"));
  a = c.args();
  a.chunk_end = c.delimiter.data();
  CHECK_THROWS_WITH(def.merge(cpu_backend{1}, a), Contains("chunk_end may alias"));
  // A bad count anywhere is caught before any row is written.
  Cache<float> bad = c;
  bad.log_count(0, 1, 7) = -0.5f;
  CHECK_THROWS_WITH(def.merge(cpu_backend{1}, bad.args()),
                    Contains("log_count -0.5 at layer 0, head 1, token 7"));
  CHECK(kvtest::bytes_of(bad.k) == kvtest::bytes_of(c.k));
}

}  // namespace kvt_mergers_semantic
