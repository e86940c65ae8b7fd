// DepthKV: per-layer budgets in proportion to sensitivity (the proportional rule) or along the
// layers' loss curves (the marginal rule), clipped to [B_min, T] and summing exactly; profile
// files (missing layers, NaN, negative values, bad curves, malformed JSON) rejected with
// messages naming the problem.
#include <vector>

#include "allocators/alloc_util.hpp"
#include "scorers/naive.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_allocators_depthkv {

using namespace kvpolicy;
using alloc_test::context;
using Catch::Contains;

namespace {

DepthKV profile(const std::vector<double>& s) { return DepthKV::from_values(s, "test"); }

// A profile with loss curves (the marginal rule): curves[l][k] is layer l's loss at knots[k].
DepthKV curves(const std::vector<double>& knots, const std::vector<std::vector<double>>& f) {
  LayerProfile p;
  p.sensitivity.assign(f.size(), 1.0);
  p.curve_budgets = knots;
  p.curves = f;
  return DepthKV::from_profile(p, "test");
}

std::vector<std::int64_t> run(const DepthKV& d, std::int64_t L, std::int64_t T, std::int64_t b,
                              Protect prot, std::int64_t H = 1) {
  ScoreMap s(L, H, T);
  std::vector<std::int64_t> budgets(static_cast<std::size_t>(L * H), b);
  d.allocate(context(s, prot), budgets);
  return budgets;
}

// Random per-row budgets over a random protection, allocated by `d`: the total must be kept
// exactly and every budget must stay in [protected, T].
void check_conserves(const DepthKV& d, kvtest::Rng& rng, std::int64_t L, std::int64_t H,
                     std::int64_t T) {
  const Protect prot{rng.integer(0, 4), rng.integer(0, 40)};
  const std::int64_t lo = prot.total(T);
  ScoreMap sm(L, H, T);
  std::vector<std::int64_t> b(static_cast<std::size_t>(L * H));
  for (auto& x : b) x = rng.integer(lo, T);
  const std::int64_t total = alloc_test::sum(b);
  d.allocate(context(sm, prot), b);
  REQUIRE(alloc_test::sum(b) == total);
  for (auto x : b) {
    REQUIRE(x >= lo);
    REQUIRE(x <= T);
  }
}

}  // namespace

TEST_CASE("depthkv: budgets in proportion to sensitivity, by hand", "[allocators][depthkv]") {
  // Equal sensitivities: uniform.
  CHECK(run(profile({1, 1, 1, 1}), 4, 1000, 100, {}) == std::vector<std::int64_t>(4, 100));
  // 4 * 100 * s / 10 = 40, 80, 120, 160.
  CHECK(run(profile({1, 2, 3, 4}), 4, 1000, 100, {}) ==
        std::vector<std::int64_t>{40, 80, 120, 160});
  // Scale does not matter.
  CHECK(run(profile({0.1, 0.2, 0.3, 0.4}), 4, 1000, 100, {}) ==
        std::vector<std::int64_t>{40, 80, 120, 160});
  // Several heads: each head column split the same way.
  CHECK(run(profile({1, 3}), 2, 1000, 100, {}, 2) == std::vector<std::int64_t>{50, 50, 150, 150});
}

TEST_CASE("depthkv: power tempers the profile, by hand", "[allocators][depthkv]") {
  DepthKV d = profile({1, 4, 9, 16});
  d.power = 0.5;  // weights 1, 2, 3, 4: 4 * 100 * w / 10
  CHECK(run(d, 4, 1000, 100, {}) == std::vector<std::int64_t>{40, 80, 120, 160});
  d.power = 0.0;  // uniform, zero sensitivities included
  CHECK(run(d, 4, 1000, 100, {}) == std::vector<std::int64_t>(4, 100));
  DepthKV z = profile({0, 2});
  z.power = 0.0;
  CHECK(run(z, 2, 1000, 100, {}) == std::vector<std::int64_t>{100, 100});
  z.power = 2.0;  // weights 0, 4
  CHECK(run(z, 2, 1000, 100, {}) == std::vector<std::int64_t>{0, 200});
}

