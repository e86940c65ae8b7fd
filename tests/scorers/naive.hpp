// Naive references for the scorers, straight from shared/algorithms.md: plain loops in double,
// the explicit attention matrix, a sort-everything selection. Plus check_scorer(), which runs a
// scorer through Pipeline<S, Uniform> and the runtime Policy on 1, 2 and the default number of
// threads and compares scores and kept sets with these references.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <kvpolicy/kvpolicy.hpp>

#include "common/random_kv.hpp"

namespace naive {

using kvpolicy::GqaReduce;
using kvpolicy::Pool;
using kvtest::Dense;

// [L][Hkv][T] scores; NaN marks a value the spec leaves open (SnapKV's protected window).
struct Scores {
  std::int64_t L = 0, H = 0, T = 0;
  std::vector<double> v;
  Scores(std::int64_t l, std::int64_t h, std::int64_t t)
      : L(l), H(h), T(t), v(static_cast<std::size_t>(l * h * t), 0.0) {}
  double& at(std::int64_t l, std::int64_t h, std::int64_t j) {
    return v[static_cast<std::size_t>((l * H + h) * T + j)];
  }
  const double* row(std::int64_t l, std::int64_t h) const { return v.data() + (l * H + h) * T; }
};

// A[i][j]: softmax attention of query i of query head qh (given query i sits at position
// T - n_q + i and sees keys 0..position) over the keys of its KV head qh / g.
inline std::vector<std::vector<double>> attention(const Dense& k, const Dense& q, std::int64_t l,
                                                  std::int64_t qh) {
  const std::int64_t T = k.N, nq = q.N, d = k.d, h = qh / (q.H / k.H);
  std::vector<std::vector<double>> A(static_cast<std::size_t>(nq),
                                     std::vector<double>(static_cast<std::size_t>(T), 0.0));
  for (std::int64_t i = 0; i < nq; ++i) {
    const std::int64_t pos = T - nq + i;
    std::vector<double> logit(static_cast<std::size_t>(pos + 1));
    for (std::int64_t j = 0; j <= pos; ++j) {
      double dot = 0;
      for (std::int64_t e = 0; e < d; ++e) dot += q.at(l, qh, i, e) * k.at(l, h, j, e);
      logit[static_cast<std::size_t>(j)] = dot / std::sqrt(static_cast<double>(d));
    }
    const double mx = *std::max_element(logit.begin(), logit.end());
    double z = 0;
    for (double x : logit) z += std::exp(x - mx);
    for (std::int64_t j = 0; j <= pos; ++j)
      A[static_cast<std::size_t>(i)][static_cast<std::size_t>(j)] =
          std::exp(logit[static_cast<std::size_t>(j)] - mx) / z;
  }
  return A;
}

// Sum over the last n of the given queries of A[i][j], per query head, reduced over each GQA
// group to its KV head.
inline Scores column_sums(const Dense& k, const Dense& q, std::int64_t n, GqaReduce r) {
  const std::int64_t g = q.H / k.H;
  Scores out(k.L, k.H, k.N);
  for (std::int64_t l = 0; l < k.L; ++l)
    for (std::int64_t h = 0; h < k.H; ++h)
      for (std::int64_t m = 0; m < g; ++m) {
        const auto A = attention(k, q, l, h * g + m);
        for (std::int64_t j = 0; j < k.N; ++j) {
          double s = 0;
          for (std::int64_t i = q.N - n; i < q.N; ++i)
            s += A[static_cast<std::size_t>(i)][static_cast<std::size_t>(j)];
          double& o = out.at(l, h, j);
          if (r == GqaReduce::max)
            o = m == 0 ? s : std::max(o, s);
          else
            o += r == GqaReduce::mean ? s / static_cast<double>(g) : s;
        }
      }
  return out;
}

// H2O: column sums of all given queries; normalize divides by how many of them see key j.
inline Scores h2o(const Dense& k, const Dense& q, bool normalize, GqaReduce r) {
  Scores s = column_sums(k, q, q.N, r);
  if (normalize)
    for (std::int64_t l = 0; l < k.L; ++l)
      for (std::int64_t h = 0; h < k.H; ++h)
        for (std::int64_t j = 0; j < k.N; ++j) {
          std::int64_t seen = 0;
          for (std::int64_t i = 0; i < q.N; ++i) seen += (k.N - q.N + i >= j);
          s.at(l, h, j) /= static_cast<double>(seen);
        }
  return s;
}

// SnapKV: column sums of the last w = min(window, T) queries over keys j < T - w, pooled over
// those keys only (avg: zero padding, divide by kernel; max: padding ignored). Window: NaN.
inline Scores snapkv(const Dense& k, const Dense& q, std::int64_t window, int kernel, Pool pool,
                     GqaReduce r) {
  const std::int64_t T = k.N, w = std::min(window, T), n = T - w, rad = kernel / 2;
  const Scores raw = column_sums(k, q, w, r);
  Scores s(k.L, k.H, T);
  for (std::int64_t l = 0; l < k.L; ++l)
    for (std::int64_t h = 0; h < k.H; ++h) {
      const double* a = raw.row(l, h);
      for (std::int64_t j = 0; j < T; ++j) {
        if (j >= n) {
          s.at(l, h, j) = std::numeric_limits<double>::quiet_NaN();
          continue;
        }
        double acc = pool == Pool::max ? -1e300 : 0.0;
        for (std::int64_t t = j - rad; t <= j + rad; ++t) {
          if (t < 0 || t >= n) continue;  // padding: adds 0 to avg, ignored by max
          acc = pool == Pool::max ? std::max(acc, a[t]) : acc + a[t];
        }
        s.at(l, h, j) = pool == Pool::max ? acc : acc / kernel;
      }
    }
  return s;
}

// TOVA: the last query's attention averaged over every query head; one row for all KV heads.
inline Scores tova(const Dense& k, const Dense& q) {
  Scores s(k.L, k.H, k.N);
  for (std::int64_t l = 0; l < k.L; ++l) {
    std::vector<double> mean(static_cast<std::size_t>(k.N), 0.0);
    for (std::int64_t qh = 0; qh < q.H; ++qh) {
      const auto A = attention(k, q, l, qh);
      for (std::int64_t j = 0; j < k.N; ++j)
        mean[static_cast<std::size_t>(j)] +=
            A[static_cast<std::size_t>(q.N - 1)][static_cast<std::size_t>(j)] /
            static_cast<double>(q.H);
    }
    for (std::int64_t h = 0; h < k.H; ++h)
      for (std::int64_t j = 0; j < k.N; ++j) s.at(l, h, j) = mean[static_cast<std::size_t>(j)];
  }
  return s;
}

inline double norm(const Dense& k, std::int64_t l, std::int64_t h, std::int64_t j) {
  double s = 0;
  for (std::int64_t e = 0; e < k.d; ++e) s += k.at(l, h, j, e) * k.at(l, h, j, e);
  return std::sqrt(s);
}

inline Scores knorm(const Dense& k) {
  Scores s(k.L, k.H, k.N);
  for (std::int64_t l = 0; l < k.L; ++l)
    for (std::int64_t h = 0; h < k.H; ++h)
      for (std::int64_t j = 0; j < k.N; ++j) s.at(l, h, j) = -norm(k, l, h, j);
  return s;
}

// KeyDiff: -cos(k_j, mean_i(k_i / ||k_i||)); a zero key (or anchor) scores 0.
inline Scores keydiff(const Dense& k) {
  Scores s(k.L, k.H, k.N);
  for (std::int64_t l = 0; l < k.L; ++l)
    for (std::int64_t h = 0; h < k.H; ++h) {
      std::vector<double> anchor(static_cast<std::size_t>(k.d), 0.0);
      for (std::int64_t i = 0; i < k.N; ++i) {
        const double n = norm(k, l, h, i);
        for (std::int64_t e = 0; e < k.d; ++e)
          if (n > 0) anchor[static_cast<std::size_t>(e)] += k.at(l, h, i, e) / n / k.N;
      }
      double an = 0;
      for (double a : anchor) an += a * a;
      an = std::sqrt(an);
      for (std::int64_t j = 0; j < k.N; ++j) {
        double dot = 0;
        for (std::int64_t e = 0; e < k.d; ++e)
          dot += k.at(l, h, j, e) * anchor[static_cast<std::size_t>(e)];
        const double n = norm(k, l, h, j);
        s.at(l, h, j) = (n > 0 && an > 0) ? -dot / (n * an) : 0.0;
      }
    }
  return s;
}

// StreamingLLM: the score is the position.
inline Scores streaming(const Dense& k) {
  Scores s(k.L, k.H, k.N);
  for (std::int64_t l = 0; l < k.L; ++l)
    for (std::int64_t h = 0; h < k.H; ++h)
      for (std::int64_t j = 0; j < k.N; ++j) s.at(l, h, j) = static_cast<double>(j);
  return s;
}

inline bool is_protected(std::int64_t j, std::int64_t T, std::int64_t sinks, std::int64_t recent) {
  return j < sinks || j >= T - recent;
}

// Keep everything if budget >= T; else the protected tokens plus the best budget - protected
// others, ordered by (score desc, index desc). Ascending.
inline std::vector<std::int32_t> select(const double* s, std::int64_t T, std::int64_t budget,
                                        std::int64_t sinks, std::int64_t recent) {
  std::vector<std::int32_t> kept, others;
  if (budget >= T) {
    kept.resize(static_cast<std::size_t>(T));
    std::iota(kept.begin(), kept.end(), 0);
    return kept;
  }
  for (std::int32_t j = 0; j < T; ++j)
    (is_protected(j, T, sinks, recent) ? kept : others).push_back(j);
  std::sort(others.begin(), others.end(),
            [&](std::int32_t a, std::int32_t b) { return s[a] != s[b] ? s[a] > s[b] : a > b; });
  const auto fill = static_cast<std::size_t>(budget) - kept.size();
  kept.insert(kept.end(), others.begin(), others.begin() + static_cast<std::ptrdiff_t>(fill));
  std::sort(kept.begin(), kept.end());
  return kept;
}

// ---- comparison with the library ------------------------------------------------------------

struct Reference {
  Scores scores;                       // what the spec says the scorer computes
  std::int64_t sinks = 0, recent = 0;  // tokens the spec protects
  double rtol = 1e-5, atol = 1e-6;     // fp32 vs double
  double tol(double x) const { return atol + rtol * std::abs(x); }
};

// Rows compared, and rows whose kept set differed from the naive one only across a near-tie.
struct Tally {
  int rows = 0, near_tie_rows = 0;
};

template <class S, kvpolicy::Element T>
kvpolicy::Selection run_pipeline(const S& scorer, const kvpolicy::cpu_backend& be,
                                 const kvpolicy::Inputs<T>& in, std::int64_t budget,
                                 kvpolicy::ScoreMap* scores) {
  const kvpolicy::Pipeline<S, kvpolicy::Uniform> p(scorer, kvpolicy::Uniform{});
  return p.select(be, in, kvpolicy::Budget::tokens(budget), scores);
}

inline void require_same(const kvpolicy::Selection& a, const kvpolicy::Selection& b) {
  REQUIRE(a.layers() == b.layers());
  REQUIRE(a.heads() == b.heads());
  for (std::int64_t l = 0; l < a.layers(); ++l)
    for (std::int64_t h = 0; h < a.heads(); ++h) {
      auto x = a.kept(l, h), y = b.kept(l, h);
      REQUIRE(std::vector<std::int32_t>(x.begin(), x.end()) ==
              std::vector<std::int32_t>(y.begin(), y.end()));
    }
}

inline void require_bit_identical(const kvpolicy::ScoreMap& a, const kvpolicy::ScoreMap& b) {
  REQUIRE(a.layers() == b.layers());
  REQUIRE(a.heads() == b.heads());
  REQUIRE(a.tokens() == b.tokens());
  const auto n = static_cast<std::size_t>(a.layers() * a.heads() * a.tokens());
  REQUIRE(std::memcmp(a.data(), b.data(), n * sizeof(float)) == 0);
}

// One row's kept set against the naive selection. Sets must be equal unless the naive boundary
// has a near-tie: a kept and a dropped token whose naive scores are within tolerance (and not an
// exact tie the library reproduces exactly, which the index rule decides). Then the kept naive
// scores must still be the same multiset within tolerance.
inline void check_row(std::span<const std::int32_t> kept, const double* ns, const float* ls,
                      std::int64_t T, std::int64_t budget, const Reference& ref, Tally& tally) {
  const std::int64_t recent = std::min(ref.recent, T);
  REQUIRE(static_cast<std::int64_t>(kept.size()) == std::min(budget, T));
  for (std::size_t i = 1; i < kept.size(); ++i) REQUIRE(kept[i - 1] < kept[i]);
  std::vector<char> in_lib(static_cast<std::size_t>(T), 0);
  for (auto j : kept) {
    REQUIRE(j >= 0);
    REQUIRE(j < T);
    in_lib[static_cast<std::size_t>(j)] = 1;
  }
  for (std::int64_t j = 0; j < T && budget < T; ++j)
    if (is_protected(j, T, ref.sinks, recent)) REQUIRE(in_lib[static_cast<std::size_t>(j)]);

  const auto expect = select(ns, T, budget, ref.sinks, recent);
  ++tally.rows;
  if (std::vector<std::int32_t>(kept.begin(), kept.end()) == expect) return;

  std::vector<char> in_naive(static_cast<std::size_t>(T), 0);
  for (auto j : expect) in_naive[static_cast<std::size_t>(j)] = 1;
  bool near_tie = false;
  for (std::int64_t a = 0; a < T; ++a)
    for (std::int64_t b = 0; b < T; ++b) {
      if (!in_naive[a] || in_naive[b] || is_protected(a, T, ref.sinks, recent)) continue;
      const bool exact = ns[a] == ns[b] && ls[a] == ls[b];
      if (!exact && std::abs(ns[a] - ns[b]) <= 2 * ref.tol(ns[a])) near_tie = true;
    }
  INFO("kept sets differ without a near-tie at the selection boundary");
  REQUIRE(near_tie);
  ++tally.near_tie_rows;
  std::vector<double> got, want;
  for (std::int64_t j = 0; j < T; ++j) {
    if (is_protected(j, T, ref.sinks, recent)) continue;
    if (in_lib[static_cast<std::size_t>(j)]) got.push_back(ns[j]);
    if (in_naive[static_cast<std::size_t>(j)]) want.push_back(ns[j]);
  }
  std::sort(got.begin(), got.end());
  std::sort(want.begin(), want.end());
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    REQUIRE(std::abs(got[i] - want[i]) <= 2 * ref.tol(want[i]));
}

// Runs `scorer` through Pipeline<S, Uniform> on 1, 2 and 0 (OpenMP default) threads and
// through Policy(spec); all must agree bit for bit. Then compares scores and kept sets with
// `ref`. Budget is Budget::tokens(budget).
template <class S, kvpolicy::Element T>
void check_scorer(const S& scorer, const std::string& spec, const kvpolicy::Inputs<T>& in,
                  std::int64_t budget, const Reference& ref, Tally& tally) {
  INFO("spec " << spec << ", dtype " << kvpolicy::dtype_name(kvpolicy::dtype_of<T>)
               << ", L=" << in.layers() << " Hkv=" << in.kv_heads() << " Hq=" << in.queries.heads
               << " T=" << in.tokens() << " n_q=" << in.queries.tokens << " d=" << in.dim()
               << " budget=" << budget);
  kvpolicy::ScoreMap scores;
  const kvpolicy::Selection sel =
      run_pipeline(scorer, kvpolicy::cpu_backend{1}, in, budget, &scores);
  for (int threads : {2, 0}) {
    kvpolicy::ScoreMap other;
    require_same(sel, run_pipeline(scorer, kvpolicy::cpu_backend{threads}, in, budget, &other));
    require_bit_identical(scores, other);
  }
  require_same(sel, run_pipeline(scorer, kvpolicy::cpu_backend{2}, in, budget, nullptr));
  {
    const kvpolicy::Policy policy(spec);
    REQUIRE(policy.scorer_name() == S::name);
    kvpolicy::ScoreMap other;
    require_same(
        sel, policy.select(kvpolicy::cpu_backend{2}, in, kvpolicy::Budget::tokens(budget), &other));
    require_bit_identical(scores, other);
  }

  const std::int64_t L = in.layers(), H = in.kv_heads(), Tk = in.tokens();
  REQUIRE(scores.layers() == L);
  REQUIRE(scores.heads() == H);
  REQUIRE(scores.tokens() == Tk);
  for (std::int64_t l = 0; l < L; ++l)
    for (std::int64_t h = 0; h < H; ++h) {
      const double* ns = ref.scores.row(l, h);
      auto ls = scores.row(l, h);
      for (std::int64_t j = 0; j < Tk; ++j) {
        if (std::isnan(ns[j])) continue;
        INFO("layer " << l << ", head " << h << ", token " << j);
        REQUIRE(std::abs(static_cast<double>(ls[j]) - ns[j]) <= ref.tol(ns[j]));
      }
      INFO("layer " << l << ", head " << h);
      check_row(sel.kept(l, h), ns, ls.data(), Tk, budget, ref, tally);
    }
}

// Fails when more than a tenth of the rows needed the near-tie fallback: the data would then be
// too tie-prone for the comparison to mean much.
inline void require_few_near_ties(const Tally& t) {
  INFO(t.near_tie_rows << " of " << t.rows << " rows differed across a near-tie");
  REQUIRE(t.rows > 0);
  REQUIRE(t.near_tie_rows * 10 <= t.rows);
}

}  // namespace naive

