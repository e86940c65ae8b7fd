// Session with a quantizer stage: eviction first, then the survivors are packed; attention over
// the packed caches (with merge counts) equals attention over their dequantized form; decode
// appends flush through the residual window; what a packed cache cannot do is rejected.
#include <catch2/catch.hpp>

#include <vector>

#include <kvpolicy/kvpolicy.hpp>

#include "session/layer_tokens.hpp"
#include "ops/naive.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_session_session_quant {

using kvpolicy::Budget;
using kvpolicy::KVView;
using kvpolicy::Policy;
using kvpolicy::Session;
using kvpolicy::SessionConfig;
using Catch::Matchers::Contains;

namespace {

constexpr std::int64_t kHkv = 2, kHq = 4, kD = 64;

SessionConfig quant_config(Budget b, std::int64_t head_dim = kD) {
  return kvtest::one_layer_config(kHkv, kHq, head_dim, b, 2);
}

using Tokens = kvtest::LayerTokens<kHkv, kHq, kD>;
Tokens random_tokens(std::int64_t S, std::uint64_t seed) { return Tokens(S, seed); }

// Attention of q over the session's packed caches dequantized, with its log-count bias (fp64).
std::vector<double> dequantized_attention(const Session<float>& s, const KVView<const float>& q) {
  std::int64_t cap = 0;
  for (std::int64_t h = 0; h < kHkv; ++h) cap = std::max(cap, s.length(0, h));
  std::vector<float> k(static_cast<std::size_t>(kHkv * cap * kD)), v(k.size()),
      bias(static_cast<std::size_t>(kHkv * cap), 0.f);
  std::vector<std::int64_t> lengths;
  for (std::int64_t h = 0; h < kHkv; ++h) {
    const auto& p = s.packed(0, h);
    REQUIRE(p.size() == s.length(0, h));
    p.decode(k.data() + h * cap * kD, v.data() + h * cap * kD);
    const auto lc = s.log_counts(0, h);
    std::copy(lc.begin(), lc.end(), bias.begin() + h * cap);
    lengths.push_back(s.length(0, h));
  }
  const auto kv = KVView<const float>::hnd(k.data(), 1, kHkv, cap, kD);
  const auto vv = KVView<const float>::hnd(v.data(), 1, kHkv, cap, kD);
  return kvtest::naive_attention(kv, vv, q, lengths, true, bias.data(), cap);
}

}  // namespace

TEST_CASE("Session quantizer: evict, then pack the survivors - attention reads the packed form",
          "[session][quant]") {
  const std::int64_t S = 150, steps = 45;
  const Tokens t = random_tokens(S + steps, 21);
  for (const char* spec : {"snapkv(window=8) | int2(residual=32)",
                           "snapkv(window=8) | semantic(tau=0.3) | int4(residual=16)",
                           "snapkv(window=8) | adakv | kivi(residual=0)"}) {
    CAPTURE(spec);
    Session<float> q(Policy(spec), quant_config(Budget::ratio(0.4)));
    // The same eviction without the quantizer (and without the merger: positions only).
    Session<float> fp(Policy("snapkv(window=8)" + std::string(std::string_view(spec).find("adakv") !=
                                                                      std::string_view::npos
                                                                  ? " | adakv"
                                                                  : "")),
                      quant_config(Budget::ratio(0.4)));
    for (auto* s : {&q, &fp}) {
      s->append(0, t.K(0, S), t.V(0, S), t.Q(0, S));
      CHECK_FALSE(s->quantized(0));
      s->compress_if_due(0);
    }
    REQUIRE(q.quantized(0));
    CHECK_FALSE(fp.quantized(0));
    for (std::int64_t h = 0; h < kHkv; ++h) {
      const auto a = q.positions(0, h), b = fp.positions(0, h);
      CHECK(std::vector<std::int32_t>(a.begin(), a.end()) ==
            std::vector<std::int32_t>(b.begin(), b.end()));
      CHECK(q.packed(0, h).size() == q.length(0, h));
    }
    CHECK(q.kv_bytes() < fp.kv_bytes());
    CHECK_THROWS_WITH(q.keys(0), Contains("quantized"));
    CHECK_THROWS_WITH(q.compress(0), Contains("already quantized"));
    // Decode: tokens go into the packed caches (through the residual window) one at a time.
    for (std::int64_t i = 0; i < steps; ++i) {
      q.append(0, t.K(S + i, 1), t.V(S + i, 1), t.Q(S + i, 1));
      CHECK_FALSE(q.compress_if_due(0));
      if (i % 11 != 0 && i != steps - 1) continue;
      std::vector<float> out(kHq * kD);
      q.attend(0, t.Q(S + i, 1), out.data());
      const auto ref = dequantized_attention(q, t.Q(S + i, 1));
      // Packed attention decodes the same tiles in fp32 and folds them with an online softmax;
      // against the fp64 reference over the same dequantized rows, only fp32 rounding differs.
      CHECK(kvtest::max_rel_err(out, ref) < 1e-4);
    }
    for (std::int64_t h = 0; h < kHkv; ++h) {
      CHECK(q.packed(0, h).size() == q.length(0, h));
      CHECK(q.positions(0, h).back() == S + steps - 1);
    }
  }
}

