// Tensor parallelism over KV heads (core/head_shard.hpp): N ranks simulated by N threads that
// share an in-memory all-gather. Every rank runs the policy on its share of the heads (strided
// views into the same K/V/Q, its own copy of the per-token state) and must keep exactly the
// tokens, with exactly the scores, of a single-rank run over every head. 3 KV heads as on the
// bundled SmolLM2-135M model, split 3, 2+1, 1+2 and 1+1+1 ways, for every scorer and every
// allocator chain, with ratio and total budgets and with scores full of ties.
#include <catch2/catch.hpp>

#include <exception>
#include <string>
#include <thread>
#include <vector>

#include <kvpolicy/kvpolicy.hpp>

#include "common/all_gather_group.hpp"
#include "common/head_shard_data.hpp"
#include "common/random_kv.hpp"

namespace kvt_core_head_shard {

using namespace kvpolicy;
using Catch::Contains;

namespace {

constexpr std::int64_t kL = 3, kH = 3, kG = 3, kT = 150, kD = 8, kQ = 16;

// One event's data for every head (tests/common/head_shard_data.hpp).
struct Model : kvtest::HeadShardData {
  Model(std::uint64_t seed, bool ties) : HeadShardData(seed, ties, kL, kH, kG, kT, kD, kQ) {}
};

// The inputs of heads [h0, h0 + n): views into the model's tensors, copies of its state.
struct Share {
  Inputs<float> in;
  std::vector<float> acc, recon;

