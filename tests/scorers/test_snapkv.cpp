// SnapKV: hand-computed window votes, pooling and kept sets; Pipeline vs Policy; the kvpress and
// authors' presets; the naive comparison on random inputs.
#include <cmath>
#include <string>

#include "scorers/naive.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_scorers_snapkv {

using namespace kvpolicy;

namespace {

// One layer, one KV head, one query head, T = 8, d = 2. Key j = (sqrt(2) ln w_j, 0) and both
// window queries (positions 6 and 7) are (1, 0), so logit_j = ln w_j and exp(logit_j) = w_j:
// attention is w_j / (sum of visible weights).
naive::Case<float> weighted_case(const std::vector<double>& w) {
  std::vector<double> k(16, 0.0), q = {1, 0, 1, 0};
  for (std::size_t j = 0; j < 8; ++j) k[2 * j] = std::sqrt(2.0) * std::log(w[j]);
  return {kvtest::make_tensor<float>(1, 1, 8, 2, k), kvtest::make_tensor<float>(1, 1, 2, 2, q)};
}

std::vector<std::int32_t> run(const SnapKV& s, const Inputs<float>& in, std::int64_t budget,
                              ScoreMap* scores = nullptr) {
  const Selection sel = Pipeline<SnapKV, Uniform>(s, Uniform{})
                            .select(cpu_backend{}, in, Budget::tokens(budget), scores);
  auto k = sel.kept(0, 0);
  return {k.begin(), k.end()};
}

SnapKV snap(std::int64_t window, int kernel, Pool pool) {
  SnapKV s;
  s.window = window;
  s.kernel = kernel;
  s.pool = pool;
  return s;
}

}  // namespace

TEST_CASE("snapkv: hand-computed window votes and pooling", "[scorers][snapkv]") {
  // w = [1, 7, 2, 4, 6, 1 | 1, 1], window W = 2 (tokens 6, 7, always kept).
  // Query at 6 sees keys 0..6: Z6 = 1+7+2+4+6+1+1 = 22; query at 7 sees 0..7: Z7 = 23.
  // Votes for j < 6: s_j = w_j (1/22 + 1/23) = w_j u with u = 45/506 = 0.0889328:
  //   s = [1, 7, 2, 4, 6, 1] u
  const auto c = weighted_case({1, 7, 2, 4, 6, 1, 1, 1});
  const auto in = c.inputs();
  const double u = 45.0 / 506.0;
  ScoreMap s;

  // kernel 1 (no pooling): top 3 of 0..5 are j1 (7u), j4 (6u), j3 (4u).
  CHECK(run(snap(2, 1, Pool::avg), in, 5, &s) == std::vector<std::int32_t>{1, 3, 4, 6, 7});
  const double raw[6] = {1, 7, 2, 4, 6, 1};
  for (int j = 0; j < 6; ++j) CHECK(s.row(0, 0)[j] == Approx(raw[j] * u).epsilon(1e-5));

  // avg, kernel 3, one zero of padding each side, divided by 3 (padding counts), over j < 6 only
  // (the window's votes are not pooled into token 5):
  //   p0 = (0+1+7)/3 = 8/3    p1 = (1+7+2)/3 = 10/3   p2 = (7+2+4)/3 = 13/3
  //   p3 = (2+4+6)/3 = 4      p4 = (4+6+1)/3 = 11/3   p5 = (6+1+0)/3 = 7/3     (times u)
  // Top 3: j2 (13/3), j3 (4), j4 (11/3).
  CHECK(run(snap(2, 3, Pool::avg), in, 5, &s) == std::vector<std::int32_t>{2, 3, 4, 6, 7});
  const double avg[6] = {8. / 3, 10. / 3, 13. / 3, 4, 11. / 3, 7. / 3};
  for (int j = 0; j < 6; ++j) CHECK(s.row(0, 0)[j] == Approx(avg[j] * u).epsilon(1e-5));
  // The window scores above every other token.
  CHECK(s.row(0, 0)[6] > s.row(0, 0)[2]);
  CHECK(s.row(0, 0)[7] > s.row(0, 0)[2]);

  // max, kernel 3, padding ignored: m = [max(1,7), max(1,7,2), max(7,2,4), max(2,4,6),
  // max(4,6,1), max(6,1)] = [7, 7, 7, 6, 6, 6] u. Budget 5: the three 7s {0, 1, 2}. Budget 6:
  // the 7s and one of the tied 6s, the most recent one (j5).
  CHECK(run(snap(2, 3, Pool::max), in, 5, &s) == std::vector<std::int32_t>{0, 1, 2, 6, 7});
  const double mx[6] = {7, 7, 7, 6, 6, 6};
  for (int j = 0; j < 6; ++j) CHECK(s.row(0, 0)[j] == Approx(mx[j] * u).epsilon(1e-5));
  CHECK(run(snap(2, 3, Pool::max), in, 6) == std::vector<std::int32_t>{0, 1, 2, 5, 6, 7});

  // sinks=1 also protects token 0: budget 5 = {0} + window {6, 7} + the 2 best avg of 1..5
  // (j2 13/3, j3 4).
  SnapKV with_sink = snap(2, 3, Pool::avg);
  with_sink.sinks = 1;
  CHECK(run(with_sink, in, 5) == std::vector<std::int32_t>{0, 2, 3, 6, 7});
}

