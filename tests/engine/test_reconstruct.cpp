// Engine::reconstruct (kvzip's context-reconstruction pass) on the bundled model:
// - its scores equal a naive computation from a plain forward pass over the same tokens (the
//   context, then the repeat prompt and the repeated chunk, captured with set_capture): the
//   largest softmax probability each context key gets from the repeat queries, one chunk or two;
// - the pass leaves the cache, position and logits as they were (later logits are bitwise equal);
// - an engine whose policy is kvzip runs the pass inside prefill, and a fork of a recording
//   full-cache engine that ran it keeps the same tokens;
// - argument errors.
#include <catch2/catch.hpp>
#include <cmath>

#include "engine/engine.hpp"
#include "engine_test_util.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_engine_reconstruct {

namespace eng = kvpolicy::engine;
using kvp_engine_test::golden;
using kvp_engine_test::model;

std::vector<std::int32_t> prompt_ids(const std::string& name) {
  return golden()["prompts"][name]["ids"].get<std::vector<std::int32_t>>();
}

eng::EngineConfig one_thread(std::string policy = "streaming") {
  eng::EngineConfig c;
  c.policy = std::move(policy);
  c.threads = 1;
  return c;
}

// The repeat prompts as KVzip words them, and the chat template's assistant opener.
std::vector<std::int32_t> encode(const std::string& text) {
  return model().tokenizer().encode(text, true, false);
}
std::vector<std::int32_t> opener() {
  const std::string mark = "\x01mark\x01";
  const std::string t = model().tokenizer().apply_chat_template({{"user", mark}}, true);
  return encode(t.substr(t.find(mark) + mark.size()));
}

// Scores [layer][head][j < ctx] from a plain forward of ctx + repeat: the maximum over the
// repeat tokens' queries (and each KV head's query group) of their softmax over every key they
// see, at the context's keys.
using Scores = std::vector<std::vector<std::vector<double>>>;
Scores naive_scores(const std::vector<std::int32_t>& ctx, const std::vector<std::int32_t>& repeat) {
  const eng::Model& m = model();
  const auto& c = m.config();
  const std::int64_t L = c.n_layers, Hq = c.n_head, Hkv = c.n_head_kv, d = c.head_dim, G = Hq / Hkv;
  std::vector<std::int32_t> all = ctx;
  all.insert(all.end(), repeat.begin(), repeat.end());
  const auto N = static_cast<std::int64_t>(all.size()), P = static_cast<std::int64_t>(ctx.size());
  // q [L][Hq][N][d], k [L][Hkv][N][d] as the forward computed them (post-RoPE).
  std::vector<float> q(static_cast<std::size_t>(L * Hq * N * d)),
      k(static_cast<std::size_t>(L * Hkv * N * d));
  eng::Engine e(m, one_thread());
  e.set_capture([&](const eng::LayerCapture& cap) {
    for (std::int64_t t = 0; t < cap.q.tokens; ++t) {
      const std::int64_t p = cap.first_position + t;
      for (std::int64_t h = 0; h < Hq; ++h)
        for (std::int64_t x = 0; x < d; ++x)
          q[static_cast<std::size_t>(((cap.layer * Hq + h) * N + p) * d + x)] =
              cap.q.at(0, h, t, x);
      for (std::int64_t h = 0; h < Hkv; ++h)
        for (std::int64_t x = 0; x < d; ++x)
          k[static_cast<std::size_t>(((cap.layer * Hkv + h) * N + p) * d + x)] =
              cap.k.at(0, h, t, x);
    }
  });
  e.prefill(all);
  Scores s(static_cast<std::size_t>(L),
           std::vector<std::vector<double>>(static_cast<std::size_t>(Hkv),
                                            std::vector<double>(static_cast<std::size_t>(P), 0.0)));
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> logit(static_cast<std::size_t>(N));
  for (std::int64_t l = 0; l < L; ++l)
    for (std::int64_t qh = 0; qh < Hq; ++qh) {
      const std::int64_t h = qh / G;
      for (std::int64_t i = P; i < N; ++i) {
        const float* qi = q.data() + ((l * Hq + qh) * N + i) * d;
        double top = -1e300, z = 0;
        for (std::int64_t j = 0; j <= i; ++j) {
          const float* kj = k.data() + ((l * Hkv + h) * N + j) * d;
          double dot = 0;
          for (std::int64_t x = 0; x < d; ++x) dot += static_cast<double>(qi[x]) * kj[x];
          logit[static_cast<std::size_t>(j)] = dot * scale;
          top = std::max(top, dot * scale);
        }
        for (std::int64_t j = 0; j <= i; ++j)
          z += std::exp(logit[static_cast<std::size_t>(j)] - top);
        auto& row = s[static_cast<std::size_t>(l)][static_cast<std::size_t>(h)];
        for (std::int64_t j = 0; j < P; ++j)
          row[static_cast<std::size_t>(j)] =
              std::max(row[static_cast<std::size_t>(j)],
                       std::exp(logit[static_cast<std::size_t>(j)] - top) / z);
      }
    }
  return s;
}

