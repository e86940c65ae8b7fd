// The accuracy benchmark's statistics (benchmarks/accuracy/stats.hpp) against hand-computed
// values: Wilson bounds, exact McNemar p-values, Newcombe's method-10 interval (the worked
// examples of the paper), the binomial tail at b + c = 100000, and the bootstrap's determinism,
// degenerate cases and width. z = 1.959963984540054 throughout, z^2 = 3.8414588.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <vector>

#include "stats.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_bench_stats {

namespace st = kvbench::stats;

namespace {

// The paired outcomes of a 2x2 table: `both` prompts both policies answer, `only_a` only a,
// `only_b` only b, `neither` neither. Interleaved rather than in blocks, which changes nothing
// for McNemar but would catch a count that depends on the order.
struct Pairs {
  std::vector<std::uint8_t> a, b;
};
Pairs table(int both, int only_a, int only_b, int neither) {
  Pairs p;
  int left[4] = {both, only_a, only_b, neither};
  const std::uint8_t va[4] = {1, 1, 0, 0}, vb[4] = {1, 0, 1, 0};
  for (bool any = true; any;) {
    any = false;
    for (int cell = 0; cell < 4; ++cell)
      if (left[cell] > 0) {
        --left[cell];
        p.a.push_back(va[cell]);
        p.b.push_back(vb[cell]);
        any = true;
      }
  }
  return p;
}

// Uniform(0, 1) from the top 53 bits: a fixed rule, so the test data are the same everywhere.
std::vector<double> uniforms(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<double> x(n);
  for (double& v : x) v = static_cast<double>(rng() >> 11) * 0x1.0p-53;
  return x;
}

}  // namespace

TEST_CASE("wilson interval matches hand-computed bounds", "[stats]") {
  // k = 0, n = 10: p = 0, so center = half = (z^2 / 20) / (1 + z^2 / 10) and
  // hi = (z^2 / 10) / (1 + z^2 / 10) = 0.38414588 / 1.38414588 = 0.27753; lo is exactly 0.
  const auto none = st::wilson(0, 10);
  CHECK(none.lo == 0.0);
  CHECK(none.hi == Approx(0.2775).margin(5e-5));
  CHECK(none.hi == Approx(0.2775328).margin(1e-7));

  // k = 5, n = 10: center = 0.5; half = z sqrt(0.25 / 10 + z^2 / 400) / (1 + z^2 / 10)
  //   = 1.959964 * sqrt(0.025 + 0.0096036) / 1.3841459 = 1.959964 * 0.1860206 / 1.3841459
  //   = 0.263407, so [0.2366, 0.7634].
  const auto half = st::wilson(5, 10);
  CHECK(half.lo == Approx(0.2366).margin(5e-5));
  CHECK(half.hi == Approx(0.7634).margin(5e-5));
  CHECK(half.lo + half.hi == Approx(1.0).margin(1e-15));  // symmetric about 1/2

  // k = n = 10: the mirror image of k = 0, with hi exactly 1.
  const auto all = st::wilson(10, 10);
  CHECK(all.hi == 1.0);
  CHECK(all.lo == Approx(1 - 0.2775328).margin(1e-7));
  CHECK(all.excludes_zero());  // [0.72, 1] lies above 0

  // The bounds at k = 0 and k = n are exact, not off by a rounding (which Newcombe's interval
  // would carry into the difference: a policy right on every prompt must have hi = 1).
  for (std::int64_t n = 1; n <= 200; ++n) {
    CHECK(st::wilson(0, n).lo == 0.0);
    CHECK(st::wilson(n, n).hi == 1.0);
  }

  // n = 0: nothing observed, the whole range.
  const auto empty = st::wilson(0, 0);
  CHECK(empty.lo == 0.0);
  CHECK(empty.hi == 1.0);

  CHECK_THROWS_AS(st::wilson(11, 10), std::invalid_argument);
  CHECK_THROWS_AS(st::wilson(-1, 10), std::invalid_argument);
}