TEST_CASE("depthkv: clipping at T and at B_min is redistributed exactly", "[allocators][depthkv]") {
  // T = 150: raw 50, 50, 50, 250 -> layer 3 clipped to 150; its 100 excess goes to the others:
  // 83.33 each -> 84, 83, 83 (the unit lost to rounding goes to the first), sum 400.
  CHECK(run(profile({1, 1, 1, 5}), 4, 150, 100, {}) ==
        std::vector<std::int64_t>{84, 83, 83, 150});
  // B_min = 10 protected tokens: layer 0 (sensitivity 0) is lifted to 10, the rest share 150.
  CHECK(run(profile({0, 1, 1, 1}), 4, 1000, 40, {2, 8}) ==
        std::vector<std::int64_t>{10, 50, 50, 50});
  // min_tokens raises the floor above the protected tokens.
  DepthKV d = profile({0, 1, 1, 1});
  d.min_tokens = 25;
  CHECK(run(d, 4, 1000, 40, {2, 8}) == std::vector<std::int64_t>{25, 45, 45, 45});
  d.min_tokens = 41;
  REQUIRE_THROWS_WITH(run(d, 4, 1000, 40, {2, 8}), Contains("depthkv: min_tokens 41 is above"));
  // All-zero profile: uniform.
  CHECK(run(profile({0, 0, 0}), 3, 1000, 70, {}) == std::vector<std::int64_t>(3, 70));
}

TEST_CASE("depthkv: random profiles conserve the budget exactly", "[allocators][depthkv]") {
  kvtest::Rng rng(17);
  for (int it = 0; it < 400; ++it) {
    const std::int64_t L = rng.integer(1, 48), H = rng.integer(1, 3), T = rng.integer(1, 2000);
    std::vector<double> s(static_cast<std::size_t>(L));
    for (auto& x : s) x = rng.integer(0, 4) == 0 ? 0.0 : rng.uniform(0, 5);  // zeros and spikes
    if (rng.integer(0, 3) == 0) s[static_cast<std::size_t>(rng.integer(0, L - 1))] = 1e6;
    INFO("L=" << L << " H=" << H << " T=" << T);
    check_conserves(profile(s), rng, L, H, T);
  }
}

TEST_CASE("depthkv: the marginal rule, by hand", "[allocators][depthkv]") {
  // T = 1000, knots 10% and 50% (100 and 500 tokens), f(1000) = 0. Layer 0 loses 1.0, 0.2;
  // layer 1 loses 0.1, 0.05. Hull slopes per token: layer 0 -0.002 on [100, 500], -0.0004 on
  // [500, 1000]; layer 1 -0.000125, then -0.0001.
  const DepthKV d = curves({0.1, 0.5}, {{1.0, 0.2}, {0.1, 0.05}});
  CHECK(d.rule == DepthKV::Rule::marginal);
  // Mean 300: both start at 100; the 400 left go to layer 0's steepest segment.
  CHECK(run(d, 2, 1000, 300, {}) == std::vector<std::int64_t>{500, 100});
  // Mean 600: layer 0 to 500 (400), then its second segment (500), then 100 to layer 1.
  CHECK(run(d, 2, 1000, 600, {}) == std::vector<std::int64_t>{1000, 200});
  // Mean 50, below the lowest measured fraction: equal shares.
  CHECK(run(d, 2, 1000, 50, {}) == std::vector<std::int64_t>{50, 50});
  // 150 protected tokens: both start at 150 (layer 0 at f = 0.9), 300 left to layer 0.
  CHECK(run(d, 2, 1000, 300, {50, 100}) == std::vector<std::int64_t>{450, 150});
  // Several heads: each head column split the same way.
  CHECK(run(d, 2, 1000, 300, {}, 2) == std::vector<std::int64_t>{500, 500, 100, 100});
  // The proportional rule on the same profile (sensitivities all 1): uniform.
  DepthKV prop = d;
  prop.rule = DepthKV::Rule::proportional;
  CHECK(run(prop, 2, 1000, 300, {}) == std::vector<std::int64_t>{300, 300});
}

