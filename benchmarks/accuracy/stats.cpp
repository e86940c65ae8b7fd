#include "stats.hpp"

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvbench::stats {

Interval wilson(std::int64_t k, std::int64_t n, double z) {
  if (n < 0 || k < 0 || k > n)
    throw std::invalid_argument("wilson: need 0 <= k <= n, got k = " + std::to_string(k) +
                                ", n = " + std::to_string(n));
  if (n == 0) return {0, 1};
  const double nn = static_cast<double>(n), p = static_cast<double>(k) / nn, z2 = z * z;
  const double denom = 1 + z2 / nn;
  const double center = (p + z2 / (2 * nn)) / denom;
  const double half = z * std::sqrt(p * (1 - p) / nn + z2 / (4 * nn * nn)) / denom;
  // At k = 0 (k = n) the bound is 0 (1) in exact arithmetic; rounding would leave ~1e-17, which
  // Newcombe's interval below would carry into the difference's bounds.
  return {k == 0 ? 0.0 : std::max(0.0, center - half), k == n ? 1.0 : std::min(1.0, center + half)};
}

double percentile(std::span<const double> sorted, double q) {
  if (sorted.empty() || !(q >= 0 && q <= 1))
    throw std::invalid_argument("percentile: need a non-empty sample and 0 <= q <= 1");
  const double h = q * static_cast<double>(sorted.size() - 1);
  const auto j = static_cast<std::size_t>(std::floor(h));
  if (j + 1 >= sorted.size()) return sorted.back();
  // Equal neighbours give exactly that value (the difference is 0), so constant data yields a
  // zero-width interval rather than one off by a rounding.
  return sorted[j] + (h - static_cast<double>(j)) * (sorted[j + 1] - sorted[j]);
}

Estimate bootstrap_mean(std::span<const double> x, int resamples, std::uint64_t seed) {
  if (resamples < 1) throw std::invalid_argument("bootstrap_mean: resamples must be >= 1");
  Estimate e;
  e.n = static_cast<std::int64_t>(x.size());
  if (x.empty()) return e;
  // Sums are taken of x[i] - x[0]: constant data then gives exactly the constant (a plain sum of
  // 400 copies of 0.1, divided by 400, does not), and a large common offset (log-probabilities of
  // long answers) costs no precision. A NaN would also break std::sort's ordering: reject it.
  const double x0 = x[0];
  std::vector<double> d(x.size());
  double sum = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i]))
      throw std::invalid_argument("bootstrap_mean: x[" + std::to_string(i) + "] is not finite");
    d[i] = x[i] - x0;
    sum += d[i];
  }
  const double nn = static_cast<double>(x.size());
  e.mean = x0 + sum / nn;
  if (x.size() == 1) {
    e.ci = {x0, x0};
    return e;
  }
  std::mt19937_64 rng(seed);
  const std::uint64_t n = x.size();
  std::vector<double> means(static_cast<std::size_t>(resamples));
  for (double& m : means) {
    double s = 0;
    // The index rule of the header: the top 53 bits mod n. Not std::uniform_int_distribution,
    // whose algorithm differs between standard libraries.
    for (std::uint64_t i = 0; i < n; ++i) s += d[(rng() >> 11) % n];
    m = x0 + s / nn;
  }
  std::sort(means.begin(), means.end());
  e.ci = {percentile(means, 0.025), percentile(means, 0.975)};
  return e;
}

Estimate paired_bootstrap(std::span<const double> a, std::span<const double> b, int resamples,
                          std::uint64_t seed) {
  if (a.size() != b.size())
    throw std::invalid_argument("paired_bootstrap: sizes differ (" + std::to_string(a.size()) +
                                " vs " + std::to_string(b.size()) + ")");
  std::vector<double> d(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) d[i] = a[i] - b[i];
  return bootstrap_mean(d, resamples, seed);
}