TEST_CASE("binomial_half_cdf is exact on small cases and stable at 100000 trials", "[stats]") {
  // Small m: P(X <= k) = sum_{i <= k} C(m, i) / 2^m.
  CHECK(st::binomial_half_cdf(0, 5) == Approx(1.0 / 32).epsilon(1e-14));
  CHECK(st::binomial_half_cdf(2, 12) == Approx((1 + 12 + 66) / 4096.0).epsilon(1e-14));
  CHECK(st::binomial_half_cdf(2, 4) == Approx((1 + 4 + 6) / 16.0).epsilon(1e-14));
  CHECK(st::binomial_half_cdf(3, 4) == Approx(15 / 16.0).epsilon(1e-14));  // upper half
  CHECK(st::binomial_half_cdf(-1, 4) == 0.0);
  CHECK(st::binomial_half_cdf(4, 4) == 1.0);
  CHECK(st::binomial_half_cdf(0, 0) == 1.0);

  // m = 100000, reference values from exact integer arithmetic (Python: the running sum of
  // C(m, i) by C(m, i) = C(m, i - 1) (m - i + 1) / i, divided by 2^m as a Fraction):
  //   P(X <= 50000) = 0.5012615631070984  (= 1/2 + C(m, m/2) / 2^(m+1); Stirling gives
  //                   C(m, m/2) / 2^m ~ sqrt(2 / (pi m)) (1 - 1/(4m)) = 0.0025231262)
  //   P(X <= 49500) = 7.911799394257978e-4
  //   P(X <= 49000) = 1.294358019173449e-10
  // 2^-100000 underflows, so a naive sum of C(m, i) / 2^m would give 0 or NaN.
  CHECK(st::binomial_half_cdf(50000, 100000) == Approx(0.5012615631070984).epsilon(1e-12));
  CHECK(st::binomial_half_cdf(49500, 100000) == Approx(7.911799394257978e-4).epsilon(1e-12));
  CHECK(st::binomial_half_cdf(49000, 100000) == Approx(1.294358019173449e-10).epsilon(1e-12));
  CHECK(st::binomial_half_cdf(0, 100000) == 0.0);  // 2^-100000: underflows to 0, not NaN
  // Upper half by symmetry: P(X <= 50499) = 1 - P(X >= 50500) = 1 - P(X <= 49500).
  CHECK(st::binomial_half_cdf(50499, 100000) == Approx(1 - 7.911799394257978e-4).epsilon(1e-12));
}

TEST_CASE("mcnemar exact p-value and the sign of the difference", "[stats]") {
  // b = 5, c = 0: P(X <= 0) = 1/2^5 with X ~ Bin(5, 1/2); p = 2/32 = 0.0625.
  {
    const auto t = table(20, 5, 0, 5);
    const auto r = st::mcnemar(t.a, t.b);
    CHECK(r.b == 5);
    CHECK(r.c == 0);
    CHECK(r.n == 30);
    CHECK(r.p == Approx(0.0625).epsilon(1e-14));
    CHECK(r.diff == Approx(5.0 / 30).epsilon(1e-15));  // a is right 25/30, b 20/30
  }
  // b = 10, c = 2: P(X <= 2) = (C(12,0) + C(12,1) + C(12,2)) / 2^12 = (1 + 12 + 66) / 4096;
  // p = 2 * 79 / 4096 = 0.0385742.
  {
    const auto t = table(30, 10, 2, 8);
    const auto r = st::mcnemar(t.a, t.b);
    CHECK(r.p == Approx(2 * (1 + 12 + 66) / 4096.0).epsilon(1e-14));
    CHECK(r.diff == Approx((10 - 2) / 50.0).epsilon(1e-15));
    CHECK(r.diff > 0);
    // Swapping the policies swaps b and c: the same p, the opposite difference, the mirrored
    // interval.
    const auto s = st::mcnemar(t.b, t.a);
    CHECK(s.b == 2);
    CHECK(s.c == 10);
    CHECK(s.p == r.p);
    CHECK(s.diff == -r.diff);
    CHECK(s.ci.lo == Approx(-r.ci.hi).margin(1e-15));
    CHECK(s.ci.hi == Approx(-r.ci.lo).margin(1e-15));
  }
  // b = c: P(X <= b) >= 1/2, so p = min(1, ...) = 1 exactly; no difference.
  {
    const auto t = table(10, 7, 7, 6);
    const auto r = st::mcnemar(t.a, t.b);
    CHECK(r.p == 1.0);
    CHECK(r.diff == 0.0);
    CHECK_FALSE(r.ci.excludes_zero());
  }
  // No discordant pairs at all: p = 1.
  {
    const auto t = table(3, 0, 0, 2);
    CHECK(st::mcnemar(t.a, t.b).p == 1.0);
  }
  // Any nonzero byte counts as correct.
  {
    const std::vector<std::uint8_t> a = {2, 255, 0}, b = {0, 1, 7};
    const auto r = st::mcnemar(a, b);
    CHECK(r.b == 1);
    CHECK(r.c == 1);
  }
  const std::vector<std::uint8_t> three = {1, 0, 1}, two = {1, 0};
  CHECK_THROWS_AS(st::mcnemar(three, two), std::invalid_argument);
  const auto empty = st::mcnemar({}, {});
  CHECK(empty.n == 0);
  CHECK(empty.p == 1.0);
  CHECK(empty.ci.lo == -1.0);
  CHECK(empty.ci.hi == 1.0);
}