double max_error(const eng::Engine& e, const Scores& want) {
  double err = 0;
  for (std::size_t l = 0; l < want.size(); ++l)
    for (std::size_t h = 0; h < want[l].size(); ++h) {
      const auto got =
          e.session().reconstruction(static_cast<std::int64_t>(l), static_cast<std::int64_t>(h));
      REQUIRE(got.size() == want[l][h].size());
      for (std::size_t j = 0; j < got.size(); ++j)
        err = std::max(err, std::abs(static_cast<double>(got[j]) - want[l][h][j]));
    }
  return err;
}

TEST_CASE("engine: reconstruct scores what a plain forward of the repeat pass attends",
          "[engine][model][kvzip]") {
  const auto ctx = prompt_ids("chat");
  const auto P = static_cast<std::int64_t>(ctx.size());
  eng::Engine e(model(), one_thread());
  e.prefill(ctx);

  // Probabilities are compared with an absolute tolerance: Q and K differ from the capture's in
  // the last bits (GEMMs over other row counts), through 30 layers; the scores reach ~1.
  // Chunk c repeats ctx[c0, c1): KVzip's first prompt for c = 0, else its second prompt and the
  // previous chunk's last 8 tokens; then the assistant opener and the chunk.
  const auto op = opener();
  auto expected = [&](std::int64_t chunk, std::int64_t first) {
    Scores want;
    for (std::int64_t c0 = first; c0 < P; c0 += chunk) {
      const std::int64_t c1 = std::min(P, c0 + chunk);
      std::vector<std::int32_t> rep =
          encode(c0 == first ? "\n\nRepeat the previous context exactly."
                             : "\n\nRepeat the part of the previous context exactly, starting with");
      if (c0 > first)  // the cue never reaches before `first`
        rep.insert(rep.end(), ctx.begin() + std::max(first, c0 - 8), ctx.begin() + c0);
      rep.insert(rep.end(), op.begin(), op.end());
      rep.insert(rep.end(), ctx.begin() + c0, ctx.begin() + c1);
      const Scores s = naive_scores(ctx, rep);
      if (want.empty()) want = s;
      for (std::size_t l = 0; l < want.size(); ++l)
        for (std::size_t h = 0; h < want[l].size(); ++h)
          for (std::size_t j = 0; j < want[l][h].size(); ++j)
            want[l][h][j] = std::max(want[l][h][j], s[l][h][j]);
    }
    return want;
  };
  std::vector<std::int64_t> capacity;
  for (std::int64_t l = 0; l < model().config().n_layers; ++l)
    capacity.push_back(e.session().capacity(l));
  SECTION("one chunk") {
    e.reconstruct({4096, 0});
    const double err = max_error(e, expected(4096, 0));
    INFO("max |score - naive| = " << err);
    CHECK(err < 2e-4);
  }
  SECTION("three chunks, each after the first cued by the previous one's last 8 tokens") {
    const std::int64_t chunk = (P + 2) / 3;
    REQUIRE(chunk >= 8);
    e.reconstruct({chunk, 0});
    const double err = max_error(e, expected(chunk, 0));
    INFO("max |score - naive| = " << err);
    CHECK(err < 2e-4);
  }
  SECTION("from position 11 on, in chunks of 5 (cues clamped at `first`)") {
    e.reconstruct({5, 11});
    const double err = max_error(e, expected(5, 11));
    INFO("max |score - naive| = " << err);
    CHECK(err < 2e-4);
  }
  // The storage the chunks needed was given back.
  for (std::int64_t l = 0; l < model().config().n_layers; ++l)
    CHECK(e.session().capacity(l) == capacity[static_cast<std::size_t>(l)]);
}

