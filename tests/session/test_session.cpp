// Session: append / attend / compress_if_due, ragged storage, positions, H2O state compaction
// and decode-time eviction, attention over the cache, and argument errors.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <kvpolicy/kvpolicy.hpp>

#include "common/error_of.hpp"
#include "common/random.hpp"
#include "ops/naive.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_session_session {

using kvpolicy::Budget;
using kvpolicy::KVView;
using kvpolicy::Session;
using kvpolicy::SessionConfig;
using Catch::Matchers::Contains;

namespace {

constexpr std::int64_t kLayers = 2, kHkv = 2, kG = 3, kHq = kHkv * kG, kD = 8;

// A whole sequence of S tokens per layer: k, v [Hkv][S][d], q [Hq][S][d] (HND).
template <class T>
struct Sequence {
  std::int64_t S;
  std::vector<std::vector<T>> k, v, q;  // per layer
  Sequence(std::int64_t s, std::uint64_t seed) : S(s) {
    kvtest::Rng rng(seed);
    for (std::int64_t l = 0; l < kLayers; ++l) {
      k.push_back(rng.normals<T>(kHkv * S * kD));
      v.push_back(rng.normals<T>(kHkv * S * kD));
      q.push_back(rng.normals<T>(kHq * S * kD));
    }
  }
  // Tokens [t0, t0 + n) as a [1][heads][n][d] view.
  static KVView<const T> slice(const std::vector<T>& b, std::int64_t heads, std::int64_t S,
                               std::int64_t t0, std::int64_t n) {
    return {b.data() + t0 * kD, 1, heads, n, kD, heads * S * kD, S * kD, kD, 1};
  }
  KVView<const T> K(std::int64_t l, std::int64_t t0, std::int64_t n) const { return slice(k[l], kHkv, S, t0, n); }
  KVView<const T> V(std::int64_t l, std::int64_t t0, std::int64_t n) const { return slice(v[l], kHkv, S, t0, n); }
  KVView<const T> Q(std::int64_t l, std::int64_t t0, std::int64_t n) const { return slice(q[l], kHq, S, t0, n); }
};

SessionConfig config(Budget b, std::int64_t initial_capacity = 8) {
  SessionConfig c;
  c.layers = kLayers;
  c.kv_heads = kHkv;
  c.q_heads = kHq;
  c.head_dim = kD;
  c.budget = b;
  c.initial_capacity = initial_capacity;
  c.backend = kvpolicy::cpu_backend{1};  // thread counts are covered by tests/ops
  return c;
}

using kvtest::error_of;

// Every stored row of (layer, head) is bit-identical to the original token at positions[i].
template <class T>
void require_rows_are_originals(const Session<T>& s, const Sequence<T>& seq, std::int64_t l) {
  for (std::int64_t h = 0; h < kHkv; ++h) {
    auto pos = s.positions(l, h);
    REQUIRE(static_cast<std::int64_t>(pos.size()) == s.length(l, h));
    REQUIRE(std::is_sorted(pos.begin(), pos.end()));
    REQUIRE(std::adjacent_find(pos.begin(), pos.end()) == pos.end());
    for (std::size_t i = 0; i < pos.size(); ++i) {
      REQUIRE(pos[i] >= 0);
      REQUIRE(pos[i] < seq.S);
      for (std::int64_t e = 0; e < kD; ++e) {
        REQUIRE(kvpolicy::to_float(s.keys(l).at(0, h, static_cast<std::int64_t>(i), e)) ==
                kvpolicy::to_float(seq.K(l, pos[i], 1).at(0, h, 0, e)));
        REQUIRE(kvpolicy::to_float(s.values(l).at(0, h, static_cast<std::int64_t>(i), e)) ==
                kvpolicy::to_float(seq.V(l, pos[i], 1).at(0, h, 0, e)));
      }
    }
  }
}

// Gathers the original rows at each head's positions into a ragged [1][Hkv][cap][d] cache.
template <class T>
struct Gathered {
  std::int64_t cap = 0;
  std::vector<T> k, v;
  std::vector<std::int64_t> lengths;
  std::vector<std::vector<std::int32_t>> pos;
  Gathered(const Session<T>& s, const Sequence<T>& seq, std::int64_t l) {
    for (std::int64_t h = 0; h < kHkv; ++h) {
      auto p = s.positions(l, h);
      pos.emplace_back(p.begin(), p.end());
      lengths.push_back(static_cast<std::int64_t>(p.size()));
      cap = std::max<std::int64_t>(cap, static_cast<std::int64_t>(p.size()));
    }
    k.resize(static_cast<std::size_t>(kHkv * cap * kD));
    v.resize(k.size());
    for (std::int64_t h = 0; h < kHkv; ++h)
      for (std::size_t i = 0; i < pos[static_cast<std::size_t>(h)].size(); ++i)
        for (std::int64_t e = 0; e < kD; ++e) {
          const auto t = pos[static_cast<std::size_t>(h)][i];
          k[static_cast<std::size_t>((h * cap + static_cast<std::int64_t>(i)) * kD + e)] = seq.K(l, t, 1).at(0, h, 0, e);
          v[static_cast<std::size_t>((h * cap + static_cast<std::int64_t>(i)) * kD + e)] = seq.V(l, t, 1).at(0, h, 0, e);
        }
  }
  KVView<const T> K() const { return KVView<const T>::hnd(k.data(), 1, kHkv, cap, kD); }
  KVView<const T> V() const { return KVView<const T>::hnd(v.data(), 1, kHkv, cap, kD); }
};

// Expected kept positions of an H2O eviction: sinks, the newest `recent`, and the best others
// by (accumulated desc, position desc), from the pre-compression state.
std::vector<std::int32_t> h2o_expected(const std::vector<std::int32_t>& pos,
                                       const std::vector<float>& acc, std::int64_t budget,
                                       kvpolicy::Protect p) {
  const auto T = static_cast<std::int64_t>(pos.size());
  if (budget >= T) return pos;
  std::vector<std::int32_t> kept;
  std::vector<std::int64_t> others;
  for (std::int64_t i = 0; i < T; ++i) {
    if (i < p.sinks || i >= T - p.recent) kept.push_back(pos[static_cast<std::size_t>(i)]);
    else others.push_back(i);
  }
  std::sort(others.begin(), others.end(), [&](std::int64_t a, std::int64_t b) {
    const float x = acc[static_cast<std::size_t>(a)], y = acc[static_cast<std::size_t>(b)];
    return x != y ? x > y : a > b;
  });
  const std::int64_t m = budget - static_cast<std::int64_t>(kept.size());
  for (std::int64_t i = 0; i < m; ++i)
    kept.push_back(pos[static_cast<std::size_t>(others[static_cast<std::size_t>(i)])]);
  std::sort(kept.begin(), kept.end());
  return kept;
}

}  // namespace

