// Expected attention: a hand-computed case, the naive reference of shared/algorithms.md (pre-RoPE
// statistics rotated to absolute future positions with full d x d matrices), the RoPE source
// (theta= or the engine's frequencies through a Session) and argument errors.
#include "common/error_of.hpp"
#include "scorers/naive.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_scorers_expected {

using namespace kvpolicy;
using Catch::Matchers::Contains;
using Mat = std::vector<std::vector<double>>;

// R(p) of Hugging Face's half-split RoPE as a d x d matrix.
Mat rope_matrix(const std::vector<float>& inv_freq, double p) {
  const auto d = inv_freq.size() * 2, half = inv_freq.size();
  Mat r(d, std::vector<double>(d, 0.0));
  for (std::size_t f = 0; f < half; ++f) {
    const double a = p * inv_freq[f];
    r[f][f] = std::cos(a), r[f][f + half] = -std::sin(a);
    r[f + half][f] = std::sin(a), r[f + half][f + half] = std::cos(a);
  }
  return r;
}

std::vector<double> mul(const Mat& m, const std::vector<double>& x) {
  std::vector<double> y(m.size(), 0.0);
  for (std::size_t a = 0; a < m.size(); ++a)
    for (std::size_t b = 0; b < x.size(); ++b) y[a] += m[a][b] * x[b];
  return y;
}

// The spec, literally: queries of absolute positions P0 + T - n + i are un-rotated to pre-RoPE,
// their mean and covariance (first `sinks` cache positions left out) are rotated by
// mean_j R(P0 + T + j), then log z = mu.k/sqrt(d) + k^T Sigma k / (2d), softmax over the
// non-sink keys, mean over the group, times ||v||. Sinks: the layer's max + 1. P0 is any offset
// of the cache's positions: the scores must not depend on it.
naive::Scores expected_reference(const kvtest::Dense& k, const kvtest::Dense& v,
                                 const kvtest::Dense& q, const std::vector<float>& inv_freq,
                                 std::int64_t future, std::int64_t sinks, double P0,
                                 std::int64_t first_query_position = -1) {
  const std::int64_t L = k.L, H = k.H, T = k.N, d = k.d, n = q.N, G = q.H / k.H;
  const auto ud = static_cast<std::size_t>(d);
  naive::Scores s(L, H, T);
  Mat rbar(ud, std::vector<double>(ud, 0.0));
  for (std::int64_t j = 0; j < future; ++j) {
    const Mat r = rope_matrix(inv_freq, P0 + static_cast<double>(T + j));
    for (std::size_t a = 0; a < ud; ++a)
      for (std::size_t b = 0; b < ud; ++b) rbar[a][b] += r[a][b] / static_cast<double>(future);
  }
  for (std::int64_t l = 0; l < L; ++l) {
    for (std::int64_t h = 0; h < H; ++h) {
      std::vector<double> a(static_cast<std::size_t>(T), 0.0);
      for (std::int64_t g = 0; g < G; ++g) {
        const std::int64_t qh = h * G + g;
        std::vector<std::vector<double>> pre;
        for (std::int64_t i = 0; i < n; ++i) {
          // The sequence's first `sinks` positions (after an eviction, not the cache's).
          if ((first_query_position >= 0 ? first_query_position : T - n) + i < sinks) continue;
          std::vector<double> x(ud);
          for (std::size_t e = 0; e < ud; ++e) x[e] = q.at(l, qh, i, static_cast<std::int64_t>(e));
          // pre-RoPE = R(p)^T q = R(-p) q
          pre.push_back(mul(rope_matrix(inv_freq, -(P0 + static_cast<double>(T - n + i))), x));
        }
        if (pre.empty()) continue;
        std::vector<double> mu(ud, 0.0);
        for (const auto& x : pre)
          for (std::size_t e = 0; e < ud; ++e) mu[e] += x[e] / static_cast<double>(pre.size());
        Mat sig(ud, std::vector<double>(ud, 0.0));
        for (const auto& x : pre)
          for (std::size_t r = 0; r < ud; ++r)
            for (std::size_t c = 0; c < ud; ++c)
              sig[r][c] += (x[r] - mu[r]) * (x[c] - mu[c]) / static_cast<double>(pre.size());
        mu = mul(rbar, mu);
        Mat rs(ud, std::vector<double>(ud, 0.0)), rsr(ud, std::vector<double>(ud, 0.0));
        for (std::size_t r = 0; r < ud; ++r)
          for (std::size_t c = 0; c < ud; ++c)
            for (std::size_t e = 0; e < ud; ++e) rs[r][c] += rbar[r][e] * sig[e][c];
        for (std::size_t r = 0; r < ud; ++r)
          for (std::size_t c = 0; c < ud; ++c)
            for (std::size_t e = 0; e < ud; ++e) rsr[r][c] += rs[r][e] * rbar[c][e];
        std::vector<double> z(static_cast<std::size_t>(T), 0.0);
        double zmax = -1e300, sum = 0;
        for (std::int64_t j = sinks; j < T; ++j) {
          double lin = 0, quad = 0;
          for (std::size_t r = 0; r < ud; ++r) {
            lin += mu[r] * k.at(l, h, j, static_cast<std::int64_t>(r));
            for (std::size_t c = 0; c < ud; ++c)
              quad += k.at(l, h, j, static_cast<std::int64_t>(r)) * rsr[r][c] *
                      k.at(l, h, j, static_cast<std::int64_t>(c));
          }
          z[static_cast<std::size_t>(j)] = lin / std::sqrt(static_cast<double>(d)) + quad / (2.0 * static_cast<double>(d));
          zmax = std::max(zmax, z[static_cast<std::size_t>(j)]);
        }
        for (std::int64_t j = sinks; j < T; ++j) sum += std::exp(z[static_cast<std::size_t>(j)] - zmax);
        for (std::int64_t j = sinks; j < T; ++j)
          a[static_cast<std::size_t>(j)] += std::exp(z[static_cast<std::size_t>(j)] - zmax) / sum / static_cast<double>(G);
      }
      for (std::int64_t j = sinks; j < T; ++j) {
        double n2 = 0;
        for (std::int64_t e = 0; e < d; ++e) n2 += v.at(l, h, j, e) * v.at(l, h, j, e);
        s.at(l, h, j) = a[static_cast<std::size_t>(j)] * std::sqrt(n2);
      }
    }
    double top = 0;
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t j = sinks; j < T; ++j) top = std::max(top, s.at(l, h, j));
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t j = 0; j < std::min(sinks, T); ++j) s.at(l, h, j) = top + 1;
  }
  return s;
}