TEST_CASE("snapkv: uniform attention, avg padding and recency ties", "[scorers][snapkv]") {
  // Every key weighs 1: the query at 6 gives 1/7 to each of keys 0..6, the one at 7 gives 1/8,
  // so s_j = 1/7 + 1/8 = 15/56 for every j < 6. avg kernel 3 divides the edge windows' two
  // terms by 3 as well: p0 = p5 = (2/3)(15/56) = 0.178571, p1..p4 = 15/56 = 0.267857.
  // Budget 5 = window {6, 7} + 3 of the four tied interior tokens: the most recent, {2, 3, 4}.
  // max pooling has no padding effect: all six tie, the most recent three {3, 4, 5} win.
  const auto c = weighted_case({1, 1, 1, 1, 1, 1, 1, 1});
  const auto in = c.inputs();
  ScoreMap s;
  CHECK(run(snap(2, 3, Pool::avg), in, 5, &s) == std::vector<std::int32_t>{2, 3, 4, 6, 7});
  const double p[6] = {2. / 3, 1, 1, 1, 1, 2. / 3};
  for (int j = 0; j < 6; ++j) CHECK(s.row(0, 0)[j] == Approx(p[j] * 15 / 56).epsilon(1e-5));
  CHECK(run(snap(2, 3, Pool::max), in, 5) == std::vector<std::int32_t>{3, 4, 5, 6, 7});
}

TEST_CASE("snapkv: window covering the whole cache", "[scorers][snapkv]") {
  // T = 8 <= window: every token is in the window, hence protected. Budget >= T keeps all;
  // a smaller budget is below the protected count: the newest tokens, with a warning.
  const auto c = weighted_case({1, 7, 2, 4, 6, 1, 1, 1});
  kvtest::Rng rng(7);
  const auto q = kvtest::random_tensor<float>(rng, 1, 1, 8, 2);
  Inputs<float> in = c.inputs();
  in.queries = q.view();
  CHECK(run(snap(8, 3, Pool::avg), in, 8) == std::vector<std::int32_t>{0, 1, 2, 3, 4, 5, 6, 7});
  CHECK(run(snap(16, 3, Pool::avg), in, 10).size() == 8);
  CHECK(run(snap(8, 3, Pool::avg), in, 7) == std::vector<std::int32_t>{1, 2, 3, 4, 5, 6, 7});
  const Selection cut = Pipeline<SnapKV, Uniform>(snap(8, 3, Pool::avg), Uniform{})
                            .select(cpu_backend{}, in, Budget::tokens(7));
  CHECK_THAT(cut.warning(), Catch::Contains("budget of 7 tokens per head is below the 8 tokens "
                                            "snapkv protects (0 sinks + 8 recent): kept the newest 7 instead"));
  // Too few queries for the window.
  REQUIRE_THROWS_WITH(run(snap(4, 3, Pool::avg), c.inputs(), 6), Catch::Contains("queries"));
}