TEMPLATE_TEST_CASE("Session prefill compression: per-head budgets, positions, original rows",
                   "[session]", float, kvpolicy::half) {
  using T = TestType;
  const std::string spec = GENERATE(as<std::string>{}, "snapkv(window=4,kernel=3)", "streaming(sinks=2)",
                                    "h2o", "knorm", "tova", "snapkv(window=4) | uniform");
  INFO(spec);
  const std::int64_t P = 40, B = 12;
  Sequence<T> seq(P, 99);
  Session<T> s(kvpolicy::Policy(spec), config(GENERATE(Budget::tokens(12), Budget::ratio(0.3))));
  std::vector<float> out(static_cast<std::size_t>(kHq * P * kD));
  for (std::int64_t l = 0; l < kLayers; ++l) {
    CHECK(s.budgets(l).empty());
    s.append(l, seq.K(l, 0, P), seq.V(l, 0, P), seq.Q(l, 0, P));
    for (std::int64_t h = 0; h < kHkv; ++h) CHECK(s.length(l, h) == P);
    require_rows_are_originals(s, seq, l);  // before compression: every token, in order
    s.attend(l, seq.Q(l, 0, P), out.data());
    REQUIRE(s.compress_if_due(l));
    for (std::int64_t h = 0; h < kHkv; ++h) {
      CHECK(s.length(l, h) == B);
      CHECK(s.lengths(l)[static_cast<std::size_t>(h)] == B);
      CHECK(s.budgets(l)[static_cast<std::size_t>(h)] == B);
    }
    require_rows_are_originals(s, seq, l);
    CHECK_FALSE(s.compress_if_due(l));  // at the budget: nothing is due
    for (std::int64_t h = 0; h < kHkv; ++h) {
      auto pos = s.positions(l, h);
      if (spec.rfind("snapkv", 0) == 0) CHECK(pos.back() == P - 1);
      if (spec.rfind("snapkv", 0) == 0) CHECK(pos[B - 4] == P - 4);
      if (spec == "streaming(sinks=2)")
        CHECK(std::vector<std::int32_t>(pos.begin(), pos.end()) ==
              std::vector<std::int32_t>{0, 1, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39});
      if (spec == "h2o") CHECK(pos[B - 6] == P - 6);  // recent = half the budget
      if (spec == "tova") CHECK(pos.back() == P - 1);
    }
    // Non-H2O policies: the session's selection equals the policy's on the full prefill
    // (the session kept the right queries and keys).
    if (spec != "h2o") {
      kvpolicy::Inputs<T> in;
      in.keys = seq.K(l, 0, P);
      in.values = seq.V(l, 0, P);
      in.queries = seq.Q(l, 0, P);
      const auto sel = s.policy().select(kvpolicy::cpu_backend{1}, in, Budget::tokens(B));
      for (std::int64_t h = 0; h < kHkv; ++h) {
        auto pos = s.positions(l, h);
        auto k = sel.kept(0, h);
        CHECK(std::vector<std::int32_t>(pos.begin(), pos.end()) == std::vector<std::int32_t>(k.begin(), k.end()));
      }
    }
  }
  CHECK(s.kv_bytes() == static_cast<std::size_t>(kLayers * kHkv * B * kD * 2) * sizeof(T));
}

TEST_CASE("Session: compress_if_due before the prefill fixes nothing", "[session]") {
  const std::int64_t P = 20;
  Sequence<float> seq(P, 8);
  Session<float> s(kvpolicy::Policy("h2o"), config(Budget::ratio(0.5)));
  CHECK_FALSE(s.compress_if_due(0));  // an engine may call it every step, even before tokens
  CHECK(s.budgets(0).empty());
  CHECK(s.compress(1).total() == 0);
  CHECK(s.budgets(1).empty());
  std::vector<float> out(static_cast<std::size_t>(kHq * P * kD));
  for (std::int64_t l = 0; l < kLayers; ++l) {
    s.append(l, seq.K(l, 0, P), seq.V(l, 0, P));
    s.attend(l, seq.Q(l, 0, P), out.data());
    REQUIRE(s.compress_if_due(l));
    CHECK(s.length(l, 0) == 10);  // half of the prefill, not half of nothing
    CHECK(s.length(l, 1) == 10);
  }
}

TEST_CASE("Session keeps the newest queries across chunked appends (snapkv)", "[session]") {
  const std::int64_t P = 40, B = 12;
  Sequence<float> seq(P, 7);
  const std::vector<std::vector<std::int64_t>> chunkings = {{37, 1, 2}, {1, 1, 1, 1, 1, 35}, {20, 20}, {38, 2}};
  for (const auto& chunks : chunkings) {
    Session<float> s(kvpolicy::Policy("snapkv(window=4,kernel=3)"), config(Budget::tokens(B), 4));
    std::int64_t t = 0;
    std::vector<float> out(static_cast<std::size_t>(kHq * P * kD));
    for (std::int64_t n : chunks) {
      s.append(0, seq.K(0, t, n), seq.V(0, t, n), seq.Q(0, t, n));
      s.attend(0, seq.Q(0, t, n), out.data());
      t += n;
    }
    REQUIRE(t == P);
    REQUIRE(s.compress_if_due(0));
    kvpolicy::Inputs<float> in;
    in.keys = seq.K(0, 0, P);
    in.queries = seq.Q(0, P - 4, 4);
    const auto sel = s.policy().select(kvpolicy::cpu_backend{1}, in, Budget::tokens(B));
    for (std::int64_t h = 0; h < kHkv; ++h) {
      auto pos = s.positions(0, h);
      auto k = sel.kept(0, h);
      CHECK(std::vector<std::int32_t>(pos.begin(), pos.end()) == std::vector<std::int32_t>(k.begin(), k.end()));
    }
    // Layer 1 was never touched.
    CHECK(s.length(1, 0) == 0);
  }
}

TEMPLATE_TEST_CASE("Session attend equals attention over the (ragged) cache", "[session]", float,
                   kvpolicy::half) {
  using T = TestType;
  const std::int64_t P = 30, steps = 4;
  Sequence<T> seq(P + steps, 5);
  // total = 2 * 9 + 1: KV head 0 keeps 10 tokens, head 1 keeps 9.
  Session<T> s(kvpolicy::Policy("snapkv(window=4,kernel=3)"), config(Budget::total(19)));
  const std::int64_t l = 1;
  std::vector<float> out(static_cast<std::size_t>(kHq * P * kD));
  s.append(l, seq.K(l, 0, P), seq.V(l, 0, P), seq.Q(l, 0, P));
  s.attend(l, seq.Q(l, 0, P), out.data());
  {
    const std::vector<std::int64_t> full(kHkv, P);
    const auto ref = kvtest::naive_attention(seq.K(l, 0, P), seq.V(l, 0, P), seq.Q(l, 0, P), full, true);
    CHECK(kvtest::max_rel_err(out, ref) < 2e-6);
  }
  REQUIRE(s.compress_if_due(l));
  CHECK(s.length(l, 0) == 10);
  CHECK(s.length(l, 1) == 9);
  for (std::int64_t step = 0; step < steps; ++step) {
    const std::int64_t p = P + step;
    s.append(l, seq.K(l, p, 1), seq.V(l, p, 1), seq.Q(l, p, 1));
    std::vector<float> got(static_cast<std::size_t>(kHq * kD), -1.f), lib(got.size(), -2.f);
    s.attend(l, seq.Q(l, p, 1), got.data());
    // Same op over the session's own views and lengths: bit-identical.
    kvpolicy::cpu::RaggedAttentionArgs args;
    args.lengths = s.lengths(l).data();
    args.causal = true;
    kvpolicy::cpu::attention(kvpolicy::cpu_backend{1}, s.keys(l), s.values(l), seq.Q(l, p, 1), args, lib.data());
    CHECK(std::memcmp(got.data(), lib.data(), got.size() * sizeof(float)) == 0);
    // Naive reference over the original tokens at the kept positions.
    const Gathered<T> g(s, seq, l);
    CHECK(g.pos[0].back() == p);
    const auto ref = kvtest::naive_attention(g.K(), g.V(), seq.Q(l, p, 1), g.lengths, true);
    CHECK(kvtest::max_rel_err(got, ref) < 2e-6);
    CHECK_FALSE(s.compress_if_due(l));  // snapkv compresses at prefill only
    CHECK(s.length(l, 0) == 10 + step + 1);
    CHECK(s.length(l, 1) == 9 + step + 1);
    require_rows_are_originals(s, seq, l);
  }
}

