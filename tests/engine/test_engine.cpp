// The Llama forward pass on SmolLM2-135M-Instruct against Hugging Face transformers running the
// same GGUF (golden/make_golden.py): logits of two prompts, the cached K/V, greedy generation;
// then the engine's own contracts (teacher forcing equals stepping, compression through the
// Session, determinism).
//
// Tolerance: both sides dequantize the Q4_1/Q8_0 weights exactly (d*q is exact in fp32 and
// both add m the same way), so the differences come only from fp32 summation order (Eigen's GEMM
// blocking vs PyTorch's, softmax and RMSNorm reductions) compounded through 30 layers. Measured:
// max |logit - transformers| = 9.1e-5 over the stored logits (stride-128 columns, top-16,
// logsumexp; logits reach 38 in magnitude, so ~2e-6 relative); max |K|, |V| difference 3.3e-5
// (layer 29). kLogitTol = 2e-3 leaves ~20x headroom for other compilers and thread counts and
// is still far below half the smallest top-1 margin in the golden data (0.036), so "top-1 equal
// at every position" cannot pass by tolerance alone.
#include <catch2/catch.hpp>
#include <cmath>

#include "engine/engine.hpp"
#include "engine_test_util.hpp"
#include "npy.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_engine_engine {

namespace eng = kvpolicy::engine;
using kvp_engine_test::golden;
using kvp_engine_test::golden_dir;
using kvp_engine_test::model;

namespace {

constexpr float kLogitTol = 2e-3f;

// Most checks run single-threaded: on a shared 2-core machine OpenMP's spinning barriers make
// small multi-threaded forwards several times slower; the logits check keeps the default
// threads so the parallel paths are covered too.
eng::EngineConfig one_thread(std::string policy = "streaming") {
  eng::EngineConfig c;
  c.policy = std::move(policy);
  c.threads = 1;
  return c;
}

xt::xarray<float> npy(const std::string& name) {
  return kvp_engine_test::load_npy_f32((golden_dir() / name).string());
}

std::vector<std::int32_t> prompt_ids(const std::string& name) {
  return golden()["prompts"][name]["ids"].get<std::vector<std::int32_t>>();
}

double logsumexp(const float* x, std::int64_t n) {
  const float mx = *std::max_element(x, x + n);
  double s = 0;
  for (std::int64_t i = 0; i < n; ++i) s += std::exp(static_cast<double>(x[i] - mx));
  return mx + std::log(s);
}

// Max |engine - golden| over the stored logits of one prompt; also checks top-1 everywhere.
float compare_logits(const std::string& name, const eng::Matrix& logits) {
  const auto& p = golden()["prompts"][name];
  const auto cols = npy(name + "_cols.npy"), top = npy(name + "_top.npy"),
             lse = npy(name + "_lse.npy");
  const auto stride = p["col_stride"].get<std::int64_t>();
  const auto n = static_cast<std::int64_t>(p["ids"].size());
  REQUIRE(logits.rows() == n);
  float worst = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const float* row = logits.row(i).data();
    for (std::size_t c = 0; c < cols.shape(1); ++c)
      worst = std::max(worst, std::abs(row[static_cast<std::int64_t>(c) * stride] - cols(i, c)));
    const auto top_ids = p["top_ids"][static_cast<std::size_t>(i)].get<std::vector<std::int64_t>>();
    for (std::size_t k = 0; k < top_ids.size(); ++k)
      worst = std::max(worst, std::abs(row[top_ids[k]] - top(i, k)));
    worst = std::max(worst, static_cast<float>(std::abs(logsumexp(row, logits.cols()) - lse(i))));
    const auto am = std::max_element(row, row + logits.cols()) - row;
    INFO(name << " position " << i);
    CHECK(am == p["argmax"][static_cast<std::size_t>(i)].get<std::int64_t>());
  }
  return worst;
}

}  // namespace

