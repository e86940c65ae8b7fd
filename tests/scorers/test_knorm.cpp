// KNorm: score -||k_j||, hand-checked (with the recency tie rule) and against the naive reference.
#include "scorers/naive.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_scorers_knorm {

using namespace kvpolicy;

TEST_CASE("knorm: hand-computed norms and ties", "[scorers][knorm]") {
  // Keys (3,4), (0,1), (1,0), (0,2), (6,8), (0,0): norms 5, 1, 1, 2, 10, 0, scores
  // [-5, -1, -1, -2, -10, 0]. Budget 2: j5 (0), then j1 and j2 tie at -1: the more recent j2.
  // Budget 3: {1, 2, 5}; budget 4 adds j3 (-2).
  const auto k = kvtest::make_tensor<float>(1, 1, 6, 2, {3, 4, 0, 1, 1, 0, 0, 2, 6, 8, 0, 0});
  Inputs<float> in;
  in.keys = k.view();
  const auto kept = [&](std::int64_t budget, ScoreMap* s = nullptr) {
    const Selection sel = Policy("knorm").select(cpu_backend{}, in, Budget::tokens(budget), s);
    return std::vector<std::int32_t>(sel.kept(0, 0).begin(), sel.kept(0, 0).end());
  };
  ScoreMap s;
  CHECK(kept(2, &s) == std::vector<std::int32_t>{2, 5});
  const float expect[6] = {-5, -1, -1, -2, -10, 0};
  for (int j = 0; j < 6; ++j) CHECK(s.row(0, 0)[j] == expect[j]);
  CHECK(kept(3) == std::vector<std::int32_t>{1, 2, 5});
  CHECK(kept(4) == std::vector<std::int32_t>{1, 2, 3, 5});
  CHECK(kept(0).empty());
}

TEMPLATE_TEST_CASE("knorm matches the naive reference", "[scorers][knorm]", float, kvpolicy::half,
                   kvpolicy::bfloat16) {
  kvtest::Rng rng(0x6e);
  naive::Tally tally;
  for (std::size_t si = 0; si < std::size(naive::kShapes); ++si) {
    const auto sh = naive::kShapes[si];
    const auto c = naive::random_case<TestType>(rng, sh.layers, sh.kv_heads, 1, sh.tokens, 0,
                                                sh.dim, naive::layout_of(si));
    naive::Reference ref{naive::knorm(c.k.ref)};
    for (std::int64_t budget : {sh.tokens + 1, sh.tokens, sh.tokens / 2, sh.tokens / 5})
      naive::check_scorer(KNorm{}, "knorm", c.inputs(), budget, ref, tally);
  }
  naive::require_few_near_ties(tally);
}

}  // namespace kvt_scorers_knorm