TEMPLATE_TEST_CASE("Session H2O: state follows its tokens, decode eviction keeps the budget",
                   "[session]", float, kvpolicy::half) {
  using T = TestType;
  const std::string spec = GENERATE(as<std::string>{}, "h2o", "h2o(recent_tokens=3,sinks=2)", "h2o(reduce=sum)");
  INFO(spec);
  const std::int64_t P = 30, B = 10, steps = 12;
  const double scale = spec == "h2o(reduce=sum)" ? 1.0 : 1.0 / kG;
  Sequence<T> seq(P + steps, 17);
  Session<T> s(kvpolicy::Policy(spec), config(Budget::tokens(B)));
  const kvpolicy::Protect prot = s.policy().protect(B + 1, B);
  for (std::int64_t l = 0; l < kLayers; ++l) {
    // ref_acc[h][position]: H2O accumulation in double over the tokens the session holds.
    std::vector<std::map<std::int32_t, double>> ref_acc(kHkv);
    std::vector<float> out(static_cast<std::size_t>(kHq * P * kD));
    s.append(l, seq.K(l, 0, P), seq.V(l, 0, P));  // h2o reads no stored queries
    s.attend(l, seq.Q(l, 0, P), out.data());
    {
      std::vector<double> acc(static_cast<std::size_t>(kHkv * P), 0.0);
      const std::vector<std::int64_t> full(kHkv, P);
      kvtest::naive_attention(seq.K(l, 0, P), seq.V(l, 0, P), seq.Q(l, 0, P), full, true, nullptr, 0,
                              &acc, scale);
      for (std::int64_t h = 0; h < kHkv; ++h)
        for (std::int32_t j = 0; j < P; ++j) ref_acc[static_cast<std::size_t>(h)][j] = acc[static_cast<std::size_t>(h * P + j)];
    }
    for (std::int64_t step = 0; step <= steps; ++step) {
      INFO("layer " << l << " step " << step);
      // Before compression: accumulators match the reference, position by position.
      std::vector<std::vector<std::int32_t>> pre_pos(kHkv);
      std::vector<std::vector<float>> pre_acc(kHkv);
      for (std::int64_t h = 0; h < kHkv; ++h) {
        auto pos = s.positions(l, h);
        auto acc = s.accumulated(l, h);
        REQUIRE(acc.size() == pos.size());
        pre_pos[static_cast<std::size_t>(h)].assign(pos.begin(), pos.end());
        pre_acc[static_cast<std::size_t>(h)].assign(acc.begin(), acc.end());
        for (std::size_t i = 0; i < pos.size(); ++i) {
          const double want = ref_acc[static_cast<std::size_t>(h)].at(pos[i]);
          INFO("head " << h << " position " << pos[i]);
          REQUIRE(acc[i] == Approx(want).epsilon(1e-5).margin(1e-6));
        }
      }
      REQUIRE(s.compress_if_due(l));
      for (std::int64_t h = 0; h < kHkv; ++h) {
        const auto& pp = pre_pos[static_cast<std::size_t>(h)];
        const auto& pa = pre_acc[static_cast<std::size_t>(h)];
        REQUIRE(s.length(l, h) == B);  // eviction back to the budget after every step
        auto pos = s.positions(l, h);
        auto acc = s.accumulated(l, h);
        // Each kept token carries its own accumulator (bit-exact copy of its pre-compaction value).
        for (std::size_t i = 0; i < pos.size(); ++i) {
          const auto it = std::find(pp.begin(), pp.end(), pos[i]);
          REQUIRE(it != pp.end());
          REQUIRE(acc[i] == pa[static_cast<std::size_t>(it - pp.begin())]);
        }
        // The kept set is the heavy hitters plus the protected tokens.
        const kvpolicy::Protect p = s.policy().protect(static_cast<std::int64_t>(pp.size()), B);
        CHECK(std::vector<std::int32_t>(pos.begin(), pos.end()) == h2o_expected(pp, pa, B, p));
        for (std::int64_t j = 0; j < prot.sinks; ++j) CHECK(pos[static_cast<std::size_t>(j)] == j);
        for (std::int64_t j = 0; j < prot.recent; ++j)
          CHECK(pos[static_cast<std::size_t>(B - 1 - j)] == pp[pp.size() - 1 - static_cast<std::size_t>(j)]);
      }
      require_rows_are_originals(s, seq, l);
      if (step == steps) break;
      // Decode one token: its query attends to the kept tokens (and itself).
      const std::int64_t p = P + step;
      s.append(l, seq.K(l, p, 1), seq.V(l, p, 1));
      std::vector<float> o(static_cast<std::size_t>(kHq * kD));
      s.attend(l, seq.Q(l, p, 1), o.data());
      const Gathered<T> g(s, seq, l);
      std::vector<double> acc(static_cast<std::size_t>(kHkv * g.cap), 0.0);
      const auto ref_o = kvtest::naive_attention(g.K(), g.V(), seq.Q(l, p, 1), g.lengths, true,
                                                 nullptr, 0, &acc, scale);
      CHECK(kvtest::max_rel_err(o, ref_o) < 2e-6);
      for (std::int64_t h = 0; h < kHkv; ++h) {
        const auto& gp = g.pos[static_cast<std::size_t>(h)];
        REQUIRE(gp.back() == p);
        REQUIRE(static_cast<std::int64_t>(gp.size()) == B + 1);
        auto& ra = ref_acc[static_cast<std::size_t>(h)];
        ra[static_cast<std::int32_t>(p)] = 0.0;  // a new token starts from zero
        for (std::size_t i = 0; i < gp.size(); ++i) ra[gp[i]] += acc[static_cast<std::size_t>(h * g.cap) + i];
      }
    }
  }
}