TEST_CASE("engine: SmolLM2 forward matches transformers", "[engine][model]") {
  const eng::Model& m = model();
  const auto& c = m.config();
  REQUIRE(c.n_layers == 30);
  REQUIRE(c.n_head == 9);
  REQUIRE(c.n_head_kv == 3);
  REQUIRE(c.head_dim == 64);
  REQUIRE(c.tied_embeddings);

  SECTION("logits of both prompts, top-1 at every position") {
    for (const std::string name : {"plain", "chat"}) {
      eng::Engine e(m);
      const auto logits = e.prefill(prompt_ids(name), /*all_logits=*/true);
      const float worst = compare_logits(name, logits);
      WARN(name << ": max |logit - transformers| = " << worst);
      CHECK(worst < kLogitTol);
    }
  }

  SECTION("the Session holds transformers' K and V (post-RoPE, Hugging Face head layout)") {
    const auto ids = prompt_ids("plain");
    const auto n = static_cast<std::int64_t>(ids.size());
    eng::Engine e(m, one_thread());
    std::vector<std::vector<float>> captured(static_cast<std::size_t>(c.n_layers));
    e.set_capture([&](const eng::LayerCapture& cap) {
      CHECK(cap.q.heads == 9);
      CHECK(cap.k.tokens == n);
      CHECK(cap.first_position == 0);
      auto& out = captured[static_cast<std::size_t>(cap.layer)];
      for (std::int64_t h = 0; h < cap.k.heads; ++h)
        for (std::int64_t t = 0; t < n; ++t)
          for (std::int64_t i = 0; i < cap.k.dim; ++i) out.push_back(cap.k.at(0, h, t, i));
    });
    e.prefill(ids);
    for (int layer : golden()["prompts"]["plain"]["kv_layers"].get<std::vector<int>>()) {
      const auto k = npy("plain_k" + std::to_string(layer) + ".npy");
      const auto v = npy("plain_v" + std::to_string(layer) + ".npy");
      REQUIRE(k.shape(0) == 3);
      REQUIRE(static_cast<std::int64_t>(k.shape(1)) == n);
      const auto keys = e.session().keys(layer), values = e.session().values(layer);
      float wk = 0, wv = 0, wc = 0;
      for (std::int64_t h = 0; h < 3; ++h) {
        REQUIRE(e.session().length(layer, h) == n);
        for (std::int64_t t = 0; t < n; ++t)
          for (std::int64_t i = 0; i < 64; ++i) {
            wk = std::max(wk, std::abs(keys.at(0, h, t, i) - k(h, t, i)));
            wv = std::max(wv, std::abs(values.at(0, h, t, i) - v(h, t, i)));
            wc = std::max(wc, std::abs(captured[static_cast<std::size_t>(layer)]
                                               [static_cast<std::size_t>((h * n + t) * 64 + i)] -
                                       k(h, t, i)));
          }
      }
      INFO("layer " << layer << ": max |K diff| " << wk << ", |V diff| " << wv);
      CHECK(wk < kLogitTol);
      CHECK(wv < kLogitTol);
      CHECK(wc == wk);
    }
  }

  SECTION("greedy generation equals transformers' and is deterministic") {
    for (const std::string name : {"plain", "chat"}) {
      auto expect = golden()["prompts"][name]["generated"].get<std::vector<std::int32_t>>();
      expect.resize(8);
      eng::Engine e(m, one_thread());
      e.prefill(prompt_ids(name));
      const auto got = e.generate(static_cast<std::int64_t>(expect.size()), /*stop=*/{});
      CHECK(got == expect);
      CHECK(e.position() == static_cast<std::int64_t>(prompt_ids(name).size() + got.size()));
      if (name == "chat") {
        e.reset();
        e.prefill(prompt_ids(name));
        CHECK(e.generate(4, {}) == std::vector<std::int32_t>(got.begin(), got.begin() + 4));
      }
    }
  }
}

