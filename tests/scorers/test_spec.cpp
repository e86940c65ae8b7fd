// Policy spec strings: what parses, and every malformed or out-of-range spec raising
// kvpolicy::Error with a message that names the problem.
#include "scorers/naive.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_scorers_spec {

using namespace kvpolicy;

TEST_CASE("policy specs that parse", "[scorers][spec]") {
  CHECK(Policy("snapkv(window=8) | uniform").scorer_name() == "snapkv");
  CHECK(Policy("  h2o ( recent = 0.25 , sinks = 2 )  ").scorer_name() == "h2o");
  CHECK(Policy("streaming()").scorer_name() == "streaming");
  CHECK(Policy("tova").query_window() == 1);
  CHECK(Policy("h2o(recent=1)").decode_time());
  const Policy p("h2o(recent=0.25,sinks=2,normalize=1,reduce=sum)");
  const auto& h = std::get<H2O>(p.scorer());
  CHECK(h.recent == 0.25);
  CHECK(h.sinks == 2);
  CHECK(h.normalize);
  CHECK(h.reduce == GqaReduce::sum);
  CHECK(std::get<Streaming>(Policy("streaming(sinks=0)").scorer()).sinks == 0);
  CHECK(Policy("knorm | uniform | uniform").spec() == "knorm | uniform | uniform");
}

TEST_CASE("bad policy specs raise kvpolicy::Error naming the problem", "[scorers][spec]") {
  using Catch::Contains;
  // Unknown names.
  REQUIRE_THROWS_WITH(Policy("snapkvv"),
                      Contains("unknown scorer 'snapkvv'") && Contains("snapkv"));
  REQUIRE_THROWS_WITH(Policy("uniform"), Contains("unknown scorer 'uniform'"));
  REQUIRE_THROWS_WITH(Policy("snapkv | pyramidd"), Contains("unknown stage 'pyramidd'"));
  REQUIRE_THROWS_WITH(Policy("snapkv(windw=8)"),
                      Contains("unknown parameter 'windw'") && Contains("window"));
  REQUIRE_THROWS_WITH(Policy("knorm(window=8)"), Contains("unknown parameter 'window'"));
  // Malformed.
  REQUIRE_THROWS_WITH(Policy(""), Contains("empty"));
  REQUIRE_THROWS_WITH(Policy("   "), Contains("empty"));
  REQUIRE_THROWS_WITH(Policy("snapkv(window=8"), Contains("closing ')'"));
  REQUIRE_THROWS_WITH(Policy("snapkv | "), Contains("empty stage"));
  REQUIRE_THROWS_WITH(Policy("| snapkv"), Contains("empty stage"));
  REQUIRE_THROWS_WITH(Policy("snapkv || uniform"), Contains("empty stage"));
  REQUIRE_THROWS_WITH(Policy("snapkv(window=)"), Contains("parameter 'window' has no value"));
  REQUIRE_THROWS_WITH(Policy("snapkv(window)"), Contains("expected key=value"));
  REQUIRE_THROWS_WITH(Policy("snapkv(window=8,)"), Contains("expected key=value"));
  REQUIRE_THROWS_WITH(Policy("snapkv(=8)"), Contains("bad parameter name"));
  REQUIRE_THROWS_WITH(Policy("snap kv"), Contains("bad stage name"));
  REQUIRE_THROWS_WITH(Policy("snapkv((window=8))"), Contains("nested parentheses"));
  REQUIRE_THROWS_WITH(Policy("snapkv(window=8,window=9)"), Contains("'window' given twice"));
  // Wrong types.
  REQUIRE_THROWS_WITH(Policy("snapkv(window=abc)"), Contains("'window' expects an integer"));
  REQUIRE_THROWS_WITH(Policy("snapkv(window=8.5)"), Contains("'window' expects an integer"));
  REQUIRE_THROWS_WITH(Policy("h2o(recent=lots)"), Contains("'recent' expects a number"));
  REQUIRE_THROWS_WITH(Policy("h2o(recent=nan)"), Contains("'recent' expects a number"));
  REQUIRE_THROWS_WITH(Policy("snapkv(pool=min)"), Contains("'pool' must be one of {avg, max}"));
  REQUIRE_THROWS_WITH(Policy("snapkv(preset=paper)"), Contains("'preset' must be one of"));
  REQUIRE_THROWS_WITH(Policy("h2o(normalize=yes)"), Contains("'normalize' must be one of"));
  REQUIRE_THROWS_WITH(Policy("h2o(reduce=median)"), Contains("'reduce' must be one of"));
  // Out of range.
  REQUIRE_THROWS_WITH(Policy("snapkv(kernel=4)"), Contains("kernel must be odd"));
  REQUIRE_THROWS_WITH(Policy("snapkv(kernel=0)"), Contains("kernel must be odd"));
  REQUIRE_THROWS_WITH(Policy("snapkv(kernel=-3)"), Contains("kernel must be odd"));
  REQUIRE_THROWS_WITH(Policy("snapkv(kernel=4294967297)"),
                      Contains("kernel 4294967297 is out of range"));
  REQUIRE_THROWS_WITH(Policy("snapkv(window=0)"), Contains("window must be >= 1"));
  REQUIRE_THROWS_WITH(Policy("snapkv(window=-4)"), Contains("window must be >= 1"));
  REQUIRE_THROWS_WITH(Policy("snapkv(sinks=-1)"), Contains("sinks must be >= 0"));
  REQUIRE_THROWS_WITH(Policy("h2o(recent=1.5)"), Contains("recent must be a fraction in [0, 1]"));
  REQUIRE_THROWS_WITH(Policy("h2o(recent=-0.1)"), Contains("recent must be a fraction in [0, 1]"));
  REQUIRE_THROWS_WITH(Policy("h2o(sinks=-2)"), Contains("sinks must be >= 0"));
  REQUIRE_THROWS_WITH(Policy("h2o(recent_tokens=-5)"), Contains("recent_tokens must be >= 0"));
  REQUIRE_THROWS_WITH(Policy("streaming(sinks=-1)"), Contains("sinks must be >= 0"));
  // Every one of them is a kvpolicy::Error (std::invalid_argument), prefixed "kvpolicy: ".
  REQUIRE_THROWS_AS(Policy("snapkv(kernel=4)"), Error);
  REQUIRE_THROWS_WITH(Policy("snapkv(kernel=4)"), Catch::StartsWith("kvpolicy: snapkv: "));
}