TEST_CASE("expected: hand-computed softmax of the rotated mean query", "[scorers][expected]") {
  // d = 2, theta irrelevant for frequency 0: inv_freq = [1], so R(a) turns by a radians. One
  // query (1, 0) at position T-1 = 2; at P = 3 it is R(1) q = (cos 1, sin 1). future=1 averages
  // R(0) = I. Keys 0, sqrt(2) (cos 1, sin 1), -sqrt(2) (cos 1, sin 1): logits mu.k / sqrt(2) =
  // 0, 1, -1. Without covariance, value norms or sinks, the scores are softmax(0, 1, -1).
  const double c = std::cos(1.0), s = std::sin(1.0), r2 = std::sqrt(2.0);
  const auto k = kvtest::make_tensor<float>(1, 1, 3, 2, {0, 0, r2 * c, r2 * s, -r2 * c, -r2 * s});
  const auto q = kvtest::make_tensor<float>(1, 1, 1, 2, {1, 0});
  Inputs<float> in;
  in.keys = k.view();
  in.queries = q.view();
  ScoreMap m;
  const Selection sel = Policy("expected(theta=10000,future=1,sinks=0,cov=false,vnorm=false)")
                            .select(cpu_backend{}, in, Budget::tokens(1), &m);
  const double zsum = 1 + std::exp(1.0) + std::exp(-1.0);
  CHECK(m.row(0, 0)[0] == Approx(1 / zsum).margin(1e-6));
  CHECK(m.row(0, 0)[1] == Approx(std::exp(1.0) / zsum).margin(1e-6));
  CHECK(m.row(0, 0)[2] == Approx(std::exp(-1.0) / zsum).margin(1e-6));
  CHECK(std::vector<std::int32_t>(sel.kept(0, 0).begin(), sel.kept(0, 0).end()) ==
        std::vector<std::int32_t>{1});
  // The covariance of one query is zero, so cov=true changes nothing here.
  ScoreMap m2;
  Policy("expected(theta=10000,future=1,sinks=0,vnorm=false)").select(cpu_backend{}, in, Budget::tokens(1), &m2);
  for (int j = 0; j < 3; ++j) CHECK(m2.row(0, 0)[j] == Approx(m.row(0, 0)[j]).margin(1e-7));
}