TEST_CASE("depthkv: the marginal rule follows the lower convex hull", "[allocators][depthkv]") {
  // Layer 0: (100, 1), (300, 0.9), (500, 0.1), (1000, 0). (300, 0.9) lies above the chord from
  // (100, 1) to (500, 0.1), so the hull is one segment of slope -0.9 / 400 = -0.00225, then
  // -0.0002. Layer 1: collinear points, one segment of slope -0.001 from 100 to 1000.
  const DepthKV d = curves({0.1, 0.3, 0.5}, {{1.0, 0.9, 0.1}, {0.9, 0.7, 0.5}});
  // Mean 300 (400 to give): all of it to layer 0's first hull segment, though its first
  // measured step (100 -> 300) is shallower than layer 1's.
  CHECK(run(d, 2, 1000, 300, {}) == std::vector<std::int64_t>{500, 100});
  // Mean 400: then 200 to layer 1 (-0.001) before layer 0's second segment (-0.0002).
  CHECK(run(d, 2, 1000, 400, {}) == std::vector<std::int64_t>{500, 300});
  // A loss that rises with the budget (noise): the hull goes under it and the budget still goes
  // where the loss falls fastest.
  const DepthKV n = curves({0.1, 0.5}, {{0.2, 0.4}, {0.5, 0.3}});
  // Layer 0: (100, 0.2) -> (1000, 0), slope -0.000222; layer 1: (100, 0.5), (500, 0.3),
  // (1000, 0): slopes -0.0005, -0.0006 (not convex: one segment, -0.000556).
  CHECK(run(n, 2, 1000, 300, {}) == std::vector<std::int64_t>{100, 500});
  // Equal slopes share in proportion to their lengths: identical curves split uniformly.
  const DepthKV same = curves({0.1}, {{0.3}, {0.3}, {0.3}});
  CHECK(run(same, 3, 1000, 400, {}) == std::vector<std::int64_t>(3, 400));
  const DepthKV zero = curves({0.2, 0.4}, {{0, 0}, {0, 0}, {0, 0}});
  CHECK(run(zero, 3, 1000, 700, {}) == std::vector<std::int64_t>(3, 700));
}

TEST_CASE("depthkv: the marginal rule conserves the budget exactly on random curves",
          "[allocators][depthkv]") {
  kvtest::Rng rng(23);
  for (int it = 0; it < 300; ++it) {
    const std::int64_t L = rng.integer(1, 40), H = rng.integer(1, 3), T = rng.integer(1, 2000);
    const std::int64_t K = rng.integer(1, DepthKV::kMaxKnots);
    std::vector<double> knots;
    for (std::int64_t k = 0; k < K; ++k)
      knots.push_back((static_cast<double>(k) + rng.uniform(0.05, 0.95)) / static_cast<double>(K));
    std::vector<std::vector<double>> f(static_cast<std::size_t>(L));
    for (auto& row : f)
      for (std::int64_t k = 0; k < K; ++k)
        row.push_back(rng.integer(0, 5) == 0 ? 0.0 : rng.uniform(0, 2));  // any shape, zeros
    INFO("L=" << L << " H=" << H << " T=" << T << " K=" << K);
    check_conserves(curves(knots, f), rng, L, H, T);
  }
}