TEST_CASE("budgets below the protected tokens keep the newest tokens, with a warning",
          "[scorers][spec]") {
  kvtest::Rng rng(11);
  const auto c = naive::random_case<float>(rng, 1, 2, 2, 20, 20, 4, Layout::HND);
  const auto in = c.inputs();
  auto kept = [](const Selection& s, std::int64_t h) {
    return std::vector<std::int32_t>(s.kept(0, h).begin(), s.kept(0, h).end());
  };
  // The window cut to the budget: tokens 15..19 of 20.
  const Selection a = Policy("snapkv(window=8)").select(cpu_backend{}, in, Budget::tokens(5));
  for (std::int64_t h = 0; h < 2; ++h) CHECK(kept(a, h) == std::vector<std::int32_t>{15, 16, 17, 18, 19});
  CHECK_THAT(a.warning(), Catch::Contains("budget of 5 tokens per head is below the 8 tokens snapkv "
                                          "protects (0 sinks + 8 recent): kept the newest 5 instead"));
  // The whole window first, then what is left of the sinks.
  const Selection b =
      Policy("snapkv(window=8,sinks=2)").select(cpu_backend{}, in, Budget::tokens(9));
  CHECK(kept(b, 0) == std::vector<std::int32_t>{0, 12, 13, 14, 15, 16, 17, 18, 19});
  CHECK_THAT(b.warning(), Catch::Contains("below the 10 tokens snapkv protects (2 sinks + 8 recent): "
                                          "kept the newest 8 and the first 1 instead"));
  // h2o's recent share already fits its budget; its sinks do not: the first 3.
  const Selection c3 = Policy("h2o(sinks=4)").select(cpu_backend{}, in, Budget::tokens(3));
  CHECK(kept(c3, 1) == std::vector<std::int32_t>{0, 1, 2});
  CHECK_THAT(c3.warning(), Catch::Contains("(4 sinks + 0 recent): kept the first 3 instead"));
  // A budget of 0 keeps nothing.
  const Selection d = Policy("tova").select(cpu_backend{}, in, Budget::tokens(0));
  CHECK(d.count(0, 0) == 0);
  CHECK_THAT(d.warning(), Catch::Contains("below the 1 tokens tova protects (0 sinks + 1 recent): kept none of them instead"));
  // Exactly the protected count: the window alone, no warning.
  const Selection sel = Policy("snapkv(window=8)").select(cpu_backend{}, in, Budget::tokens(8));
  CHECK(sel.kept(0, 1).front() == 12);
  CHECK(sel.warning().empty());
}

TEST_CASE("query_window: -1 (every query) for h2o unless an allocator bounds it",
          "[scorers][spec]") {
  // Regression: h2o's -1 was maxed with the allocators' 0 into "no queries", so callers that
  // size the queries they pass by it (the kvpress adapter) passed none.
  CHECK(Policy("h2o").query_window() == -1);
  CHECK(Policy("h2o | adakv").query_window() == -1);
  CHECK(Policy("h2o | ams").query_window() == 32);
  CHECK(Policy("snapkv(window=16) | ams").query_window() == 32);
  CHECK(Policy("knorm").query_window() == 0);
}

TEST_CASE("a quantizer alone keeps every token", "[scorers][spec]") {
  kvtest::Rng rng(12);
  const auto c = naive::random_case<float>(rng, 1, 2, 2, 20, 20, 4, Layout::HND);
  const auto in = c.inputs();
  for (const char* spec : {"int2", "int4", "kivi", "int2(residual=16)"}) {
    const Policy p(spec);
    CHECK(p.spec() == spec);
    CHECK(p.keeps_all());
    CHECK(p.scorer_name().empty());
    CHECK(p.quant_config().has_value());
    CHECK(p.needs() == Needs::none);
    CHECK(p.query_window() == 0);
    CHECK_FALSE(p.decode_time());
    const Selection s = p.select(cpu_backend{}, in, Budget::ratio(1.0));
    for (std::int64_t h = 0; h < 2; ++h) CHECK(s.count(0, h) == 20);
    CHECK(s.kept(0, 1).back() == 19);
    CHECK_THROWS_WITH(p.select(cpu_backend{}, in, Budget::ratio(0.5)),
                      Catch::Contains(std::string("policy '") + spec + "' has no scorer and keeps every "
                                      "token; the budget keeps 20 of 40"));
  }
  CHECK_FALSE(Policy("snapkv | int2").keeps_all());
  // Only alone: a quantizer first with other stages after it is still an unknown scorer.
  CHECK_THROWS_WITH(Policy("int2 | adakv"), Catch::Contains("unknown scorer 'int2'"));
  CHECK_THROWS_WITH(Policy("nope"), Catch::Contains("or a quantizer alone: int2, int4, kivi"));
}

}  // namespace kvt_scorers_spec