TEST_CASE("Session quantizer: x | int2 never holds more bytes than x (residual fitted)",
          "[session][quant]") {
  // kv_bytes of the packed session against the same eviction without the quantizer, after the
  // prefill compression and after every decode append. The default residual window (128
  // tokens) shrinks to what the survivors allow (quant::fit_residual).
  const std::int64_t S = 300, steps = 80;
  const Tokens t = random_tokens(S + steps, 33);
  for (const double ratio : {0.11, 0.2, 0.5, 1.0}) {
    for (const char* quant : {"int2", "int4", "kivi"}) {
      CAPTURE(ratio, quant);
      Session<float> q(Policy(std::string("snapkv(window=8) | ") + quant), quant_config(Budget::ratio(ratio)));
      Session<float> fp(Policy("snapkv(window=8)"), quant_config(Budget::ratio(ratio)));
      for (auto* s : {&q, &fp}) {
        s->append(0, t.K(0, S), t.V(0, S), t.Q(0, S));
        s->compress_if_due(0);
      }
      REQUIRE(q.quantized(0));
      const std::int64_t n = q.length(0, 0);
      const std::int64_t r = q.packed(0, 0).config().residual;
      CAPTURE(n, r);
      CHECK(r <= 128);
      if (n >= 128 + 2 * 32) CHECK(r == 128);  // room for the whole window: not shrunk
      if (n < 128) CHECK(r < 128);
      CHECK(q.kv_bytes() <= fp.kv_bytes());
      for (std::int64_t i = 0; i < steps; ++i) {
        for (auto* s : {&q, &fp}) s->append(0, t.K(S + i, 1), t.V(S + i, 1), t.Q(S + i, 1));
        REQUIRE(q.kv_bytes() <= fp.kv_bytes());
      }
    }
  }
  // Below one group of survivors nothing can be packed: the fp32 residual rows and their key
  // norms cost 4 bytes per token more than fp32 rows (the documented exception).
  Session<float> q(Policy("snapkv(window=8) | int2"), quant_config(Budget::tokens(20)));
  Session<float> fp(Policy("snapkv(window=8)"), quant_config(Budget::tokens(20)));
  for (auto* s : {&q, &fp}) {
    s->append(0, t.K(0, S), t.V(0, S), t.Q(0, S));
    s->compress_if_due(0);
  }
  CHECK(q.packed(0, 0).config().residual == 0);
  CHECK(q.kv_bytes() == fp.kv_bytes() + 4 * kHkv * 20);
}

TEST_CASE("Session quantizer: a quantizer alone keeps and packs every token", "[session][quant]") {
  const std::int64_t S = 100;
  const Tokens t = random_tokens(S + 1, 8);
  Session<float> q(Policy("int4(residual=16)"), quant_config(Budget::ratio(1.0)));
  q.append(0, t.K(0, S), t.V(0, S));  // no queries: the policy reads none
  CHECK(q.compress_if_due(0));
  REQUIRE(q.quantized(0));
  for (std::int64_t h = 0; h < kHkv; ++h) {
    CHECK(q.length(0, h) == S);
    CHECK(q.packed(0, h).packed_tokens() == 96);  // residual 16 fits: ceil(84 / 32) groups
  }
  std::vector<float> out(kHq * kD);
  q.append(0, t.K(S, 1), t.V(S, 1));
  q.attend(0, t.Q(S, 1), out.data());
  CHECK(kvtest::max_rel_err(out, dequantized_attention(q, t.Q(S, 1))) < 1e-4);
  // A budget that would evict needs a scorer.
  Session<float> e(Policy("int2"), quant_config(Budget::ratio(0.5)));
  e.append(0, t.K(0, S), t.V(0, S));
  CHECK_THROWS_WITH(e.compress_if_due(0), Contains("has no scorer and keeps every token"));
}