TEST_CASE("mcnemar interval is Newcombe method 10 as in the paper's worked examples", "[stats]") {
  // Newcombe, R. G. (1998), Statistics in Medicine 17:2635-2650, Table II, method 10 (cells e, f,
  // g, h = both, only a, only b, neither). The 4-decimal limits as reproduced in the tests of the
  // R package propint (ci.two.dep.props); recomputed here independently, by the arithmetic below
  // (and in double precision, which agrees to within 4e-5 of every rounded limit).
  //
  // (a) 36, 12, 2, 0; n = 50: p1 = 48/50 = 0.96, p2 = 38/50 = 0.76, diff = 10/50 = 0.2.
  //   Wilson(48, 50): 1 + z^2/50 = 1.0768292; center = (0.96 + 0.0384146) / 1.0768292 = 0.927180;
  //     half = z sqrt(0.96 * 0.04 / 50 + z^2 / 10000) / 1.0768292
  //          = 1.959964 * sqrt(0.000768 + 0.000384146) / 1.0768292 = 0.061781
  //     -> l1 = 0.865399, u1 = 0.988961.
  //   Wilson(38, 50): center = (0.76 + 0.0384146) / 1.0768292 = 0.741450;
  //     half = 1.959964 * sqrt(0.003648 + 0.000384146) / 1.0768292 = 0.115576
  //     -> l2 = 0.625873, u2 = 0.857026.
  //   D = e h - f g = 0 - 24 = -24 < 0, so phi = -24 / sqrt(48 * 2 * 38 * 12)
  //     = -24 / 209.2271 = -0.114708 (no correction applies to a negative D).
  //   p1 - l1 = 0.094601, u2 - p2 = 0.097026:
  //     delta = sqrt(0.094601^2 + 2 * 0.114708 * 0.094601 * 0.097026 + 0.097026^2)
  //           = sqrt(0.0089493 + 0.0021057 + 0.0094140) = sqrt(0.0204690) = 0.143070
  //     -> lo = 0.2 - 0.143070 = 0.056930 (paper: 0.0569).
  //   u1 - p1 = 0.028961, p2 - l2 = 0.134127:
  //     eps = sqrt(0.028961^2 + 2 * 0.114708 * 0.028961 * 0.134127 + 0.134127^2)
  //         = sqrt(0.00083874 + 0.00089116 + 0.0179900) = sqrt(0.0197199) = 0.140428
  //     -> hi = 0.2 + 0.140428 = 0.340428 (paper: 0.3404).
  {
    const auto t = table(36, 12, 2, 0);
    const auto r = st::mcnemar(t.a, t.b);
    CHECK(r.diff == Approx(0.2).epsilon(1e-15));
    CHECK(r.ci.lo == Approx(0.0569).margin(5e-5));
    CHECK(r.ci.hi == Approx(0.3404).margin(5e-5));
    CHECK(r.ci.lo == Approx(0.056930).margin(2e-6));
    CHECK(r.ci.hi == Approx(0.340428).margin(2e-6));
    CHECK(r.ci.excludes_zero());
    // b = 12, c = 2: p = 2 (1 + 14 + 91) / 2^14 = 212 / 16384 = 0.012939.
    CHECK(r.p == Approx(212 / 16384.0).epsilon(1e-14));
  }
  // (b) 18, 12, 2, 18; n = 50: D = 324 - 24 = 300 > n/2 = 25, so the corrected
  //   phi = (300 - 25) / sqrt(30 * 20 * 20 * 30) = 275 / 600 = 0.458333 (uncorrected: 0.5).
  //   Paper: 0.0562 to 0.3290.
  {
    const auto t = table(18, 12, 2, 18);
    const auto r = st::mcnemar(t.a, t.b);
    CHECK(r.ci.lo == Approx(0.0562).margin(5e-5));
    CHECK(r.ci.hi == Approx(0.3290).margin(5e-5));
  }
  // (c) 53, 0, 0, 1; n = 54: p1 = p2 = 53/54 = 0.981481, diff = 0.
  //   Wilson(53, 54): 1 + z^2/54 = 1.0711381; center = (0.981481 + 0.0355691) / 1.0711381
  //     = 0.949505, half = 0.047219 -> l = 0.902286, u = 0.996724.
  //   D = 53 > n/2 = 27, so phi = (53 - 27) / sqrt(53 * 1 * 53 * 1) = 26/53 = 0.490566.
  //   p - l = 0.079196, u - p = 0.015242:
  //     delta = eps = sqrt(0.079196^2 - 2 * 0.490566 * 0.079196 * 0.015242 + 0.015242^2)
  //                 = sqrt(0.0062720 - 0.0011843 + 0.0002323) = sqrt(0.0053200) = 0.072938.
  //   Paper: -0.0729 to 0.0729. Without the correction (phi = 53/53 = 1) the half-width would be
  //   0.079196 - 0.015242 = 0.063954; with phi = 0, sqrt(0.0065043) = 0.080649: this example
  //   tells all three apart.
  {
    const auto t = table(53, 0, 0, 1);
    const auto r = st::mcnemar(t.a, t.b);
    CHECK(r.diff == 0.0);
    CHECK(r.ci.lo == Approx(-0.0729).margin(5e-5));
    CHECK(r.ci.hi == Approx(0.0729).margin(5e-5));
    CHECK(r.ci.hi == Approx(0.072938).margin(2e-6));
    CHECK(r.p == 1.0);
  }
  // (d) 0, 30, 0, 0; n = 30: p1 = 1, p2 = 0, diff = 1. The marginal e + g = 0 makes phi's
  //   denominator zero: phi = 0. Wilson(30, 30) = [0.886487, 1], Wilson(0, 30) = [0, 0.113513]
  //   (hi = (z^2/30) / (1 + z^2/30) = 0.128049 / 1.128049); lo = 1 - sqrt(0.113513^2 +
  //   0.113513^2) = 1 - 0.160532 = 0.839468, hi = 1 + sqrt(0 + 0) = 1. Paper: 0.8395 to 1.0.
  {
    const auto t = table(0, 30, 0, 0);
    const auto r = st::mcnemar(t.a, t.b);
    CHECK(r.diff == 1.0);
    CHECK(r.ci.lo == Approx(0.8395).margin(5e-5));
    CHECK(r.ci.hi == 1.0);
    // b = 30, c = 0: p = 2 / 2^30.
    CHECK(r.p == Approx(2 / 1073741824.0).epsilon(1e-12));
  }
}