TEST_CASE("engine: reconstruct changes nothing but the scores, and kvzip engines and forks agree",
          "[engine][model][kvzip]") {
  const eng::Model& m = model();
  const auto ids = prompt_ids("chat");
  const std::span<const std::int32_t> ctx(ids.data(), ids.size() - 6),
      question(ids.data() + ids.size() - 6, 6);
  eng::Engine plain(m, one_thread());
  plain.prefill(ctx);
  eng::Engine rec(m, one_thread());
  rec.prefill(ctx);
  const std::vector<float> before(rec.last_logits().begin(), rec.last_logits().end());
  rec.reconstruct();
  CHECK(rec.position() == static_cast<std::int64_t>(ctx.size()));
  CHECK(std::vector<float>(rec.last_logits().begin(), rec.last_logits().end()) == before);
  for (std::int64_t l = 0; l < m.config().n_layers; ++l) {
    REQUIRE(rec.session().reconstructed(l));
    for (std::int64_t h = 0; h < m.config().n_head_kv; ++h) {
      CHECK(rec.session().length(l, h) == static_cast<std::int64_t>(ctx.size()));
      const auto sc = rec.session().reconstruction(l, h);
      CHECK(*std::max_element(sc.begin(), sc.end()) > 0.f);
      CHECK(*std::max_element(sc.begin(), sc.end()) <= 1.f);
    }
  }
  // The same continuation on both: bitwise the same logits (the chunk left no trace).
  eng::Engine a = rec.fork("streaming", kvpolicy::Budget::ratio(1.0));
  eng::Engine b = plain.fork("streaming", kvpolicy::Budget::ratio(1.0));
  const auto la = a.extend(question, true), lb = b.extend(question, true);
  CHECK(la == lb);

  // kvzip runs the pass inside its own prefill; a fork of `rec` keeps the same tokens.
  eng::EngineConfig cfg = one_thread("kvzip");
  cfg.budget = kvpolicy::Budget::ratio(0.4);
  eng::Engine direct(m, cfg);
  direct.prefill(ctx);
  eng::Engine forked = rec.fork("kvzip", cfg.budget);
  forked.compress_now();
  for (std::int64_t l = 0; l < m.config().n_layers; ++l)
    for (std::int64_t h = 0; h < m.config().n_head_kv; ++h) {
      const auto x = direct.session().positions(l, h), y = forked.session().positions(l, h);
      CHECK(std::vector<std::int32_t>(x.begin(), x.end()) ==
            std::vector<std::int32_t>(y.begin(), y.end()));
      CHECK(static_cast<double>(x.size()) == std::round(0.4 * static_cast<double>(ctx.size())));
      CHECK(x[0] == 0);  // a sink
    }
  CHECK_THROWS_WITH(plain.fork("kvzip", cfg.budget),
                    Catch::Matchers::Contains("context-reconstruction scores"));
  CHECK_THROWS_WITH(rec.reconstruct({0, 0}), Catch::Matchers::Contains("chunk must be positive"));
  CHECK_THROWS_WITH(rec.reconstruct({16, static_cast<std::int64_t>(ctx.size())}),
                    Catch::Matchers::Contains("outside the"));
  // After the compression the packed (quantized) cache refuses a new pass.
  eng::EngineConfig q = one_thread("streaming | int2");
  q.budget = kvpolicy::Budget::ratio(1.0);
  eng::Engine packed(m, q);
  packed.prefill(ctx);
  CHECK_THROWS_WITH(packed.reconstruct(), Catch::Matchers::Contains("quantized"));
}

}  // namespace kvt_engine_reconstruct