TEST_CASE("Session rejects bad arguments and leaves its state unchanged", "[session]") {
  Sequence<float> seq(12, 3);
  Session<float> s(kvpolicy::Policy("snapkv(window=4,kernel=3)"), config(Budget::tokens(6)));
  s.append(0, seq.K(0, 0, 5), seq.V(0, 0, 5), seq.Q(0, 0, 5));
  std::vector<float> out(static_cast<std::size_t>(kHq * 12 * kD));
  auto unchanged = [&] {
    for (std::int64_t h = 0; h < kHkv; ++h) {
      REQUIRE(s.length(0, h) == 5);
      REQUIRE(s.length(1, h) == 0);
      auto pos = s.positions(0, h);
      REQUIRE(std::vector<std::int32_t>(pos.begin(), pos.end()) == std::vector<std::int32_t>{0, 1, 2, 3, 4});
    }
  };

  SECTION("layer index") {
    CHECK_THAT(error_of([&] { s.append(2, seq.K(0, 5, 1), seq.V(0, 5, 1), seq.Q(0, 5, 1)); }),
               Contains("session: layer 2 is outside [0, 2)"));
    CHECK_THAT(error_of([&] { s.attend(-1, seq.Q(0, 5, 1), out.data()); }), Contains("layer -1 is outside [0, 2)"));
    CHECK_THAT(error_of([&] { s.compress_if_due(7); }), Contains("layer 7 is outside"));
    CHECK_THAT(error_of([&] { (void)s.keys(2); }), Contains("layer 2 is outside"));
    CHECK_THAT(error_of([&] { (void)s.positions(3, 0); }), Contains("layer 3 is outside"));
    unchanged();
  }
  SECTION("shapes") {
    std::vector<float> big(3 * 12 * 16 * 7, 0.5f);
    auto blk = [&](std::int64_t heads, std::int64_t n, std::int64_t d) {
      return KVView<const float>::hnd(big.data(), 1, heads, n, d);
    };
    CHECK_THAT(error_of([&] { s.append(0, blk(3, 2, kD), seq.V(0, 5, 2), seq.Q(0, 5, 2)); }),
               Contains("session: k must be [1][2][n][8], got [1][3][2][8]"));
    CHECK_THAT(error_of([&] { s.append(0, seq.K(0, 5, 2), blk(kHkv, 2, 4), seq.Q(0, 5, 2)); }),
               Contains("session: v must be [1][2][n][8], got [1][2][2][4]"));
    CHECK_THAT(error_of([&] { s.append(0, seq.K(0, 5, 2), seq.V(0, 5, 3), seq.Q(0, 5, 2)); }),
               Contains("v has 3 tokens, k has 2"));
    CHECK_THAT(error_of([&] { s.append(0, seq.K(0, 5, 2), seq.V(0, 5, 2), blk(4, 2, kD)); }),
               Contains("session: q must be [1][6][n][8], got [1][4][2][8]"));
    CHECK_THAT(error_of([&] { s.append(0, seq.K(0, 5, 2), seq.V(0, 5, 2), seq.Q(0, 5, 1)); }),
               Contains("q has 1 tokens, k has 2"));
    KVView<const float> two_layers = blk(kHkv, 2, kD);
    two_layers.layers = 2;
    CHECK_THAT(error_of([&] { s.append(0, two_layers, seq.V(0, 5, 2), seq.Q(0, 5, 2)); }),
               Contains("k must be [1][2][n][8], got [2][2][2][8]"));
    CHECK_THAT(error_of([&] { s.attend(0, blk(kHq, 1, 4), out.data()); }), Contains("q must be [1][6][n][8]"));
    CHECK_THAT(error_of([&] { s.attend(0, seq.Q(0, 4, 1), nullptr); }), Contains("out is null"));
    unchanged();
  }
  SECTION("missing queries for a policy that reads them") {
    CHECK_THAT(error_of([&] { s.append(0, seq.K(0, 5, 1), seq.V(0, 5, 1)); }),
               Contains("policy 'snapkv(window=4,kernel=3)' needs the queries; pass q"));
    unchanged();
  }
  SECTION("NaN / Inf in appended k, v, q") {
    std::vector<float> bad(seq.k[0]);
    KVView<float>::hnd(bad.data(), 1, kHkv, 12, kD).at(0, 1, 6, 2) = std::numeric_limits<float>::quiet_NaN();
    const auto bad_k = Sequence<float>::slice(bad, kHkv, 12, 5, 2);
    CHECK_THAT(error_of([&] { s.append(0, bad_k, seq.V(0, 5, 2), seq.Q(0, 5, 2)); }),
               Contains("k contains a non-finite value (nan) at layer 0, head 1, token 1, dim 2"));
    unchanged();
    CHECK_THAT(error_of([&] { s.append(0, seq.K(0, 5, 2), bad_k, seq.Q(0, 5, 2)); }),
               Contains("v contains a non-finite value (nan)"));
    unchanged();
    std::vector<float> badq(seq.q[0]);
    KVView<float>::hnd(badq.data(), 1, kHq, 12, kD).at(0, 5, 5, 0) = std::numeric_limits<float>::infinity();
    CHECK_THAT(error_of([&] { s.append(0, seq.K(0, 5, 2), seq.V(0, 5, 2), Sequence<float>::slice(badq, kHq, 12, 5, 2)); }),
               Contains("q contains a non-finite value (inf) at layer 0, head 5, token 0"));
    unchanged();
    // A valid append after the failures continues at position 5.
    // (A quantizing session also refuses magnitudes its packed cache cannot rotate: below.)
    s.append(0, seq.K(0, 5, 2), seq.V(0, 5, 2), seq.Q(0, 5, 2));
    auto pos = s.positions(0, 1);
    CHECK(std::vector<std::int32_t>(pos.begin(), pos.end()) == std::vector<std::int32_t>{0, 1, 2, 3, 4, 5, 6});
  }
  SECTION("configuration") {
    auto bad_cfg = config(Budget::tokens(6));
    bad_cfg.q_heads = 5;
    CHECK_THAT(error_of([&] { (void)Session<float>(kvpolicy::Policy("knorm"), bad_cfg); }),
               Contains("q_heads 5 is not a positive multiple of kv_heads 2"));
    bad_cfg = config(Budget::tokens(6));
    bad_cfg.layers = 0;
    CHECK_THAT(error_of([&] { (void)Session<float>(kvpolicy::Policy("knorm"), bad_cfg); }),
               Contains("layers, kv_heads and head_dim must be positive"));
    CHECK_THAT(error_of([&] { (void)Session<float>(kvpolicy::Policy("knorm"), config(Budget::ratio(2.0))); }),
               Contains("budget ratio 2 is above 1"));
    CHECK_THAT(error_of([&] { (void)Session<float>(kvpolicy::Policy("knorm"), config(Budget::tokens(-4))); }),
               Contains("budget is negative (-4)"));
    CHECK_THAT(error_of([&] { (void)Session<float>(kvpolicy::Policy("h2o(reduce=max)"), config(Budget::tokens(4))); }),
               Contains("reduce=max cannot be accumulated"));
    CHECK_THAT(error_of([&] { (void)Session<float>(kvpolicy::Policy("knorm"), config(Budget::tokens(4), 0)); }),
               Contains("initial_capacity must be positive"));
  }
  SECTION("budget below the protected count at compression: the newest tokens, a warning") {
    Session<float> t(kvpolicy::Policy("snapkv(window=8,kernel=3)"), config(Budget::tokens(5)));
    t.append(0, seq.K(0, 0, 12), seq.V(0, 0, 12), seq.Q(0, 0, 12));
    CHECK(t.take_warning().empty());
    CHECK(t.compress_if_due(0));
    for (std::int64_t h = 0; h < 2; ++h) {
      CHECK(t.length(0, h) == 5);
      auto pos = t.positions(0, h);
      CHECK(std::vector<std::int32_t>(pos.begin(), pos.end()) == std::vector<std::int32_t>{7, 8, 9, 10, 11});
    }
    CHECK(t.take_warning() ==
          "session: layer 0: budget of 5 tokens per head is below the 8 tokens snapkv protects "
          "(0 sinks + 8 recent): kept the newest 5 instead");
    CHECK(t.take_warning().empty());  // taken
  }
}