TEMPLATE_TEST_CASE("expected matches the naive reference (absolute positions, full matrices)",
                   "[scorers][expected]", float, kvpolicy::half, kvpolicy::bfloat16) {
  kvtest::Rng rng(0xe7);
  naive::Tally tally;
  struct Sh {
    std::int64_t L, H, g, T, n, d;
  };
  // One layer or two, GQA 1/3/4, queries shorter than, equal to and (with sinks) covering the
  // whole cache, head_dim 2 to 16, both layouts.
  const Sh shapes[] = {{2, 2, 1, 20, 6, 4},  {1, 1, 3, 33, 33, 8}, {1, 2, 4, 70, 16, 16},
                       {2, 1, 2, 9, 9, 2},   {1, 3, 3, 45, 45, 6}};
  for (std::size_t si = 0; si < std::size(shapes); ++si) {
    const auto sh = shapes[si];
    const auto layout = naive::layout_of(si);
    // Queries scaled down so the covariance term (k^T Sigma k / 2d) stays comparable to the mean
    // term instead of dominating the logits.
    const auto c = naive::random_case<TestType>(rng, sh.L, sh.H, sh.g, sh.T, sh.n, sh.d, layout, 1.0);
    const auto v = kvtest::random_tensor<TestType>(rng, sh.L, sh.H, sh.T, sh.d, 1.0, layout);
    Inputs<TestType> in = c.inputs();
    in.values = v.view();
    const double theta = si % 2 ? 500.0 : 10000.0;
    const std::int64_t future = si == 0 ? 1 : si == 1 ? 7 : 64, sinks = si == 3 ? 0 : 4;
    const auto inv = rope_inv_freq(theta, sh.d);
    ExpectedAttention e;
    e.theta = theta, e.future = future, e.sinks = sinks;
    const std::string spec = "expected(theta=" + std::to_string(static_cast<int>(theta)) +
                             ",future=" + std::to_string(future) + ",sinks=" + std::to_string(sinks) + ")";
    // The positions' origin must not matter: the reference uses absolute positions P0 + t.
    const double P0 = si % 2 ? 0.0 : 1000.0;
    // Shape 4's queries cover the whole cache, as at prefill; after an eviction (the caller says
    // where they start) the oldest of them are no sinks' and count.
    const std::int64_t qpos = si == 4 ? 100 : -1;
    in.first_query_position = qpos;
    naive::Reference ref{expected_reference(c.k.ref, v.ref, c.q.ref, inv, future, sinks, P0, qpos)};
    ref.sinks = sinks;
    ref.rtol = 2e-4, ref.atol = 1e-6;  // fp32 Sigma and Sigma k against double
    for (std::int64_t budget : {sh.T + 1, sh.T, sh.T / 2, sh.T / 4 + sinks})
      naive::check_scorer(e, spec, in, budget, ref, tally);
  }
  naive::require_few_near_ties(tally);
}

