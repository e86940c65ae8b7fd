// TOVA: the last query's attention averaged over every query head, one choice shared by all KV
// heads of a layer, newest token pinned.
#include <cmath>

#include "scorers/naive.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_scorers_tova {

using namespace kvpolicy;

TEST_CASE("tova: hand-computed last-query attention shared by the KV heads", "[scorers][tova]") {
  // T = 5, d = 2, two KV heads, one query head each (g = 1), one query (position 4).
  // KV head 0: k_j = (sqrt(2) ln w_j, 0) with w = [2, 1, 1, 4, 1] and q = (1, 0), so the last
  //   query's attention is w / 9 = [2/9, 1/9, 1/9, 4/9, 1/9].
  // KV head 1: q = 0, uniform [1/5] * 5.
  // TOVA = mean over the 2 query heads = [(2/9+1/5)/2, (1/9+1/5)/2, (1/9+1/5)/2, (4/9+1/5)/2,
  //   (1/9+1/5)/2] = [0.211111, 0.155556, 0.155556, 0.322222, 0.155556], for both KV heads.
  // Budget 3: token 4 pinned, then j3 and j0 -> {0, 3, 4} on both heads, although head 1's own
  // attention is flat (alone it would keep the most recent {2, 3, 4}).
  const double w[5] = {2, 1, 1, 4, 1};
  std::vector<double> kv(20, 0.0);
  for (int j = 0; j < 5; ++j) kv[static_cast<std::size_t>(2 * j)] = std::sqrt(2.0) * std::log(w[j]);
  const auto k = kvtest::make_tensor<float>(1, 2, 5, 2, kv);
  const auto q = kvtest::make_tensor<float>(1, 2, 1, 2, {1, 0, 0, 0});
  Inputs<float> in;
  in.keys = k.view();
  in.queries = q.view();
  ScoreMap s;
  const Selection sel = Policy("tova").select(cpu_backend{}, in, Budget::tokens(3), &s);
  for (int h = 0; h < 2; ++h) {
    for (int j = 0; j < 5; ++j) CHECK(s.row(0, h)[j] == Approx((w[j] / 9 + 0.2) / 2).epsilon(1e-5));
    CHECK(std::vector<std::int32_t>(sel.kept(0, h).begin(), sel.kept(0, h).end()) ==
          std::vector<std::int32_t>{0, 3, 4});
  }
  // Budget 1: only the pinned newest token.
  const Selection one = Policy("tova").select(cpu_backend{}, in, Budget::tokens(1));
  CHECK(std::vector<std::int32_t>(one.kept(0, 1).begin(), one.kept(0, 1).end()) ==
        std::vector<std::int32_t>{4});
}

TEMPLATE_TEST_CASE("tova matches the naive reference", "[scorers][tova]", float, kvpolicy::half,
                   kvpolicy::bfloat16) {
  kvtest::Rng rng(0x70);
  naive::Tally tally;
  int iter = 0;
  for (std::size_t si = 0; si < std::size(naive::kShapes); ++si) {
    const auto sh = naive::kShapes[si];
    for (std::int64_t g : naive::kGroups) {
      const std::int64_t nq = 1 + (iter++ % 2) * 2;  // only the last of them counts
      const auto c = naive::random_case<TestType>(rng, sh.layers, sh.kv_heads, g, sh.tokens, nq,
                                                  sh.dim, naive::layout_of(si));
      naive::Reference ref{naive::tova(c.k.ref, c.q.ref), 0, 1};
      for (std::int64_t budget : {sh.tokens + 2, sh.tokens, sh.tokens / 2, std::int64_t{1}})
        naive::check_scorer(TOVA{}, "tova", c.inputs(), budget, ref, tally);
    }
  }
  naive::require_few_near_ties(tally);
}

}  // namespace kvt_scorers_tova