TEST_CASE("snapkv: presets, and Pipeline vs Policy", "[scorers][snapkv]") {
  const auto fields = [](const Policy& p) {
    const auto& s = std::get<SnapKV>(p.scorer());
    return std::tuple(s.window, s.kernel, s.pool, s.reduce, s.sinks);
  };
  // kvpress defaults: window 64, kernel 5, avg.
  CHECK(fields(Policy("snapkv")) == std::tuple(64, 5, Pool::avg, GqaReduce::mean, 0));
  CHECK(fields(Policy("snapkv(preset=kvpress)")) ==
        std::tuple(64, 5, Pool::avg, GqaReduce::mean, 0));
  // Authors' LongBench configuration: window 32, kernel 7, max.
  CHECK(fields(Policy("snapkv(preset=authors)")) ==
        std::tuple(32, 7, Pool::max, GqaReduce::mean, 0));
  const SnapKV a = SnapKV::authors();
  CHECK(std::tuple(a.window, a.kernel, a.pool) == std::tuple(32, 7, Pool::max));
  // Explicit parameters override the preset's.
  CHECK(fields(Policy("snapkv(preset=authors, window=16)")) ==
        std::tuple(16, 7, Pool::max, GqaReduce::mean, 0));
  CHECK(fields(Policy("snapkv(preset=authors,pool=avg,kernel=3)")) ==
        std::tuple(32, 3, Pool::avg, GqaReduce::mean, 0));

  // Both presets on T = 100 > window, compared with the naive reference; check_scorer also
  // requires Pipeline<SnapKV, Uniform> and Policy(spec) to give the same selection and scores.
  kvtest::Rng rng(0x5a9);
  naive::Tally tally;
  const auto c = naive::random_case<float>(rng, 1, 2, 4, 100, 64, 4, Layout::HND);
  const auto in = c.inputs();
  for (std::int64_t budget : {80, 72}) {
    naive::Reference ref{naive::snapkv(c.k.ref, c.q.ref, 64, 5, Pool::avg, GqaReduce::mean), 0, 64};
    naive::check_scorer(SnapKV{}, "snapkv | uniform", in, budget, ref, tally);
  }
  for (std::int64_t budget : {48, 40}) {
    naive::Reference ref{naive::snapkv(c.k.ref, c.q.ref, 32, 7, Pool::max, GqaReduce::mean), 0, 32};
    naive::check_scorer(SnapKV::authors(), "snapkv(preset=authors) | uniform", in, budget, ref,
                        tally);
  }
  naive::require_few_near_ties(tally);
}

TEMPLATE_TEST_CASE("snapkv matches the naive reference", "[scorers][snapkv]", float, kvpolicy::half,
                   kvpolicy::bfloat16) {
  kvtest::Rng rng(0x5a4);
  naive::Tally tally;
  const GqaReduce reduces[] = {GqaReduce::mean, GqaReduce::max, GqaReduce::sum};
  const char* reduce_names[] = {"mean", "max", "sum"};
  const std::int64_t windows[] = {1, 3, 8};
  const int kernels[] = {1, 3, 5, 7};
  int iter = 0;
  for (std::size_t si = 0; si < std::size(naive::kShapes); ++si) {
    const auto sh = naive::kShapes[si];
    for (std::int64_t g : naive::kGroups) {
      SnapKV s;
      s.window = windows[iter % 3];
      s.kernel = kernels[(iter / 3) % 4];
      s.pool = iter % 2 ? Pool::max : Pool::avg;
      s.reduce = reduces[(iter / 2) % 3];
      s.sinks = (iter / 5) % 2 * 2;
      const std::string spec =
          "snapkv(window=" + std::to_string(s.window) + ",kernel=" + std::to_string(s.kernel) +
          ",pool=" + (s.pool == Pool::max ? "max" : "avg") +
          ",reduce=" + reduce_names[(iter / 2) % 3] + ",sinks=" + std::to_string(s.sinks) + ")";
      ++iter;
      // A few queries more than the window: only the last `window` may vote.
      const std::int64_t w = std::min(s.window, sh.tokens), nq = std::min(sh.tokens, w + 3);
      const auto c = naive::random_case<TestType>(rng, sh.layers, sh.kv_heads, g, sh.tokens, nq,
                                                  sh.dim, naive::layout_of(si));
      const auto in = c.inputs();
      naive::Reference ref{naive::snapkv(c.k.ref, c.q.ref, s.window, s.kernel, s.pool, s.reduce),
                           s.sinks, w};
      std::vector<std::int64_t> budgets = {sh.tokens + 3, sh.tokens};
      if (s.sinks + w < sh.tokens) budgets.push_back(s.sinks + w + (sh.tokens - s.sinks - w) / 2);
      for (std::int64_t budget : budgets) naive::check_scorer(s, spec, in, budget, ref, tally);
    }
  }
  naive::require_few_near_ties(tally);
}

}  // namespace kvt_scorers_snapkv
