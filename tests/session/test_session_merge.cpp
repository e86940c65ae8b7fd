// Session with a merger stage: spec parsing and ordering, proportional attention after merging
// (exact for identical tokens), counts conserved across decode-time events, the delimiter mask
// compacted with the cache.
#include <catch2/catch.hpp>

#include <cmath>
#include <numeric>
#include <vector>

#include <kvpolicy/kvpolicy.hpp>

#include "session/layer_tokens.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_session_session_merge {

using kvpolicy::Budget;
using kvpolicy::KVView;
using kvpolicy::Policy;
using kvpolicy::Session;
using kvpolicy::SessionConfig;
using Catch::Matchers::Contains;

namespace {

constexpr std::int64_t kHkv = 2, kG = 2, kHq = kHkv * kG, kD = 8;

SessionConfig merge_config(Budget b) { return kvtest::one_layer_config(kHkv, kHq, kD, b, 1); }

using Tokens = kvtest::LayerTokens<kHkv, kHq, kD>;
Tokens random_tokens(std::int64_t S, std::uint64_t seed) { return Tokens(S, seed); }

double count_sum(const Session<float>& s, std::int64_t h) {
  double n = 0;
  for (float lc : s.log_counts(0, h)) n += std::nearbyint(std::exp(static_cast<double>(lc)));
  return n;
}

}  // namespace

TEST_CASE("Policy spec: merger and quantizer stages, in order", "[session][merge]") {
  const Policy p("snapkv | ams | semantic(tau=0.8)");
  REQUIRE(p.merger().has_value());
  CHECK(std::holds_alternative<kvpolicy::Semantic>(*p.merger()));
  CHECK(p.allocators().size() == 1);
  CHECK(p.spec() == "snapkv | ams | semantic(tau=0.8)");
  CHECK_FALSE(Policy("snapkv").merger().has_value());
  CHECK(std::holds_alternative<kvpolicy::Nearest>(*Policy("h2o | nearest").merger()));
  const Policy q("snapkv | adakv | int2(residual=64)");
  REQUIRE(q.quant_config().has_value());
  CHECK(q.quant_config()->bits == 2);
  CHECK(q.quant_config()->residual == 64);
  CHECK(Policy("snapkv | semantic | kivi").quant_config()->rotate == false);
  // Order and multiplicity.
  CHECK_THROWS_WITH(Policy("snapkv | semantic | adakv"), Contains("comes after the merger"));
  CHECK_THROWS_WITH(Policy("snapkv | semantic | nearest"), Contains("at most one"));
  CHECK_THROWS_WITH(Policy("snapkv | int2 | semantic"), Contains("comes after the quantizer"));
  CHECK_THROWS_WITH(Policy("snapkv | int2 | int4"), Contains("at most one"));
  CHECK_THROWS_WITH(Policy("snapkv | merge"), Contains("mergers: semantic, nearest"));
  CHECK_THROWS_WITH(Policy("snapkv | semantic(tau=2)"), Contains("tau must be in [-1, 1]"));
  CHECK_THROWS_WITH(Policy("snapkv | semantic(tua=0.5)"), Contains("tua"));
  // The delimiter set an engine builds its mask from.
  CHECK(Policy("snapkv").delimiter_set() == ".,;:!?\n");
  CHECK(Policy("snapkv | semantic(delimiters=.\\n)").delimiter_set() == ".\n");
  CHECK(Policy("snapkv | semantic(delimiters=.)").is_delimiter("end."));
  CHECK_FALSE(Policy("snapkv | semantic(delimiters=.)").is_delimiter("a,b"));
  // The quantizer's format is checked against the session's head_dim up front.
  CHECK_THROWS_WITH(Session<float>(Policy("snapkv | int2"), merge_config(Budget::ratio(0.5))),
                    Contains("group 32 does not divide head_dim 8"));
}