TEST_CASE("depthkv: profile files", "[allocators][depthkv]") {
  const alloc_test::TempFile good(
      "depthkv_good.json",
      R"({"model": "tiny", "scorer": "snapkv", "budget": 0.2, "metric": "kl",
          "notes": {"a": [1, 2, {"b": null}], "c": true}, "layers": 3,
          "sensitivity": [0.5, 1.5e0, 2]})");
  const LayerProfile p = load_layer_profile(good.path);
  CHECK(p.model == "tiny");
  CHECK(p.scorer == "snapkv");
  CHECK(p.sensitivity == std::vector<double>{0.5, 1.5, 2});
  const Policy pol("snapkv(window=4) | depthkv(profile=" + good.path + ")");
  const auto& d = std::get<DepthKV>(pol.allocators().at(0));
  CHECK(d.layers == 3);
  CHECK(d.sensitivity[2] == 2.0f);

  auto bad = [](const std::string& json) { return parse_layer_profile(json, "p.json"); };
  REQUIRE_THROWS_WITH(bad(R"({"layers": 4, "sensitivity": [1, 2, 3]})"),
                      Contains("\"layers\" is 4 but \"sensitivity\" lists 3 values (missing layers)"));
  REQUIRE_THROWS_WITH(bad(R"({"sensitivity": [1, NaN, 3]})"),
                      Contains("profile 'p.json': sensitivity of layer 1 is NaN"));
  REQUIRE_THROWS_WITH(bad(R"({"sensitivity": [1, 2, -0.5]})"),
                      Contains("sensitivity of layer 2 is negative"));
  REQUIRE_THROWS_WITH(bad(R"({"sensitivity": [Infinity]})"), Contains("layer 0 is infinite"));
  REQUIRE_THROWS_WITH(bad(R"({"sensitivity": []})"), Contains("lists no layers"));
  REQUIRE_THROWS_WITH(bad(R"({"model": "x"})"), Contains("no \"sensitivity\" array"));
  REQUIRE_THROWS_WITH(bad(R"({"sensitivity": [1, "two"]})"), Contains("expects numbers"));
  REQUIRE_THROWS_WITH(bad(R"({"sensitivity": 3})"), Contains("must be an array of numbers"));
  REQUIRE_THROWS_WITH(bad(R"({"sensitivity": [1, 2)"), Contains("expected ']'"));
  REQUIRE_THROWS_WITH(bad(R"({"sensitivity": [1]} x)"), Contains("expected end of input"));
  REQUIRE_THROWS_WITH(bad("not json"), Contains("profile 'p.json': not valid JSON"));
  REQUIRE_THROWS_WITH(bad("[1, 2]"), Contains("the top level must be a JSON object"));
  REQUIRE_THROWS_WITH(bad(R"({"sensitivity": [1], "layers": 1.5})"),
                      Contains("\"layers\" must be a non-negative integer"));
  // The non-finite tokens are only special outside strings.
  CHECK(bad(R"({"model": "NaN Infinity", "sensitivity": [1]})").model == "NaN Infinity");
  REQUIRE_THROWS_WITH(Policy("snapkv | depthkv(profile=no_such_profile.json)"),
                      Contains("depthkv: cannot open profile 'no_such_profile.json'"));
}