TEST_CASE("engine: teacher forcing, decoding and compression through the Session",
          "[engine][model]") {
  const eng::Model& m = model();
  const auto ids = prompt_ids("chat");
  const std::size_t split = 24;
  const std::span<const std::int32_t> prompt(ids.data(), split),
      cont(ids.data() + split, ids.size() - split);

  SECTION("teacher forcing scores the continuation like one long prefill") {
    eng::Engine full(m, one_thread());
    const auto logits = full.prefill(ids, true);
    // The block path (prefill-time policies) and the token-by-token path (decode-time ones;
    // a per-head budget above the length, so H2O never evicts and the model stays exact).
    for (const std::string policy : {"streaming", "h2o"}) {
      eng::EngineConfig cfg = one_thread(policy);
      cfg.budget = kvpolicy::Budget::tokens(1000);
      cfg.prefill_chunk = 7;  // also exercises chunked prefill
      eng::Engine e(m, cfg);
      e.prefill(prompt);
      const auto tf = e.teacher_force(cont, /*keep_logits=*/true);
      REQUIRE(tf.logprob.size() == cont.size());
      for (std::size_t i = 0; i < cont.size(); ++i) {
        const float* row = logits.row(static_cast<std::int64_t>(split + i - 1)).data();
        const double lp = row[cont[i]] - logsumexp(row, logits.cols());
        INFO(policy << " continuation token " << i);
        CHECK(std::abs(tf.logprob[i] - lp) < kLogitTol);
        CHECK(tf.argmax[i] == std::max_element(row, row + logits.cols()) - row);
        CHECK(std::abs(tf.logits(static_cast<std::int64_t>(i), cont[i]) - row[cont[i]]) <
              kLogitTol);
      }
      CHECK(e.position() == static_cast<std::int64_t>(ids.size()));
      const float* last = logits.row(logits.rows() - 1).data();
      CHECK(std::abs(e.last_logits()[0] - last[0]) < kLogitTol);
    }
  }

  SECTION("a budget compresses the cache at prefill; H2O keeps it there while decoding") {
    eng::EngineConfig snap = one_thread("snapkv(window=8)");
    snap.budget = kvpolicy::Budget::ratio(0.5);
    eng::Engine s(m, snap);
    s.prefill(ids);
    const auto kept =
        static_cast<std::int64_t>(std::llround(0.5 * static_cast<double>(ids.size())));
    for (std::int64_t l = 0; l < m.config().n_layers; ++l)
      for (std::int64_t h = 0; h < 3; ++h) REQUIRE(s.session().length(l, h) == kept);
    const auto gen = s.generate(4, {});
    CHECK(gen.size() == 4);
    CHECK(s.session().length(0, 0) == kept + 4);  // prefill-time policy: decode appends

    eng::EngineConfig h2o = one_thread("h2o");
    h2o.budget = kvpolicy::Budget::tokens(16);
    eng::Engine e(m, h2o);
    e.prefill(ids);
    const auto g0 = e.generate(4, {});
    for (std::int64_t l = 0; l < m.config().n_layers; ++l) REQUIRE(e.session().length(l, 2) == 16);
    // Eviction is deterministic: a second run generates the same tokens.
    eng::Engine e2(m, h2o);
    e2.prefill(ids);
    CHECK(e2.generate(4, {}) == g0);
  }

  SECTION("misuse is reported") {
    eng::Engine e(m, one_thread());
    CHECK_THROWS_WITH(e.step(1), Catch::Matchers::Contains("prefill a prompt first"));
    CHECK_THROWS_WITH(e.prefill(std::vector<std::int32_t>{}), Catch::Matchers::Contains("empty"));
    CHECK_THROWS_WITH(e.prefill(std::vector<std::int32_t>{1, 49152}),
                      Catch::Matchers::Contains("token id 49152"));
    e.reset();
    e.prefill(std::vector<std::int32_t>{1, 2});
    CHECK_THROWS_WITH(e.prefill(std::vector<std::int32_t>{1}),
                      Catch::Matchers::Contains("reset()"));
  }
}