TEST_CASE("Session quantizer: magnitudes the packed cache cannot rotate are refused at append, "
          "before anything moves (fuzz_spec regression)", "[session][quant]") {
  // Found by fuzz_spec: finite rows of ~3e38 passed the finiteness check, overflowed to -inf in
  // the Hadamard rotation and reached the encoder (a NaN converted to int, UB).
  Tokens t = random_tokens(40, 9);
  t.v[static_cast<std::size_t>(1 * 40 * kD + 7 * kD + 3)] = -3e38f;  // head 1, token 7, dim 3
  for (const char* spec : {"knorm | int4(residual=16)", "int2"}) {
    CAPTURE(spec);
    Session<float> s(Policy(spec), quant_config(Budget::ratio(1.0)));
    s.append(0, t.K(0, 5), t.V(0, 5));
    CHECK_THROWS_WITH(s.append(0, t.K(5, 10), t.V(5, 10)),
                      Contains("session.append: v holds -3e+38 at layer 0, head 1, token 2, dim 3: "
                               "a quantized cache takes magnitudes below 2^100"));
    for (std::int64_t h = 0; h < kHkv; ++h) CHECK(s.length(0, h) == 5);  // nothing moved
    s.append(0, t.K(5, 2), t.V(5, 2));  // the rows before the bad one still go in
    CHECK(s.compress_if_due(0));
    CHECK(s.length(0, 1) == 7);
  }
  // Without a quantizer the same rows are only required to be finite.
  Session<float> plain(Policy("knorm"), quant_config(Budget::ratio(1.0)));
  plain.append(0, t.K(0, 40), t.V(0, 40));
  CHECK(plain.length(0, 1) == 40);
  // ... and a fork of it into a quantizing policy is refused at once, not halfway through its
  // first compression.
  CHECK_THROWS_WITH(plain.fork(Policy("knorm | int2"), Budget::ratio(0.5)),
                    Contains("session.fork: v holds -3e+38 at layer 0, head 1, token 7, dim 3"));
  CHECK(plain.fork(Policy("knorm"), Budget::ratio(0.5)).length(0, 1) == 40);
}

TEST_CASE("Session quantizer: what a packed cache cannot do is rejected", "[session][quant]") {
  CHECK_THROWS_WITH(Session<float>(Policy("h2o | int2"), quant_config(Budget::ratio(0.5))),
                    Contains("h2o evicts at every step"));
  SessionConfig c = quant_config(Budget::ratio(0.5));
  c.decode_interval = 8;
  CHECK_THROWS_WITH(Session<float>(Policy("snapkv | int2"), c), Contains("decode_interval > 0"));
  c = quant_config(Budget::ratio(0.5));
  c.record_attention = true;
  CHECK_THROWS_WITH(Session<float>(Policy("snapkv | int2"), c), Contains("record_attention"));
  CHECK_THROWS_WITH(Session<float>(Policy("snapkv | int2"), quant_config(Budget::ratio(0.5), 96)),
                    Contains("power of two"));
  CHECK_THROWS_WITH(Session<float>(Policy("snapkv | kivi"), quant_config(Budget::ratio(0.5), 48)),
                    Contains("does not divide head_dim 48"));

  // Fork: a recorded full-cache session forks into a quantizing policy (and not the other way).
  const Tokens t = random_tokens(80, 5);
  SessionConfig rc = quant_config(Budget::ratio(1.0));
  rc.record_queries = 32;
  rc.record_attention = true;
  Session<float> full(Policy("streaming"), rc);
  full.append(0, t.K(0, 80), t.V(0, 80), t.Q(0, 80));
  Session<float> f = full.fork(Policy("snapkv(window=32) | int2"), Budget::ratio(0.5));
  f.compress_if_due(0);
  CHECK(f.quantized(0));
  CHECK(f.length(0, 0) == 40);
  CHECK_THROWS_WITH(f.fork(Policy("snapkv"), Budget::ratio(0.5)), Contains("quantized"));
  CHECK_THROWS_WITH(full.fork(Policy("snapkv(window=32) | int2"), Budget::ratio(0.5), 4),
                    Contains("decode_interval > 0"));
}

}  // namespace kvt_session_session_quant