TEST_CASE("depthkv: profile files with loss curves", "[allocators][depthkv]") {
  const alloc_test::TempFile good(
      "depthkv_curves.json",
      R"({"layers": 2, "sensitivity": [0.2, 0.05], "curve_budgets": [0.1, 0.5],
          "curves": [[1.0, 0.2], [0.1, 0.05]]})");
  const LayerProfile p = load_layer_profile(good.path);
  CHECK(p.curve_budgets == std::vector<double>{0.1, 0.5});
  CHECK(p.curves == std::vector<std::vector<double>>{{1.0, 0.2}, {0.1, 0.05}});
  const Policy marginal("snapkv(window=4) | depthkv(profile=" + good.path + ")");
  const auto& d = std::get<DepthKV>(marginal.allocators().at(0));
  CHECK(d.rule == DepthKV::Rule::marginal);
  CHECK(d.n_knots == 2);
  CHECK(d.knots[1] == 0.5f);
  CHECK(d.loss[DepthKV::kMaxKnots + 1] == 0.05f);
  CHECK(run(d, 2, 1000, 300, {}) == std::vector<std::int64_t>{500, 100});
  // rule=proportional on the same file uses "sensitivity": 2 * 300 * s / 0.25 = 480, 120.
  const Policy prop("snapkv(window=4) | depthkv(profile=" + good.path + ", rule=proportional)");
  const auto& dp = std::get<DepthKV>(prop.allocators().at(0));
  CHECK(dp.rule == DepthKV::Rule::proportional);
  CHECK(run(dp, 2, 1000, 300, {}) == std::vector<std::int64_t>{480, 120});
  REQUIRE_THROWS_WITH(Policy("snapkv | depthkv(profile=" + good.path + ", power=0.5)"),
                      Contains("depthkv: power applies to rule=proportional only"));
  REQUIRE_THROWS_WITH(Policy("snapkv | depthkv(weights=1:2, rule=marginal)"),
                      Contains("depthkv: rule=marginal needs loss curves"));
  REQUIRE_THROWS_WITH(Policy("snapkv | depthkv(weights=1:2, rule=best)"),
                      Contains("parameter 'rule' must be one of {marginal, proportional}"));

  auto bad = [](const std::string& json) { return parse_layer_profile(json, "p.json"); };
  REQUIRE_THROWS_WITH(bad(R"({"sensitivity": [1, 2], "curve_budgets": [0.1]})"),
                      Contains("\"curve_budgets\" and \"curves\" come together"));
  REQUIRE_THROWS_WITH(bad(R"({"sensitivity": [1], "curves": [[1]]})"),
                      Contains("come together"));
  REQUIRE_THROWS_WITH(bad(R"({"sensitivity": [1], "curve_budgets": [], "curves": []})"),
                      Contains("\"curve_budgets\" must be a non-empty array"));
  REQUIRE_THROWS_WITH(bad(R"({"sensitivity": [1], "curve_budgets": [0.5, 0.2],
                              "curves": [[1, 2]]})"),
                      Contains("\"curve_budgets\" must be strictly ascending (entry 1)"));
  REQUIRE_THROWS_WITH(bad(R"({"sensitivity": [1], "curve_budgets": [1.0], "curves": [[1]]})"),
                      Contains("curve budget 0 (1.0) is outside (0, 1)"));
  REQUIRE_THROWS_WITH(bad(R"({"sensitivity": [1, 2], "curve_budgets": [0.1], "curves": [[1]]})"),
                      Contains("\"curves\" must be an array of one row per layer (2)"));
  REQUIRE_THROWS_WITH(bad(R"({"sensitivity": [1], "curve_budgets": [0.1, 0.2], "curves": [[1]]})"),
                      Contains("curve of layer 0 must hold one loss per curve budget (2)"));
  REQUIRE_THROWS_WITH(bad(R"({"sensitivity": [1], "curve_budgets": [0.1], "curves": [[NaN]]})"),
                      Contains("curve of layer 0 at budget 0 is NaN"));
  REQUIRE_THROWS_WITH(bad(R"({"sensitivity": [1], "curve_budgets": [0.1], "curves": [[-1]]})"),
                      Contains("curve of layer 0 at budget 0 is negative"));
  // More curve points than the allocator holds, and losses beyond a float.
  LayerProfile many;
  many.sensitivity = {1};
  for (int k = 1; k <= 9; ++k) many.curve_budgets.push_back(k / 10.0);
  many.curves = {std::vector<double>(9, 0.5)};
  REQUIRE_THROWS_WITH(DepthKV::from_profile(many, "m.json"),
                      Contains("has loss curves at 9 budgets; at most 8 are supported"));
  // Two budgets that a double tells apart and a float does not.
  const auto close = bad(R"({"sensitivity": [1], "curve_budgets": [0.1, 0.10000000001],
                             "curves": [[1, 1]]})");
  REQUIRE_THROWS_WITH(DepthKV::from_profile(close, "c.json"),
                      Contains("curve budgets must ascend strictly inside (0, 1) as floats "
                               "(budget 1 is 0.10000000001000001, as a float 0.100000001)"));
  // A budget that a float holds as 0 or 1.
  const auto tiny = bad(R"({"sensitivity": [1], "curve_budgets": [1e-46], "curves": [[1]]})");
  REQUIRE_THROWS_WITH(DepthKV::from_profile(tiny, "t.json"), Contains("as a float 0)"));
  const auto near1 = bad(R"({"sensitivity": [1], "curve_budgets": [0.99999999], "curves": [[1]]})");
  REQUIRE_THROWS_WITH(DepthKV::from_profile(near1, "n.json"), Contains("as a float 1)"));
  const auto huge = bad(R"({"sensitivity": [1], "curve_budgets": [0.1], "curves": [[1e300]]})");
  REQUIRE_THROWS_WITH(DepthKV::from_profile(huge, "h.json"),
                      Contains("loss of layer 0 at budget 0 is 1e+300"));
}

