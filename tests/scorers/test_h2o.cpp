// H2O: hand-computed column sums and kept sets, the accumulated-state path, and the naive
// comparison on random inputs (every dtype, GQA group, reduction, normalize, budget regime).
#include <cmath>
#include <string>

#include "scorers/naive.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_scorers_h2o {

using namespace kvpolicy;
using H2OPipeline = Pipeline<H2O, Uniform>;

namespace {

// One layer, one KV head, T = 6, d = 2. k_3 = (sqrt(2) ln 3, 0), every other key is 0, so with
// q = (1, 0) the logit q.k / sqrt(2) is ln 3 on key 3 and 0 elsewhere: key 3 weighs 3, others 1.
// Query head 0 uses q = (1, 0) at every position; query head 1 (if any) uses q = 0 (uniform).
naive::Case<float> heavy_key_case(std::int64_t q_heads) {
  std::vector<double> k(12, 0.0);
  k[3 * 2] = std::sqrt(2.0) * std::log(3.0);
  std::vector<double> q(static_cast<std::size_t>(q_heads * 6 * 2), 0.0);
  for (int i = 0; i < 6; ++i) q[static_cast<std::size_t>(i * 2)] = 1.0;  // head 0
  return {kvtest::make_tensor<float>(1, 1, 6, 2, k),
          kvtest::make_tensor<float>(1, q_heads, 6, 2, q)};
}

std::vector<std::int32_t> kept(const Selection& s) {
  auto k = s.kept(0, 0);
  return {k.begin(), k.end()};
}

}  // namespace

TEST_CASE("h2o: hand-computed column sums and heavy hitters", "[scorers][h2o]") {
  // Query i (position i) sees keys 0..i. Rows of A (weights / their sum):
  //   i=0: [1]                  i=3: [1,1,1,3]/6
  //   i=1: [1,1]/2              i=4: [1,1,1,3,1]/7
  //   i=2: [1,1,1]/3            i=5: [1,1,1,3,1,1]/8
  // Column sums (1/7 + 1/8 = 15/56):
  //   j0 = 1 + 1/2 + 1/3 + 1/6 + 15/56 = 2 + 15/56 = 2.267857
  //   j1 =     1/2 + 1/3 + 1/6 + 15/56 = 1 + 15/56 = 1.267857
  //   j2 =           1/3 + 1/6 + 15/56 = 1/2 + 15/56 = 0.767857
  //   j3 =                 3/6 + 3/7 + 3/8 = 1/2 + 45/56 = 1.303571
  //   j4 = 15/56 = 0.267857,  j5 = 1/8 = 0.125            (total 6 = one per query)
  const auto c = heavy_key_case(1);
  const auto in = c.inputs();
  const double expect[6] = {2 + 15. / 56,   1 + 15. / 56, 0.5 + 15. / 56,
                            0.5 + 45. / 56, 15. / 56,     0.125};
  ScoreMap s;
  // Budget 4, recent = 0.5 -> floor(0.5 * 4) = 2 recent tokens {4, 5}; the 2 heavy hitters among
  // 0..3 are j0 (2.27) and j3 (1.30 > j1's 1.27).
  H2O h2o;
  Selection sel = H2OPipeline(h2o, Uniform{}).select(cpu_backend{}, in, Budget::tokens(4), &s);
  for (int j = 0; j < 6; ++j) CHECK(s.row(0, 0)[j] == Approx(expect[j]).epsilon(1e-5));
  CHECK(kept(sel) == std::vector<std::int32_t>{0, 3, 4, 5});

  // Budget 2 with one recent token {5}: one heavy hitter among 0..4.
  //   raw: j0 (2.27) wins.
  //   normalize=true divides by the queries seeing each key, T - j = 6,5,4,3,2,1:
  //   j0 2.267857/6 = 0.377976, j1 1.267857/5 = 0.253571, j2 0.767857/4 = 0.191964,
  //   j3 1.303571/3 = 0.434524, j4 0.267857/2 = 0.133929, j5 0.125/1 -> j3 wins.
  h2o.recent_tokens = 1;
  sel = H2OPipeline(h2o, Uniform{}).select(cpu_backend{}, in, Budget::tokens(2));
  CHECK(kept(sel) == std::vector<std::int32_t>{0, 5});
  h2o.normalize = true;
  sel = H2OPipeline(h2o, Uniform{}).select(cpu_backend{}, in, Budget::tokens(2), &s);
  CHECK(kept(sel) == std::vector<std::int32_t>{3, 5});
  for (int j = 0; j < 6; ++j) CHECK(s.row(0, 0)[j] == Approx(expect[j] / (6 - j)).epsilon(1e-5));
  // The runtime Policy agrees.
  sel = Policy("h2o(recent_tokens=1, normalize=true)").select(cpu_backend{}, in, Budget::tokens(2));
  CHECK(kept(sel) == std::vector<std::int32_t>{3, 5});
}