TEST_CASE("Session H2O with a budget that does not divide evenly over heads", "[session]") {
  // total(9) over 2 KV heads resolves to 5 + 4: the heads have different lengths after the
  // prefill, and decode-time eviction must compress each head back to its own budget.
  const std::int64_t P = 20, steps = 6;
  Sequence<float> seq(P + steps, 41);
  Session<float> s(kvpolicy::Policy("h2o(recent=0.5)"), config(Budget::total(9)));
  std::vector<float> out(kHq * P * kD);
  for (std::int64_t l = 0; l < kLayers; ++l) {
    s.append(l, seq.K(l, 0, P), seq.V(l, 0, P));
    s.attend(l, seq.Q(l, 0, P), out.data());
    REQUIRE(s.compress_if_due(l));
    REQUIRE(s.length(l, 0) == 5);
    REQUIRE(s.length(l, 1) == 4);
  }
  for (std::int64_t p = P; p < P + steps; ++p)
    for (std::int64_t l = 0; l < kLayers; ++l) {
      s.append(l, seq.K(l, p, 1), seq.V(l, p, 1));
      s.attend(l, seq.Q(l, p, 1), out.data());
      REQUIRE(s.compress_if_due(l));
      CHECK(s.length(l, 0) == 5);
      CHECK(s.length(l, 1) == 4);
      for (std::int64_t h = 0; h < kHkv; ++h) {
        auto pos = s.positions(l, h);
        // The newest token is always kept (recent = floor(0.5 * budget) >= 2) and order holds.
        CHECK(pos.back() == p);
        CHECK(std::is_sorted(pos.begin(), pos.end()));
      }
    }
}

TEST_CASE("Session fork: one recorded full-cache prefill equals a session built for the policy",
          "[session]") {
  // Direct sessions run each policy from the start; the fork comes from a full-cache session
  // that recorded queries and H2O statistics. Same selection, same K/V, same state.
  const std::int64_t S = 40;
  const Sequence<float> seq(S, 99);
  auto feed = [&](Session<float>& s) {
    for (std::int64_t t0 = 0; t0 < S; t0 += 16) {  // chunked prefill
      const std::int64_t n = std::min<std::int64_t>(16, S - t0);
      for (std::int64_t l = 0; l < kLayers; ++l) {
        s.append(l, seq.K(l, t0, n), seq.V(l, t0, n), seq.Q(l, t0, n));
        std::vector<float> out(static_cast<std::size_t>(kHq * n * kD));
        s.attend(l, seq.Q(l, t0, n), out.data());
      }
    }
  };
  SessionConfig full_cfg = config(Budget::ratio(1.0));
  full_cfg.record_queries = 8;
  full_cfg.record_attention = true;
  Session<float> full(kvpolicy::Policy("streaming"), full_cfg);
  feed(full);
  for (std::int64_t l = 0; l < kLayers; ++l) full.compress_if_due(l);  // keeps everything
  for (const std::string spec : {"snapkv(window=8)", "snapkv(window=4)", "h2o",
                                 "h2o(reduce=sum)", "tova", "knorm"}) {
    INFO(spec);
    const Budget b = Budget::ratio(0.4);
    Session<float> direct(kvpolicy::Policy(spec), config(b));
    feed(direct);
    Session<float> forked = full.fork(kvpolicy::Policy(spec), b);
    for (std::int64_t l = 0; l < kLayers; ++l) {
      REQUIRE(direct.compress_if_due(l));
      REQUIRE(forked.compress_if_due(l));
      for (std::int64_t h = 0; h < kHkv; ++h) {
        REQUIRE(forked.length(l, h) == direct.length(l, h));
        const auto pf = forked.positions(l, h), pd = direct.positions(l, h);
        CHECK(std::vector<std::int32_t>(pf.begin(), pf.end()) ==
              std::vector<std::int32_t>(pd.begin(), pd.end()));
        const auto af = forked.accumulated(l, h), ad = direct.accumulated(l, h);
        if (kvpolicy::has(direct.policy().needs(), kvpolicy::Needs::accumulated))
          for (std::size_t j = 0; j < ad.size(); ++j) CHECK(af[j] == Approx(ad[j]).epsilon(1e-5));
        for (std::int64_t t = 0; t < direct.length(l, h); ++t)
          for (std::int64_t i = 0; i < kD; ++i)
            REQUIRE(forked.keys(l).at(0, h, t, i) == direct.keys(l).at(0, h, t, i));
      }
    }
  }
  // The source is unchanged by forking and can be forked again.
  CHECK(full.length(0, 0) == S);
  // shrink_to_fit gives the freed rows back without changing the cache.
  Session<float> small = full.fork(kvpolicy::Policy("knorm"), Budget::tokens(5));
  for (std::int64_t l = 0; l < kLayers; ++l) small.compress_if_due(l);
  const auto before = std::vector<std::int32_t>(small.positions(1, 1).begin(),
                                                small.positions(1, 1).end());
  const float k0 = small.keys(1).at(0, 1, 4, 3);
  small.shrink_to_fit();
  CHECK(small.capacity(1) == 5);
  CHECK(std::vector<std::int32_t>(small.positions(1, 1).begin(), small.positions(1, 1).end()) ==
        before);
  CHECK(small.keys(1).at(0, 1, 4, 3) == k0);
}

TEST_CASE("Session fork rejects what the source did not record", "[session]") {
  const Sequence<float> seq(12, 5);
  Session<float> plain(kvpolicy::Policy("streaming"), config(Budget::ratio(1.0)));
  for (std::int64_t l = 0; l < kLayers; ++l) plain.append(l, seq.K(l, 0, 12), seq.V(l, 0, 12), seq.Q(l, 0, 12));
  CHECK_THROWS_WITH(plain.fork(kvpolicy::Policy("snapkv(window=4)"), Budget::ratio(0.5)),
                    Contains("record_queries"));
  CHECK_THROWS_WITH(plain.fork(kvpolicy::Policy("h2o"), Budget::ratio(0.5)),
                    Contains("record_attention"));
  CHECK_THROWS_WITH(plain.fork(kvpolicy::Policy("knorm"), Budget::ratio(1.5)), Contains("ratio"));
  Session<float> compressed(kvpolicy::Policy("knorm"), config(Budget::ratio(0.5)));
  for (std::int64_t l = 0; l < kLayers; ++l) {
    compressed.append(l, seq.K(l, 0, 12), seq.V(l, 0, 12));
    compressed.compress_if_due(l);
  }
  CHECK_THROWS_WITH(compressed.fork(kvpolicy::Policy("knorm"), Budget::ratio(0.5)),
                    Contains("kept everything"));
}

