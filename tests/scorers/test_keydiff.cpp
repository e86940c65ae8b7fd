// KeyDiff: score -cos(k_j, mean of normalized keys), hand-checked and against the naive reference.
#include "scorers/naive.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_scorers_keydiff {

using namespace kvpolicy;

TEST_CASE("keydiff: hand-computed cosines and ties", "[scorers][keydiff]") {
  // Keys (1,0), (3,0), (0,2), (0,-1), (-2,0), (0,0). Normalized: (1,0), (1,0), (0,1), (0,-1),
  // (-1,0), and the zero key adds nothing: anchor = (1+1-1, 1-1)/6 = (1/6, 0), direction (1, 0).
  // cos = [1, 1, 0, 0, -1, 0 (zero key, [ours])] -> scores [-1, -1, 0, 0, 1, 0].
  // Budget 2: j4 (1), then the most recent of the zeros, j5. Budget 4: j4 + all three zeros.
  // Budget 5: + the more recent of the tied -1s, j1.
  const auto k = kvtest::make_tensor<float>(1, 1, 6, 2, {1, 0, 3, 0, 0, 2, 0, -1, -2, 0, 0, 0});
  Inputs<float> in;
  in.keys = k.view();
  const auto kept = [&](std::int64_t budget, ScoreMap* s = nullptr) {
    const Selection sel = Policy("keydiff").select(cpu_backend{}, in, Budget::tokens(budget), s);
    return std::vector<std::int32_t>(sel.kept(0, 0).begin(), sel.kept(0, 0).end());
  };
  ScoreMap s;
  CHECK(kept(2, &s) == std::vector<std::int32_t>{4, 5});
  const double expect[6] = {-1, -1, 0, 0, 1, 0};
  for (int j = 0; j < 6; ++j) CHECK(s.row(0, 0)[j] == Approx(expect[j]).margin(1e-6));
  CHECK(kept(4) == std::vector<std::int32_t>{2, 3, 4, 5});
  CHECK(kept(5) == std::vector<std::int32_t>{1, 2, 3, 4, 5});
}

TEMPLATE_TEST_CASE("keydiff matches the naive reference", "[scorers][keydiff]", float, kvpolicy::half,
                   kvpolicy::bfloat16) {
  kvtest::Rng rng(0x6b);
  naive::Tally tally;
  for (std::size_t si = 0; si < std::size(naive::kShapes); ++si) {
    const auto sh = naive::kShapes[si];
    const auto c = naive::random_case<TestType>(rng, sh.layers, sh.kv_heads, 1, sh.tokens, 0,
                                                sh.dim, naive::layout_of(si));
    naive::Reference ref{naive::keydiff(c.k.ref)};
    for (std::int64_t budget : {sh.tokens + 1, sh.tokens, sh.tokens / 2, sh.tokens / 5})
      naive::check_scorer(KeyDiff{}, "keydiff", c.inputs(), budget, ref, tally);
  }
  naive::require_few_near_ties(tally);
}

}  // namespace kvt_scorers_keydiff