TEST_CASE("Session merge: n identical tokens in one core attend exactly like the full cache",
          "[session][merge]") {
  // Every token outside snapkv's protected window is one and the same (K, V) per head, so
  // whatever the selection keeps, one kept copy absorbs every evicted copy (tau=1, one chunk)
  // and proportional attention (+log n) reproduces the full cache's output.
  for (const char* merger : {"semantic(tau=1,chunk=1000)", "nearest"})
    for (std::int64_t S : {12, 29, 64}) {
      CAPTURE(merger, S);
      Tokens t = random_tokens(S + 1, 7 + static_cast<std::uint64_t>(S));
      constexpr std::int64_t W = 4;
      for (std::int64_t h = 0; h < kHkv; ++h)
        for (std::int64_t j = 1; j < S - W; ++j)
          for (std::int64_t i = 0; i < kD; ++i) {
            t.k[(h * t.S + j) * kD + i] = t.k[(h * t.S) * kD + i];
            t.v[(h * t.S + j) * kD + i] = t.v[(h * t.S) * kD + i];
          }
      Session<float> full(Policy("streaming"), merge_config(Budget::ratio(1.0)));
      Session<float> merged(Policy(std::string("snapkv(window=4) | ") + merger),
                            merge_config(Budget::tokens(W + 2)));
      for (auto* s : {&full, &merged}) {
        s->append(0, t.K(0, S), t.V(0, S), t.Q(0, S));
        s->compress_if_due(0);
      }
      REQUIRE(merged.length(0, 0) == W + 2);
      for (std::int64_t h = 0; h < kHkv; ++h) CHECK(count_sum(merged, h) == S);
      // One more token, then the attention of its query over each cache.
      for (auto* s : {&full, &merged}) s->append(0, t.K(S, 1), t.V(S, 1), t.Q(S, 1));
      std::vector<float> a(kHq * kD), b(kHq * kD);
      full.attend(0, t.Q(S, 1), a.data());
      merged.attend(0, t.Q(S, 1), b.data());
      for (std::size_t i = 0; i < a.size(); ++i) CHECK(b[i] == Approx(a[i]).margin(1e-5));
      // Without the bias the copies would weigh 1 instead of n: the outputs must differ.
      Session<float> evict_only(Policy("snapkv(window=4)"), merge_config(Budget::tokens(W + 2)));
      evict_only.append(0, t.K(0, S), t.V(0, S), t.Q(0, S));
      evict_only.compress_if_due(0);
      evict_only.append(0, t.K(S, 1), t.V(S, 1), t.Q(S, 1));
      std::vector<float> c(kHq * kD);
      evict_only.attend(0, t.Q(S, 1), c.data());
      double diff = 0;
      for (std::size_t i = 0; i < a.size(); ++i) diff = std::max(diff, std::fabs(double(c[i]) - a[i]));
      CHECK(diff > 1e-3);
    }
}

TEST_CASE("Session merge: counts add up over decode-time events (tau=-1, one chunk)",
          "[session][merge]") {
  // tau=-1: every evicted token joins the best kept seed of its chunk, so with one chunk per row
  // nothing is lost and the counts of the kept rows sum to every token appended so far.
  const std::int64_t S = 40, steps = 37;
  const Tokens t = random_tokens(S + steps, 11);
  SessionConfig cfg = merge_config(Budget::tokens(16));
  cfg.decode_interval = 5;
  Session<float> s(Policy("snapkv(window=4) | semantic(tau=-1,chunk=100000)"), cfg);
  s.append(0, t.K(0, S), t.V(0, S), t.Q(0, S));
  REQUIRE(s.compress_if_due(0));
  int events = 1;
  for (std::int64_t i = 0; i < steps; ++i) {
    s.append(0, t.K(S + i, 1), t.V(S + i, 1), t.Q(S + i, 1));
    events += s.compress_if_due(0) ? 1 : 0;
    for (std::int64_t h = 0; h < kHkv; ++h) {
      CHECK(count_sum(s, h) == S + i + 1);
      CHECK(s.length(0, h) <= 16 + 4);
    }
  }
  CHECK(events == 1 + steps / 5);
}

TEST_CASE("Session merge: the delimiter mask is compacted with the cache", "[session][merge]") {
  // Delimiters at every 7th token: after the event each kept row's flag says whether it is the
  // last kept row of its chunk (what semantic writes back, so the next event keeps the chunks).
  const std::int64_t S = 50;
  const Tokens t = random_tokens(S, 13);
  std::vector<std::uint8_t> delim(S, 0);
  for (std::int64_t j = 6; j < S; j += 7) delim[static_cast<std::size_t>(j)] = 1;
  Session<float> s(Policy("snapkv(window=4) | semantic(tau=0.2,chunk=0)"),
                   merge_config(Budget::ratio(0.4)));
  s.append(0, t.K(0, S), t.V(0, S), t.Q(0, S), delim);
  for (std::int64_t h = 0; h < kHkv; ++h)
    CHECK(std::vector<std::uint8_t>(s.delimiters(0, h).begin(), s.delimiters(0, h).end()) ==
          delim);
  s.compress_if_due(0);
  for (std::int64_t h = 0; h < kHkv; ++h) {
    const auto pos = s.positions(0, h);
    const auto flags = s.delimiters(0, h);
    REQUIRE(flags.size() == pos.size());
    for (std::size_t i = 0; i < pos.size(); ++i) {
      const bool last_of_chunk = i + 1 == pos.size() || pos[i] / 7 != pos[i + 1] / 7;
      CAPTURE(h, i, pos[i]);
      CHECK((flags[i] != 0) == last_of_chunk);
    }
    CHECK(count_sum(s, h) >= static_cast<double>(pos.size()));
    CHECK(count_sum(s, h) <= static_cast<double>(S));
  }
  CHECK_THROWS_WITH(s.append(0, t.K(0, 2), t.V(0, 2), t.Q(0, 2), std::vector<std::uint8_t>(3)),
                    Contains("3 delimiter flags for 2 tokens"));
}

}  // namespace kvt_session_session_merge