TEST_CASE("expected: RoPE frequencies from the spec or from the engine (Session)",
          "[scorers][expected]") {
  kvtest::Rng rng(0x51);
  const std::int64_t Hkv = 2, Hq = 4, T = 40, d = 8, W = 12;
  auto k = kvtest::random_tensor<float>(rng, 1, Hkv, T, d, 1.0);
  auto v = kvtest::random_tensor<float>(rng, 1, Hkv, T, d, 1.0);
  auto q = kvtest::random_tensor<float>(rng, 1, Hq, T, d, 1.0);
  Inputs<float> in;
  in.keys = k.view();
  in.values = v.view();
  in.queries = last_tokens(q.view(), W);
  // Neither theta= nor the caller's frequencies: a clear refusal.
  CHECK_THAT(kvtest::error_of([&] { Policy("expected").select(cpu_backend{}, in, Budget::tokens(10)); }),
             Contains("needs the model's RoPE frequencies: give theta="));
  // The caller's frequencies equal theta=.
  const auto inv = rope_inv_freq(10000, d);
  in.rope_inv_freq = inv;
  const Selection a = Policy("expected(window=12)").select(cpu_backend{}, in, Budget::tokens(10));
  in.rope_inv_freq = {};
  const Selection b = Policy("expected(window=12,theta=10000)").select(cpu_backend{}, in, Budget::tokens(10));
  naive::require_same(a, b);
  // A wrong count of frequencies is refused.
  const std::vector<float> three(3, 1.f);
  in.rope_inv_freq = three;
  CHECK_THAT(kvtest::error_of([&] { Policy("expected").select(cpu_backend{}, in, Budget::tokens(10)); }),
             Contains("3 RoPE frequencies for head_dim 8 (want 4)"));

  // A Session given the engine's frequencies keeps what Policy::select keeps on the same
  // inputs: the prefill's last W queries, the Session's ring.
  SessionConfig cfg;
  cfg.layers = 1, cfg.kv_heads = Hkv, cfg.q_heads = Hq, cfg.head_dim = d;
  cfg.budget = Budget::tokens(10);
  cfg.rope_inv_freq = inv;
  Session<float> s(Policy("expected(window=12)"), cfg);
  s.append(0, k.view(), v.view(), q.view());
  REQUIRE(s.compress_if_due(0));
  for (std::int64_t h = 0; h < Hkv; ++h) {
    auto pos = s.positions(0, h);
    auto kept = a.kept(0, h);
    CHECK(std::vector<std::int32_t>(pos.begin(), pos.end()) ==
          std::vector<std::int32_t>(kept.begin(), kept.end()));
  }
  // Without them, the Session's compression says what is missing; a bad table is refused.
  cfg.rope_inv_freq.clear();
  Session<float> s2(Policy("expected(window=12)"), cfg);
  s2.append(0, k.view(), v.view(), q.view());
  CHECK_THAT(kvtest::error_of([&] { s2.compress_if_due(0); }), Contains("theta="));
  cfg.rope_inv_freq = three;
  CHECK_THAT(kvtest::error_of([&] { Session<float>(Policy("expected"), cfg); }),
             Contains("rope_inv_freq has 3 frequencies; head_dim 8 needs 4"));
  cfg.rope_inv_freq = {1.f, 0.5f, NAN, 0.1f};
  CHECK_THAT(kvtest::error_of([&] { Session<float>(Policy("expected"), cfg); }),
             Contains("frequencies must be finite and positive"));
}

TEST_CASE("expected: argument errors name the parameter", "[scorers][expected]") {
  for (const auto& [spec, msg] : std::vector<std::pair<std::string, std::string>>{
           {"expected(window=0)", "window must be >= 1"},
           {"expected(future=0)", "future must be in [1, 65536], got 0"},
           {"expected(future=65537)", "future must be in [1, 65536], got 65537"},
           {"expected(sinks=-1)", "sinks must be >= 0"},
           {"expected(eps=-1)", "eps must be finite and >= 0"},
           {"expected(theta=1)", "theta (the RoPE base) must be > 1"},
           {"expected(cov=maybe)", "cov"}}) {
    CAPTURE(spec);
    const std::string s = spec;  // (clang 14 cannot capture a structured binding)
    CHECK_THAT(kvtest::error_of([&] { Policy p(s); }), Contains(msg));
  }
  // Odd head_dim cannot carry RoPE pairs; missing values with vnorm=true are named.
  kvtest::Rng rng(3);
  auto k = kvtest::random_tensor<float>(rng, 1, 1, 10, 3, 1.0);
  auto q = kvtest::random_tensor<float>(rng, 1, 1, 2, 3, 1.0);
  Inputs<float> in;
  in.keys = k.view();
  in.queries = q.view();
  CHECK_THAT(kvtest::error_of([&] { Policy("expected(theta=100,vnorm=false)").select(cpu_backend{}, in, Budget::tokens(5)); }),
             Contains("head_dim must be even"));
  auto k4 = kvtest::random_tensor<float>(rng, 1, 1, 10, 4, 1.0);
  auto q4 = kvtest::random_tensor<float>(rng, 1, 1, 2, 4, 1.0);
  in.keys = k4.view();
  in.queries = q4.view();
  // Through a policy the pipeline's shape check names the values first; the scorer called
  // directly names what it needs them for.
  CHECK_THAT(kvtest::error_of([&] { Policy("expected(theta=100)").select(cpu_backend{}, in, Budget::tokens(5)); }),
             Contains("values shape [0,0,0,0] does not match keys [1,1,10,4]"));
  ExpectedAttention e;
  e.theta = 100;
  Stats stats;
  ScoreMap out;
  CHECK_THAT(kvtest::error_of([&] { e.score(cpu_backend{}, in, stats, out); }),
             Contains("expected: vnorm=true needs the values"));
}

}  // namespace kvt_scorers_expected