double binomial_half_cdf(std::int64_t k, std::int64_t m) {
  if (m < 0) throw std::invalid_argument("binomial_half_cdf: m < 0");
  if (k < 0) return 0;
  if (k >= m) return 1;
  // Upper half by symmetry: P(X <= k) = 1 - P(X >= k + 1) = 1 - P(X <= m - k - 1).
  if (2 * k > m) return 1 - binomial_half_cdf(m - k - 1, m);
  // Lower half (k <= m / 2): the terms t_i = C(m, i) / 2^m increase with i up to k, so sum them
  // downwards relative to the largest, t_k, with t_{i-1} = t_i * i / (m - i + 1): no overflow, no
  // cancellation. t_k = 2^-m prod_{i=1..k} (m - k + i) / i as a product whose binary exponent is
  // kept apart (frexp), since 2^-m underflows from m = 1075 on. Each factor costs one rounding, so
  // the relative error stays near sqrt(k) * 2^-53; a log-space sum (or lgamma) would lose ~1e-9 at
  // m = 100000 to the rounding of a ~7e4 logarithm, and glibc's lgamma is not thread-safe.
  double mant = 1;
  std::int64_t bin_exp = -m;
  for (std::int64_t i = 1; i <= k; ++i) {
    int e = 0;
    mant = std::frexp(mant * (static_cast<double>(m - k + i) / static_cast<double>(i)), &e);
    bin_exp += e;
  }
  double rel = 1, sum = 1;
  for (std::int64_t i = k; i > 0; --i) {
    rel *= static_cast<double>(i) / static_cast<double>(m - i + 1);
    sum += rel;
    // The ratios only shrink further down, so the rest is below rel times a geometric series.
    if (rel < sum * 1e-18) break;
  }
  // mant * sum < k + 1 < 2^63, so an exponent below -2000 gives 0 either way: the clamp only keeps
  // the int conversion in range.
  const auto e2 = static_cast<int>(std::max<std::int64_t>(bin_exp, -2000));
  return std::min(1.0, std::ldexp(mant * sum, e2));
}

McNemar mcnemar(std::span<const std::uint8_t> a, std::span<const std::uint8_t> bb) {
  if (a.size() != bb.size())
    throw std::invalid_argument("mcnemar: sizes differ (" + std::to_string(a.size()) + " vs " +
                                std::to_string(bb.size()) + ")");
  // The paired 2x2 table: both correct (e), only a (b), only bb (c), neither (h).
  std::int64_t e = 0, h = 0;
  McNemar r;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const bool x = a[i] != 0, y = bb[i] != 0;
    e += x && y;
    r.b += x && !y;
    r.c += !x && y;
    h += !x && !y;
  }
  r.n = static_cast<std::int64_t>(a.size());
  if (r.n == 0) {
    r.ci = {-1, 1};  // nothing observed: every difference is possible
    return r;
  }
  const double n = static_cast<double>(r.n);
  r.diff = static_cast<double>(r.b - r.c) / n;

  // Newcombe (1998) method 10: Wilson intervals (l1, u1) of p1 = (e + b) / n and (l2, u2) of
  // p2 = (e + c) / n, combined as
  //   lo = diff - sqrt((p1 - l1)^2 - 2 phi (p1 - l1)(u2 - p2) + (u2 - p2)^2)
  //   hi = diff + sqrt((u1 - p1)^2 - 2 phi (u1 - p1)(p2 - l2) + (p2 - l2)^2)
  // where phi estimates the correlation of the two outcomes, with the paper's continuity
  // correction of the numerator: with D = e h - b c,
  //   phi = (D - n/2) / sqrt((e+b)(c+h)(e+c)(b+h))   if D > n/2,
  //         0                                         if 0 <= D <= n/2,
  //         D / sqrt((e+b)(c+h)(e+c)(b+h))           if D < 0.
  // When a marginal total is zero the denominator is zero (one outcome is constant, so its
  // correlation is undefined); the paper then takes phi = 0, and so do we. Doubles: the product
  // of the four marginals, up to (n/2)^4, overflows int64 from n ~ 110000 on.
  const Interval w1 = wilson(e + r.b, r.n), w2 = wilson(e + r.c, r.n);
  const double p1 = static_cast<double>(e + r.b) / n, p2 = static_cast<double>(e + r.c) / n;
  const double den = static_cast<double>(e + r.b) * static_cast<double>(r.c + h) *
                     static_cast<double>(e + r.c) * static_cast<double>(r.b + h);
  const double D = static_cast<double>(e) * static_cast<double>(h) -
                   static_cast<double>(r.b) * static_cast<double>(r.c);
  double phi = 0;
  if (den > 0) {
    if (D > n / 2)
      phi = (D - n / 2) / std::sqrt(den);
    else if (D < 0)
      phi = D / std::sqrt(den);
  }
  const double dl1 = p1 - w1.lo, du1 = w1.hi - p1, dl2 = p2 - w2.lo, du2 = w2.hi - p2;
  // |phi| <= 1 (the correction only shrinks |D|) keeps both radicands >= 0, lo >= l1 - u2 >= -1
  // and hi <= u1 - l2 <= 1 in exact arithmetic; the max and the clamp only absorb rounding.
  const double delta = std::sqrt(std::max(0.0, dl1 * dl1 - 2 * phi * dl1 * du2 + du2 * du2));
  const double eps = std::sqrt(std::max(0.0, du1 * du1 - 2 * phi * du1 * dl2 + dl2 * dl2));
  r.ci = {std::max(-1.0, r.diff - delta), std::min(1.0, r.diff + eps)};

  const std::int64_t discordant = r.b + r.c;
  r.p = discordant == 0 ? 1.0
                        : std::min(1.0, 2 * binomial_half_cdf(std::min(r.b, r.c), discordant));
  return r;
}

}  // namespace kvbench::stats