  Share(const Model& m, std::int64_t h0, std::int64_t n) {
    auto slice = [](KVView<const float> v, std::int64_t first, std::int64_t count) {
      v.data += first * v.stride_head;
      v.heads = count;
      return v;
    };
    in.keys = slice(m.k.view(), h0, n);
    in.values = slice(m.v.view(), h0, n);
    in.queries = slice(m.q.view(), h0 * kG, n * kG);
    for (std::int64_t l = 0; l < kL; ++l)
      for (std::int64_t h = h0; h < h0 + n; ++h)
        for (std::int64_t j = 0; j < kT; ++j) {
          const auto at = static_cast<std::size_t>((l * kH + h) * kT + j);
          acc.push_back(m.acc[at]);
          recon.push_back(m.recon[at]);
        }
    in.accumulated = acc.data();
    in.reconstruction = recon.data();
  }
};

struct RankResult {
  Selection sel;
  ScoreMap scores;
  std::string error;
  std::int64_t calls = 0;
};

// Runs `p` on ranks holding `split` heads each, one thread per rank. `tweak(rank, shard, in)`
// may spoil a rank's arguments for the error tests.
template <class Tweak>
std::vector<RankResult> run_ranks(const Policy& p, const Model& m, const Budget& budget,
                                  const std::vector<std::int64_t>& split, Tweak&& tweak) {
  const int R = static_cast<int>(split.size());
  kvtest::Group group(R);
  std::vector<kvtest::Group::Member> members(static_cast<std::size_t>(R));
  std::vector<RankResult> out(static_cast<std::size_t>(R));
  std::vector<std::thread> threads;
  std::int64_t h0 = 0;
  for (int r = 0; r < R; ++r) {
    const std::int64_t n = split[static_cast<std::size_t>(r)];
    threads.emplace_back([&, r, h0, n] {
      auto& res = out[static_cast<std::size_t>(r)];
      auto& mem = members[static_cast<std::size_t>(r)];
      mem.group = &group;
      mem.rank = r;
      Share share(m, h0, n);
      HeadShard shard;
      shard.rank = r;
      shard.ranks = R;
      shard.first_head = h0;
      shard.model_heads = kH;
      shard.all_gather = &kvtest::Group::all_gather;
      shard.user = &mem;
      tweak(r, shard, share.in);
      EventInfo ev;
      ev.shard = &shard;
      try {
        res.sel = p.select(cpu_backend{1}, share.in, budget, ev, &res.scores);
      } catch (const std::exception& e) {
        res.error = e.what();
      }
      res.calls = mem.calls;
    });
    h0 += n;
  }
  for (auto& t : threads) t.join();
  return out;
}
std::vector<RankResult> run_ranks(const Policy& p, const Model& m, const Budget& budget,
                                  const std::vector<std::int64_t>& split) {
  return run_ranks(p, m, budget, split, [](int, HeadShard&, Inputs<float>&) {});
}

// Every rank's kept sets and scores equal the single-rank run's rows of its heads.
void require_same_as_one_rank(const std::string& spec, const Model& m, const Budget& budget) {
  const Policy p(spec);
  Share all(m, 0, kH);
  ScoreMap ref_scores;
  const Selection ref = p.select(cpu_backend{1}, all.in, budget, EventInfo{}, &ref_scores);
  for (const auto& split : std::vector<std::vector<std::int64_t>>{{3}, {2, 1}, {1, 2}, {1, 1, 1}}) {
    INFO(spec << ", ranks holding " << split.size() << " shares, first " << split[0] << " heads");
    const auto res = run_ranks(p, m, budget, split);
    std::int64_t h0 = 0;
    for (std::size_t r = 0; r < res.size(); ++r) {
      INFO("rank " << r);
      REQUIRE(res[r].error.empty());
      const std::int64_t n = split[r];
      REQUIRE(res[r].sel.heads() == n);
      for (std::int64_t l = 0; l < kL; ++l)
        for (std::int64_t h = 0; h < n; ++h) {
          INFO("layer " << l << ", model head " << h0 + h);
          const auto got = res[r].sel.kept(l, h), want = ref.kept(l, h0 + h);
          REQUIRE(std::vector<std::int32_t>(got.begin(), got.end()) ==
                  std::vector<std::int32_t>(want.begin(), want.end()));
          const std::span<const float> gs = res[r].scores.row(l, h), ws = ref_scores.row(l, h0 + h);
          REQUIRE(std::vector<float>(gs.begin(), gs.end()) == std::vector<float>(ws.begin(), ws.end()));
        }
      // Chains that combine no heads exchange nothing; the others do once they are sharded.
      if (split.size() == 1 || !p.spans_heads()) REQUIRE(res[r].calls == 0);
      else REQUIRE(res[r].calls > 0);
      h0 += n;
    }
  }
}

// Every registered scorer (registry.hpp), so that a new one is tested here without an edit; the
// ones whose defaults do not fit the small model get parameters.
std::vector<std::string> scorer_specs() {
  std::vector<std::string> out;
  auto spec = [](std::string_view name) -> std::string {
    if (name == "snapkv") return "snapkv(window=8)";
    if (name == "expected") return "expected(window=8,theta=10000)";
    return std::string(name);
  };
  std::apply([&](auto... s) { (out.push_back(spec(decltype(s)::name)), ...); }, scorer_types{});
  return out;
}
const std::vector<std::string> kScorers = scorer_specs();
const char* const kChains[] = {"",
                               " | pyramid(beta=2)",
                               " | depthkv(weights=0.2:1:3)",
                               " | adakv",
                               " | adakv(alpha=0)",
                               " | ams(window=8,min_seg_len=4)",
                               " | pyramid(beta=2) | adakv(alpha=0.1)",
                               " | depthkv(weights=0.2:1:3) | adakv | ams(window=8,min_seg_len=4)",
                               " | adakv(alpha=0.5) | ams(window=8,min_seg_len=4,min_keep=2)"};

}  // namespace

TEST_CASE("head shard: every scorer x allocator chain keeps on 1, 2 and 3 ranks what one rank "
          "keeps", "[core][head_shard]") {
  const bool ties = GENERATE(false, true);
  const Model m(ties ? 77 : 76, ties);
  for (const std::string& s : kScorers)
    for (const char* c : kChains) {
      const std::string spec = s + c;
      require_same_as_one_rank(spec, m, Budget::ratio(0.3));
      // A total budget that does not divide over the 9 rows: the remainder goes to the model's
      // first rows whichever rank holds them.
      require_same_as_one_rank(spec, m, Budget::total(9 * 61 + 5));
    }
}

TEST_CASE("head shard: a budget that keeps everything on one rank and evicts on another",
          "[core][head_shard]") {
  const Model m(78, false);
  // 8 of the 9 rows keep every token; the last row (layer 2, head 2: rank 1's in a 2+1 split)
  // evicts one. Rank 0 must still take part in adakv's exchange.
  require_same_as_one_rank("snapkv(window=8) | adakv", m, Budget::total(9 * kT - 1));
  require_same_as_one_rank("tova", m, Budget::total(9 * kT - 1));
  require_same_as_one_rank("snapkv(window=8) | adakv", m, Budget::ratio(1.0));
  // 70 tokens over 9 rows: rows 0-6 keep 8, rows 7 and 8 keep 7, below snapkv's 8-token window,
  // so every row keeps only the newest 7 of it, also on a rank whose own rows all keep 8.
  require_same_as_one_rank("snapkv(window=8)", m, Budget::total(70));
  require_same_as_one_rank("snapkv(window=8) | adakv", m, Budget::total(70));
}

TEST_CASE("head shard: an error on one rank is raised on every rank", "[core][head_shard]") {
  const Model m(79, false);
  const Policy p("tova | adakv");
  SECTION("a rank's inputs fail their checks") {
    const auto res = run_ranks(p, m, Budget::ratio(0.3), {2, 1}, [](int r, HeadShard&, Inputs<float>& in) {
      if (r == 1) in.queries = {};  // tova reads the last query
    });
    REQUIRE_THAT(res[1].error, Contains("queries: this policy needs the last 1 queries"));
    REQUIRE_THAT(res[0].error, Contains("head shard: rank 1 failed its checks: queries"));
  }
  SECTION("a scorer's own check fails on one rank, after the first agreement") {
    const Policy snap("snapkv(window=8) | adakv");
    const auto res = run_ranks(snap, m, Budget::ratio(0.3), {1, 1, 1}, [](int r, HeadShard&, Inputs<float>& in) {
      if (r == 1) {  // the newest 4 queries only: enough for the first checks, not for snapkv
        in.queries.data += (in.queries.tokens - 4) * in.queries.stride_token;
        in.queries.tokens = 4;
      }
    });
    REQUIRE_THAT(res[1].error, Contains("snapkv: needs the last 8 queries, got 4"));
    REQUIRE_THAT(res[0].error, Contains("head shard: rank 1 failed its checks: snapkv: needs"));
    REQUIRE_THAT(res[2].error, Contains("head shard: rank 1 failed its checks: snapkv: needs"));
  }
  SECTION("ranks with different layer counts") {
    const auto res = run_ranks(p, m, Budget::ratio(0.3), {2, 1}, [](int r, HeadShard&, Inputs<float>& in) {
      if (r == 0) in.keys.layers = in.values.layers = in.queries.layers = 2;
    });
    REQUIRE_THAT(res[0].error, Contains("head shard: rank 1 has 3 layers, rank 0 has 2"));
    REQUIRE_THAT(res[1].error, Contains("head shard: rank 0 has 2 layers, rank 1 has 3"));
  }
  SECTION("head ranges that overlap") {
    const auto res = run_ranks(p, m, Budget::ratio(0.3), {1, 1, 1}, [](int r, HeadShard& s, Inputs<float>&) {
      if (r == 2) s.first_head = 1;
    });
    for (const auto& x : res)
      REQUIRE_THAT(x.error, Contains("rank 2 holds heads from 1 but the ranks before it end at 2"));
  }
  SECTION("head counts that do not add up to model_heads") {
    const auto res = run_ranks(p, m, Budget::ratio(0.3), {1, 1}, [](int, HeadShard&, Inputs<float>&) {});
    for (const auto& x : res) REQUIRE_THAT(x.error, Contains("the ranks hold 2 KV heads, model_heads is 3"));
  }
  SECTION("ranks with different token counts") {
    const auto res = run_ranks(p, m, Budget::ratio(0.3), {2, 1}, [](int r, HeadShard&, Inputs<float>& in) {
      if (r == 0) in.keys.tokens = in.values.tokens = kT - 1;
    });
    for (const auto& x : res) REQUIRE_THAT(x.error, Contains("tokens"));
    REQUIRE_THAT(res[1].error, Contains("rank 0 has 149 tokens, rank 1 has 150"));
  }
  SECTION("no all_gather for a chain that combines heads") {
    const auto res = run_ranks(p, m, Budget::ratio(0.3), {2, 1}, [](int, HeadShard& s, Inputs<float>&) {
      s.all_gather = nullptr;
    });
    for (const auto& x : res) REQUIRE_THAT(x.error, Contains("needs HeadShard::all_gather"));
  }
  SECTION("the engine's all_gather fails") {
    const auto res = run_ranks(p, m, Budget::ratio(0.3), {2, 1}, [](int, HeadShard& s, Inputs<float>&) {
      s.all_gather = [](void*, const void*, void*, std::size_t) { return 7; };
    });
    for (const auto& x : res) REQUIRE_THAT(x.error, Contains("all_gather failed on rank"));
    REQUIRE_THAT(res[0].error, Contains("(returned 7)"));
  }
  SECTION("a shard that does not fit the model") {
    const auto res = run_ranks(p, m, Budget::ratio(0.3), {2, 1}, [](int, HeadShard& s, Inputs<float>&) {
      s.model_heads = 2;
    });
    REQUIRE_THAT(res[1].error, Contains("heads [2, 3) of rank 1 do not fit the model's 2 KV heads"));
  }
}

TEST_CASE("head shard: chains that combine no heads need no all_gather", "[core][head_shard]") {
  const Model m(80, false);
  for (const char* spec : {"snapkv(window=8) | pyramid(beta=2) | ams(window=8,min_seg_len=4)", "knorm", "int4"}) {
    const Policy p(spec);
    REQUIRE_FALSE(p.spans_heads());
    const Budget b = p.keeps_all() ? Budget::ratio(1.0) : Budget::ratio(0.3);
    Share all(m, 0, kH);
    const Selection ref = p.select(cpu_backend{1}, all.in, b, EventInfo{});
    const auto res = run_ranks(p, m, b, {2, 1}, [](int, HeadShard& s, Inputs<float>&) { s.all_gather = nullptr; });
    for (std::size_t r = 0; r < 2; ++r) {
      REQUIRE(res[r].error.empty());
      for (std::int64_t l = 0; l < kL; ++l)
        for (std::int64_t h = 0; h < res[r].sel.heads(); ++h) {
          const auto got = res[r].sel.kept(l, h), want = ref.kept(l, (r == 0 ? 0 : 2) + h);
          REQUIRE(std::vector<std::int32_t>(got.begin(), got.end()) ==
                  std::vector<std::int32_t>(want.begin(), want.end()));
        }
    }
  }
  // One rank holds every head: a one-rank shard of a part of the heads is a mistake.
  Share part(m, 0, 2);
  HeadShard one;
  one.model_heads = kH;
  EventInfo ev;
  ev.shard = &one;
  REQUIRE_THROWS_WITH(Policy("knorm").select(cpu_backend{1}, part.in, Budget::ratio(0.3), ev),
                      Contains("a single rank holds every KV head (first_head 0, model_heads 0 or "
                               "2), got first_head 0 and model_heads 3"));
  one.model_heads = 1 << 20;
  one.ranks = 2;
  REQUIRE_THROWS_WITH(Policy("knorm").select(cpu_backend{1}, part.in, Budget::ratio(0.3), ev),
                      Contains("must be at most 65536"));
  REQUIRE(Policy("knorm | adakv").spans_heads());
  REQUIRE(Policy("tova").spans_heads());
  REQUIRE(Policy("expected").spans_heads());
  REQUIRE_FALSE(Policy("kvzip | depthkv(weights=1:2:3) | ams").spans_heads());
}

}  // namespace kvt_core_head_shard
