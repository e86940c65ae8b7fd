// StreamingLLM: sinks + the newest tokens, hand-checked and against the naive reference.
#include <string>

#include "scorers/naive.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_scorers_streaming {

using namespace kvpolicy;

TEST_CASE("streaming: sinks and the newest tokens", "[scorers][streaming]") {
  kvtest::Rng rng(3);
  const auto k = kvtest::random_tensor<float>(rng, 1, 2, 10, 3);
  Inputs<float> in;
  in.keys = k.view();
  const auto kept = [&](const char* spec, std::int64_t budget) {
    const Selection sel = Policy(spec).select(cpu_backend{}, in, Budget::tokens(budget));
    REQUIRE(sel.kept(0, 0).size() == sel.kept(0, 1).size());
    REQUIRE(std::equal(sel.kept(0, 0).begin(), sel.kept(0, 0).end(), sel.kept(0, 1).begin()));
    return std::vector<std::int32_t>(sel.kept(0, 0).begin(), sel.kept(0, 0).end());
  };
  // T = 10, default 4 sinks {0..3}; budget 6 adds the 2 newest {8, 9}.
  CHECK(kept("streaming", 6) == std::vector<std::int32_t>{0, 1, 2, 3, 8, 9});
  CHECK(kept("streaming", 4) == std::vector<std::int32_t>{0, 1, 2, 3});
  CHECK(kept("streaming(sinks=1)", 4) == std::vector<std::int32_t>{0, 7, 8, 9});
  CHECK(kept("streaming(sinks=0)", 3) == std::vector<std::int32_t>{7, 8, 9});
  CHECK(kept("streaming", 10).size() == 10);
  CHECK(kept("streaming", 12).size() == 10);
  // Below the 4 sinks: the first 3 (Selection::warning says so; tests/scorers/test_spec.cpp).
  CHECK(kept("streaming", 3) == std::vector<std::int32_t>{0, 1, 2});
  // Scores are the positions.
  ScoreMap s;
  Pipeline<Streaming, Uniform>(Streaming{}, Uniform{})
      .select(cpu_backend{}, in, Budget::tokens(6), &s);
  for (int j = 0; j < 10; ++j) CHECK(s.row(0, 1)[j] == static_cast<float>(j));
}

TEMPLATE_TEST_CASE("streaming matches the naive reference", "[scorers][streaming]", float,
                   kvpolicy::half, kvpolicy::bfloat16) {
  kvtest::Rng rng(0x57);
  naive::Tally tally;
  for (std::size_t si = 0; si < std::size(naive::kShapes); ++si) {
    const auto sh = naive::kShapes[si];
    const auto c = naive::random_case<TestType>(rng, sh.layers, sh.kv_heads, 1, sh.tokens, 0,
                                                sh.dim, naive::layout_of(si));
    for (std::int64_t sinks : {0, 1, 4}) {
      naive::Reference ref{naive::streaming(c.k.ref), sinks, 0};
      for (std::int64_t budget : {sh.tokens + 1, sh.tokens, std::max(sinks, sh.tokens / 2)})
        naive::check_scorer(Streaming{sinks}, "streaming(sinks=" + std::to_string(sinks) + ")",
                            c.inputs(), budget, ref, tally);
    }
  }
  REQUIRE(tally.near_tie_rows == 0);
}

}  // namespace kvt_scorers_streaming
