// Allocator chains through the runtime Policy on random shapes and budgets: the global budget is
// kept exactly, no row goes below its protected tokens or above its length, the protected tokens
// are always kept, and results do not depend on the thread count. Includes the full
// `snapkv | depthkv(profile=...) | adakv | ams` chain and edge cases (T below the protected count,
// budget = protected count, budget >= T, one head, one layer).
#include <string>
#include <vector>

#include "allocators/alloc_util.hpp"
#include "scorers/naive.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_allocators_chains {

using namespace kvpolicy;
using Catch::Contains;

namespace {

void check_chain(const std::string& spec, kvtest::Rng& rng, int iterations) {
  const Policy p(spec);
  for (int it = 0; it < iterations; ++it) {
    const std::int64_t L = spec.find("depthkv") != std::string::npos ? 3 : rng.integer(1, 4);
    const std::int64_t H = rng.integer(1, 3), g = rng.integer(1, 2);
    const std::int64_t T = rng.integer(1, 160);
    const std::int64_t nq = std::min<std::int64_t>(T, 32);
    const auto c = naive::random_case<float>(rng, L, H, g, T, nq, 8, Layout::HND);
    const Protect prot = p.protect(T, 0);
    const std::int64_t lo = prot.total(T);
    // Edge budgets often: exactly the protected count, exactly T, above T.
    const int pick = static_cast<int>(rng.integer(0, 5));
    const std::int64_t B = pick == 0 ? lo : pick == 1 ? T : pick == 2 ? T + 7 : rng.integer(lo, T);
    if (B < lo) continue;
    INFO(spec << ": L=" << L << " H=" << H << " g=" << g << " T=" << T << " B=" << B);
    const Selection sel = p.select(cpu_backend{1}, c.inputs(), Budget::tokens(B));
    alloc_test::require_valid(sel, T, prot);
    REQUIRE(sel.total() == L * H * std::min(B, T));
    // Heads stay within a layer's budget for head-level stages; layer stages keep the model's.
    const Selection sel2 = p.select(cpu_backend{3}, c.inputs(), Budget::tokens(B));
    for (std::int64_t l = 0; l < L; ++l)
      for (std::int64_t h = 0; h < H; ++h)
        REQUIRE(alloc_test::kept(sel, l, h) == alloc_test::kept(sel2, l, h));
  }
}

}  // namespace

TEST_CASE("allocator chains conserve the budget on random shapes", "[allocators][chains]") {
  kvtest::Rng rng(2024);
  for (const char* spec :
       {"snapkv(window=8) | uniform", "snapkv(window=8) | pyramid", "snapkv(window=8) | pyramid(beta=2)",
        "snapkv(window=4,sinks=2) | adakv", "knorm | adakv(alpha=0)", "h2o(recent_tokens=4) | adakv",
        "snapkv(window=8) | ams(min_seg_len=4)", "knorm | ams(window=8, min_seg_len=2, min_keep=2)",
        "tova | pyramid(beta=3) | adakv | ams(min_seg_len=8)",
        "snapkv(window=8) | depthkv(weights=0.2:1:3) | adakv | ams(min_seg_len=4)",
        "keydiff | depthkv(weights=0:0:1) | adakv(alpha=0.5)"})
    check_chain(spec, rng, 25);
}

TEST_CASE("snapkv | depthkv(profile) | adakv | ams, layer by layer", "[allocators][chains]") {
  const alloc_test::TempFile prof(
      "depthkv_chain.json",
      R"({"model": "test", "scorer": "snapkv", "budget": 0.3, "layers": 4,
          "sensitivity": [0.5, 2.0, 1.0, 0.25]})");
  const Policy p("snapkv(window=16) | depthkv(profile=" + prof.path + ") | adakv | ams");
  kvtest::Rng rng(31);
  const std::int64_t L = 4, H = 3, T = 400, B = 120;
  const auto c = naive::random_case<float>(rng, L, H, 2, T, 32, 8, Layout::HND);
  const Selection all = p.select(cpu_backend{2}, c.inputs(), Budget::tokens(B));
  alloc_test::require_valid(all, T, {4, 32});
  CHECK(all.total() == L * H * B);
  // Layer totals follow the profile: layer 1 (2.0) keeps the most, layer 3 (0.25) the least.
  std::vector<std::int64_t> layer(L, 0);
  for (std::int64_t l = 0; l < L; ++l)
    for (std::int64_t h = 0; h < H; ++h) layer[static_cast<std::size_t>(l)] += all.count(l, h);
  CHECK(layer[1] > layer[2]);
  CHECK(layer[2] > layer[0]);
  CHECK(layer[0] > layer[3]);
  // One layer at a time (what the Session does) gives the same kept sets.
  std::int64_t total = 0;
  for (std::int64_t l = 0; l < L; ++l) {
    const Selection sel = p.select(cpu_backend{1}, alloc_test::layer_of(c.inputs(), l),
                                   Budget::tokens(B), EventInfo{l, L});
    for (std::int64_t h = 0; h < H; ++h) {
      CHECK(alloc_test::kept(sel, 0, h) == alloc_test::kept(all, l, h));
      total += sel.count(0, h);
    }
  }
  CHECK(total == L * H * B);
  // The compile-time pipeline agrees.
  SnapKV snap;
  snap.window = 16;
  const DepthKV d = DepthKV::from_profile(load_layer_profile(prof.path), prof.path);
  const Selection pipe = Pipeline<SnapKV, DepthKV, AdaKV, AMS>(snap, d, AdaKV{}, AMS{})
                             .select(cpu_backend{1}, c.inputs(), Budget::tokens(B));
  for (std::int64_t l = 0; l < L; ++l)
    for (std::int64_t h = 0; h < H; ++h) CHECK(alloc_test::kept(pipe, l, h) == alloc_test::kept(all, l, h));
}

TEST_CASE("allocators: bad event descriptions are rejected", "[allocators][chains]") {
  kvtest::Rng rng(6);
  const auto c = naive::random_case<float>(rng, 2, 1, 1, 40, 8, 8, Layout::HND);
  const Policy p("snapkv(window=8) | pyramid");
  REQUIRE_THROWS_WITH(p.select(cpu_backend{1}, c.inputs(), Budget::tokens(20), EventInfo{-1, 4}),
                      Contains("event layers [-1, 1) do not fit a model of 4 layers"));
  REQUIRE_THROWS_WITH(p.select(cpu_backend{1}, c.inputs(), Budget::tokens(20), EventInfo{3, 4}),
                      Contains("event layers [3, 5) do not fit a model of 4 layers"));
  EventInfo ev;
  ev.alloc_state_stride = 10;
  REQUIRE_THROWS_WITH(p.select(cpu_backend{1}, c.inputs(), Budget::tokens(20), ev),
                      Contains("alloc_state_stride 10 is below the 40 tokens"));
}

}  // namespace kvt_allocators_chains