TEST_CASE("percentile interpolates linearly between order statistics", "[stats]") {
  const std::vector<double> v = {0, 10, 20, 30, 40};
  // h = q (5 - 1): q = 0.025 -> h = 0.1 -> 0 + 0.1 * 10 = 1; q = 0.975 -> h = 3.9 -> 39.
  CHECK(st::percentile(v, 0.025) == Approx(1.0).margin(1e-12));
  CHECK(st::percentile(v, 0.975) == Approx(39.0).margin(1e-12));
  CHECK(st::percentile(v, 0.5) == 20.0);
  CHECK(st::percentile(v, 0.0) == 0.0);
  CHECK(st::percentile(v, 1.0) == 40.0);
  // 2000 resampled means valued 0..1999: h = 0.025 * 1999 = 49.975 and 0.975 * 1999 = 1949.025.
  std::vector<double> w(2000);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = static_cast<double>(i);
  CHECK(st::percentile(w, 0.025) == Approx(49.975).margin(1e-9));
  CHECK(st::percentile(w, 0.975) == Approx(1949.025).margin(1e-9));
  CHECK_THROWS_AS(st::percentile(std::vector<double>{}, 0.5), std::invalid_argument);
}

TEST_CASE("bootstrap_mean of constant data collapses to the constant", "[stats]") {
  // 0.1 is not a binary fraction: a plain sum of 400 copies divided by 400 is off by a rounding;
  // the interval must still be exactly {0.1, 0.1}.
  const std::vector<double> x(400, 0.1);
  const auto e = st::bootstrap_mean(x);
  CHECK(e.n == 400);
  CHECK(e.mean == 0.1);
  CHECK(e.ci.lo == 0.1);
  CHECK(e.ci.hi == 0.1);

  const std::vector<double> one = {-3.25};
  const auto e1 = st::bootstrap_mean(one);
  CHECK(e1.n == 1);
  CHECK(e1.mean == -3.25);
  CHECK(e1.ci.lo == -3.25);
  CHECK(e1.ci.hi == -3.25);
  CHECK(e1.ci.excludes_zero());

  const auto e0 = st::bootstrap_mean({});
  CHECK(e0.n == 0);
  CHECK(e0.mean == 0.0);
  CHECK(e0.ci.lo == 0.0);
  CHECK(e0.ci.hi == 0.0);
  CHECK_FALSE(e0.ci.excludes_zero());

  CHECK_THROWS_AS(st::bootstrap_mean(x, 0), std::invalid_argument);
  const std::vector<double> bad = {1.0, std::nan("")};
  CHECK_THROWS_AS(st::bootstrap_mean(bad), std::invalid_argument);
}