TEST_CASE("Session decode-time interval mode: compress every `interval` tokens to the target",
          "[session]") {
  const std::int64_t S = 60, prompt = 24;
  const Sequence<float> seq(S, 17);
  SessionConfig cfg = config(Budget::ratio(0.5));
  cfg.decode_interval = 4;
  cfg.decode_target = Budget::tokens(10);
  Session<float> s(kvpolicy::Policy("snapkv(window=3)"), cfg);
  REQUIRE(s.decode_interval() == 4);
  for (std::int64_t l = 0; l < kLayers; ++l) {
    s.append(l, seq.K(l, 0, prompt), seq.V(l, 0, prompt), seq.Q(l, 0, prompt));
    REQUIRE(s.compress_if_due(l));  // prefill: 12 of 24
  }
  CHECK(s.length(0, 0) == 12);
  // Decode: one token at a time; compressions happen exactly every 4 tokens, to 10 per head.
  std::vector<std::int64_t> lengths_seen;
  for (std::int64_t t = prompt; t < S; ++t)
    for (std::int64_t l = 0; l < kLayers; ++l) {
      s.append(l, seq.K(l, t, 1), seq.V(l, t, 1), seq.Q(l, t, 1));
      const bool did = s.compress_if_due(l);
      const std::int64_t step = t - prompt + 1;
      INFO("step " << step << " layer " << l);
      CHECK(did == (step % 4 == 0));
      if (l == 0) lengths_seen.push_back(s.length(0, 1));
      for (std::int64_t h = 0; h < kHkv; ++h) {
        CHECK(s.length(l, h) <= 12 + 3);  // the prefill kept 12; at most 3 appended since
        if (did) CHECK(s.length(l, h) == 10);
        // The window of the newest 3 queries is always kept (snapkv protects its window).
        const auto pos = s.positions(l, h);
        CHECK(pos.back() == t);
      }
    }
  CHECK(lengths_seen[0] == 13);
  CHECK(lengths_seen[3] == 10);
  // Queries come from the ring buffer in chronological order: a session that only saw the last
  // tokens compresses the same way as the one that wrapped its ring many times.
  SessionConfig one = config(Budget::tokens(5));
  Session<float> a(kvpolicy::Policy("snapkv(window=3)"), one), b(kvpolicy::Policy("snapkv(window=3)"), one);
  for (std::int64_t t = 0; t < 20; ++t) a.append(0, seq.K(0, t, 1), seq.V(0, t, 1), seq.Q(0, t, 1));
  b.append(0, seq.K(0, 0, 20), seq.V(0, 0, 20), seq.Q(0, 0, 20));
  a.compress(0);
  b.compress(0);
  for (std::int64_t h = 0; h < kHkv; ++h) {
    const auto pa = a.positions(0, h), pb = b.positions(0, h);
    CHECK(std::vector<std::int32_t>(pa.begin(), pa.end()) ==
          std::vector<std::int32_t>(pb.begin(), pb.end()));
  }
  SessionConfig bad = config(Budget::ratio(0.5));
  bad.decode_interval = -1;
  CHECK_THROWS_WITH(Session<float>(kvpolicy::Policy("knorm"), bad), Contains("decode_interval"));
}

TEST_CASE("Session: a budget above the prompt lets H2O grow to it before evicting", "[session]") {
  const Sequence<float> seq(30, 3);
  Session<float> s(kvpolicy::Policy("h2o"), config(Budget::tokens(20)));
  std::vector<float> out(static_cast<std::size_t>(kHq * 12 * kD));
  for (std::int64_t l = 0; l < kLayers; ++l) {
    s.append(l, seq.K(l, 0, 12), seq.V(l, 0, 12), seq.Q(l, 0, 12));
    s.attend(l, seq.Q(l, 0, 12), out.data());
    s.compress_if_due(l);
  }
  for (std::int64_t t = 12; t < 30; ++t)
    for (std::int64_t l = 0; l < kLayers; ++l) {
      s.append(l, seq.K(l, t, 1), seq.V(l, t, 1), seq.Q(l, t, 1));
      s.attend(l, seq.Q(l, t, 1), out.data());
      s.compress_if_due(l);
      CHECK(s.length(l, 0) == std::min<std::int64_t>(t + 1, 20));
    }
}

TEST_CASE("Session: a total budget or decode target above the prompt is not clamped to it",
          "[session]") {
  // Regression (found by the soak, tests/session/test_soak.cpp): total(n) budgets and decode
  // targets were resolved against the prompt length and so clamped to it. A short prompt then
  // fixed targets of a few tokens instead of n / heads (unlike tokens(n), which lets the cache
  // grow to the budget), and with a policy that protects more tokens than that, every
  // decode-time compression threw "budget of 6 tokens per head is below the 8 tokens snapkv
  // protects".
  const std::int64_t P = 6, S = 40, B = 12;
  const Sequence<float> seq(S, 5);
  struct Case {
    Budget budget;
    std::optional<Budget> target;
  };
  for (const Case& c : {Case{Budget::tokens(B), std::nullopt}, Case{Budget::total(kHkv * B), std::nullopt},
                        Case{Budget::ratio(1.0), Budget::total(kHkv * B)}}) {
    SessionConfig cfg = config(c.budget);
    cfg.decode_interval = 2;
    cfg.decode_target = c.target;
    Session<float> s(kvpolicy::Policy("snapkv(window=8)"), cfg);  // protects 8 tokens > P
    for (std::int64_t l = 0; l < kLayers; ++l) {
      s.append(l, seq.K(l, 0, P), seq.V(l, 0, P), seq.Q(l, 0, P));
      REQUIRE(s.compress_if_due(l));  // keeps the whole prompt
      CHECK(s.length(l, 0) == P);
    }
    const std::int64_t prefill_target = c.target ? P : B;
    CHECK(std::vector<std::int64_t>(s.budgets(0).begin(), s.budgets(0).end()) ==
          std::vector<std::int64_t>(kHkv, prefill_target));
    for (std::int64_t t = P; t < S; ++t)
      for (std::int64_t l = 0; l < kLayers; ++l) {
        s.append(l, seq.K(l, t, 1), seq.V(l, t, 1), seq.Q(l, t, 1));
        REQUIRE_NOTHROW(s.compress_if_due(l));
        for (std::int64_t h = 0; h < kHkv; ++h) {
          CHECK(s.length(l, h) < B + 2);  // [target, target + interval) once grown to it
          CHECK(s.length(l, h) >= std::min<std::int64_t>(t + 1, B));
          CHECK(s.positions(l, h).back() == t);
        }
      }
    CHECK(std::vector<std::int64_t>(s.budgets(1).begin(), s.budgets(1).end()) ==
          std::vector<std::int64_t>(kHkv, B));
  }
}

