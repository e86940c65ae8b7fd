// Interval estimates and paired comparisons for the accuracy benchmark. A grid point's score is a
// sample (a few hundred prompts at most), so every number the report prints carries a 95%
// interval, and a claim that one policy beats another is made only when the interval of the
// paired difference excludes zero.
//
//   wilson            exact match (passkey): k correct of n. Unlike the Wald interval it stays
//                     inside [0, 1] and does not collapse to a point at k = 0 or k = n, the usual
//                     case for an easy depth or a generous budget.
//   bootstrap_mean    continuous per-prompt scores (KL against the full cache, answer
//                     log-probability): the mean and its percentile-bootstrap interval, which
//                     assumes no normality (KL is heavily right-skewed).
//   paired_bootstrap  two policies scored on the same prompts: the interval of the mean
//                     difference over pairs, far narrower than comparing two separate intervals
//                     because the prompt-to-prompt variation cancels.
//   mcnemar           two policies' exact-match outcomes on the same prompts: only the discordant
//                     prompts carry information. The exact McNemar p-value, and Newcombe's
//                     method-10 interval for the accuracy difference.
//
// Everything is deterministic and platform-independent: the bootstrap draws its indices from
// std::mt19937_64 (whose output sequence the standard fixes) with a fixed integer rule, never
// through std::uniform_int_distribution (whose algorithm is implementation-defined), so a report
// regenerated on another machine shows the same intervals.
#pragma once
#include <cstdint>
#include <span>

namespace kvbench::stats {

constexpr double kZ95 = 1.959963984540054;  // the 97.5% point of the standard normal

struct Interval {
  double lo = 0, hi = 0;
  bool excludes_zero() const { return lo > 0 || hi < 0; }
};

struct Estimate {
  double mean = 0;
  Interval ci;
  std::int64_t n = 0;
};

// Wilson score interval for k successes in n trials (n == 0: {0, 1}), clamped to [0, 1]; k = 0
// gives lo = 0 and k = n gives hi = 1 exactly. Throws std::invalid_argument unless 0 <= k <= n.
Interval wilson(std::int64_t k, std::int64_t n, double z = kZ95);

// Mean of x and its percentile-bootstrap 95% interval from `resamples` resamples of size n.
// Index rule: rng = std::mt19937_64(seed); each draw is index = (rng() >> 11) % n (53 random bits
// reduced mod n: the bias is below n / 2^53, and the sequence is the same on every platform).
// A resample's indices are drawn consecutively, resample after resample. Percentile rule: see
// percentile(). n == 0: mean 0, ci {0, 0}; n == 1: ci {x0, x0}. Throws std::invalid_argument if
// resamples < 1.
Estimate bootstrap_mean(std::span<const double> x, int resamples = 2000, std::uint64_t seed = 1);

// Paired: mean of a[i] - b[i] and the percentile-bootstrap 95% interval over pairs (exactly
// bootstrap_mean on the differences, so the same index draws). Throws std::invalid_argument if
// the sizes differ.
Estimate paired_bootstrap(std::span<const double> a, std::span<const double> b,
                          int resamples = 2000, std::uint64_t seed = 1);

// McNemar's test for paired binary outcomes (nonzero = correct). b = #(a[i] && !bb[i]),
// c = #(!a[i] && bb[i]). Throws std::invalid_argument if the sizes differ.
struct McNemar {
  std::int64_t b = 0, c = 0, n = 0;
  double diff = 0;  // (b - c) / n: accuracy of a minus accuracy of bb
  Interval ci;      // 95% interval of diff: Newcombe (1998) method 10 (hybrid score, from the
                    // Wilson intervals of the two marginal proportions with the phi correction);
                    // n == 0: {-1, 1}
  double p = 1;     // exact two-sided p-value: min(1, 2 * P(X <= min(b, c))), X ~ Bin(b + c, 1/2)
};
McNemar mcnemar(std::span<const std::uint8_t> a, std::span<const std::uint8_t> bb);

// ---- helpers (exposed for the tests) ------------------------------------------------------

// The q-quantile of ascending `sorted` (non-empty), by linear interpolation between order
// statistics (Hyndman & Fan type 7, numpy's default): h = q * (size - 1), j = floor(h),
// result = sorted[j] + (h - j) * (sorted[j + 1] - sorted[j]). With 2000 resamples the 95% interval
// is 0.05 of the way from the 50th to the 51st smallest mean (h = 49.975, 0-based), and 0.025 of
// the way from the 1950th to the 1951st (h = 1949.025).
double percentile(std::span<const double> sorted, double q);

// P(X <= k) for X ~ Bin(m, 1/2), 0 <= m; k < 0 gives 0 and k >= m gives 1. Stable for large m
// (100000 and beyond): see stats.cpp.
double binomial_half_cdf(std::int64_t k, std::int64_t m);

}  // namespace kvbench::stats