TEST_CASE("h2o: GQA reductions, hand-computed", "[scorers][h2o]") {
  // Two query heads on one KV head. Head 0 as above: a = [2.267857, 1.267857, 0.767857,
  // 1.303571, 0.267857, 0.125]. Head 1 has q = 0: uniform rows 1/(i+1), column sums
  // u_j = sum_{i=j..5} 1/(i+1) = [2.45, 1.45, 0.95, 0.616667, 0.366667, 0.166667].
  //   mean = (a+u)/2 = [2.358929, 1.358929, 0.858929, 0.960119, 0.317262, 0.145833]
  //   max            = [2.45, 1.45, 0.95, 1.303571, 0.366667, 0.166667]
  //   sum  = a+u     = [4.717857, 2.717857, 1.717857, 1.920238, 0.634524, 0.291667]
  const auto c = heavy_key_case(2);
  const auto in = c.inputs();
  const double a[6] = {2 + 15. / 56, 1 + 15. / 56, 0.5 + 15. / 56, 0.5 + 45. / 56, 15. / 56, 0.125};
  const double u[6] = {2.45, 1.45, 0.95, 1. / 4 + 1. / 5 + 1. / 6, 1. / 5 + 1. / 6, 1. / 6};
  for (auto r : {GqaReduce::mean, GqaReduce::max, GqaReduce::sum}) {
    H2O h2o;
    h2o.reduce = r;
    ScoreMap s;
    H2OPipeline(h2o, Uniform{}).select(cpu_backend{}, in, Budget::tokens(3), &s);
    for (int j = 0; j < 6; ++j) {
      const double want = r == GqaReduce::mean  ? (a[j] + u[j]) / 2
                          : r == GqaReduce::max ? std::max(a[j], u[j])
                                                : a[j] + u[j];
      CHECK(s.row(0, 0)[j] == Approx(want).epsilon(1e-5));
    }
  }
  // Budget 4, recent_tokens=1 ({5}), 3 heavy among 0..4: mean ranks j0 2.36, j1 1.36, j3 0.96
  // (> j2 0.86); max ranks j0 2.45, j1 1.45, j3 1.30 (> j2 0.95): both keep {0, 1, 3, 5}.
  for (const char* spec : {"h2o(recent_tokens=1)", "h2o(recent_tokens=1,reduce=max)"}) {
    const Selection sel = Policy(spec).select(cpu_backend{}, in, Budget::tokens(4));
    CHECK(kept(sel) == std::vector<std::int32_t>{0, 1, 3, 5});
  }
}