TEST_CASE("Session: decode-time events on heads shorter than the query window", "[session]") {
  // Regression (found by the soak): compress() handed the policy every query of its window even
  // when a head held fewer tokens, and the policy rejected them ("8 queries for only 6 keys").
  // AMS reads a window of queries that it does not protect, so with a decode target below the
  // window the first decode-time event threw. The newest queries, at most one per cached token
  // of the head, are passed now.
  const std::int64_t P = 30, S = 45;
  const Sequence<float> seq(S, 9);
  struct Case {
    const char* spec;
    std::int64_t record_queries;
    Budget budget;
    std::vector<std::int64_t> kept;  // per head
  };
  const char* ams = "snapkv(window=2) | ams(window=8,sinks=0,keep_last=2,min_seg_len=1)";
  for (const Case& c : {Case{ams, 0, Budget::tokens(5), {5, 5}},
                        Case{ams, 12, Budget::total(11), {6, 5}}}) {  // ragged: per-head events
    INFO(c.spec << " " << c.record_queries);
    SessionConfig cfg = config(c.budget);
    cfg.record_queries = c.record_queries;
    cfg.decode_interval = 1;
    Session<float> s(kvpolicy::Policy(c.spec), cfg);
    std::vector<float> out(static_cast<std::size_t>(kHq * P * kD));
    for (std::int64_t l = 0; l < kLayers; ++l) {
      s.append(l, seq.K(l, 0, P), seq.V(l, 0, P), seq.Q(l, 0, P));
      s.attend(l, seq.Q(l, 0, P), out.data());
      REQUIRE(s.compress_if_due(l));
    }
    for (std::int64_t t = P; t < S; ++t)
      for (std::int64_t l = 0; l < kLayers; ++l) {
        s.append(l, seq.K(l, t, 1), seq.V(l, t, 1), seq.Q(l, t, 1));
        s.attend(l, seq.Q(l, t, 1), out.data());
        REQUIRE_NOTHROW(s.compress_if_due(l));
        for (std::int64_t h = 0; h < kHkv; ++h) {
          CHECK(s.length(l, h) == c.kept[static_cast<std::size_t>(h)]);
          CHECK(s.positions(l, h).back() == t);  // the newest token is protected
        }
      }
  }
}

TEST_CASE("Session: compress() of empty heads with a policy that reads queries", "[session]") {
  // Budget 0 (nothing protected) empties heads; an explicit compress() then handed the policy
  // its window of queries over zero keys and threw. It keeps nothing instead.
  const Sequence<float> seq(12, 4);
  const char* spec = "keydiff | ams(window=4,sinks=0,keep_last=0,min_seg_len=1,min_keep=0)";
  for (const Budget b : {Budget::tokens(0), Budget::total(1)}) {  // total(1): heads keep 1 and 0
    Session<float> s(kvpolicy::Policy(spec), config(b));
    s.append(0, seq.K(0, 0, 10), seq.V(0, 0, 10), seq.Q(0, 0, 10));
    REQUIRE(s.compress_if_due(0));
    CHECK(s.length(0, 1) == 0);
    REQUIRE_NOTHROW(s.compress(0));
    CHECK(s.length(0, 0) == (b.kind() == Budget::Kind::total ? 1 : 0));
    CHECK(s.length(0, 1) == 0);
  }
}

TEST_CASE("Session carries AMS credit across compression events, compacted with its tokens",
          "[session]") {
  // The Session against a hand-run of the same policy: one event over both heads of layer 0,
  // with a credit array the test zeroes for new tokens and compacts by the selection itself.
  const std::string spec =
      "snapkv(window=4) | ams(window=4,kernel=3,min_seg_len=2,max_seg_len=8,min_keep=1,sinks=1,"
      "keep_last=2,segment_mass=0.1)";
  const kvpolicy::Policy policy(spec);
  REQUIRE(policy.alloc_state());
  const std::int64_t S = 40, prompt = 24, keep = 12;
  const Sequence<float> seq(S, 23);
  SessionConfig cfg = config(Budget::tokens(keep));
  cfg.decode_interval = 4;
  Session<float> s(policy, cfg);

  // Reference state for layer 0: per head, original positions and credit of the kept tokens.
  std::vector<std::vector<std::int32_t>> pos(kHkv);
  std::vector<std::vector<float>> credit(kHkv);
  auto reference_event = [&](std::int64_t t_end) {
    const auto T = static_cast<std::int64_t>(pos[0].size());
    std::vector<float> k(static_cast<std::size_t>(kHkv * T * kD)), st(static_cast<std::size_t>(kHkv * T));
    for (std::int64_t h = 0; h < kHkv; ++h)
      for (std::int64_t t = 0; t < T; ++t) {
        for (std::int64_t i = 0; i < kD; ++i)
          k[static_cast<std::size_t>((h * T + t) * kD + i)] = seq.K(0, pos[h][t], 1).at(0, h, 0, i);
        st[static_cast<std::size_t>(h * T + t)] = credit[h][t];
      }
    std::vector<float> q(static_cast<std::size_t>(kHq * 4 * kD));
    for (std::int64_t h = 0; h < kHq; ++h)
      for (std::int64_t t = 0; t < 4; ++t)
        for (std::int64_t i = 0; i < kD; ++i)
          q[static_cast<std::size_t>((h * 4 + t) * kD + i)] = seq.Q(0, t_end - 4 + t, 1).at(0, h, 0, i);
    kvpolicy::Inputs<float> in;
    in.keys = KVView<const float>::hnd(k.data(), 1, kHkv, T, kD);
    in.queries = KVView<const float>::hnd(q.data(), 1, kHq, 4, kD);
    const auto sel = policy.select(kvpolicy::cpu_backend{1}, in, Budget::total(kHkv * keep),
                                   kvpolicy::EventInfo{0, kLayers, st.data(), T});
    for (std::int64_t h = 0; h < kHkv; ++h) {
      std::vector<std::int32_t> p2;
      std::vector<float> c2;
      for (auto j : sel.kept(0, h)) {
        p2.push_back(pos[h][j]);
        c2.push_back(st[static_cast<std::size_t>(h * T + j)]);
      }
      pos[h] = p2;
      credit[h] = c2;
    }
  };
  auto add_tokens = [&](std::int64_t t0, std::int64_t n) {
    for (std::int64_t h = 0; h < kHkv; ++h)
      for (std::int64_t t = t0; t < t0 + n; ++t) {
        pos[h].push_back(static_cast<std::int32_t>(t));
        credit[h].push_back(0.f);
      }
  };

  for (std::int64_t l = 0; l < kLayers; ++l) {
    s.append(l, seq.K(l, 0, prompt), seq.V(l, 0, prompt), seq.Q(l, 0, prompt));
    s.compress_if_due(l);
  }
  add_tokens(0, prompt);
  reference_event(prompt);
  int events = 1;
  for (std::int64_t t = prompt; t < S; ++t) {
    for (std::int64_t l = 0; l < kLayers; ++l) {
      s.append(l, seq.K(l, t, 1), seq.V(l, t, 1), seq.Q(l, t, 1));
      s.compress_if_due(l);
    }
    add_tokens(t, 1);
    if ((t - prompt + 1) % 4 == 0) {
      reference_event(t + 1);
      ++events;
    }
  }
  REQUIRE(events == 5);
  bool some_credit = false;
  for (std::int64_t h = 0; h < kHkv; ++h) {
    INFO("head " << h);
    const auto p = s.positions(0, h);
    CHECK(std::vector<std::int32_t>(p.begin(), p.end()) == pos[h]);
    const auto c = s.alloc_state(0, h);
    REQUIRE(c.size() == credit[h].size());
    for (std::size_t j = 0; j < c.size(); ++j) {
      CHECK(c[j] == Approx(credit[h][j]).margin(1e-7));
      some_credit = some_credit || c[j] > 0;
    }
  }
  CHECK(some_credit);  // the state is really carried (a stateless run would leave zeros)
  // Stateless policies keep none.
  Session<float> plain(kvpolicy::Policy("snapkv(window=4)"), config(Budget::tokens(keep)));
  plain.append(0, seq.K(0, 0, prompt), seq.V(0, 0, prompt), seq.Q(0, 0, prompt));
  CHECK(plain.alloc_state(0, 0).empty());
}