TEST_CASE("engine: extend, fork and batched steps equal the one-sequence paths",
          "[engine][model]") {
  const eng::Model& m = model();
  const auto ids = prompt_ids("chat");
  const std::size_t split = 20;
  const std::span<const std::int32_t> head(ids.data(), split),
      tail(ids.data() + split, ids.size() - split);

  // A full-cache engine that records what the policies need, prefilled in two parts.
  eng::EngineConfig rec = one_thread();
  rec.record_queries = 8;
  rec.record_attention = true;
  eng::Engine full(m, rec);
  full.prefill(head);
  full.extend(tail);
  REQUIRE(full.position() == static_cast<std::int64_t>(ids.size()));

  SECTION("extend continues a prefill exactly") {
    eng::Engine once(m, one_thread());
    once.prefill(ids);
    for (std::int64_t v = 0; v < m.config().n_vocab; v += 97)
      CHECK(std::abs(full.last_logits()[v] - once.last_logits()[v]) < kLogitTol);
  }

  SECTION("a fork behaves like an engine created with the policy") {
    for (const std::string policy : {"snapkv(window=8)", "h2o", "knorm"}) {
      INFO(policy);
      eng::EngineConfig cfg = one_thread(policy);
      cfg.budget = kvpolicy::Budget::ratio(0.5);
      eng::Engine direct(m, cfg);
      direct.prefill(ids);
      eng::Engine forked = full.fork(policy, cfg.budget);
      forked.compress_now();
      for (std::int64_t l = 0; l < m.config().n_layers; l += 7)
        for (std::int64_t h = 0; h < 3; ++h) {
          const auto a = direct.session().positions(l, h), b = forked.session().positions(l, h);
          // Chunking differs (one prefill vs two), so H2O's sums may differ in the last bits;
          // the kept sets are compared as sets.
          CHECK(std::vector<std::int32_t>(a.begin(), a.end()) ==
                std::vector<std::int32_t>(b.begin(), b.end()));
        }
      CHECK(direct.generate(3, {}) == forked.generate(3, {}));
    }
    // The source is still the full cache.
    CHECK(full.session().length(0, 0) == static_cast<std::int64_t>(ids.size()));
    CHECK_THROWS_WITH(full.fork("snapkv(window=16)", kvpolicy::Budget::ratio(0.5)),
                      Catch::Matchers::Contains("record_queries"));
  }

  SECTION("step_batch equals stepping each engine alone") {
    std::vector<eng::Engine> solo, batch;
    const std::vector<std::string> policies = {"streaming", "h2o", "snapkv(window=8)"};
    for (const auto& p : policies) {
      const auto b = p == "h2o" ? kvpolicy::Budget::tokens(24) : kvpolicy::Budget::ratio(0.6);
      solo.push_back(full.fork(p, b));
      batch.push_back(full.fork(p, b));
    }
    // Different lengths in one batch: the first sequence gets two extra tokens first.
    for (auto* set : {&solo, &batch}) {
      for (auto& e : *set) e.compress_now();
      (*set)[0].step(ids[3]);
      (*set)[0].step(ids[4]);
    }
    const std::vector<std::int32_t> toks = {ids[5], ids[6], ids[7]};
    for (int step = 0; step < 3; ++step) {
      for (std::size_t i = 0; i < solo.size(); ++i) solo[i].step(toks[i]);
      std::vector<eng::Engine*> ptrs;
      for (auto& e : batch) ptrs.push_back(&e);
      eng::Engine::step_batch(ptrs, toks);
    }
    for (std::size_t i = 0; i < solo.size(); ++i) {
      INFO(policies[i]);
      CHECK(batch[i].position() == solo[i].position());
      const auto a = solo[i].last_logits(), b = batch[i].last_logits();
      float diff = 0;
      for (std::size_t v = 0; v < a.size(); ++v) diff = std::max(diff, std::abs(a[v] - b[v]));
      CHECK(diff < kLogitTol);
      CHECK(std::max_element(a.begin(), a.end()) - a.begin() ==
            std::max_element(b.begin(), b.end()) - b.begin());
      for (std::int64_t h = 0; h < 3; ++h)
        CHECK(batch[i].session().length(29, h) == solo[i].session().length(29, h));
    }
    std::vector<eng::Engine*> dup = {&batch[0], &batch[0]};
    CHECK_THROWS_WITH(eng::Engine::step_batch(dup, std::vector<std::int32_t>{1, 2}),
                      Catch::Matchers::Contains("twice"));
    std::vector<eng::Engine*> one = {&batch[0]};
    CHECK_THROWS_WITH(eng::Engine::step_batch(one, std::vector<std::int32_t>{1, 2}),
                      Catch::Matchers::Contains("1 engines but 2 tokens"));
  }
}