TEST_CASE("h2o: given accumulators and observation counts", "[scorers][h2o]") {
  // State path (what a Session passes): acc = [5, 1, 4, 2, 3, 0.5], observed = [6, 5, 4, 3, 2, 1].
  // Budget 3, recent_tokens=1 ({5}), 2 heavy among 0..4:
  //   raw:        j0 (5), j2 (4)                                       -> {0, 2, 5}
  //   normalized: acc/obs = [0.833, 0.2, 1.0, 0.667, 1.5, 0.5]: j4, j2  -> {2, 4, 5}
  const auto k = kvtest::make_tensor<float>(1, 1, 6, 2, std::vector<double>(12, 0.5));
  const float acc[6] = {5, 1, 4, 2, 3, 0.5f}, obs[6] = {6, 5, 4, 3, 2, 1};
  Inputs<float> in;
  in.keys = k.view();
  in.accumulated = acc;
  in.observed = obs;
  H2O h2o;
  h2o.recent_tokens = 1;
  ScoreMap s;
  Selection sel = H2OPipeline(h2o, Uniform{}).select(cpu_backend{}, in, Budget::tokens(3), &s);
  CHECK(kept(sel) == std::vector<std::int32_t>{0, 2, 5});
  for (int j = 0; j < 6; ++j) CHECK(s.row(0, 0)[j] == acc[j]);
  h2o.normalize = true;
  sel = H2OPipeline(h2o, Uniform{}).select(cpu_backend{}, in, Budget::tokens(3), &s);
  CHECK(kept(sel) == std::vector<std::int32_t>{2, 4, 5});
  for (int j = 0; j < 6; ++j) CHECK(s.row(0, 0)[j] == Approx(acc[j] / obs[j]));
  // preset=observed (kvpress's ObservedAttentionPress): normalized, no recent window, so budget 3
  // takes the three best ratios j4, j2, j0.
  sel = Policy("h2o(preset=observed)").select(cpu_backend{}, in, Budget::tokens(3), &s);
  CHECK(kept(sel) == std::vector<std::int32_t>{0, 2, 4});
  CHECK(kept(Policy("h2o(preset=observed,recent_tokens=1)").select(cpu_backend{}, in, Budget::tokens(3))) ==
        std::vector<std::int32_t>{2, 4, 5});
  CHECK(kept(Policy("h2o(preset=observed,normalize=false)").select(cpu_backend{}, in, Budget::tokens(3))) ==
        std::vector<std::int32_t>{0, 2, 4});
  REQUIRE_THROWS_WITH(Policy("h2o(preset=kvpress)"), Catch::Contains("preset"));
  // normalize=true without the counts is an error, not a silent raw score.
  in.observed = nullptr;
  REQUIRE_THROWS_WITH(H2OPipeline(h2o, Uniform{}).select(cpu_backend{}, in, Budget::tokens(3)),
                      Catch::Contains("observed-query counts"));
  // Neither accumulators nor queries: nothing to score from.
  in.accumulated = nullptr;
  REQUIRE_THROWS_WITH(H2OPipeline(H2O{}, Uniform{}).select(cpu_backend{}, in, Budget::tokens(3)),
                      Catch::Contains("accumulated attention"));
}

TEMPLATE_TEST_CASE("h2o matches the naive reference", "[scorers][h2o]", float, kvpolicy::half,
                   kvpolicy::bfloat16) {
  kvtest::Rng rng(0x4820);
  naive::Tally tally;
  const GqaReduce reduces[] = {GqaReduce::mean, GqaReduce::max, GqaReduce::sum};
  const char* reduce_names[] = {"mean", "max", "sum"};
  const double recents[] = {0.5, 0.25, 0.0};
  // Case ci (shape x group) and budget bi pick the parameters so that the evicting budget
  // meets every reduction, normalize with and without a partial query set, and sinks.
  int ci = 0;
  for (std::size_t si = 0; si < std::size(naive::kShapes); ++si) {
    const auto sh = naive::kShapes[si];
    for (std::int64_t g : naive::kGroups) {
      // Full prefill (n_q = T) or only the last queries, which changes the normalization
      // count to T - max(j, T - n_q).
      const std::int64_t nq = ci % 2 ? sh.tokens - sh.tokens / 3 : sh.tokens;
      const auto c = naive::random_case<TestType>(rng, sh.layers, sh.kv_heads, g, sh.tokens, nq,
                                                  sh.dim, naive::layout_of(si));
      const auto in = c.inputs();
      const std::int64_t budgets[] = {sh.tokens + 3, sh.tokens, sh.tokens / 2};
      for (int bi = 0; bi < 3; ++bi) {
        const std::int64_t budget = budgets[bi];
        H2O h2o;
        h2o.reduce = reduces[(ci + bi) % 3];
        h2o.normalize = (ci + bi) / 3 % 2 == 1;
        h2o.recent = recents[(ci + 2 * bi) % 3];
        h2o.sinks = (ci / 2 + bi) % 2;
        const std::string spec = "h2o(recent=" + std::to_string(h2o.recent) +
                                 ",sinks=" + std::to_string(h2o.sinks) +
                                 ",normalize=" + (h2o.normalize ? "true" : "false") +
                                 ",reduce=" + reduce_names[(ci + bi) % 3] + ")";
        naive::Reference ref{naive::h2o(c.k.ref, c.q.ref, h2o.normalize, h2o.reduce)};
        // [ours] recent = floor(fraction * per-head budget), at most budget - sinks.
        const std::int64_t b = std::min(budget, sh.tokens);
        ref.sinks = h2o.sinks;
        ref.recent = std::max<std::int64_t>(
            0, std::min<std::int64_t>(static_cast<std::int64_t>(std::floor(h2o.recent * b)),
                                      b - h2o.sinks));
        naive::check_scorer(h2o, spec, in, budget, ref, tally);
      }
      ++ci;
    }
  }
  naive::require_few_near_ties(tally);
}

}  // namespace kvt_scorers_h2o