TEST_CASE("bootstrap_mean is deterministic for a seed and differs across seeds", "[stats]") {
  const auto x = uniforms(50, 7);
  const auto a = st::bootstrap_mean(x, 500, 42), b = st::bootstrap_mean(x, 500, 42);
  CHECK(a.ci.lo == b.ci.lo);  // bit-identical, not just close
  CHECK(a.ci.hi == b.ci.hi);
  CHECK(a.mean == b.mean);
  const auto c = st::bootstrap_mean(x, 500, 43);
  CHECK(c.mean == a.mean);  // the point estimate does not depend on the seed
  CHECK((c.ci.lo != a.ci.lo || c.ci.hi != a.ci.hi));
  CHECK(a.ci.lo < a.mean);
  CHECK(a.mean < a.ci.hi);
}

TEST_CASE("bootstrap_mean follows the documented draw and percentile rules", "[stats]") {
  // The platform independence rests on std::mt19937_64's output, which the standard pins: the
  // 10000th value of a default-constructed engine is 9981545732273789042.
  std::mt19937_64 probe;
  probe.discard(9999);
  CHECK(probe() == 9981545732273789042ull);

  // The rule of stats.hpp, spelled out: 40 resamples of 7, index = (rng() >> 11) % 7 with
  // rng = mt19937_64(3), consecutively; sorted means; h = 0.025 * 39 = 0.975 and
  // 0.975 * 39 = 38.025, so lo = m[0] + 0.975 (m[1] - m[0]), hi = m[38] + 0.025 (m[39] - m[38]).
  const std::vector<double> x = {0, 1, 2, 4, 8, 16, 32};
  std::mt19937_64 rng(3);
  std::vector<double> m(40);
  for (double& v : m) {
    double s = 0;
    for (int i = 0; i < 7; ++i) s += x[(rng() >> 11) % 7];
    v = s / 7;
  }
  std::sort(m.begin(), m.end());
  const auto e = st::bootstrap_mean(x, 40, 3);
  CHECK(e.mean == Approx(63.0 / 7).margin(1e-14));
  CHECK(e.ci.lo == Approx(m[0] + 0.975 * (m[1] - m[0])).margin(1e-12));
  CHECK(e.ci.hi == Approx(m[38] + 0.025 * (m[39] - m[38])).margin(1e-12));
  CHECK(e.ci.lo < e.ci.hi);
}