TEST_CASE("engine: merger and quantizer stages run through the Session", "[engine][model]") {
  const eng::Model& m = model();
  // The chat prompt three times, then its first 24 tokens: long enough for whole 32-token tiles.
  const auto chat = prompt_ids("chat");
  std::vector<std::int32_t> ids;
  for (int r = 0; r < 3; ++r) ids.insert(ids.end(), chat.begin(), chat.end());
  ids.insert(ids.end(), chat.begin(), chat.end());
  const std::size_t split = ids.size() - (chat.size() - 24);
  const std::span<const std::int32_t> prompt(ids.data(), split),
      cont(ids.data() + split, ids.size() - split);
  eng::Engine full(m, one_thread());
  full.prefill(prompt);
  const std::size_t full_bytes = full.session().kv_bytes();
  const auto ref = full.teacher_force(cont);

  SECTION("the engine records delimiter flags from token text") {
    const kvpolicy::Policy p("snapkv");
    int flagged = 0;
    const auto flags = full.session().delimiters(0, 0);
    REQUIRE(flags.size() == ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const bool d = p.is_delimiter(m.tokenizer().decode(std::span<const std::int32_t>(&ids[i], 1)));
      CHECK((flags[i] != 0) == d);
      flagged += d ? 1 : 0;
    }
    CHECK(flagged > 0);
    CHECK_THROWS_WITH(full.fork("snapkv | semantic(delimiters=.)", kvpolicy::Budget::ratio(0.5)),
                      Catch::Matchers::Contains("other delimiters"));
  }

  SECTION("semantic merging: counts carried, proportional attention in every layer") {
    eng::EngineConfig cfg = one_thread("snapkv(window=8) | semantic(tau=0.5)");
    cfg.budget = kvpolicy::Budget::ratio(0.5);
    eng::Engine e(m, cfg);
    e.prefill(prompt);
    double merged = 0;
    for (std::int64_t l = 0; l < m.config().n_layers; ++l)
      for (std::int64_t h = 0; h < 3; ++h) {
        double n = 0;
        for (float lc : e.session().log_counts(l, h)) n += std::nearbyint(std::exp(lc));
        CHECK(n <= static_cast<double>(split));
        merged += n - static_cast<double>(e.session().length(l, h));
      }
    CHECK(merged > 0);  // some evicted tokens live on in cores
    const auto tf = e.teacher_force(cont);
    for (float lp : tf.logprob) CHECK(std::isfinite(lp));
  }

  SECTION("quantized caches: packed after the prefill, close to the full cache") {
    for (const std::string q : {"int4(residual=0)", "int2(residual=0)"}) {
      INFO(q);
      eng::EngineConfig cfg = one_thread("streaming | " + q);
      eng::Engine e(m, cfg);
      e.prefill(prompt);
      for (std::int64_t l = 0; l < m.config().n_layers; ++l) REQUIRE(e.session().quantized(l));
      // Packed tiles for the first 128 tokens, fp32 rows (+ norm) for the last few.
      CHECK(e.session().kv_bytes() * 3 < full_bytes);
      const auto tf = e.teacher_force(cont);
      double agree = 0, dlp = 0;
      for (std::size_t i = 0; i < cont.size(); ++i) {
        agree += tf.argmax[i] == ref.argmax[i] ? 1 : 0;
        dlp += std::abs(tf.logprob[i] - ref.logprob[i]);
      }
      agree /= static_cast<double>(cont.size());
      dlp /= static_cast<double>(cont.size());
      // Measured on this prompt: int4 agrees on nearly every token; int2 less (see the accuracy
      // benchmark's quant suite for the real figures). Broken wiring (rotation, norms, bias,
      // RoPE order) gives agreement near 0.
      CHECK(agree >= (q[3] == '4' ? 0.9 : 0.6));
      CHECK(dlp < (q[3] == '4' ? 0.3 : 1.5));
      WARN(q << ": agreement " << agree << ", mean |dlogprob| " << dlp);
    }
  }
}

}  // namespace kvt_engine_engine