TEST_CASE("depthkv: the profile must match the model's layers", "[allocators][depthkv]") {
  kvtest::Rng rng(2);
  const auto c = naive::random_case<float>(rng, 4, 2, 1, 64, 4, 8, Layout::HND);
  const Policy three("snapkv(window=4) | depthkv(weights=1:2:3)");
  REQUIRE_THROWS_WITH(three.select(cpu_backend{1}, c.inputs(), Budget::tokens(20)),
                      Contains("depthkv: the profile has 3 layers but the model has 4 (missing layers)"));
  const Policy five("snapkv(window=4) | depthkv(weights=1:2:3:4:5)");
  REQUIRE_THROWS_WITH(five.select(cpu_backend{1}, c.inputs(), Budget::tokens(20)),
                      Contains("the profile has 5 layers but the model has 4"));
  // One layer of a 5-layer model: fine.
  Inputs<float> one = c.inputs();
  one.keys.layers = 1;
  one.queries.layers = 1;
  const Selection sel = five.select(cpu_backend{1}, one, Budget::tokens(20), EventInfo{4, 5});
  // Targets 100 * s / 15 = 6.67, 13.33, 20, 26.67, 33.33 round to 7, 13, 20, 27, 33 (sum 100).
  CHECK(sel.count(0, 0) == 33);
}

TEST_CASE("depthkv: spec parameters", "[allocators][depthkv][spec]") {
  const Policy p("snapkv | depthkv(weights=1:0.5:2, min_tokens=70)");
  const auto& d = std::get<DepthKV>(p.allocators().at(0));
  CHECK(d.layers == 3);
  CHECK(d.sensitivity[1] == 0.5f);
  CHECK(d.min_tokens == 70);
  CHECK(d.power == 1.0);
  CHECK(std::get<DepthKV>(Policy("snapkv | depthkv(weights=1:2, power=0.5)").allocators().at(0))
            .power == 0.5);
  REQUIRE_THROWS_WITH(Policy("snapkv | depthkv(weights=1:2, power=-1)"),
                      Contains("depthkv: power must be >= 0"));
  REQUIRE_THROWS_WITH(Policy("snapkv | depthkv"), Contains("give exactly one of 'profile'"));
  REQUIRE_THROWS_WITH(Policy("snapkv | depthkv(weights=1:2, profile=a.json)"),
                      Contains("give exactly one of 'profile'"));
  REQUIRE_THROWS_WITH(Policy("snapkv | depthkv(weights=1:x)"),
                      Contains("'weights' expects numbers separated by ':'"));
  REQUIRE_THROWS_WITH(Policy("snapkv | depthkv(weights=1::2)"), Contains("'weights' expects"));
  REQUIRE_THROWS_WITH(Policy("snapkv | depthkv(weights=1:-2)"),
                      Contains("sensitivity of layer 1 is negative"));
  REQUIRE_THROWS_WITH(Policy("snapkv | depthkv(weights=1:nan)"),
                      Contains("sensitivity of layer 1 is not finite"));
  REQUIRE_THROWS_WITH(Policy("snapkv | depthkv(weights=1, min_tokens=-3)"),
                      Contains("depthkv: min_tokens must be >= 0"));
  REQUIRE_THROWS_WITH(Policy("snapkv | depthkv(weights=1, floor=3)"),
                      Contains("unknown parameter 'floor'"));
}

TEST_CASE("depthkv: profile values beyond a float or a double are rejected (fuzz_profile "
          "regressions)",
          "[allocators][depthkv][spec]") {
  // Found by fuzz_profile: 8.4e205 is a finite double, accepted, then held as an infinite float.
  REQUIRE_THROWS_WITH(Policy("snapkv | depthkv(weights=1:1e300)"),
                      Contains("sensitivity of layer 1 (1e+300) is above the float range"));
  const auto p = kvpolicy::parse_layer_profile(R"({"sensitivity": [0.5, 8.4e205]})", "p.json");
  REQUIRE_THROWS_WITH(DepthKV::from_profile(p, "p.json"), Contains("above the float range"));
  CHECK(DepthKV::from_values(std::vector<double>{3.4e38, 1e-50}, "w").sensitivity[0] == 3.4e38f);
  // Found by fuzz_profile: a number beyond a double made nlohmann-json throw out_of_range, which
  // escaped as another exception type than kvpolicy::Error.
  REQUIRE_THROWS_WITH(kvpolicy::parse_layer_profile(R"({"sensitivity": [1, 11e308]})", "p.json"),
                      Contains("profile 'p.json': not valid JSON") && Contains("number overflow"));
}

}  // namespace kvt_allocators_depthkv