TEST_CASE("bootstrap_mean interval width matches normal theory on 400 uniform draws", "[stats]") {
  // Uniform(0, 1): sd = 1 / sqrt(12) = 0.288675. The 95% interval of the mean of n = 400 is
  // about 2 * 1.96 * 0.288675 / 20 = 0.056580 wide; the percentile bootstrap should agree to
  // well within 20% (sample sd, the bootstrap's (n-1)/n and 2000-resample noise are a few %).
  const std::size_t n = 400;
  const auto x = uniforms(n, 2024);
  double sum = 0;
  for (double v : x) sum += v;
  const auto e = st::bootstrap_mean(x);  // 2000 resamples, seed 1
  CHECK(e.n == 400);
  CHECK(e.mean == Approx(sum / n).epsilon(1e-13));
  const double expected = 2 * st::kZ95 * (1 / std::sqrt(12.0)) / std::sqrt(static_cast<double>(n));
  CHECK(expected == Approx(0.056580).margin(1e-6));
  const double width = e.ci.hi - e.ci.lo;
  CHECK(width > 0.8 * expected);
  CHECK(width < 1.2 * expected);
  CHECK(e.ci.lo < e.mean);
  CHECK(e.mean < e.ci.hi);
  // With this seed the interval covers the true mean 1/2 (a 95% event, fixed by the seed).
  CHECK(e.ci.lo < 0.5);
  CHECK(0.5 < e.ci.hi);
}

TEST_CASE("paired_bootstrap works on the differences and rejects unequal sizes", "[stats]") {
  const auto b = uniforms(200, 5);
  std::vector<double> a(b.size());
  for (std::size_t i = 0; i < b.size(); ++i) a[i] = b[i] + 0.5;
  // a[i] - b[i] is 0.5 up to the rounding of b[i] + 0.5 (at most 2^-53 = 1.1e-16).
  const auto e = st::paired_bootstrap(a, b);
  CHECK(e.n == 200);
  CHECK(e.mean == Approx(0.5).margin(1e-15));
  CHECK(e.ci.lo == Approx(0.5).margin(1e-15));
  CHECK(e.ci.hi == Approx(0.5).margin(1e-15));
  CHECK(e.ci.excludes_zero());

  // The same draws as bootstrap_mean on the differences.
  const auto c = uniforms(200, 6);
  std::vector<double> d(b.size());
  for (std::size_t i = 0; i < b.size(); ++i) d[i] = c[i] - b[i];
  const auto p = st::paired_bootstrap(c, b, 300, 9), q = st::bootstrap_mean(d, 300, 9);
  CHECK(p.mean == q.mean);
  CHECK(p.ci.lo == q.ci.lo);
  CHECK(p.ci.hi == q.ci.hi);
  double sb = 0, sc = 0;
  for (std::size_t i = 0; i < b.size(); ++i) sb += b[i], sc += c[i];
  CHECK(p.mean == Approx((sc - sb) / 200).margin(1e-15));
  CHECK(p.ci.lo < p.mean);
  CHECK(p.mean < p.ci.hi);

  const std::vector<double> shorter(199, 0.0);
  CHECK_THROWS_AS(st::paired_bootstrap(a, shorter), std::invalid_argument);
}

}  // namespace kvt_bench_stats