namespace naive {

// Random inputs: keys [L][Hkv][T][d] and the queries of the last n_q positions [L][Hkv*g][n_q][d],
// uniform in [-scale, scale) (scale 2 gives logits of standard deviation ~1.3: attention neither
// flat nor one-hot).
template <kvpolicy::Element T>
struct Case {
  kvtest::Tensor<T> k, q;
  kvpolicy::Inputs<T> inputs() const {
    kvpolicy::Inputs<T> in;
    in.keys = k.view();
    if (q.ref.N > 0) in.queries = q.view();
    return in;
  }
};

template <kvpolicy::Element T>
Case<T> random_case(kvtest::Rng& rng, std::int64_t L, std::int64_t Hkv, std::int64_t g,
                    std::int64_t Tk, std::int64_t nq, std::int64_t d, kvpolicy::Layout layout,
                    double scale = 2.0) {
  return {kvtest::random_tensor<T>(rng, L, Hkv, Tk, d, scale, layout),
          kvtest::random_tensor<T>(rng, L, Hkv * g, nq, d, scale, layout)};
}

// Shapes of the random comparisons: odd and even head_dim, one KV head or several, one layer or
// two, T from below to above one 64-query block of the blockwise column sums. Odd entries use
// the token-major (NHD) layout.
struct Shape {
  std::int64_t layers, kv_heads, tokens, dim;
};
inline constexpr Shape kShapes[] = {
    {2, 2, 6, 3}, {1, 1, 17, 5}, {2, 3, 24, 2}, {1, 2, 40, 8}, {1, 2, 70, 3}};
inline constexpr std::int64_t kGroups[] = {1, 3, 4, 8};
inline kvpolicy::Layout layout_of(std::size_t shape_index) {
  return shape_index % 2 ? kvpolicy::Layout::NHD : kvpolicy::Layout::HND;
}

}  // namespace naive