TEST_CASE("Session: decode-time compressions keep the per-head budgets the allocators chose",
          "[session]") {
  // depthkv splits the budget unevenly over the two layers and adakv over the heads at the
  // first event; later events must return every head to exactly what it kept then, without
  // re-running those allocators on budgets that are no longer uniform.
  const std::int64_t S = 48, prompt = 32;
  const Sequence<float> seq(S, 41);
  SessionConfig cfg = config(Budget::ratio(0.5));
  cfg.decode_interval = 4;
  Session<float> s(kvpolicy::Policy("snapkv(window=4) | depthkv(weights=1:3) | adakv"), cfg);
  for (std::int64_t l = 0; l < kLayers; ++l) {
    s.append(l, seq.K(l, 0, prompt), seq.V(l, 0, prompt), seq.Q(l, 0, prompt));
    REQUIRE(s.compress_if_due(l));
  }
  std::vector<std::vector<std::int64_t>> kept(kLayers);
  std::int64_t total = 0;
  for (std::int64_t l = 0; l < kLayers; ++l)
    for (std::int64_t h = 0; h < kHkv; ++h) {
      kept[l].push_back(s.length(l, h));
      total += s.length(l, h);
    }
  CHECK(total == kLayers * kHkv * prompt / 2);  // the model's budget, conserved
  CHECK(kept[1][0] + kept[1][1] > kept[0][0] + kept[0][1]);  // depthkv favours layer 1
  int compressions = 0;
  for (std::int64_t t = prompt; t < S; ++t)
    for (std::int64_t l = 0; l < kLayers; ++l) {
      s.append(l, seq.K(l, t, 1), seq.V(l, t, 1), seq.Q(l, t, 1));
      if (s.compress_if_due(l)) {
        ++compressions;
        for (std::int64_t h = 0; h < kHkv; ++h) CHECK(s.length(l, h) == kept[l][h]);
      }
    }
  CHECK(compressions == kLayers * (S - prompt) / 4);
}

TEST_CASE("Session: token budgets up to INT64_MAX keep everything (fuzz_spec regression)",
          "[session]") {
  // Found by fuzz_spec: a per-head budget of 2^62 on two heads overflowed the event's total
  // (undefined behaviour); tokens(INT64_MAX) is stored as the double 2^63, whose conversion
  // back overflowed; total(n) split over the heads overflowed n * heads.
  Sequence<float> seq(6, 11);
  const std::int64_t big = std::int64_t{1} << 62, max = std::numeric_limits<std::int64_t>::max();
  for (const Budget b : {Budget::tokens(big), Budget::tokens(max), Budget::total(big),
                         Budget::total(max)}) {
    INFO("budget " << b.count() << (b.kind() == Budget::Kind::total ? " in total" : " per head"));
    SessionConfig c = config(b);
    c.decode_interval = 1;
    c.decode_target = b;
    Session<float> s(kvpolicy::Policy("knorm"), c);
    for (std::int64_t l = 0; l < kLayers; ++l) {
      s.append(l, seq.K(l, 0, 5), seq.V(l, 0, 5), seq.Q(l, 0, 5));
      CHECK(s.compress_if_due(l));
      s.append(l, seq.K(l, 5, 1), seq.V(l, 5, 1), seq.Q(l, 5, 1));
      CHECK_FALSE(s.compress_if_due(l));  // nothing to evict below the budget
      for (std::int64_t h = 0; h < kHkv; ++h) CHECK(s.length(l, h) == 6);
      const std::int64_t per_head = b.kind() == Budget::Kind::total ? b.count() / kHkv : b.count();
      CHECK(s.budgets(l)[1] == per_head);
    }
  }
}

TEST_CASE("Session rejects shapes whose buffers overflow the address space (fuzz_c_api regression)",
          "[session]") {
  // Found by fuzz_c_api: kv_heads * initial_capacity * head_dim (and q_heads * query window *
  // head_dim) overflowed int64 while sizing the buffers.
  SessionConfig c = config(Budget::ratio(0.5), std::int64_t{1} << 62);
  CHECK_THAT(error_of([&] { Session<float>(kvpolicy::Policy("knorm"), c); }),
             Contains("need buffers larger than the address space"));
  c.initial_capacity = 8;
  c.head_dim = std::numeric_limits<std::int64_t>::max();
  CHECK_THAT(error_of([&] { Session<float>(kvpolicy::Policy("knorm"), c); }),
             Contains("need buffers larger than the address space"));
  CHECK_THAT(error_of([&] {
               Session<float>(kvpolicy::Policy("snapkv(window=4611686018427387904)"),
                              config(Budget::ratio(0.5)));
             }),
             Contains("a query window of 4611686018427387904 need buffers larger"));
}

TEST_CASE("Session::reserve sets a layer's storage, never below its longest head", "[session]") {
  Sequence<float> seq(12, 11);
  Session<float> s(kvpolicy::Policy("knorm"), config(Budget::tokens(5), 4));
  for (std::int64_t l = 0; l < kLayers; ++l) s.append(l, seq.K(l, 0, 12), seq.V(l, 0, 12));
  CHECK(s.capacity(0) == 12);  // grown to fit the append
  REQUIRE(s.compress_if_due(0));
  const auto held = [&] {
    const auto p = s.positions(0, 1);
    std::vector<float> k;
    for (std::int64_t t = 0; t < s.length(0, 1); ++t)
      for (std::int64_t i = 0; i < kD; ++i) k.push_back(s.keys(0).at(0, 1, t, i));
    return std::make_pair(std::vector<std::int32_t>(p.begin(), p.end()), k);
  };
  const auto before = held();
  s.reserve(0, 40);  // grows; the cache is unchanged
  CHECK(s.capacity(0) == 40);
  CHECK(s.capacity(1) == 12);
  CHECK(held() == before);
  s.append(0, seq.K(0, 0, 7), seq.V(0, 0, 7));  // 12 tokens: within the reserve
  CHECK(s.capacity(0) == 40);
  s.reserve(0, 1);  // shrinks, but not below the longest head
  CHECK(s.capacity(0) == 12);
  CHECK(s.length(0, 0) == 12);
  CHECK_THROWS_WITH(s.reserve(0, 0), Contains("tokens must be positive"));
  CHECK_THROWS_WITH(s.reserve(0, std::numeric_limits<std::int64_t>::max() / 2),
                    Contains("larger than the address space"));
  CHECK(s.capacity(0) == 12);
}

}  // namespace kvt_session_session
